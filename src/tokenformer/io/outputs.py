"""Where commands write: never into their inputs, never over what they did not write, one writer
per run folder.

Every command that writes calls :func:`check_output` (a folder or a file it produces in one go)
or :func:`check_run_folder` (a folder a run fills over time) *before* it writes anything, and
folders it produces get a marker file, ``.tokenformer-output`` (JSON naming the command), so that
``--overwrite`` can tell its own earlier output from a folder the user cares about. A run folder
is held with an exclusive lock (:func:`hold_run_folder`) for the whole run; the OS drops the lock
when its process dies, so a killed run never blocks the next one. docs/reliability.md states what
is guaranteed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..errors import OutputError, TokenFormerError
from .files import (
    MARKER,
    atomic_write_text,
    clean_stale_temps,
    link_error,
    read_marker,
    write_marker,
)
from .paths import has_regular_file, is_link_loop
from .process_group import World, max_across
from .run_folders import clean_leftovers

LOCK = ".tokenformer.lock"
LOCK_PID = ".tokenformer.lock.pid"  # sidecar: the lock file itself must stay empty for filelock


class RunFolderBusy(TokenFormerError):
    """Another process holds the run folder's lock."""


# -------------------------------------------------------------------------------------- checks
def _resolved(path: str | Path) -> Path:
    try:
        return Path(os.path.abspath(Path(path).expanduser())).resolve()  # follows every symlink
    except (RuntimeError, OSError):  # a link loop: RuntimeError before Python 3.13
        if not is_link_loop(path):
            raise
        raise OutputError(f"{path} is (or passes through) a symbolic link loop: it leads back "
                          f"to itself, never to a folder; remove the link or choose another "
                          f"path") from None


def check_not_input(out: str | Path, inputs: Iterable[str | Path | None], flag: str = "--out"
                    ) -> None:
    """Refuse an output that is, contains or lies inside an input (symlinks resolved).

    Inputs that are not existing paths (``bytes``, ``default``, a preset name) are skipped.
    """
    target = _resolved(out)
    for spec in inputs:
        if spec is None or str(spec) == "" or not Path(spec).exists():
            continue
        source = _resolved(spec)
        if target == source:
            raise OutputError(f"{flag} {out} is the input {spec}: choose another output")
        if source in target.parents:
            raise OutputError(f"{flag} {out} lies inside the input {spec}: choose an output "
                              f"outside it")
        if target in source.parents:
            raise OutputError(f"{flag} {out} contains the input {spec}: choose another output")


def check_creatable(out: str | Path, flag: str = "--out", *, temporary: bool = True) -> None:
    """Refuse, before any work, an output that could not be created at the end: a parent that is
    a file, a name longer than the file system allows (``temporary``: with the 14 bytes the
    temporary name ``.NAME.XXXXXXXX.tmp`` adds), a folder this process cannot create folders in
    (permissions, read-only file system). The last is probed: an empty folder created and
    removed in the nearest existing ancestor."""
    path = Path(os.path.abspath(Path(out).expanduser()))
    base = path.parent
    while not os.path.lexists(base):
        base = base.parent
    if not base.is_dir():
        raise OutputError(f"{flag} {out}: {base} is a file, not a folder")
    try:
        limit = os.pathconf(base, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    parts = path.relative_to(base).parts
    for i, part in enumerate(parts):
        size = len(os.fsencode(part)) + (14 if temporary and i == len(parts) - 1 else 0)
        if size > limit:
            raise OutputError(f"{flag} {out}: the name {part[:24]}... is too long for the file "
                              f"system ({size} bytes{' with its temporary name' * temporary}, "
                              f"at most {limit}): choose a shorter one")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".tokenformer-probe.", dir=base))
    except OSError as exc:
        raise OutputError(f"{flag} {out}: cannot create folders in {base} ({exc.strerror}): "
                          f"choose another output") from None


def check_output(out: str | Path, inputs: Iterable[str | Path | None], *, command: str,
                 overwrite: bool = False, kind: str = "dir", flag: str = "--out") -> None:
    """Before ``command`` writes ``out`` (a folder built whole, or a file): refuse inputs as
    outputs, an output that could not be created (:func:`check_creatable`), an existing ``out``
    without ``overwrite``, and with ``overwrite`` a folder without this command's marker
    (someone else's files), a link, the current folder, or anything of the wrong kind. Removes
    the temporary folders a killed earlier run left beside ``out``
    (:func:`tokenformer.io.files.clean_stale_temps`)."""
    check_not_input(out, inputs, flag)
    path = Path(out)
    if kind == "dir":
        here = Path.cwd().resolve()
        if _resolved(path) == here or _resolved(path) in here.parents:
            raise OutputError(f"{flag} {out} is the current folder or contains it: an output "
                              f"folder is replaced whole; choose another {flag}")
        clean_stale_temps(path)
    check_creatable(path, flag)
    if not path.exists() and not path.is_symlink():
        return
    if kind == "file":
        if path.is_dir():
            raise OutputError(f"{flag} {out} is a directory; give a file name")
        if not overwrite:
            raise OutputError(f"{out} already exists (pass --overwrite to replace it)")
        return
    if not path.is_dir():
        raise OutputError(f"{flag} {out} exists and is not a directory")
    if not overwrite:
        raise OutputError(f"output directory already exists: {out} (pass --overwrite to "
                          f"replace it)")
    if path.is_symlink():
        raise link_error(path, f"{flag} {out}")
    owner = read_marker(path)
    if owner is None:
        raise OutputError(f"{out} was not written by tokenformer {command} (no {MARKER} in it); "
                          f"--overwrite replaces only such outputs: remove it yourself or choose "
                          f"another {flag}")
    if owner != command:
        raise OutputError(f"{out} was written by tokenformer {owner}, not {command}; "
                          f"--overwrite replaces only this command's outputs")


def check_run_folder(out: str | Path, inputs: Iterable[str | Path | None], *, command: str,
                     legacy: Iterable[str] = (), flag: str = "--out") -> None:
    """Before a run writes into ``out`` (created, extended or resumed): refuse inputs as outputs
    and a non-empty folder the command did not write. ``legacy``: names whose presence marks a
    folder this command wrote before markers existed."""
    check_not_input(out, inputs, flag)
    path = Path(out)
    if not path.exists() and not path.is_symlink():
        check_creatable(path, flag, temporary=False)
        return
    if not path.is_dir():
        raise OutputError(f"{flag} {out} exists and is not a directory")
    owner = read_marker(path)
    if owner is not None:
        if owner != command:
            raise OutputError(f"{out} holds the output of tokenformer {owner}, not {command}: "
                              f"choose another {flag}")
        return
    names = {p.name for p in path.iterdir() if not p.name.startswith(".tokenformer")}  # ours
    if names and not names & set(legacy):
        raise OutputError(f"{out} already holds files tokenformer did not write (no {MARKER}): "
                          f"choose an empty or new {flag}")


# ---------------------------------------------------------------------------------- run lock
_held: dict[Path, list[Any]] = {}  # resolved folder -> [FileLock, depth]: re-entrant per process


def _holder(directory: Path) -> str:
    """The lock holder's pid, from the sidecar it writes right after locking (waited for briefly:
    two runs started at once may ask before the holder has written it)."""
    for _ in range(20):
        try:
            pid = (directory / LOCK_PID).read_text().strip() if has_regular_file(
                directory / LOCK_PID, folder=directory) else ""
        except (OSError, ValueError, TokenFormerError):
            pid = ""
        if pid.isdigit():
            return f"pid {pid}"
        time.sleep(0.05)
    return "an unknown pid"


@contextlib.contextmanager
def hold_run_folder(directory: str | Path, *, command: str, world: World | None = None
                    ) -> Iterator[Path]:
    """Hold ``directory`` (created if needed) exclusively for the block, mark it as
    ``command``'s, and remove crash leftovers (:func:`tokenformer.io.run_folders.clean_leftovers`).

    The lock is an OS file lock (``filelock``): a second process is refused at once with the
    holder's pid; a process killed with -9 releases it. Re-entrant within one process. Under
    torchrun only rank 0 locks (``world``) and every rank learns the outcome, so none hangs.
    """
    path = Path(directory)
    key = _resolved(path)
    main = world is None or world.is_main
    error: str | None = None
    failure: BaseException | None = None
    if main and key in _held:
        _held[key][1] += 1
    elif main:
        path.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path / LOCK), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            error = (f"{path} is in use by another tokenformer process ({_holder(path)}); "
                     f"wait for it to finish or stop it")
        else:
            _held[key] = [lock, 1]
            try:
                atomic_write_text(path / LOCK_PID, f"{os.getpid()}\n")
                clean_leftovers(path)
                if read_marker(path) is None:
                    write_marker(path, command)
            except BaseException as exc:  # raised below, once every rank knows
                _release(path, key)
                failure = exc
    if world is not None and world.distributed:
        if max_across(1 if error or failure else 0, world) and error is None and failure is None:
            error = f"{path} could not be held by rank 0 (see its error)"
    if failure is not None:
        raise failure
    if error is not None:
        raise RunFolderBusy(error)
    try:
        yield path
    finally:
        if main:
            _release(path, key)


def _release(path: Path, key: Path) -> None:
    entry = _held[key]
    entry[1] -= 1
    if entry[1] == 0:
        del _held[key]
        with contextlib.suppress(OSError):
            (path / LOCK_PID).unlink()
        entry[0].release()
