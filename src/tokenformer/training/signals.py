"""Stopping on a signal: while training into a run folder, SIGINT/SIGTERM finish the current step, a
checkpoint is written and the run ends with :class:`Interrupted` (a second signal stops at once)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..errors import TokenFormerError
from ..io.process_group import World, max_across


class Interrupted(TokenFormerError):
    """SIGINT or SIGTERM stopped a run after its current step, with a checkpoint written; the
    CLI exits with ``exit_code`` (128 + the signal number: 130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class StopOnSignal:
    """While training into a run folder: the first SIGINT/SIGTERM asks the loop to stop after
    the current step; a second one raises KeyboardInterrupt at once (the CLI then exits 130).

    Signals within ``ECHO`` seconds of the first count as the same one: a Ctrl-C under torchrun
    reaches each worker twice, from the terminal and forwarded by the launcher.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    ECHO = 0.5

    def __init__(self, enabled: bool) -> None:
        self.signum = 0
        self.first = 0.0
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if self.enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:
            if time.monotonic() - self.first < self.ECHO:
                return
            raise KeyboardInterrupt
        self.signum, self.first = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: finishing the current step, then writing a "
              f"checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self, world: World) -> int:
        """The signal that asked to stop (0: none), the same on every rank."""
        return max_across(self.signum, world)


@contextlib.contextmanager
def interrupt_on_signal(kept: str) -> Iterator[None]:
    """For commands with no checkpoint to write when stopped (adapt, scale): SIGINT or SIGTERM
    during the block stops the command at once with :class:`Interrupted`, whose one line says
    ``kept`` (what is saved and how to go on), and the CLI exits 128 + the signal number, as a
    ``train`` interrupt does. Signal handlers belong to the main thread: elsewhere, no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: Any) -> None:
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}: {kept}", 128 + signum)

    previous = {sig: signal.signal(sig, handle) for sig in StopOnSignal.SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
