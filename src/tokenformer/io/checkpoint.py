"""The checkpoint folder: its format, written atomically, and its manifest, the one rule every
loader of a folder applies (:func:`verify_checkpoint`). The training state in it is read and
written by :mod:`tokenformer.io.training_state`; a run's checkpoints are listed, pruned and
cleaned by :mod:`tokenformer.io.run_folders`.

A checkpoint directory is also a model directory (``TokenFormerLM.load(dir)`` and the growth CLI
read it). Nothing in it is a pickle::

    model.safetensors  config.json        the model (its own save format)
    tokenizer files                       when the trainer knows the tokenizer
    optimizer.safetensors                 optimizer.state_dict(): tensors, the rest (param
                                          groups, hyper-parameters) as JSON in the header
    rng.safetensors                       torch / numpy / python RNG states (rank 0), the same way
    trainer_state.json                    step (= data position), tokens, FLOPs, wall-clock,
                                          optimizer param-group names, growth events applied
    manifest.json                         size and sha256 of every other file (verify_checkpoint)

FSDP runs write the model and optimizer with ``torch.distributed.checkpoint`` into ``sharded/``
instead (see :mod:`tokenformer.training.distributed`), with the same JSON and manifest beside them.
Checkpoints of earlier versions (``optimizer.pt``, ``rng.pt``, no manifest) are still read, with
``torch.load(weights_only=True)`` only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .files import atomic_dir, atomic_write_text, read_marker
from .paths import has_regular_file, not_found, regular_file, sha256_file
from .training_state import (
    LEGACY_OPTIMIZER_NAME,
    LEGACY_RNG_NAME,
    OPTIMIZER_NAME,
    RNG_NAME,
    STATE_NAME,
    rng_state,
    save_optimizer_state,
    write_state,
)
from .tree import save_tree

MANIFEST_NAME = "manifest.json"
SHARDED = "sharded"  # the DCP folder of an FSDP checkpoint (tokenformer.training.distributed)
# The files a loader of this package reads from a folder (models, checkpoints, adapters, official
# folders): in a folder with a manifest each one present must be listed, else it was added after
# the manifest was written (e.g. a model.safetensors beside a sharded checkpoint) and would be
# read unverified.
READ_FILES = ("config.json", "model.safetensors", "adapter_config.json", "adapter.safetensors",
              OPTIMIZER_NAME, RNG_NAME, STATE_NAME, LEGACY_OPTIMIZER_NAME, LEGACY_RNG_NAME,
              "pytorch_model.bin")
# Commands whose output always holds a manifest (each wrote one since its marker exists): such a
# folder without one is incomplete or tampered.
MANIFEST_COMMANDS = ("grow", "prune", "merge", "adapt")
_MANIFEST_FORMAT = "tokenformer-manifest-v1"


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], extra: Callable[[Path], None] | None = None) -> Path:
    """Write a complete checkpoint under a temporary name, then rename it onto ``path``."""
    with atomic_dir(path, overwrite=True) as tmp:
        model.save(tmp)
        save_optimizer_state(tmp, optimizer)
        save_tree(tmp / RNG_NAME, rng_state())
        if extra is not None:
            extra(tmp)
        write_state(tmp, state)
        write_manifest(tmp)
    return Path(path)


# ------------------------------------------------------------------------------ manifest
def _files(directory: Path) -> list[str]:
    """Every file and symlink under ``directory`` (links not followed), as POSIX relative paths."""
    return sorted((Path(root) / name).relative_to(directory).as_posix()
                  for root, _, names in os.walk(directory) for name in names)


def write_manifest(directory: str | Path) -> None:
    """``manifest.json``: size and sha256 of every file of the checkpoint, written last. A link or
    a special file in it is refused (docs/reliability.md: a folder holds regular files only)."""
    directory = Path(directory)
    files = {rel: {"size": regular_file(directory / rel, folder=directory).stat().st_size,
                   "sha256": sha256_file(directory / rel)}
             for rel in _files(directory) if rel != MANIFEST_NAME}
    atomic_write_text(directory / MANIFEST_NAME, json.dumps(
        {"format": _MANIFEST_FORMAT, "files": files}, indent=1) + "\n")


def verify_checkpoint(path: str | Path) -> bool:
    """The one manifest rule, applied by every loader of a folder before anything in it is read.

    A folder with ``manifest.json`` is verified: every listed file must exist with its size and
    sha256, every file a loader reads (:data:`READ_FILES`) must be listed, and ``sharded/`` may
    hold no unlisted file (torch's DCP reader unpickles ``sharded/.metadata``, so that file must
    be exactly the one we wrote). Returns True then.

    A folder without one is refused when this package always writes one there: a checkpoint with
    ``sharded/``, ``optimizer.safetensors`` or ``rng.safetensors``, an adapter, or the output of
    a command in :data:`MANIFEST_COMMANDS` (its marker says so). Otherwise it returns False: a
    checkpoint of a version before manifests (``optimizer.pt``), a folder written by
    ``TokenFormerLM.save`` or assembled by hand, an official or Hugging Face folder; their files
    are read as such (``weights_only``, safetensors) and checked as they are read. Raises
    :class:`CheckpointError`, one line, otherwise."""
    path = Path(path)
    manifest_file = path / MANIFEST_NAME
    if not path.exists():
        raise not_found(path, "checkpoint")  # says so when it is a dangling link or a loop
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not has_regular_file(manifest_file, folder=path):
        why = _manifest_expected(path)
        if why:
            raise CheckpointError(f"{path} has no {MANIFEST_NAME} ({why}: incomplete or "
                                  f"tampered); nothing in it was read")
        return False
    try:
        manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest["format"] != _MANIFEST_FORMAT or not all(
                _plain_relative(rel) and isinstance(e["size"], int) and isinstance(e["sha256"], str)
                for rel, e in files.items()):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{manifest_file} is corrupt") from None
    for rel, entry in files.items():
        file = path / rel
        # a link or a FIFO is refused in words of its own, never opened, never called missing
        if not has_regular_file(file, folder=path):
            raise CheckpointError(f"{path}: {rel} is missing (the manifest lists it)")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says "
                                  f"{entry['size']} (truncated or modified)")
        if sha256_file(file) != entry["sha256"]:
            raise CheckpointError(f"{path}: {rel} does not match its sha256 in the manifest "
                                  f"(corrupt or modified)")
    unlisted = [name for name in READ_FILES if name not in files
                and ((path / name).is_symlink() or (path / name).exists())]
    if (path / SHARDED).exists():
        unlisted += [SHARDED] if (path / SHARDED).is_symlink() else [
            rel for rel in (f"{SHARDED}/{r}" for r in _files(path / SHARDED)) if rel not in files]
    for name in unlisted[:1]:
        if name in READ_FILES:  # a FIFO or a link there is named as such, never opened
            has_regular_file(path / name, folder=path)
    if unlisted:
        raise CheckpointError(f"{path}: {unlisted[0]} is not in the manifest (added after it "
                              f"was written?); refusing to read the folder")
    return True


def _manifest_expected(path: Path) -> str | None:
    """Why a folder without a manifest should have one (see :func:`verify_checkpoint`), or None."""
    if any((path / name).exists() for name in (SHARDED, OPTIMIZER_NAME, RNG_NAME)):
        return "a checkpoint of this version always has one"
    if any((path / name).exists() for name in ("adapter_config.json", "adapter.safetensors")):
        return "every adapter is saved with one"
    command = read_marker(path)
    if command in MANIFEST_COMMANDS:
        return f"tokenformer {command} wrote it with one"
    return None


def _plain_relative(rel: Any) -> bool:
    parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
    return bool(parts) and not rel.startswith("/") and ".." not in parts and "\\" not in rel
