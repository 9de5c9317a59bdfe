"""The ``tokenformer`` command line: a thin layer over the package's Python functions.

Each module in :mod:`tokenformer.commands` adds its subcommands with ``register(subparsers)`` and
sets ``func`` to a plain function taking the parsed arguments. Every user-facing error becomes one
``error: ...`` line on stderr and a non-zero exit; ``TOKENFORMER_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pkgutil
import sys
from collections.abc import Callable
from typing import Any

from . import __version__, commands
from .errors import TokenFormerError


def positive(kind: type) -> Callable[[str], Any]:
    """argparse ``type=`` for a number > 0 of ``kind`` (int or float)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other error
        self.exit(2, f"error: {self.prog}: {message}\n")


def non_negative_float(text: str) -> float:
    """argparse ``type=`` for a finite float >= 0 (NaN and infinities refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def device(text: str) -> str:
    """argparse ``type=`` for a torch device this build can use (``cuda`` needs CUDA)."""
    import torch

    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (e.g. cpu, cuda, "
                                         f"cuda:1)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available in this torch build or "
                                         f"on this machine; use cpu")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; use cpu or cuda")
    return text


def describe_failure(exc: BaseException) -> str:
    """One line for an unexpected failure: its type and the first line of its message (disk
    full said plainly)."""
    from .outputs import is_disk_full

    if is_disk_full(exc):
        where = getattr(exc, "filename", None)
        return f"no space left on device{f' writing {where}' if where else ''}"
    text = str(exc).strip()
    message = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {message} (TOKENFORMER_DEBUG=1 shows the traceback)"


def _fail(message: str, code: int) -> int:
    print(f"error: {message.strip().splitlines()[0] if message.strip() else 'failed'}",
          file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tokenformer", description="TokenFormer: train, grow, evaluate, serve.")
    parser.add_argument("--version", action="version", version=f"tokenformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = os.environ.get("TOKENFORMER_DEBUG") == "1"
    try:
        result = args.func(args)
    except TokenFormerError as exc:
        if debug:
            raise
        return _fail(str(exc), getattr(exc, "exit_code", 2))
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # every other failure, BaseException subclasses included
        # (torch's CheckpointException): one line, never a raw traceback
        if debug:
            raise
        return _fail(describe_failure(exc), 2)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
