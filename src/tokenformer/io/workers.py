"""Worker processes that never outlive their parent (``tokenformer scale --jobs N``).

The parent holds the run folder's lock (:mod:`.outputs`), an OS lock released when it dies; a
worker that went on training after a ``kill -9`` of its parent would write results into a folder
nobody holds, beside a rerun. So each worker asks the kernel to kill it when its parent dies
(Linux ``PR_SET_PDEATHSIG``), and, where that is unavailable or was set too late, checks before
every write that its parent is still the one that started it (:func:`check_parent`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from multiprocessing.pool import Pool

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_parent: int | None = None  # in a worker: the pid of the process that started it


def _die_with_parent(parent: int) -> None:
    """The pool's initializer, in each worker: SIGKILL when the parent dies, and exit now if it
    already has (the kernel only signals deaths after the request)."""
    global _parent
    _parent = parent
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # check_parent still stops every write
    check_parent()


def check_parent() -> None:
    """In a worker of :func:`worker_pool`: exit at once, writing nothing, when the parent that
    started it is gone (and its run-folder lock with it). A no-op in any other process."""
    if _parent is not None and os.getppid() != _parent:
        os._exit(1)


def worker_pool(processes: int) -> Pool:
    """A ``spawn`` pool (no forked torch state) of ``processes`` workers that die with this
    process."""
    return multiprocessing.get_context("spawn").Pool(
        processes, initializer=_die_with_parent, initargs=(os.getpid(),))
