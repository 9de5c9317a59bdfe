"""Nested tensors and plain values as one safetensors file, never a pickle: a checkpoint's
optimizer and RNG files (:mod:`tokenformer.io.training_state`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from .files import atomic_write, save_safetensors

_TREE_FORMAT = "tokenformer-tree-v1"


def save_tree(path: str | Path, tree: Any) -> None:
    """Write nested dicts / lists / tuples of tensors and plain values (an optimizer state dict,
    RNG states) as one safetensors file: the tensors as tensors, the structure and every other
    value as JSON in its header. :func:`load_tree` reads it back exactly (tuples stay tuples,
    integer keys stay integers, no two values share memory); nothing is pickled."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def encode(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # Every reference is its own tensor when read back (an optimizer updates its state in
            # place: two parameters must never share one); safetensors refuses shared storage.
            t = obj.detach().cpu().contiguous()
            if t.numel() and t.untyped_storage().data_ptr() in storages:
                t = t.clone()
            storages.add(t.untyped_storage().data_ptr())
            key = str(len(tensors))
            tensors[key] = t
            return {"__tensor__": key}
        if isinstance(obj, tuple):
            return {"__tuple__": [encode(v) for v in obj]}
        if isinstance(obj, list):
            return [encode(v) for v in obj]
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: encode(v) for k, v in obj.items()}
            return {"__items__": [[encode(k), encode(v)] for k, v in obj.items()]}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise CheckpointError(f"cannot write a {type(obj).__name__} into {path}: only tensors "
                              f"and plain values are saved")

    metadata = {"format": _TREE_FORMAT, "tree": json.dumps(encode(tree))}
    atomic_write(path, lambda tmp: save_safetensors(tensors, tmp, metadata=metadata))


def load_tree(path: str | Path) -> Any:
    """Read a :func:`save_tree` file (safetensors: an untrusted file cannot run code)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        if metadata.get("format") != _TREE_FORMAT:
            raise ValueError
        tree = json.loads(metadata["tree"])
    except Exception:  # safetensors, JSON and key errors alike: the file is not ours or damaged
        raise CheckpointError(f"{path} is not a readable checkpoint file (truncated, corrupt, "
                              f"or not written by tokenformer)") from None

    def decode(obj: Any) -> Any:
        if isinstance(obj, list):
            return [decode(v) for v in obj]
        if not isinstance(obj, dict):
            return obj
        if len(obj) == 1 and "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if len(obj) == 1 and "__tuple__" in obj:
            return tuple(decode(v) for v in obj["__tuple__"])
        if len(obj) == 1 and "__items__" in obj:
            return {_hashable(decode(k)): decode(v) for k, v in obj["__items__"]}
        return {k: decode(v) for k, v in obj.items()}

    try:
        return decode(tree)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path} is corrupt (its structure names a missing tensor)"
                              ) from None


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor)):
        raise TypeError("unhashable key")
    return key
