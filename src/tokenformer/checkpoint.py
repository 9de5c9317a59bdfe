"""Training checkpoints: one directory per checkpoint, written atomically, newest N kept.

A checkpoint directory is also a model directory (``TokenFormerLM.load(dir)`` and the growth CLI
read it)::

    model.safetensors  config.json        the model (its own save format)
    tokenizer files                       when the trainer knows the tokenizer
    optimizer.pt                          torch.save(optimizer.state_dict()), weights_only-loadable
    rng.pt                                torch / numpy / python RNG states (rank 0)
    trainer_state.json                    step (= data position), tokens, FLOPs, wall-clock,
                                          optimizer param-group names, growth events applied

FSDP runs write the model and optimizer with ``torch.distributed.checkpoint`` into ``sharded/``
instead (see :mod:`tokenformer.distributed`), with the same JSON beside them.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import CheckpointError
from .io import atomic_dir, atomic_write, atomic_write_text, safe_torch_load

CHECKPOINTS = "checkpoints"
FINAL = "final"
OPTIMIZER_NAME = "optimizer.pt"
RNG_NAME = "rng.pt"
STATE_NAME = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def rng_state() -> dict[str, Any]:
    """RNG states in a form ``torch.load(weights_only=True)`` accepts (no numpy objects)."""
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


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                    state: dict[str, Any], extra: Callable[[Path], None] | None = None) -> Path:
    """Write a complete checkpoint under a temporary name, then rename it onto ``path``."""
    with atomic_dir(path, overwrite=True) as tmp:
        model.save(tmp)
        atomic_write(tmp / OPTIMIZER_NAME, lambda f: torch.save(optimizer.state_dict(), f))
        atomic_write(tmp / RNG_NAME, lambda f: torch.save(rng_state(), f))
        if extra is not None:
            extra(tmp)
        write_state(tmp, state)
    return Path(path)


def read_state(path: str | Path) -> dict[str, Any]:
    file = Path(path) / STATE_NAME
    if not file.is_file():
        raise CheckpointError(f"{path} is not a training checkpoint (no {STATE_NAME})")
    try:
        state = json.loads(file.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"{file} is corrupt (not JSON)") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is malformed (not a JSON object)")
    return state


def load_optimizer_state(path: str | Path) -> dict[str, Any]:
    return safe_torch_load(Path(path) / OPTIMIZER_NAME)


def load_rng_state(path: str | Path) -> None:
    file = Path(path) / RNG_NAME
    if file.is_file():
        set_rng_state(safe_torch_load(file))


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run (periodic and final), oldest first."""
    run_dir = Path(run_dir)
    found = []
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / STATE_NAME).is_file():
                found.append((int(m.group(1)), child))
    if (run_dir / FINAL / STATE_NAME).is_file():
        step = read_state(run_dir / FINAL).get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise CheckpointError(f"{run_dir / FINAL / STATE_NAME} is malformed (step is "
                                  f"{step!r}, expected an integer >= 0)")
        found.append((step, run_dir / FINAL))
    return sorted(found, key=lambda item: (item[0], item[1].name == FINAL))


def latest_checkpoint(run_dir: str | Path) -> Path:
    found = list_checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"no checkpoint to resume from in {run_dir}")
    return found[-1][1]


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` periodic checkpoints (``final`` is never deleted)."""
    periodic = [p for _, p in list_checkpoints(run_dir) if p.name != FINAL]
    for path in periodic[:max(len(periodic) - keep_last, 0)]:
        _remove(path)


def _remove(path: Path) -> None:
    """Delete a checkpoint folder (or a leftover file): first renamed out of sight, so a kill
    mid-way leaves a ``.tmp`` that :func:`clean_leftovers` removes, never a half ``step-N/``."""
    if path.is_dir() and not path.is_symlink():
        doomed = path.with_name(f".{path.name}.deleting.tmp")
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_leftovers(run_dir: str | Path) -> list[str]:
    """Remove what a killed run left behind in ``run_dir`` and its ``checkpoints/``; returns the
    names removed (or restored). Called under the run-folder lock at the start of every run.

    - ``.NAME.*.tmp`` (atomic writes and checkpoint folders cut short, prunes mid-way): removed.
    - ``.NAME.old`` (a kill while ``NAME`` was being replaced): put back when ``NAME`` is missing
      and it is a complete checkpoint, else removed (it would block the next replacement).
    - ``checkpoints/step-N/`` without ``trainer_state.json`` (a prune cut short): removed.
    """
    run_dir = Path(run_dir)
    done: list[str] = []
    for folder in (run_dir, run_dir / CHECKPOINTS):
        if not folder.is_dir():
            continue
        for child in sorted(folder.iterdir()):
            name = child.name
            if name.startswith(".") and name.endswith(".old") and len(name) > len("..old"):
                original = folder / name[1:-len(".old")]
                if not original.exists() and (child / STATE_NAME).is_file():
                    os.replace(child, original)
                    done.append(f"{child} -> {original.name}")
                    continue
            elif not (name.startswith(".") and name.endswith(".tmp")) and not (
                    folder.name == CHECKPOINTS and _STEP_DIR.match(name) and child.is_dir()
                    and not (child / STATE_NAME).is_file()):
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            done.append(str(child))
    return done


class MetricsLog:
    """``metrics.jsonl``: one JSON record per line (``type`` = train, eval or grow), plus optional
    TensorBoard scalars."""

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                from .errors import ConfigError

                raise ConfigError("tensorboard logging needs the tensorboard package: "
                                  "pip install 'tokenformer[tensorboard]'") from None
            self._tb = SummaryWriter(str(tensorboard_dir))

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self._tb.add_scalar(f"{record['type']}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()

    @staticmethod
    def truncate(path: str | Path, step: int) -> None:
        """Keep the records up to ``step`` (a resumed run rewrites what came after its
        checkpoint); a line cut short by a kill is dropped."""
        path = Path(path)
        if path.is_file():
            atomic_write_text(path, "".join(MetricsLog.kept(path, step)))

    @staticmethod
    def kept(path: str | Path, step: int) -> list[str]:
        """The lines :meth:`truncate` keeps; CheckpointError names a malformed line (a line cut
        short by a kill is expected only at the end, and dropped)."""
        path = Path(path)
        if not path.is_file():
            return []
        kept = []
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the line a kill cut short
                    continue
                record = None
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                raise CheckpointError(f"{path} line {number} is not a metrics record (a JSON "
                                      f"object with an integer step): fix or delete that line, "
                                      f"then resume again")
            if record.get("step", 0) <= step:
                kept.append(line + "\n")
        return kept


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise CheckpointError(f"{run_dir} has no metrics.jsonl: not a training run directory")
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
