"""Adapting a checkpoint: a token adapter trained on a new domain over a frozen base and saved
alone (``tokenformer adapt``; the training itself is :mod:`tokenformer.training.adapt`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..io.outputs import check_output
from ..ops import adapters as ad
from ..training.adapt import train_adapter
from ..training.config import load_config
from ..training.signals import interrupt_on_signal


def adapt_checkpoint(base: str, data_spec: str, tokens: dict[str, int], out: str | Path, *,
                     name: str = "adapter", overrides: dict[str, Any] | None = None,
                     progress: bool | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Load ``base``, attach a token adapter, train it on ``data_spec`` with the trainer
    (:func:`tokenformer.training.fit`; any TrainConfig key in ``overrides``), save it to ``out``
    (``overwrite``: replacing an earlier ``adapt``'s output)."""
    out = Path(out)
    ad.check_name(name)  # before loading anything
    # before training: an output that exists, is an input or cannot be created is refused now
    check_output(out, [base, data_spec if Path(data_spec).exists() else None], command="adapt",
                 overwrite=overwrite)
    cfg = load_config(None, {"steps": 200, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20,
                             "eval_interval": 0, "eval_batches": 8, "batch_size": 16,
                             "seq_len": 128, "weight_decay": 0.0, **(overrides or {}),
                             "data": data_spec})
    # an adapter is written only once trained: a signal before that leaves nothing to resume
    with interrupt_on_signal(f"nothing was written to {out} (an adapter is saved when its "
                             f"training ends); rerun the same command to train it"):
        model, summary = train_adapter(base, data_spec, tokens, cfg, name, progress)
    ad.save_adapter(model, name, out, extra={"training": summary}, overwrite=overwrite,
                    command="adapt")
    return {**summary, "out": str(out)}
