"""Writing files and folders so that no reader sees half of one: atomic writes, the output marker,
and folders committed by a rename that never replaces what it must not."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import safetensors.torch
import torch

from .. import __version__
from ..errors import DiskFullError, OutputError, TokenFormerError, is_disk_full
from .paths import has_regular_file

try:
    import fcntl
except ImportError:  # Windows: temporary folders are not locked (and not cleaned while in use)
    fcntl = None  # type: ignore[assignment]


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
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, Exception) and is_disk_full(exc):  # say which file, not its temporary
            raise _disk_full_at(path, exc) from None
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write(path: str | Path, writer: Callable[[Path], None]) -> None:
    """Call ``writer(tmp_path)`` and move the result onto ``path`` atomically."""
    with atomic_path(path) as tmp:
        writer(tmp)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                     metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` (every safetensors write of the package goes through
    here), its disk-full failure raised as the ``OSError(ENOSPC)`` naming ``path`` that any other
    write raises: safetensors reports it as a ``SafetensorError`` with the OS error in words, which
    callers and the CLI would not recognise as "no space left on device"."""
    try:  # through the module: a test replaces safetensors.torch.save_file (a full disk)
        safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    except Exception as exc:
        if isinstance(exc, OSError) or not is_disk_full(exc):
            raise
        raise _disk_full_at(path, exc) from None


def _disk_full_at(path: str | Path, exc: Exception) -> OSError:
    """A full disk as the package reports it, whatever the writer said (``exc``: torch's zip
    writer, safetensors, an OSError without a file name): ``OSError(ENOSPC)`` (EDQUOT when
    ``exc`` is one) naming ``path``, which callers and the CLI show."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno else errno.ENOSPC
    return OSError(code, os.strerror(code), str(path))


@contextlib.contextmanager
def stop_on_disk_full(where: str | Path, then: str) -> Iterator[None]:
    """Inside, a write that fails for lack of space (:func:`is_disk_full`) becomes one
    :class:`DiskFullError` line: ``no space left on device writing FILE; THEN``. FILE: the one
    the ``OSError`` names (every atomic write names its target; a file of the temporary folder
    :func:`atomic_dir` builds for ``where``, by its name inside ``where``), else ``where``;
    ``then``: what is kept and what to do (free space and rerun the same command)."""
    try:
        yield
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        filename = getattr(exc, "filename", None)
        raise DiskFullError(f"no space left on device writing "
                            f"{_committed_name(filename, where) if filename else where}; "
                            f"{then}") from None


def _committed_name(filename: str | Path, where: str | Path) -> Path:
    """``filename``, or, for a file inside the temporary folder :func:`atomic_dir` builds for
    ``where`` (removed by now), the name it would have had in ``where``."""
    path, target = Path(os.path.abspath(filename)), Path(os.path.abspath(where))
    pattern = _temp_pattern(target)
    for folder in path.parents:
        if folder.parent == target.parent and pattern.fullmatch(folder.name):
            return Path(where) / path.relative_to(folder)
    return Path(filename)


# ------------------------------------------------------------------ the output marker
# Folders a command produces carry this file (JSON naming the command), so that --overwrite can
# tell its own earlier output from a folder the user cares about (tokenformer.io.outputs).
MARKER = ".tokenformer-output"


def write_marker(directory: str | Path, command: str) -> None:
    """Record that ``command`` wrote ``directory`` (what ``--overwrite`` may later replace)."""
    atomic_write_text(Path(directory) / MARKER, json.dumps(
        {"command": command, "version": __version__,
         "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")


def read_marker(directory: str | Path, *, dir_fd: int | None = None) -> str | None:
    """The command named by ``directory``'s marker, or None (no marker, or not ours). With
    ``dir_fd`` (``directory`` is then ignored), the marker of the folder open as that descriptor:
    the one held, whatever was renamed since. A marker that is not a regular file (a FIFO would
    block the read, a link points elsewhere) is not ours."""
    try:
        if dir_fd is None:
            if not has_regular_file(Path(directory) / MARKER, folder=directory):
                return None
            text = (Path(directory) / MARKER).read_text()
        else:
            fd = os.open(MARKER, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0),
                         dir_fd=dir_fd)
            with open(fd) as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                text = f.read()
        data = json.loads(text)
    except (OSError, ValueError, TokenFormerError):
        return None
    return data.get("command") if isinstance(data, dict) else None


# ------------------------------------------------------------------ committing a folder
# A folder is built under a temporary name beside its target, ``.NAME.XXXXXXXX.tmp`` (mkdtemp's
# eight random characters), held with an flock while it exists, and renamed onto NAME when
# complete. The renames never replace what they were not asked to (docs/reliability.md):
# ``renameat2(RENAME_NOREPLACE)`` / ``(RENAME_EXCHANGE)`` on Linux; elsewhere (or on a file
# system without them, e.g. NFS) a folder is renamed only onto an empty folder this process has
# just created with mkdir, which is atomic and fails if anything is there.
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


class _Unsupported(Exception):
    """renameat2 or the flag is not available here: use the portable fallback."""


@functools.cache
def _renameat2() -> Callable[..., int] | None:
    """glibc's ``renameat2`` (2.28+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _rename2(src: Path, dst: Path, flags: int) -> None:
    function = _renameat2()
    if function is None:
        raise _Unsupported
    if function(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # kernel or file system
            raise _Unsupported
        raise OSError(code, os.strerror(code), str(src), None, str(dst))


def rename_noreplace(src: str | Path, dst: str | Path) -> None:
    """Rename the folder ``src`` to ``dst`` atomically; FileExistsError if anything (a folder, a
    file, a dangling link) is at ``dst``, which is then left as it is."""
    src, dst = Path(src), Path(dst)
    try:
        return _rename2(src, dst, _RENAME_NOREPLACE)
    except _Unsupported:
        pass
    # The fallback: claim dst with mkdir, then rename onto the claim. POSIX rename replaces only
    # an empty folder, so at worst it replaces the empty claim itself (if someone wrote into it
    # meanwhile, the rename fails with ENOTEMPTY and their files stay).
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # only while it is still our empty claim
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst)) from None
        raise


def _temp_pattern(path: Path) -> re.Pattern[str]:
    return re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.tmp")


def _hold(directory: Path) -> int | None:
    """An fd holding an exclusive flock on ``directory`` (never a link), or None when another
    process holds it or it is gone. Without fcntl: an fd without a lock."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
                     | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return None
    return fd


def _same(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed) is the folder ``fd`` is open on."""
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def clean_stale_temps(path: str | Path) -> list[Path]:
    """Remove the temporary folders :func:`atomic_dir` left beside ``path`` when its process was
    killed (``.NAME.XXXXXXXX.tmp``, no process holding its lock); returns them. A folder some
    process still holds is being built, or replaced, right now, and is kept. Without fcntl
    (no flock: a live folder cannot be told from a stale one) nothing is removed."""
    if fcntl is None:
        return []
    path = Path(os.path.abspath(path))
    pattern = _temp_pattern(path)
    try:
        children = [c for c in path.parent.iterdir() if pattern.fullmatch(c.name)]
    except OSError:
        return []
    removed = []
    for child in children:
        fd = _hold(child)
        if fd is None:
            continue
        try:
            if _same(fd, child):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        finally:
            os.close(fd)
    return removed


def _held_tempdir(path: Path) -> tuple[Path, int | None]:
    """A new ``.NAME.XXXXXXXX.tmp`` beside ``path`` and the fd holding its lock. A cleaner of
    another process may lock and remove a fresh folder before we lock it: then take another."""
    umask = os.umask(0)
    os.umask(umask)
    for _ in range(100):
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        fd = _hold(tmp)
        if fd is not None and _same(fd, tmp):
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; mkdir's mode is expected
            return tmp, fd
        if fd is not None:
            os.close(fd)
    raise OutputError(f"could not create a temporary folder beside {path}")


def link_error(path: str | Path, name: str | None = None) -> OutputError:
    """The refusal of an output ``path`` (shown as ``name``) that is a symbolic link: replacing
    the link would leave its target, replacing the target would surprise whoever else links it."""
    return OutputError(f"{name or path} is a symbolic link (to {os.readlink(path)}); an output "
                       f"replaces only a real folder: give the folder it points to, or remove "
                       f"the link")


class _Stranded(OutputError):
    """A commit that found a foreign folder and could not put it back: the temporary folder may
    hold it, so it is not deleted."""


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False, *, command: str | None = None
               ) -> Iterator[Path]:
    """Build a folder under a temporary name beside ``path``; move it onto ``path`` when the
    block completes (on an exception it is removed and ``path`` is untouched).

    The commit never replaces what it was not asked to, even if ``path`` changed meanwhile:

    - without ``overwrite`` nothing is replaced: if anything appeared at ``path`` while the block
      ran, :class:`OutputError` says so, that thing is left as it is, the new folder is removed;
    - with ``overwrite`` a folder at ``path`` is replaced (in one atomic exchange on Linux) only
      when, checked at that moment, it carries ``command``'s marker (:mod:`tokenformer.io.outputs`;
      any folder when ``command`` is None: checkpoints in a run folder the caller holds). A
      symbolic link is never replaced.

    With ``command`` the new folder gets its marker first. Temporary folders that a killed
    process left beside ``path`` are removed first (:func:`clean_stale_temps`).
    """
    path = Path(os.path.abspath(path))  # "." and ".." have no name to build a temporary one
    if os.path.lexists(path) and not overwrite:
        raise OutputError(f"output directory already exists: {path}")
    if path.is_symlink():
        raise link_error(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(path)
    tmp, held = _held_tempdir(path)
    discard = True
    try:
        if command is not None:
            write_marker(tmp, command)
        yield tmp
        _commit(tmp, path, overwrite, command)
    except _Stranded:
        discard = False
        raise
    finally:
        if discard:  # our unfinished folder, or the output just replaced
            shutil.rmtree(tmp, ignore_errors=True)
        if held is not None:
            os.close(held)


def _commit(tmp: Path, path: Path, overwrite: bool, command: str | None) -> None:
    """Move ``tmp`` (complete) onto ``path`` as :func:`atomic_dir` says. Afterwards ``tmp`` holds
    nothing to keep: our new folder on failure, the replaced output (or nothing) on success."""
    appeared = OutputError(f"{path} appeared while this command was writing it; it was left as "
                           f"it is and nothing was written: choose another output")
    for _ in range(10):  # a folder to replace that vanished meanwhile: commit as a new one
        if not overwrite or not os.path.lexists(path):
            try:
                return rename_noreplace(tmp, path)
            except FileExistsError:
                if not overwrite:
                    raise appeared from None
                continue
        old = _hold(path)  # held: no other commit replaces it, no cleaner removes it
        if old is None:
            if path.is_symlink():
                raise link_error(path)
            if os.path.lexists(path):
                raise OutputError(f"{path} exists and is not a folder; nothing was written"
                                  if not path.is_dir() else
                                  f"{path} is being replaced by another process; nothing was "
                                  f"written")
            continue
        try:
            if not _same(old, path):
                continue
            if command is not None and (owner := read_marker(".", dir_fd=old)) != command:
                why = f"no {MARKER} in it" if owner is None else f"written by {owner}"
                raise OutputError(f"{path} is not (or no longer) an output of tokenformer "
                                  f"{command} ({why}); it was left as it is and nothing was "
                                  f"written")
            return _replace(tmp, path, old)
        finally:
            os.close(old)
    raise appeared


def _replace(tmp: Path, path: Path, old: int) -> None:
    """Swap the complete ``tmp`` with the folder held as ``old`` at ``path``. If, by then,
    another folder was at ``path``, it is put back untouched and OutputError raised."""
    changed = OutputError(f"{path} was replaced by another folder while this command was "
                          f"writing it; it was left as it is and nothing was written")
    try:
        _rename2(tmp, path, _RENAME_EXCHANGE)
    except _Unsupported:
        return _replace_aside(tmp, path, old, changed)
    if not _same(old, tmp):  # not the folder checked: swap back
        try:
            _rename2(tmp, path, _RENAME_EXCHANGE)
        except OSError:
            raise _Stranded(f"{path} was replaced by another folder while this command was "
                            f"writing it, and that folder is now {_out_of_reach(tmp)}: move it "
                            f"back") from None
        raise changed


def _out_of_reach(folder: Path) -> Path:
    """Rename a folder that may not be ours from a temporary name (which a cleaner removes) to
    ``.NAME.XXXXXXXX.old`` (which nothing removes); where it is now."""
    kept = folder.with_name(folder.name[:-len(".tmp")] + ".old")
    with contextlib.suppress(OSError):
        rename_noreplace(folder, kept)
        return kept
    return folder


def _replace_aside(tmp: Path, path: Path, old: int, changed: OutputError) -> None:
    """:func:`_replace` without an atomic exchange: the old folder is renamed aside onto an empty
    folder claimed with mkdtemp (``.NAME.XXXXXXXX.old``: never removed by a cleaner), then
    ``tmp`` is committed as a new folder, then the old one is deleted. A kill between the two
    renames leaves the old output there and nothing at ``path`` (docs/reliability.md)."""
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    try:
        os.rename(path, aside)
    except OSError:
        os.rmdir(aside)
        raise
    if not _same(old, aside):  # not the folder checked: put it back
        try:
            rename_noreplace(aside, path)
        except OSError:
            raise OutputError(f"{path} was replaced by another folder while this command was "
                              f"writing it, and that folder is now {aside}: move it back"
                              ) from None
        raise changed
    try:
        rename_noreplace(tmp, path)
    except FileExistsError:
        raise OutputError(f"{path} appeared while this command was replacing it; it was left as "
                          f"it is, the earlier output is in {aside}, nothing was written"
                          ) from None
    shutil.rmtree(aside, ignore_errors=True)  # the marked output --overwrite replaces
