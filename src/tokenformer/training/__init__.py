"""Training: the task-agnostic loop and its components, the language-model front end, DDP/FSDP,
vision training and plots (docs/training.md, docs/architecture.md).

``fit`` (:mod:`.loop`) is a short loop; each concern is one module: the config (:mod:`.config`),
the ``--grow-at`` language (:mod:`.growth_events`), the learning-rate schedule (:mod:`.schedule`),
the optimizer (:mod:`.optim`), one optimizer step (:mod:`.step`), where it runs
(:mod:`.execution`), the records (:mod:`.recording`), evaluation (:mod:`.evaluation`),
checkpoints (:mod:`.checkpointing`), signals (:mod:`.signals`), growth during a run
(:mod:`.growth`), old tokens frozen after one (:mod:`.freezing`) and Θ's factor annealed after an
exact one (:mod:`.anneal`). :mod:`.lm` is ``tokenformer train``'s front end and :mod:`.report` its
summary.
"""

from .config import TrainConfig, load_config
from .evaluation import lm_evaluator
from .execution import Execution
from .lm import lm_batches, train
from .loop import FitResult, RunFolder, RunState, fit

__all__ = ["Execution", "FitResult", "RunFolder", "RunState", "TrainConfig", "fit", "lm_batches",
           "lm_evaluator", "load_config", "train"]
