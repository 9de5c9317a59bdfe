"""The paper's ablations (``tokenformer ablate``), rerun here on the LM or the vision TokenFormer.

Data flows one way: :mod:`.plan` (studies, variants, tasks, presets: pure data) → :mod:`.run`
(each variant's LR sweep, then every variant over seeds; resumable; writes ``results.json``) →
:mod:`.report` (``results.json`` → summary, the paper's claims checked, the verdict, report.md
and plots).
"""

from .plan import (
    PRESETS,
    SCHEMA,
    STUDIES,
    TASKS,
    AblationPreset,
    Study,
    Task,
    get_preset,
    lr_grid,
    paper_claims,
    select_variants,
    tuning_seed,
)
from .report import rerender, summarize, verdict, write_outputs
from .run import PARTIAL, SWEEP_PARTIAL, run_ablation, train_variant

__all__ = ["PARTIAL", "PRESETS", "SCHEMA", "STUDIES", "SWEEP_PARTIAL", "TASKS", "AblationPreset",
           "Study", "Task", "get_preset", "lr_grid", "paper_claims", "rerender", "run_ablation",
           "select_variants", "summarize", "train_variant", "tuning_seed", "verdict",
           "write_outputs"]
