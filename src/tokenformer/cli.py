"""The ``tokenformer`` command line: a thin layer over the package's Python functions.

Each module in :mod:`tokenformer.commands` adds its subcommands with ``register(subparsers)`` and
sets ``func`` to a plain function taking the parsed arguments. Every user-facing error becomes one
``error: ...`` line on stderr and a non-zero exit; ``TOKENFORMER_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import math
import os
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
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


def comma_list(kind: type, what: str) -> Callable[[str], list[Any]]:
    """argparse ``type=`` for comma-separated values of ``kind`` (e.g. ``0,3,5``)."""
    def parse(text: str) -> list[Any]:
        try:
            return [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got "
                                             f"{text!r}") from None

    return parse


def field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` from a dataclass's attribute docstrings (the string literal right after a
    field, the convention Sphinx and tyro read), one line each; fields without one are absent."""
    import inspect
    import itertools
    import textwrap

    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):  # a subclass's docstring wins
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body
        if not body or not isinstance(body[0], ast.ClassDef):
            continue
        stmts = body[0].body
        for stmt, after in itertools.pairwise(stmts):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def describe_field(f: Any, docs: dict[str, str], show_default: bool = True) -> tuple[str, str]:
    """``(metavar, help)`` of a dataclass field for ``--help``: its type (``INT``, ``FLOAT``,
    ``STR|NONE``...) and its doc, with the default unless it is set elsewhere (a preset)."""
    import dataclasses

    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    doc = docs.get(f.name, "").replace("%", "%%")  # argparse %-formats help
    help_ = f"{doc} (default: {default!r})".lstrip() if show_default else doc
    return kind.upper().replace(" ", ""), help_


class DeprecatedFlag(argparse.Action):
    """A hidden old spelling of a ``store_true`` flag: sets the same ``dest`` and says the new
    name on stderr (``add_argument("--quiet", dest="no_progress", action=DeprecatedFlag,
    new="--no-progress")``)."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        kwargs.pop("help", None)
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"warning: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, True)


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

    from .train import parse_device

    try:
        parsed = parse_device(text)
    except TokenFormerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available in this torch build or "
                                         f"on this machine; use cpu")
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
