"""Checks of what is read from disk before it becomes a model: a config that names every
shape-setting field, tensors with the model's keys and shapes, floating point and finite, and a
model that its weights file can fill and this machine can hold.

Every loader uses them (our directories, the released format, baselines, ViT, Hugging Face
folders, adapters, training checkpoints), so each refusal is worded once.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import CheckpointError
from .memory import check_memory

# Keys a model directory's config.json must name: every other field has a default, these set
# tensor shapes, and a default here would only surface later as a shape mismatch.
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads")


def require_shape_keys(config_file: Path, config_class: type) -> None:
    """Refuse a config.json that leaves a shape-setting field (one ``config_class`` has) to its
    default."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # the config loader reports an unreadable file in its own words
    missing = [k for k in SHAPE_KEYS if k in fields and isinstance(data, dict) and k not in data]
    if missing:
        raise CheckpointError(f"{config_file} does not name {', '.join(missing)}: not a complete "
                              f"model config (it sets the weights' shapes; no default is safe)")


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding NaN or infinity; None when all are finite."""
    return next((name for name, t in tensors if not bool(torch.isfinite(t).all())), None)


def check_weights(state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights a model cannot compute with: integer (or bool) tensors, NaN or infinity."""
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: weight {key!r} is {str(tensor.dtype)[6:]}, not "
                                  f"floating point: not model weights")
    key = non_finite(state.items())
    if key is not None:
        raise CheckpointError(f"{source}: weight {key!r} holds NaN or infinite values: the "
                              f"checkpoint is corrupt (or saved from a diverged run)")


def check_tensors(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                  source: str) -> None:
    """The one check of tensors read from a file before they enter a model (base weights and
    adapters alike): keys and shapes (:func:`check_state_dict`), then dtype and finiteness
    (:func:`check_weights`)."""
    check_state_dict(expected, state, source)
    check_weights(state, source)


def load_state_dict_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict(strict=True)`` with one error sentence naming the offending key, after
    :func:`check_tensors`."""
    check_tensors(model.state_dict(), state, source)
    model.load_state_dict(state, strict=True)


def header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file declares, from its header alone (no tensor is read;
    safetensors refuses a header its file is too short to hold)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is corrupt or truncated: {exc}") from None


def check_buildable(config: Any, source: str, weights: Path | None = None) -> None:
    """Refuse, before any tensor is made, a model described by a config read from disk
    (``source``) that its weights file cannot fill or this machine cannot hold: the config's
    parameter count (computed, nothing allocated) against the values the file's header declares
    (a 4 KB file cannot hold a 10⁶-layer model), then grow's memory estimate (the model and the
    weights read into it: two fp32 copies) against the memory available now."""
    if weights is not None:
        params = config.num_parameters()
        held = sum(math.prod(shape) for shape in header_shapes(weights).values())
        if params > held:
            raise CheckpointError(f"{source} describes a model of {params:,} parameters but "
                                  f"{weights} holds {held:,} values: they do not belong "
                                  f"together")
    check_memory(config, 2, source, error=CheckpointError)


def check_state_dict(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                     source: str) -> None:
    """Raise one CheckpointError naming the first missing, unexpected or wrongly shaped key."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing key {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected key {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1
                                 else ""))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{source}: key {key!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(expected[key].shape)}")
