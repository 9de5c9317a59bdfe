"""The checks every registry of the package makes when something is registered: Θ variants
(:data:`tokenformer.nn.theta.THETAS`), growth recipes
(:data:`tokenformer.ops.growth.recipes.RECIPES`) and MLP widenings
(:data:`tokenformer.ops.growth.widening.WIDENINGS`).

An entry is checked when it is registered, so that a wrong one is one line in the registry's
words then (``a growth recipe must be a Recipe, got None``, ``growth recipe 'weird':
tokens must be a function ..., got int 42``), not an AttributeError or "'int' object is not
callable" at its first use. Names are what options are written with (``--grow-at
...,recipe=NAME``, ``widen=NAME``, ``--model.norm=NAME``), so one must be a non-empty string
those can carry. Lookups read the table (a plain dict) itself; only adding and removing go
through :class:`Registry`.

Imports nothing of the package but its errors: every layer's registry uses it.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EntryRule:
    """What one field of a registered entry must hold: ``ok(value)``, and ``text``, the words
    for it in the refusal (``tokens must be {text}, got ...``)."""

    ok: Callable[[Any], bool]
    text: str


def function_rule(signature: str, *, optional: bool = False) -> EntryRule:
    """A callable (``signature``: its arguments and result, in words); ``optional``: or None."""
    return EntryRule(lambda value: callable(value) or (optional and value is None),
                     f"a function {signature}" + (" or None" if optional else ""))


def instance_rule(kind: type, text: str, *, optional: bool = False) -> EntryRule:
    """An instance of ``kind`` that is not a bool (True is an int to isinstance); ``optional``:
    or None."""
    def ok(value: object) -> bool:
        if value is None:
            return optional
        return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))

    return EntryRule(ok, text + (" or None" if optional else ""))


FLAG_RULE = instance_rule(bool, "True or False")
TEXT_RULE = EntryRule(lambda value: isinstance(value, str) and bool(value.strip()),
                      "a non-empty string")
NAME_TEXT = ("a non-empty string without spaces, ',' or '=' (options such as --grow-at write it "
             "as key=value)")


def is_name(value: object) -> bool:
    """Whether ``value`` can name an entry (:data:`NAME_TEXT`)."""
    return (isinstance(value, str) and bool(value)
            and not any(c.isspace() or c in ",=" for c in value))


def shown(value: object) -> str:
    """``value`` as a refusal names it: its type and a short repr (``int 42``, ``str 'x'``)."""
    return "None" if value is None else f"{type(value).__name__} {reprlib.repr(value)}"


@dataclass(frozen=True)
class Registry:
    """One table of named entries and the checks of :meth:`add` and :meth:`remove`.

    ``noun``: what one entry is called (``"growth recipe"``), ``article`` its article;
    ``table``: the dict itself; ``kind``: the entries' class; ``error``: the class the refusals
    raise (the registry's layer's: ConfigError, GrowthError); ``fields``: the rule of each field
    of an entry to check; ``built_in``: names :meth:`remove` refuses; ``reserved``: names taken
    that are no entry of the table, and what each names (``widen=duplicate``); ``alias_field``:
    the field holding an entry's other names (recipes' old names), taken like names."""

    noun: str
    table: dict[str, Any]
    kind: type
    error: type[Exception]
    fields: Mapping[str, EntryRule] = field(default_factory=dict)
    built_in: tuple[str, ...] = ()
    reserved: Mapping[str, str] = field(default_factory=dict)
    alias_field: str | None = None
    article: str = "a"

    def aliases(self, entry: Any) -> tuple[str, ...]:
        """``entry``'s other names (none unless :attr:`alias_field` is set)."""
        return tuple(getattr(entry, self.alias_field)) if self.alias_field else ()

    def add(self, name: object, entry: object) -> None:
        """Put ``entry`` in the table under ``name``, after checking, in this order, the entry's
        class, the name, every field in :attr:`fields`, the other names and that no name is
        taken (by an entry, an entry's other name or a reserved name)."""
        if not isinstance(entry, self.kind):
            raise self.error(f"{self.article} {self.noun} must be a {self.kind.__name__}, got "
                             f"{shown(entry)}")
        if not is_name(name):
            raise self.error(f"{self.article} {self.noun}'s name must be {NAME_TEXT}, got "
                             f"{shown(name)}")
        for key, rule in self.fields.items():
            value = getattr(entry, key)
            if not rule.ok(value):
                raise self.error(f"{self.noun} {name!r}: {key} must be {rule.text}, got "
                                 f"{shown(value)}")
        names = (name, *self.aliases(entry))
        for other in names[1:]:
            if not is_name(other):
                raise self.error(f"{self.noun} {name!r}: every other name must be {NAME_TEXT}, "
                                 f"got {shown(other)}")
        if len(set(names)) < len(names):
            raise self.error(f"{self.noun} {name!r} gives one name twice: {', '.join(names)}")
        for n in names:
            if n in self.reserved:
                raise self.error(f"{self.article} {self.noun} cannot be named {n!r}: that name "
                                 f"is {self.reserved[n]}")
        taken = {*self.table,
                 *(alias for other in self.table.values() for alias in self.aliases(other))}
        clash = [n for n in names if n in taken]
        if clash:
            raise self.error(f"{self.article} {self.noun} named {clash[0]!r} is already "
                             f"registered; choose another name")
        self.table[name] = entry  # type: ignore[index]  (is_name: a str)

    def remove(self, name: object) -> None:
        """Take the entry ``name`` out of the table; a built-in one stays."""
        if name in self.built_in:
            raise self.error(f"{self.noun} {name!r} is built in and cannot be unregistered")
        if not (isinstance(name, str) and name in self.table):
            added = [n for n in self.table if n not in self.built_in]
            raise self.error(f"no {self.noun} named {name!r} is registered (registered: "
                             f"{', '.join(added) or 'none'}, besides the built-in "
                             f"{', '.join(self.built_in)})")
        del self.table[name]
