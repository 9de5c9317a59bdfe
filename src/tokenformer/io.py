"""File I/O shared by every module: atomic writes and safe loading of untrusted checkpoints."""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import pickle
import stat
import tarfile
import tempfile
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError, PathError


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


# ----------------------------------------------------------------- what may be opened for reading
_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def regular_file(path: str | Path, what: str = "file", *, folder: str | Path | None = None
                 ) -> Path:
    """``path`` if it is a regular file this process may read; else one :class:`PathError` line
    (missing, a directory, a FIFO, a device, a socket, unreadable).

    Every file the package reads passes through here (or :func:`has_regular_file`) before it is
    opened: opening a FIFO blocks until something writes to it, forever if nothing does.
    ``folder``: ``path`` lies inside this model, adapter, dataset or run folder, and then no part
    of it below ``folder`` may be a symbolic link (docs/reliability.md, "Symlinks and special
    files inside folders"); a path the user named (``folder=None``) is followed. ``what`` names
    the file in the message ("tokenizer file", "checkpoint"). A file swapped after this check is
    not caught (as every check-then-open)."""
    path = Path(path)
    if folder is not None:
        _refuse_links(path, Path(folder), what)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        dangling = f" (a symbolic link to {os.readlink(path)}, which does not exist)" \
            if path.is_symlink() else ""
        raise PathError(f"{what} not found: {path}{dangling}") from None
    except OSError as exc:  # a link loop, a name too long, no permission to look
        raise PathError(f"cannot read {what} {path}: {exc.strerror}") from None
    for test, kind in _NOT_REGULAR:
        if test(mode):
            raise PathError(f"{what} {path} is {kind}, not a regular file"
                            + (": refusing to open it (a reader would wait for a writer "
                               "forever)" if kind.startswith("a FIFO") else ""))
    if not stat.S_ISREG(mode):
        raise PathError(f"{what} {path} is not a regular file")
    if not os.access(path, os.R_OK):
        raise PathError(f"{what} {path} is not readable (permission denied)")
    return path


def has_regular_file(path: str | Path, what: str = "file", *,
                     folder: str | Path | None = None) -> bool:
    """False when nothing is at ``path`` (an optional file that is absent); True when it is a
    regular file; otherwise :func:`regular_file`'s error (a FIFO, a directory, a link inside
    ``folder``... is never silently taken for absent, nor opened)."""
    path = Path(path)
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        pass  # regular_file says what
    regular_file(path, what, folder=folder)
    return True


def check_folder_files(folder: str | Path, *, links: bool = False) -> None:
    """:func:`regular_file` for every file below ``folder``, before a third-party reader that
    finds files by itself (transformers for a Hugging Face folder, datasets for a saved
    dataset) opens any. Links are refused (a model folder) unless ``links`` (a user's corpus)."""
    for root, dirs, names in os.walk(folder):
        for name in names if links else [*names, *dirs]:
            entry = Path(root) / name
            if links or entry.is_symlink() or not entry.is_dir():
                regular_file(entry, folder=None if links else folder)


def _refuse_links(path: Path, folder: Path, what: str) -> None:
    """No component of ``path`` below ``folder`` is a symbolic link (missing ones are not)."""
    try:
        parts = path.relative_to(folder).parts
    except ValueError:  # not below folder: the last component is all we can tell about
        parts, folder = (path.name,), path.parent
    current = folder
    for part in parts:
        current = current / part
        try:
            is_link = stat.S_ISLNK(os.lstat(current).st_mode)
        except OSError:
            return  # missing (or unreadable): regular_file says so
        if is_link:
            raise PathError(f"{current} is a symbolic link (to {os.readlink(current)}): the files "
                            f"of a model, adapter, dataset or run folder must be regular files "
                            f"inside it, never links; replace the link with a copy of the file")


# ------------------------------------------------------------------ loading untrusted torch files
class _Stub:
    """Inert stand-in for anything a checkpoint names outside the allow-list (DeepSpeed's argparse
    args, numpy RNG state, or a payload's ``os.system``): constructing it stores nothing and runs
    nothing, so a pickled call to it is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any,
                    *ignored: Any) -> torch.Tensor:
    """What ``torch._utils._rebuild_tensor(_v2)`` does for plain tensors, with public calls only.

    ``requires_grad``, backward hooks and metadata in the file are ignored: loaded weights are
    data, never hooks that would run later."""
    if not isinstance(storage, torch.TypedStorage):
        raise pickle.UnpicklingError("a tensor's data is not a torch storage")
    return torch.empty((0,), dtype=storage.dtype, device=storage.device).set_(
        storage.untyped(), int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data: Any, *ignored: Any) -> torch.Tensor:
    """``nn.Parameter`` pickles: the tensor only (no hooks, no attributes set from the file)."""
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError("a parameter's data is not a tensor")
    return data


def _latin1_bytes(text: Any, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """Protocol 2 pickles ``bytes`` as ``_codecs.encode(text, 'latin1')``; only that is allowed."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError("_codecs.encode is only allowed for latin1 bytes")
    return text.encode("latin1")


def _allowed_globals() -> dict[str, Any]:
    """Every global a legacy or zip ``torch.save`` of a state dict needs, and nothing else.

    Storage classes (``torch.FloatStorage``...) never reach this table: torch's own loader maps
    every ``*Storage`` name to a storage type before asking the unpickler."""
    allowed: dict[str, Any] = {
        "collections.OrderedDict": collections.OrderedDict,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.bytearray": bytearray,
        "_codecs.encode": _latin1_bytes,
        "torch.Size": torch.Size,
        "torch._utils._rebuild_tensor": _rebuild_tensor,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    }
    allowed.update({f"torch.{name}": value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    return allowed


def _restricted_pickle_module(stubbed: list[str]) -> Any:
    """A stand-in for the ``pickle`` module, for ``torch.load(pickle_module=...)``.

    Its unpickler resolves only :func:`_allowed_globals` (our wrappers, never torch's private
    functions themselves); every other global becomes :class:`_Stub` and its name is appended to
    ``stubbed``. ``load`` (which torch's legacy loader calls for the file's header records) uses
    the same unpickler: a pickle is never read by the unrestricted ``pickle.load``."""
    allowed = _allowed_globals()

    def resolve(module: str, name: str) -> Any:
        key = f"{module}.{name}"
        if key in allowed:
            return allowed[key]
        stubbed.append(key)
        return _Stub

    unpickler = restricted_unpickler(resolve)

    def load(file: Any, **kwargs: Any) -> Any:
        return unpickler(file, **kwargs).load()

    return types.SimpleNamespace(Unpickler=unpickler, load=load,
                                 __name__="tokenformer_restricted_pickle")


def restricted_unpickler(resolve: Callable[[str, str], Any]) -> type[pickle.Unpickler]:
    """An unpickler that obtains every global (``GLOBAL``, ``STACK_GLOBAL``, ``EXT*``) from
    ``resolve(module, name)`` only, never by importing: the only callables a pickle can then
    reach are the ones ``resolve`` hands out (or it raises ``pickle.UnpicklingError``)."""

    class Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            return resolve(module, name)

    return Unpickler


def _refused_container(path: Path) -> str | None:
    """Why ``torch.load(weights_only=False)`` must not see this file at all, if it must not.

    Such a load would hand a TorchScript archive to ``torch.jit.load`` and a legacy tar archive
    to ``tarfile``; neither goes through the restricted unpickler. A TorchScript zip is spotted by
    the name ``constants.pkl`` anywhere in the raw bytes (zip member names are stored as is), so a
    zip parser that disagrees with torch's cannot hide it."""
    with path.open("rb") as f:
        head = f.read(4)
        if head == b"PK\x03\x04" and path.stat().st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(b"constants.pkl") != -1:
                    return "a TorchScript archive (code, not weights)"
            return None
    if tarfile.is_tarfile(path):
        return "a pre-2018 tar checkpoint (not supported)"
    return None


def _unreadable(path: Path, detail: str = "truncated or corrupt?",
                stubbed: Sequence[str] = ()) -> CheckpointError:
    names = sorted(set(stubbed))
    note = (f"; it names {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}, "
            f"which was not run" if names else "")
    return CheckpointError(f"{path} is not a readable PyTorch checkpoint ({detail}){note}")


def safe_torch_load(path: str | Path, *, foreign: bool = True) -> Any:
    """Load a ``torch.save`` file (zip or legacy format) without ever executing pickled code.

    First ``torch.load(weights_only=True)``. With ``foreign`` (released checkpoints: DeepSpeed's
    ``mp_rank_00_model_states.pt`` also pickles its argparse namespace), a file that load refuses
    is read again through :func:`_restricted_pickle_module`: tensors and plain containers are
    rebuilt, every other object becomes an inert :class:`_Stub`, nothing named in the file is
    called. ``foreign=False`` (our own files) allows the ``weights_only`` load only.
    """
    path = regular_file(path, "checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pickle-protocol and source-change notes: not the user's
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # refused globals, zip errors, EOF, bad magic: decided below
            if not foreign:
                raise _unreadable(path, "truncated, corrupt, or not plain tensors") from None
        refused = _refused_container(path)
        if refused is not None:
            raise CheckpointError(f"{path} is {refused}; refusing to load it") from None
        stubbed: list[str] = []
        try:
            return torch.load(path, map_location="cpu", weights_only=False,
                              pickle_module=_restricted_pickle_module(stubbed))
        except Exception:
            raise _unreadable(path, stubbed=stubbed) from None
