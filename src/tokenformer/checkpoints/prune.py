"""Pruning a checkpoint folder: the model shrunk by its least important parameter tokens,
calibrated on a dataset where the criterion needs it, its tokenizer kept (``tokenformer prune``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..data import corpus, datasets
from ..formats.loading import load_model
from ..io.outputs import check_output
from ..io.paths import not_found
from ..ops.pruning import needs_calibration, prune, prune_sizes
from .folders import derived_model_folder

CALIBRATION_BATCH = (8, 256)  # sequences × tokens of the default calibration batch


def calibration_ids(model: torch.nn.Module, data: str = "default", tokenizer: str = "bytes",
                    batch: tuple[int, int] = CALIBRATION_BATCH) -> torch.Tensor:
    """Input ids [B, T] for calibration: evenly spread windows of a prepared dataset's training
    split (``default``: the embedded corpus, prepared with ``tokenizer``)."""
    dataset = (corpus.default_dataset(tokenizer, progress=False) if data == "default"
               else datasets.TokenDataset.open(data))
    dataset.check_vocab(model.config.vocab_size, "train")  # as adapt and train check it
    seq = min(batch[1], model.config.max_seq_len)
    windows = next(iter(dataset.eval_windows("train", seq, batch[0], max_batches=1)))
    return windows


def prune_checkpoint(checkpoint: str | Path, out: str | Path, *, qkv: str | None = None,
                     proj: str | None = None, ffn: str | None = None, by: str = "contribution",
                     scale: str = "hold", data: str = "default", tokenizer: str = "bytes",
                     overwrite: bool = False) -> dict[str, Any]:
    """Load ``checkpoint``, prune it (:func:`tokenformer.prune`, calibrated on ``data``
    when ``by``/``scale`` need it), write the model and its tokenizer files to ``out``
    atomically, with a manifest (as ``grow``). Returns parameter counts and the new config."""
    out, source = Path(out), Path(checkpoint)
    if not source.exists():
        raise not_found(source, "checkpoint")
    # every path it reads is an input: --data pout/mydata with --overwrite must not delete it
    check_output(out, [source, data if data != "default" else None, tokenizer],
                 command="prune", overwrite=overwrite)
    model = load_model(source).eval()  # a folder is checked against its manifest first
    prune_sizes(model.config, qkv, proj, ffn)  # refuse before loading calibration data
    ids = calibration_ids(model, data, tokenizer) if needs_calibration(by, scale) else None
    small = prune(model, qkv=qkv, proj=proj, ffn=ffn, by=by, calibration=ids, scale=scale)
    with derived_model_folder(out, source, command="prune", overwrite=overwrite) as tmp:
        small.save(tmp)
    return {"out": str(out), "params_before": model.num_parameters(),
            "params_after": small.num_parameters(), "config": small.config.to_dict()}
