"""The growth recipes, one table: :data:`RECIPES`, name → :class:`Recipe`.

A recipe is the function that draws a grown Pattention's K and V (:data:`.tokens.TokensFn`)
and what it promises: whether it is exact (Θ's factor held, the function preserved), whether
inserted blocks start as the identity, whether it starts a fresh optimizer, and its old names.
Everything that depends on the recipe reads this table: :func:`canonical_recipe`,
:func:`resets_optimizer`, the planned config (:func:`tokenformer.ops.growth.plan_growth`), the
token stage of :func:`tokenformer.ops.growth.grow`, ``tokenformer grow --recipe`` and the
``--grow-at`` mini-language. (A recipe used to be called a growth *strategy*: ``strategy=``,
``--strategy``, ``register_strategy`` still work, each with a deprecation warning; *strategy*
now names only the data-parallel mode, ``--strategy ddp|fsdp``.)

Adding a recipe is one token function and one line: in :data:`RECIPES` below, or, from outside
the package, :func:`register_recipe` (docs/architecture.md, "Adding a growth operator").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import GrowthError, warn_deprecated
from ...nn.pattention import Pattention
from ...registry import FLAG_RULE, Registry, function_rule, instance_rule
from .tokens import TokensFn, exact_tokens, random_tokens, zero_key_tokens
from .widening import DUPLICATE, WIDENINGS


@dataclass(frozen=True)
class Recipe:
    """One growth recipe.

    ``tokens``: K and V of a grown Pattention that keeps its place (old rows first).
    ``exact``: the grown config holds Θ's factor (and a top-k) at its pre-growth value, which
    function preservation needs (Θ = softmax then only grows by whole multiples); False: the
    factor follows the new n (``*_scale`` reset to None). ``identity_blocks``: an inserted
    block's branch outputs are zero for every input (the block is the identity); False: its
    tokens are drawn fresh. ``resets_optimizer``: a fresh optimizer (and, in a run, a warmup
    restart). ``aliases``: old names, accepted with a DeprecationWarning carrying
    ``alias_note``."""

    name: str
    tokens: TokensFn
    exact: bool = False
    identity_blocks: bool = True
    resets_optimizer: bool = False
    aliases: tuple[str, ...] = ()
    alias_note: str = ""


RELEASED = "official-released"
_OFFICIAL_NOTE = (f"(the released initialisation, optimizer carried); {RELEASED!r} is the "
                  f"released training recipe (also a fresh optimizer, a warmup restart and a "
                  f"new decay)")

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("exact", exact_tokens, exact=True),
    Recipe("paper", zero_key_tokens),
    Recipe("official-init", random_tokens, identity_blocks=False, aliases=("official",),
           alias_note=_OFFICIAL_NOTE),
    Recipe(RELEASED, random_tokens, identity_blocks=False, resets_optimizer=True),
)}

# The built-in names, read off the table when the package is imported (the registry refuses to
# remove them); lookups go to the table itself (recipe_names), so registered recipes count there.
BUILT_IN_RECIPES = tuple(RECIPES)
RECIPE_ALIASES = {alias: r.name for r in RECIPES.values() for alias in r.aliases}
BUILT_IN_NAMES = (*BUILT_IN_RECIPES, *RECIPE_ALIASES)  # every built-in name recipe= accepts
OLD_RECIPE_KEY = "strategy"  # recipe's old name: a keyword and a --grow-at key that still work

# Depth growth, by how=: "identity" inserts blocks (built by the recipe, between the old ones,
# at positions) in the token stage; "stack" is a stage of its own that repeats the trained
# blocks in order (tokenformer.ops.growth.stages).
HOW = {"identity": "insert identity blocks", "stack": "repeat the trained blocks in order"}
HOWS = tuple(HOW)

def widen_names() -> dict[str, str]:
    """Every ``widen=`` name and what it does: ``duplicate``, then the table's widenings
    (:data:`~tokenformer.ops.growth.widening.WIDENINGS`, registered ones included)."""
    return {DUPLICATE: "copy every unit a whole number of times (HyperCloning)",
            **{name: w.what for name, w in WIDENINGS.items()}}


def _aliases() -> dict[str, str]:
    return {alias: r.name for r in RECIPES.values() for alias in r.aliases}


def recipe_names() -> tuple[str, ...]:
    """Every name ``recipe=`` accepts now: the table's, then the old names."""
    return (*RECIPES, *_aliases())


# Adding and removing recipes, checked (tokenformer.registry): a Recipe whose tokens are no
# function is refused when it is registered, not at the first growth that draws them.
_REGISTRY = Registry("growth recipe", RECIPES, Recipe, GrowthError, fields={
    "tokens": function_rule("(old, new, generator, copy) -> (keys, values)"),
    "exact": FLAG_RULE,
    "identity_blocks": FLAG_RULE,
    "resets_optimizer": FLAG_RULE,
    "aliases": instance_rule(tuple, "a tuple of old names"),
    "alias_note": instance_rule(str, "a string"),
}, built_in=BUILT_IN_NAMES, alias_field="aliases")


def register_recipe(recipe: Recipe) -> Recipe:
    """Add ``recipe`` to :data:`RECIPES`; returns it. GrowthError, naming the problem, for a
    name or an old name that is taken or no name (:data:`tokenformer.registry.NAME_TEXT`) and
    for fields that are not what :class:`Recipe` says (tokens that are no function, ...).
    :func:`unregister_recipe` takes it out again."""
    _REGISTRY.add(recipe.name if isinstance(recipe, Recipe) else None, recipe)
    return recipe


def unregister_recipe(name: str) -> None:
    """Remove the recipe ``name`` (registered by :func:`register_recipe`)."""
    _REGISTRY.remove(name)


def register_strategy(recipe: Recipe) -> Recipe:
    """Deprecated: :func:`register_recipe` (a growth recipe was called a strategy)."""
    warn_old_recipe_name("register_strategy", "register_recipe")
    return register_recipe(recipe)


def unregister_strategy(name: str) -> None:
    """Deprecated: :func:`unregister_recipe`."""
    warn_old_recipe_name("unregister_strategy", "unregister_recipe")
    unregister_recipe(name)


def warn_old_recipe_name(old: str, new: str) -> None:
    """The one warning of an old spelling of a recipe (``strategy=``, ``--strategy``,
    ``register_strategy``): a :class:`~tokenformer.errors.TokenFormerDeprecationWarning` blamed
    on the user's line (the CLI prints it as one ``warning:`` line)."""
    warn_deprecated(f"{old} is deprecated (a growth recipe was called a strategy): use {new}; "
                    f"strategy now names only the data-parallel mode (ddp, fsdp)")


def take_old_recipe_key(request: dict[str, Any], old: str, new: str,
                        error: type[Exception], where: str = "") -> dict[str, Any]:
    """``request`` with its old key ``strategy`` renamed ``recipe``, after one warning (``old``
    → ``new``: how the caller's user spells them); ``error`` (prefixed by ``where``) when both
    are given. The one place the old key is read: grow()/plan_growth, --grow-at, grow --strategy."""
    if OLD_RECIPE_KEY not in request:
        return request
    if "recipe" in request:
        raise error(f"{where}recipe and strategy (its old name) name the same thing; give recipe")
    request = {("recipe" if k == OLD_RECIPE_KEY else k): v for k, v in request.items()}
    warn_old_recipe_name(old, new)
    return request


def canonical_recipe(name: str, *, warn: bool = True) -> str:
    """The recipe ``name`` stands for (``official`` → ``official-init``, with a deprecation
    warning unless ``warn`` is False); GrowthError for an unknown name."""
    aliases = _aliases()
    if name in aliases:
        if warn:
            warn_deprecated(recipe_alias_note(name))
        return aliases[name]
    if name not in RECIPES:
        raise GrowthError(f"unknown growth recipe {name!r}; choose one of "
                          f"{', '.join(RECIPES)} ({', '.join(aliases)}: an old name)")
    return name


def recipe_named(name: str, *, warn: bool = False) -> Recipe:
    """The :class:`Recipe` ``name`` (or an old name of it) stands for."""
    return RECIPES[canonical_recipe(name, warn=warn)]


def recipe_alias_note(name: str) -> str:
    """The one-line note for an old recipe name."""
    target = RECIPES[_aliases()[name]]
    return f"growth recipe {name!r} is now called {target.name!r} {target.alias_note}".rstrip()


def resets_optimizer(recipe: str) -> bool:
    """Whether the recipe starts a fresh optimizer (and, in a run, restarts the schedule)."""
    return recipe_named(recipe).resets_optimizer


def grown_tokens(old: Pattention, new: Pattention, recipe: str,
                 generator: torch.Generator | None, copy: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``new`` (at least as many rows as ``old``): old rows first, new rows by
    ``recipe`` (its :attr:`Recipe.tokens`)."""
    return recipe_named(recipe).tokens(old, new, generator, copy)
