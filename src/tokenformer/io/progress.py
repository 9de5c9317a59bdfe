"""Progress reporting that works on a terminal *and* in a log file.

On a terminal, :func:`progress_bar` is a tqdm bar. When stderr is not a terminal (``nohup``, CI,
``2> log``) a redrawn bar would be noise and tqdm hides itself, which leaves a long run silent;
there the same object prints plain lines instead: one per ``every`` updates, or at about
``lines`` evenly spaced points of the run, and at the end. ``progress`` is the one switch every
command shares (``--no-progress``): ``None`` (the default) picks by the terminal, ``True`` forces
the bar, ``False`` prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm.auto import tqdm


class _Plain:
    """tqdm's subset used here (update, set_postfix[_str], write, close), as plain lines."""

    def __init__(self, total: int | None, desc: str, unit: str, initial: int, every: int | None,
                 lines: int, file: TextIO | None) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.file = file
        if every is None:  # ~`lines` lines over the run, counted from where it starts
            every = max(1, -(-((total or 0) - initial) // lines)) if total else 1
        self.every = every
        self.postfix = ""
        self.start = time.perf_counter()
        self.last_printed = initial
        self.closed = False

    def _print(self) -> None:
        done = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        post = f"  {self.postfix}" if self.postfix else ""
        print(f"{self.desc}: {done} {self.unit}{pct}, {time.perf_counter() - self.start:.1f} s"
              f"{post}", file=self.file or sys.stderr, flush=True)
        self.last_printed = self.n

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n - self.last_printed >= self.every or (self.total and self.n >= self.total):
            self._print()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = s

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True,
                    **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = " ".join(f"{k} {v}" for k, v in items.items())

    @staticmethod
    def write(s: str, file: TextIO | None = None) -> None:
        print(s, file=file or sys.stdout, flush=True)  # where tqdm.write prints

    def close(self) -> None:
        if not self.closed and self.n != self.last_printed:
            self._print()
        self.closed = True

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Silent(_Plain):
    def _print(self) -> None:
        self.last_printed = self.n

    @staticmethod
    def write(s: str, file: TextIO | None = None) -> None:
        pass


def inner_progress(progress: bool | None) -> bool | None:
    """The ``progress`` setting for a loop inside one that reports already (a training run inside
    an experiment's arms): a bar on a terminal, silent in a log, where the outer loop's plain
    lines say enough."""
    if progress is None and not sys.stderr.isatty():
        return False
    return progress


def progress_bar(total: int | None, desc: str, *, progress: bool | None = None,
                 unit: str = "it", initial: int = 0, every: int | None = None, lines: int = 10,
                 file: TextIO | None = None, **tqdm_kwargs: Any) -> Any:
    """A tqdm bar on a terminal, plain progress lines elsewhere, nothing when ``progress`` is
    False (see the module docstring). ``every`` (plain lines only): print after this many
    updates, e.g. 1 for one line per experiment arm; default ≈ ``total / lines``."""
    if progress is False:
        return _Silent(total, desc, unit, initial, every, lines, file)
    stream = file or sys.stderr
    if progress or (hasattr(stream, "isatty") and stream.isatty()):
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, dynamic_ncols=True,
                    file=file, **tqdm_kwargs)
    return _Plain(total, desc, unit, initial, every, lines, file)
