"""The ``tokenformer`` command line: a thin layer over the package's Python functions.

Each module in :mod:`tokenformer.cli.commands` adds its subcommands with ``register(subparsers)``
and sets ``func`` to a plain function taking the parsed arguments (the argparse helpers they
share: :mod:`.options`). Every user-facing error becomes one ``error: ...`` line on stderr and a
non-zero exit; ``TOKENFORMER_DEBUG=1`` shows the traceback. The package's own warnings
(:class:`~tokenformer.errors.TokenFormerWarning`: a documented fallback) are one ``warning: ...``
line each. This module imports no torch, so ``tokenformer --help`` answers at once.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pkgutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import (
    TokenFormerDeprecationWarning,
    TokenFormerError,
    TokenFormerWarning,
    is_disk_full,
)
from . import commands


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other error
        self.exit(2, f"error: {self.prog}: {message}\n")


def describe_failure(exc: BaseException) -> str:
    """One line for an unexpected failure: its type and the first line of its message (disk
    full said plainly)."""
    if is_disk_full(exc):
        where = getattr(exc, "filename", None)
        return f"no space left on device{f' writing {where}' if where else ''}"
    text = str(exc).strip()
    message = text.splitlines()[0] if text else ""
    if isinstance(exc, MemoryError) and not message:  # Python's own gives no message
        message = "out of memory (the request needs more than this process may allocate)"
    return f"{type(exc).__name__}: {message} (TOKENFORMER_DEBUG=1 shows the traceback)"


def one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints a :class:`TokenFormerWarning` as one ``warning:``
    line in its own words (not Python's two lines with the file, line number and source line
    of its caller) and hands every other warning to ``show``, the display it replaces."""
    def showwarning(message: Warning | str, category: type[Warning], filename: str,
                    lineno: int, file: Any = None, line: str | None = None) -> None:
        if issubclass(category, TokenFormerWarning):
            print(f"warning: {message}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def _fail(message: str, code: int) -> int:
    print(f"error: {message.strip().splitlines()[0] if message.strip() else 'failed'}",
          file=sys.stderr)
    return code


def command_index() -> dict[str, tuple[str, str]]:
    """``{command: (module, one-line help)}`` for every top-level command, read from the
    ``sub.add_parser(NAME, help=HELP)`` calls in each command module's ``register`` *without
    importing the module*: the modules import torch, and ``tokenformer --help`` should not wait
    for it (tests check this index against the full registration)."""
    index: dict[str, tuple[str, str]] = {}
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        path = Path(commands.__path__[0]) / f"{info.name}.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.FunctionDef) and node.name == "register"
                    and node.args.args):
                continue
            sub = node.args.args[0].arg
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "add_parser"
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == sub
                        and call.args and isinstance(call.args[0], ast.Constant)):
                    help_ = next((k.value.value for k in call.keywords if k.arg == "help"
                                  and isinstance(k.value, ast.Constant)), "")
                    index[call.args[0].value] = (info.name, help_)
    return index


def _command_of(argv: list[str]) -> str | None:
    """The command named on the command line (the top-level parser has only -h and --version,
    so it is the first token that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; with ``argv``, only the module of the command it names is imported (the other
    commands get a stub with their help line, enough for ``--help`` and for "invalid choice")."""
    parser = _Parser(prog="tokenformer", description="TokenFormer: train, grow, evaluate, serve.")
    parser.add_argument("--version", action="version", version=f"tokenformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    index = command_index()
    wanted = None if argv is None else index.get(_command_of(argv) or "", ("", ""))[0]
    registered: set[str] = set()
    for name, (module, help_) in index.items():
        if wanted is None or module == wanted:
            if module not in registered:
                importlib.import_module(f"{commands.__name__}.{module}").register(sub)
                registered.add(module)
        else:
            sub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = os.environ.get("TOKENFORMER_DEBUG") == "1"
    try:
        with warnings.catch_warnings():  # the display restored afterwards (main in a test)
            warnings.showwarning = one_line_warnings(warnings.showwarning)
            # an old spelling the command line still takes: one line, once per message and place
            # (Python ignores DeprecationWarnings outside __main__)
            warnings.simplefilter("default", TokenFormerDeprecationWarning)
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
