"""Checkpoint operations: a model folder in, a new folder out, callable from Python as the
commands call them (docs/architecture.md).

``grow_checkpoint`` (``tokenformer grow``), ``prune_checkpoint`` (``prune``), ``merge_checkpoint``
(``merge``) and ``adapt_checkpoint`` (``adapt``) each check the output before any work (an input,
a folder another command wrote, a path nobody may create), load the model, apply one operation
of :mod:`tokenformer.ops` and commit the result atomically with a manifest; a derived model keeps
its source's tokenizer files (:mod:`.folders`). This layer sits above ``training`` (growing carries
the optimizer and rewrites the trainer's state; adapting trains) and below the experiments and
the CLI, which only parses arguments and prints.
"""

from .adapt import adapt_checkpoint
from .folders import copy_tokenizer
from .grow import grow_checkpoint
from .merge import merge_checkpoint
from .prune import CALIBRATION_BATCH, calibration_ids, prune_checkpoint

__all__ = ["CALIBRATION_BATCH", "adapt_checkpoint", "calibration_ids", "copy_tokenizer",
           "grow_checkpoint", "merge_checkpoint", "prune_checkpoint"]
