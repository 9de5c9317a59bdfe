"""What may be opened for reading: regular files only, and no symbolic link inside a package folder.

Opening a FIFO blocks until something writes to it, a device reads forever, and a link inside a
model, adapter, dataset or run folder points outside it (docs/reliability.md, "Symlinks and special
files inside folders"): every file the package reads passes through :func:`regular_file` or
:func:`has_regular_file` first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, PathError

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
        raise not_found(path, what) from None
    except OSError as exc:  # a link loop, a name too long, no permission to look
        if exc.errno == errno.ELOOP:
            raise not_found(path, what) from None
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


def is_link_loop(path: str | Path) -> bool:
    """Whether ``path`` is, or passes through, a symbolic link loop (a link that, through
    others, points back at itself)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def not_found(path: str | Path, what: str = "file") -> PathError:
    """The one line for a path that leads to nothing: missing, a link to a missing target, or a
    symbolic link loop (:func:`is_link_loop`)."""
    path = Path(path)
    if is_link_loop(path):
        return PathError(f"{what} {path} is a symbolic link loop (it leads back to itself, "
                         f"never to a file or folder)")
    if path.is_symlink():
        return PathError(f"{what} not found: {path} (a symbolic link to {os.readlink(path)}, "
                         f"which does not exist)")
    return PathError(f"{what} not found: {path}")


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


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file ``path`` (already checked to be a regular file): one
    :class:`CheckpointError` line when it is not UTF-8, not JSON or not an object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError:  # not JSON, or not UTF-8
        raise CheckpointError(f"{path} is corrupt (not JSON)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is malformed (not a JSON object)")
    return data


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


def sha256_file(file: str | Path, *, folder: str | Path | None = None) -> str:
    """The sha256 of a regular file (:func:`regular_file`), hex, read in 1 MiB blocks: a
    checkpoint file's entry in its manifest, a tokenizer file's identity in ``meta.json``."""
    digest = hashlib.sha256()
    with regular_file(file, folder=folder).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()

