"""What the commands that run an experiment share (``scale``, ``ablate``, ``sparse-study``,
``adapt-bench``): the command line they record and the output folder they hold."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..io.outputs import check_run_folder, hold_run_folder


def command_line(name: str) -> str | None:
    """The command as typed (recorded in results.json), when ``tokenformer NAME`` is running;
    None when called otherwise (e.g. from Python)."""
    return "tokenformer " + " ".join(sys.argv[1:]) if sys.argv[1:2] == [name] else None


def experiment_folder(out: str, inputs: list[str | None], command: str
                      ) -> contextlib.AbstractContextManager[Path]:
    """The experiment's output folder, checked (not an input, not someone else's folder) and
    held for the run: a rerun resumes it, a concurrent one is refused."""
    check_run_folder(out, inputs, command=command,
                     legacy=("results.json", "report.md", ".partial.json", "runs"))
    return hold_run_folder(out, command=command)
