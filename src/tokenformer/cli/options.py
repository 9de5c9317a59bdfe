"""argparse helpers every command module shares: typed values with one-line errors, dataclass fields
as flags with their docstrings, deprecated spellings."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import math
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import torch

from ..errors import TokenFormerError
from ..models.config import SEED
from ..training.config import parse_device


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



def seed(text: str) -> int:
    """argparse ``type=`` for a seed: an integer the configs' ``SEED`` rule allows (32 bits)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not SEED.ok(value):  # the config's own rule, worded as it words it
        raise argparse.ArgumentTypeError(f"must be {SEED.text.format(a='an integer')}, got "
                                         f"{text}")
    return value


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
    try:
        parsed = parse_device(text)
    except TokenFormerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available in this torch build or "
                                         f"on this machine; use cpu")
    return text


def add_config_flags(group: Any, cls: type, prefix: str) -> None:
    """``--PREFIX.KEY VALUE`` for every field of the dataclass ``cls`` (the one override syntax of
    every command that takes config overrides), each stored as ``set:PREFIX.KEY`` with its type
    and docstring in ``--help``; :func:`config_overrides` reads them back."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        metavar, help_ = describe_field(f, docs, show_default=False)
        group.add_argument(f"--{prefix}.{f.name}", dest=f"set:{prefix}.{f.name}",
                           metavar=metavar, default=argparse.SUPPRESS, help=help_)


def config_overrides(args: argparse.Namespace, prefix: str | None = None) -> dict[str, Any]:
    """The ``set:`` values of parsed ``args`` (:func:`add_config_flags`, ``--KEY VALUE``): all of
    them with their dotted keys, or with ``prefix`` only those under it, the prefix removed."""
    values = {k[4:]: v for k, v in vars(args).items() if k.startswith("set:")}
    if prefix is None:
        return values
    return {k[len(prefix) + 1:]: v for k, v in values.items() if k.startswith(prefix + ".")}


class DeprecatedAppend(argparse.Action):
    """A hidden old spelling of an ``append`` option: appends to the same ``dest`` and says the
    new spelling on stderr, once per command line."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs: Any) -> None:
        kwargs.pop("help", None)
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        if not items:
            print(f"warning: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, [*items, values])
