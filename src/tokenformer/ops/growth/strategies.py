"""The growth strategies (recipes), one table: :data:`STRATEGY`, name → :class:`Strategy`.

A strategy is the function that draws a grown Pattention's K and V (:data:`.tokens.TokensFn`)
and what the recipe promises: whether it is exact (Θ's factor held, the function preserved),
whether inserted blocks start as the identity, whether it starts a fresh optimizer, and its
old names. Everything that depends on the recipe reads this table: :func:`canonical_recipe`,
:func:`resets_optimizer`, the planned config (:func:`tokenformer.ops.growth.plan_growth`), the
token stage of :func:`tokenformer.ops.growth.grow`, ``tokenformer grow --strategy`` and the
``--grow-at`` mini-language.

Adding a strategy is one token function and one line: in :data:`STRATEGY` below, or, from
outside the package, :func:`register_strategy` (docs/architecture.md, "Adding a growth
operator").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ...errors import GrowthError
from ...nn.pattention import Pattention
from ...registry import FLAG_RULE, Registry, function_rule, instance_rule
from .tokens import TokensFn, exact_tokens, random_tokens, zero_key_tokens
from .widening import DUPLICATE, WIDENINGS


@dataclass(frozen=True)
class Strategy:
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

STRATEGY: dict[str, Strategy] = {s.name: s for s in (
    Strategy("exact", exact_tokens, exact=True),
    Strategy("paper", zero_key_tokens),
    Strategy("official-init", random_tokens, identity_blocks=False, aliases=("official",),
             alias_note=_OFFICIAL_NOTE),
    Strategy(RELEASED, random_tokens, identity_blocks=False, resets_optimizer=True),
)}

# The built-in names, read off the table when the package is imported (argparse choices, the
# frontier's arms); lookups go to the table itself, so registered strategies count there.
RECIPES = tuple(STRATEGY)
RECIPE_ALIASES = {alias: s.name for s in STRATEGY.values() for alias in s.aliases}
STRATEGIES = (*RECIPES, *RECIPE_ALIASES)  # every built-in name grow(strategy=...) accepts

# Depth growth, by how=: "identity" inserts blocks (built by the strategy, between the old ones,
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
    return {alias: s.name for s in STRATEGY.values() for alias in s.aliases}


def strategy_names() -> tuple[str, ...]:
    """Every name ``strategy=`` accepts now: the table's, then the old names."""
    return (*STRATEGY, *_aliases())


# Adding and removing strategies, checked (tokenformer.registry): a Strategy whose tokens are
# no function is refused when it is registered, not at the first growth that draws them.
_REGISTRY = Registry("growth strategy", STRATEGY, Strategy, GrowthError, fields={
    "tokens": function_rule("(old, new, generator, copy) -> (keys, values)"),
    "exact": FLAG_RULE,
    "identity_blocks": FLAG_RULE,
    "resets_optimizer": FLAG_RULE,
    "aliases": instance_rule(tuple, "a tuple of old names"),
    "alias_note": instance_rule(str, "a string"),
}, built_in=STRATEGIES, alias_field="aliases")


def register_strategy(strategy: Strategy) -> Strategy:
    """Add ``strategy`` to :data:`STRATEGY`; returns it. GrowthError, naming the problem, for a
    name or an old name that is taken or no name (:data:`tokenformer.registry.NAME_TEXT`) and
    for fields that are not what :class:`Strategy` says (tokens that are no function, ...).
    :func:`unregister_strategy` takes it out again."""
    _REGISTRY.add(strategy.name if isinstance(strategy, Strategy) else None, strategy)
    return strategy


def unregister_strategy(name: str) -> None:
    """Remove the strategy ``name`` (registered by :func:`register_strategy`)."""
    _REGISTRY.remove(name)


def canonical_recipe(name: str, *, warn: bool = True) -> str:
    """The recipe ``name`` stands for (``official`` → ``official-init``, with a
    DeprecationWarning unless ``warn`` is False); GrowthError for an unknown name."""
    aliases = _aliases()
    if name in aliases:
        if warn:
            warnings.warn(recipe_alias_note(name), DeprecationWarning, stacklevel=2)
        return aliases[name]
    if name not in STRATEGY:
        raise GrowthError(f"unknown growth strategy {name!r}; choose one of "
                          f"{', '.join(STRATEGY)} ({', '.join(aliases)}: an old name)")
    return name


def strategy_named(name: str, *, warn: bool = False) -> Strategy:
    """The :class:`Strategy` ``name`` (or an old name of it) stands for."""
    return STRATEGY[canonical_recipe(name, warn=warn)]


def recipe_alias_note(name: str) -> str:
    """The one-line note for an old recipe name."""
    target = STRATEGY[_aliases()[name]]
    return f"growth strategy {name!r} is now called {target.name!r} {target.alias_note}".rstrip()


def resets_optimizer(strategy: str) -> bool:
    """Whether the recipe starts a fresh optimizer (and, in a run, restarts the schedule)."""
    return strategy_named(strategy).resets_optimizer


def grown_tokens(old: Pattention, new: Pattention, strategy: str,
                 generator: torch.Generator | None, copy: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``new`` (at least as many rows as ``old``): old rows first, new rows by
    ``strategy`` (its :attr:`Strategy.tokens`)."""
    return strategy_named(strategy).tokens(old, new, generator, copy)
