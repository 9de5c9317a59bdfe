"""File I/O shared by every module: atomic writes and safe loading of untrusted checkpoints."""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    Readers never see a half-written file: either the old file or the complete new one.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; the result should look like open()'s
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write(path: str | Path, writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and move the result onto ``path`` atomically."""
    with atomic_path(path) as tmp:
        writer(tmp)


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name, then rename it to ``path`` when complete."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise CheckpointError(f"output directory already exists: {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the result should look like mkdir's
    try:
        yield tmp
        if path.exists():
            import shutil

            old = path.with_name(f".{path.name}.old")
            if old.exists():  # left by a kill during an earlier replacement: never blocks
                shutil.rmtree(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


class _Stub:
    """Inert stand-in for a class a checkpoint pickled (e.g. DeepSpeed's argparse args)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _StubbingUnpickler(pickle.Unpickler):
    """Resolves only torch's tensor-rebuilding globals; every other global becomes ``_Stub``.

    Nothing a checkpoint names is imported or called except the functions torch's own
    ``weights_only`` unpickler allows, so loading cannot execute code from the file.
    """

    def find_class(self, module: str, name: str) -> Any:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = _get_allowed_globals()
        key = f"{module}.{name}"
        if key in allowed:
            return allowed[key]
        return _Stub


class _StubbingPickleModule:
    Unpickler = _StubbingUnpickler
    load = pickle.load
    __name__ = "tokenformer_stub_pickle"


def safe_torch_load(path: str | Path) -> Any:
    """Load a ``torch.save`` file without ever executing pickled code.

    First ``torch.load(weights_only=True)``. Files that also pickle foreign objects (DeepSpeed's
    ``mp_rank_00_model_states.pt`` stores its argparse namespace) are retried with an unpickler
    that replaces every non-tensor class by an inert stub: tensors survive, code never runs.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(f"expected a checkpoint file, got a directory: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" not in str(exc).lower():
            raise CheckpointError(f"{path} is not a readable PyTorch checkpoint "
                                  f"(truncated or corrupt?)") from None
    except Exception:  # zip errors, EOF, bad magic: all mean "not a checkpoint"
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint "
                              f"(truncated or corrupt?)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_StubbingPickleModule)
    except Exception:
        raise CheckpointError(f"{path} is not a readable PyTorch checkpoint") from None
