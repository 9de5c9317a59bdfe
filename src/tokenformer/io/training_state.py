"""The training state a checkpoint holds beside the model (:mod:`tokenformer.io.checkpoint`):
the optimizer's and RNGs' states (:func:`~tokenformer.io.tree.save_tree` files) and
``trainer_state.json``. Earlier versions' ``optimizer.pt`` and ``rng.pt`` are still read, with
``torch.load(weights_only=True)`` only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, first_line
from .files import atomic_write_text
from .paths import has_regular_file, read_json_object
from .tree import load_tree, save_tree
from .untrusted import safe_torch_load

OPTIMIZER_NAME = "optimizer.safetensors"
RNG_NAME = "rng.safetensors"
LEGACY_OPTIMIZER_NAME = "optimizer.pt"  # written before manifests; read weights_only
LEGACY_RNG_NAME = "rng.pt"
STATE_NAME = "trainer_state.json"


def rng_state() -> dict[str, Any]:
    """RNG states as tensors and plain values (no numpy objects), for :func:`save_tree`."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_state(directory: Path, state: dict[str, Any]) -> None:
    atomic_write_text(directory / STATE_NAME, json.dumps(state, indent=2) + "\n")


def save_optimizer_state(directory: str | Path, optimizer: torch.optim.Optimizer) -> None:
    save_tree(Path(directory) / OPTIMIZER_NAME, optimizer.state_dict())


def has_optimizer_state(directory: str | Path) -> bool:
    return any([has_regular_file(Path(directory) / name, folder=directory)
                for name in (OPTIMIZER_NAME, LEGACY_OPTIMIZER_NAME)])

def read_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_NAME
    if not has_regular_file(file, folder=path):
        raise CheckpointError(f"{path} is not a training checkpoint (no {STATE_NAME})")
    return read_json_object(file)


def _read_own(directory: Path, name: str, legacy: str) -> Any:
    """Our file ``name`` (safetensors + JSON), else the ``legacy`` torch.save file of earlier
    versions through ``torch.load(weights_only=True)`` only; None when neither exists."""
    if has_regular_file(directory / name, folder=directory):
        return load_tree(directory / name)
    if has_regular_file(directory / legacy, folder=directory):
        return safe_torch_load(directory / legacy, foreign=False)
    return None


def load_optimizer_state(path: str | Path) -> dict[str, Any]:
    state = _read_own(Path(path), OPTIMIZER_NAME, LEGACY_OPTIMIZER_NAME)
    if state is None:
        raise CheckpointError(f"{path} has no optimizer state ({OPTIMIZER_NAME})")
    if not isinstance(state, dict) or "param_groups" not in state or "state" not in state:
        raise CheckpointError(f"{path}: the optimizer file is not an optimizer state dict")
    return state


def apply_optimizer_state(optimizer: Any, state: dict[str, Any], file: str | Path) -> None:
    """Load ``state`` (read from ``file``: a checkpoint's optimizer file, or a state holding one)
    into ``optimizer``: one :class:`CheckpointError` line when it does not fit the model's
    parameters."""
    try:
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{file} does not match the model: {first_line(exc)}") from None
    # load_state_dict checks the parameter counts only: a moment (AdamW's exp_avg, exp_avg_sq)
    # of another shape would fail at the first step, or be carried into a grown model.
    for group in optimizer.param_groups:
        for param in group["params"]:
            for key, value in optimizer.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise CheckpointError(
                        f"{file} does not match the model: its {key} of "
                        f"shape {tuple(value.shape)} belongs to a parameter of shape "
                        f"{tuple(param.shape)}")


def read_rng_state(path: str | Path) -> dict[str, Any] | None:
    return _read_own(Path(path), RNG_NAME, LEGACY_RNG_NAME)


def load_rng_state(path: str | Path) -> None:
    state = read_rng_state(path)
    if state is not None:
        try:
            set_rng_state(state)
        except (KeyError, TypeError, ValueError, RuntimeError, AttributeError):
            raise CheckpointError(f"{path}: the RNG state file is malformed") from None
