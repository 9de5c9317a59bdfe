"""Saving and loading a model: our directory format (``config.json`` + ``model.safetensors``) and
the released one (:mod:`tokenformer.models.official`).

:class:`tokenformer.models.lm.TokenFormerLM`'s ``save``, ``load``, ``from_official`` and
``from_pretrained`` are one-line delegations to the functions here; the model class they build is
passed in (this module never imports the model). Nothing is ever unpickled, and every tensor is
checked (:mod:`tokenformer.models.checks`) before it enters a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from ..errors import CheckpointError
from ..io.checkpoint import verify_checkpoint
from ..io.files import atomic_write, atomic_write_text, save_safetensors
from ..io.paths import has_regular_file
from .checks import (
    check_buildable,
    check_state_dict,
    check_weights,
    load_state_dict_strict,
    require_shape_keys,
)
from .official import ours_to_official, read_official

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def save_directory(model: nn.Module, directory: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (each atomically) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(directory / WEIGHTS_NAME,
                 lambda tmp: save_safetensors(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_text(directory / CONFIG_NAME, json.dumps(model.config.to_dict(), indent=2))
    return directory


def load_directory(cls: Any, directory: str | Path, map_location: str | torch.device = "cpu", *,
                   verify: bool = True) -> nn.Module:
    """A ``cls`` model from a directory written by :func:`save_directory` (safetensors: no code is
    ever unpickled); ``cls.config_class`` reads its config.

    The folder is first checked against its manifest
    (:func:`tokenformer.io.checkpoint.verify_checkpoint`; ``verify=False`` only for a caller
    that has just done so), and the model its config describes against the weights file's
    header and the memory available (:func:`tokenformer.models.checks.check_buildable`) before
    any tensor is made."""
    directory = Path(directory)
    if not directory.exists():
        raise CheckpointError(f"checkpoint not found: {directory}")
    if verify:
        verify_checkpoint(directory)
    config_file, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    if not all([has_regular_file(f, folder=directory) for f in (config_file, weights)]):
        raise CheckpointError(f"{directory} is not a tokenformer model directory "
                              f"(expected {CONFIG_NAME} and {WEIGHTS_NAME})")
    require_shape_keys(config_file, cls.config_class)
    config = cls.config_class.load(config_file)
    check_buildable(config, str(config_file), weights)
    try:
        state = safetensors.torch.load_file(str(weights), device=str(map_location))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{weights} is corrupt or truncated: {exc}") from None
    model = cls(config)
    load_state_dict_strict(model, state, source=str(weights))
    return model


def load_official(model_class: Any, path: str | Path, *, dtype: torch.dtype = torch.float32,
                  **kwargs: Any) -> nn.Module:
    """A ``model_class`` (the TokenFormer LM) from a released checkpoint (``pytorch_model.bin``,
    its folder, or a DeepSpeed file; ``num_heads``, ``rotary_pct``, ``max_seq_len``, ``norm``,
    ``config``: see :func:`tokenformer.models.official.read_official`).

    Loading is strict (a missing or unexpected key, or a wrong shape, names the key) and never
    unpickles code. Weights are converted to ``dtype`` (fp16 DeepSpeed weights become fp32).
    """
    config, state, official = read_official(path, **kwargs)
    check_weights(state, str(path))
    check_buildable(config, str(path))  # e.g. a seq_length of 10⁹ in config.json
    model = model_class(config)
    # Checked under the official names: an error must name the key as it is in the user's file.
    check_state_dict(ours_to_official(model.state_dict(), config.num_layers), official,
                     str(path))
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(dtype)


def load_pretrained(cls: Any, path: str | Path, **kwargs: Any) -> nn.Module:
    """``cls.load`` for our directory format, else ``cls.from_official`` (the released formats,
    with ``kwargs``)."""
    path = Path(path)
    if path.is_dir() and (path / WEIGHTS_NAME).is_file():
        return cls.load(path)
    return cls.from_official(path, **kwargs)
