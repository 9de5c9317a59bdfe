"""Load any model spec: a preset, one of our model directories, a Hugging Face folder, or an
official checkpoint.

This module sits above the model family it dispatches to (:mod:`tokenformer.models.lm`,
:mod:`tokenformer.models.baselines` and, for Hugging Face folders, the optional
:mod:`tokenformer.hf`, imported only for such a folder), so the models never import it: one way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..io.checkpoint import verify_checkpoint
from ..io.paths import has_regular_file, is_link_loop, not_found
from ..models.baselines import load_model_dir
from ..models.config import PRESETS, TokenFormerConfig
from ..models.lm import TokenFormerLM
from ..models.persistence import CONFIG_NAME, WEIGHTS_NAME


def load_model(spec: str | Path, **official_kwargs: Any) -> TokenFormerLM:
    """The one loader behind every command: a preset name (random init, seeded by the caller);
    a model directory of ours (any ``arch``: TokenFormer or a Transformer baseline); a Hugging
    Face folder written by :mod:`tokenformer.hf` (needs the ``hf`` extra); or an official
    checkpoint (``pytorch_model.bin``, its folder, or a DeepSpeed file).

    A folder is checked against its manifest before anything in it is read
    (:func:`tokenformer.io.checkpoint.verify_checkpoint`: the one rule for every load path)."""
    if str(spec) in PRESETS and not Path(spec).exists():
        return TokenFormerLM(TokenFormerConfig.from_name(str(spec)))
    path = Path(spec)
    if not path.exists():
        if path.is_symlink() or is_link_loop(path):  # say which, not only "not found"
            raise not_found(path, "checkpoint")
        raise CheckpointError(f"checkpoint not found: {path} (nor a preset name; presets: "
                              f"{', '.join(PRESETS)})")
    if path.is_dir() and has_regular_file(path / WEIGHTS_NAME, folder=path):
        verify_checkpoint(path)  # the manifest rule, before config.json is read to dispatch
        try:
            model_type = (json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
                          .get("model_type")
                          if has_regular_file(path / CONFIG_NAME, folder=path) else None)
        except (OSError, ValueError, AttributeError):  # the loader below says what is wrong
            model_type = None
        if model_type == "tokenformer":
            from ..hf import load_hf  # optional extra: imported only for an HF folder

            return load_hf(path, verify=False).model
        return load_model_dir(path, verify=False)
    _refuse_run_folder(path)
    return TokenFormerLM.from_official(path, **official_kwargs)  # verifies a folder itself


def _refuse_run_folder(path: Path) -> None:
    """A training run folder is not a model: name the model inside it instead."""
    if not path.is_dir() or not ((path / "metrics.jsonl").is_file()
                                 or (path / "checkpoints").is_dir()):
        return
    if (path / "final" / WEIGHTS_NAME).is_file() or (path / "final" / "sharded").is_dir():
        hint = f"use {path / 'final'}"
    else:
        steps = sorted((path / "checkpoints").glob("step-*"))
        hint = (f"it has no final model yet; use a checkpoint such as {steps[-1]}" if steps
                else "it holds no model yet")
    raise CheckpointError(f"{path} is a training run folder, not a model: {hint}")
