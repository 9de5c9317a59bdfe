"""Training checkpoints: one directory per checkpoint, written atomically, newest N kept.

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
import random
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from ..errors import CheckpointError, ConfigError
from .files import atomic_dir, atomic_write, atomic_write_text, read_marker, save_safetensors
from .paths import has_regular_file, not_found, read_json_object, regular_file, sha256_file
from .untrusted import safe_torch_load

CHECKPOINTS = "checkpoints"
FINAL = "final"
OPTIMIZER_NAME = "optimizer.safetensors"
RNG_NAME = "rng.safetensors"
LEGACY_OPTIMIZER_NAME = "optimizer.pt"  # written before manifests; read weights_only
LEGACY_RNG_NAME = "rng.pt"
STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "manifest.json"
SHARDED = "sharded"  # the DCP folder of an FSDP checkpoint (tokenformer.training.distributed)
_STEP_DIR = re.compile(r"^step-(\d+)$")
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
_TREE_FORMAT = "tokenformer-tree-v1"
_MANIFEST_FORMAT = "tokenformer-manifest-v1"


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


# ------------------------------------------------------------------ tensors + JSON, never pickle
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
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"{file} does not match the model: {first}") from None
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


# ------------------------------------------------------------------------------ run folders
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
        checkpoint; a growth at ``step`` itself came after it too); a line cut short by a kill
        is dropped."""
        path = Path(path)
        if path.is_file():
            atomic_write_text(path, "".join(MetricsLog.kept(path, step)))

    @staticmethod
    def kept(path: str | Path, step: int) -> list[str]:
        """The lines :meth:`truncate` keeps; CheckpointError names a malformed line (a line cut
        short by a kill is expected only at the end, and dropped)."""
        path = Path(path)
        if not has_regular_file(path, folder=path.parent):
            return []
        kept = []
        lines = _read_lines(path)
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
            # A growth at step s runs after s steps, so after the checkpoint of step s: the run
            # resumed from that checkpoint grows again and writes the record again.
            last = step - 1 if record.get("type") == "grow" else step
            if record.get("step", 0) <= last:
                kept.append(line + "\n")
        return kept


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not has_regular_file(path, folder=run_dir):
        raise CheckpointError(f"{run_dir} has no metrics.jsonl: not a training run directory")
    records = []
    for line in _read_lines(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path} is not UTF-8 text (byte {exc.start}): not a metrics "
                              f"log written by tokenformer") from None
