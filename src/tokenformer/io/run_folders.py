"""A training run's folder: its checkpoints (``checkpoints/step-N/``, ``final/``), the newest one
that verifies, pruning the oldest, and removing what a killed run left behind."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from ..errors import CheckpointError
from .checkpoint import verify_checkpoint
from .training_state import STATE_NAME, read_state

CHECKPOINTS = "checkpoints"
FINAL = "final"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints of a run (periodic and final), oldest first; a ``final`` whose state file is
    unreadable is left out."""
    run_dir = Path(run_dir)
    found = []
    root = run_dir / CHECKPOINTS
    if root.is_dir():
        for child in root.iterdir():
            m = _STEP_DIR.match(child.name)
            if m and (child / STATE_NAME).is_file():
                found.append((int(m.group(1)), child))
    if (run_dir / FINAL / STATE_NAME).is_file():
        # An unreadable or malformed final/ is left out, so resume falls back to the newest
        # periodic checkpoint (latest_checkpoint says so) instead of stopping.
        try:
            step = read_state(run_dir / FINAL).get("step")
        except CheckpointError:
            step = None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            found.append((step, run_dir / FINAL))
    return sorted(found, key=lambda item: (item[0], item[1].name == FINAL))


def latest_checkpoint(run_dir: str | Path, *, quiet: bool = False) -> Path:
    """The newest checkpoint of a run that verifies (:func:`verify_checkpoint`).

    Newer ones that do not (a damaged disk, a file edited by hand) are skipped with one line on
    stderr naming the first problem (unless ``quiet``: a look before the resume itself), so that
    a run resumes instead of stopping."""
    run_dir = Path(run_dir)
    found = list_checkpoints(run_dir)
    skipped: list[str] = []
    if (run_dir / FINAL).is_dir() and all(p != run_dir / FINAL for _, p in found):
        skipped.append(f"{run_dir / FINAL / STATE_NAME} is missing or corrupt")
    for step, path in reversed(found):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        if skipped and not quiet:
            _note(f"warning: {len(skipped)} newer checkpoint(s) unusable ({skipped[0]}); "
                  f"resuming from {path} (step {step})")
        return path
    if skipped:
        raise CheckpointError(f"no usable checkpoint in {run_dir}: {skipped[0]}")
    raise CheckpointError(f"no checkpoint to resume from in {run_dir}")


def _note(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, one line, not one per rank
        print(message, file=sys.stderr, flush=True)


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
