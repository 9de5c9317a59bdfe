"""What one growth asks for, as one typed object: :class:`GrowthOptions`.

:func:`~tokenformer.ops.growth.grow`, :func:`~tokenformer.ops.growth.grow_with_optimizer` and
:func:`~tokenformer.ops.growth.plan_growth` take its fields as keyword arguments (or the object
itself), and every list of keys elsewhere is read off its fields: ``tokenformer info --grow``'s
(:data:`REQUEST_KEYS`) and the ``--grow-at`` mini-language's
(:data:`tokenformer.training.growth_events.GROW_KEYS`). A new option is one field here.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from ...errors import GrowthError
from .recipes import OLD_RECIPE_KEY, canonical_recipe, recipe_names, take_old_recipe_key
from .sizes import size_request

# Field metadata: "text" False = no key=value form (a list); "planned" False = no effect on the
# grown config, so plan_growth leaves it to grow (the old-token options).
_LIST = {"text": False}
_NOT_PLANNED = {"planned": False}


@dataclass(frozen=True)
class GrowthOptions:
    """One growth request (the module docstring of :mod:`tokenformer.ops.growth` gives the
    math; :func:`~tokenformer.ops.growth.grow` each field's meaning).

    Sizes are absolute (``1536``) or multipliers (``"2x"``); ``recipe`` names an entry of
    :data:`tokenformer.ops.growth.recipes.RECIPES` (``strategy``, its old name, still works as
    a keyword of ``grow``/``plan_growth``, not of this class, with a deprecation warning);
    ``how`` one of
    :data:`tokenformer.ops.growth.recipes.HOW`; ``widen`` one of
    :func:`tokenformer.ops.growth.recipes.widen_names` (how a Transformer baseline's MLP grows
    with ``ffn=``). Values are checked when the request is
    planned (:func:`~tokenformer.ops.growth.plan_growth`), not here, so that every refusal is
    the one line it has always been."""

    qkv: int | str | None = None
    proj: int | str | None = None
    ffn: int | str | None = None
    layers: int | str | None = None
    hidden: int | str | None = None
    heads: int | None = None
    how: str = "identity"
    width_noise: float = 0.0
    widen: str = "duplicate"
    recipe: str = "exact"
    positions: list[int] | None = field(default=None, metadata=_LIST)
    freeze_old: int | str | bool | None = field(default=None, metadata=_NOT_PLANNED)
    noise_old: float = field(default=0.0, metadata=_NOT_PLANNED)

    @classmethod
    def of(cls, options: GrowthOptions | None, request: dict[str, Any]
           ) -> tuple[GrowthOptions, dict[str, object]]:
        """``options`` (default: all defaults) with the fields named in ``request`` replaced, and
        the keys of ``request`` that are no field (for :func:`refuse_unsupported`); the old
        keyword ``strategy`` is ``recipe``, and an old recipe name the recipe it now names, each
        with one deprecation warning (later lookups find the name they read)."""
        request = take_old_recipe_key(request, "strategy=", "recipe=", GrowthError)
        known = {k: v for k, v in request.items() if k in OPTION_KEYS}
        unknown = {k: v for k, v in request.items() if k not in OPTION_KEYS}
        merged = dataclasses.replace(options or cls(), **known)
        if isinstance(merged.recipe, str) and merged.recipe in recipe_names():
            merged = dataclasses.replace(merged, recipe=canonical_recipe(merged.recipe))
        return merged, unknown

    def planned(self) -> dict[str, Any]:
        """The fields that shape the grown config (:func:`~tokenformer.ops.growth.plan_growth`'s
        keywords)."""
        return {k: getattr(self, k) for k in PLAN_KEYS}

    def recorded(self) -> dict[str, Any]:
        """:meth:`planned` as a growth record holds it (``tokenformer grow``'s entry in
        ``trainer_state.json``): the recipe under the key records have always used,
        ``strategy``."""
        return {(OLD_RECIPE_KEY if k == "recipe" else k): v for k, v in self.planned().items()}


def _keys(**metadata: bool) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(GrowthOptions)
                 if all(f.metadata.get(k, True) == v for k, v in metadata.items()))


OPTION_KEYS = _keys()  # every keyword grow() takes beside generator, copy and progress
PLAN_KEYS = _keys(planned=True)
OLD_TOKEN_KEYS = _keys(planned=False)  # freeze_old, noise_old
TEXT_KEYS = _keys(text=True)  # the keys of the key=value forms (--grow-at, info --grow)
REQUEST_KEYS = _keys(text=True, planned=True)  # tokenformer info --grow

FOREVER = "forever"


def freeze_request(value: object) -> int | str | None:
    """``freeze_old`` as None (no freeze), a positive step count or :data:`FOREVER`; accepts
    None/False/0, a count (an int or its digits), ``"forever"`` or True."""
    if value is None or value is False or value == 0 or value == "0":
        return None
    if value is True or value == FOREVER:
        return FOREVER
    count = size_request(value, 0)
    if not isinstance(count, int) or count < 0:
        raise GrowthError(f"freeze_old must be a number of steps or {FOREVER!r}, got {value!r}")
    return count


def noise_level(value: object) -> float:
    """``noise_old`` as a float >= 0; GrowthError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value >= 0):
        raise GrowthError(f"noise_old must be a number >= 0 (a std relative to each tensor's "
                          f"rms), got {value!r}")
    return float(value)


_CANNOT_GROW = {
    "hidden size": "grow the hidden size with hidden= (a whole multiple like '2x': width by "
                   "duplication)",
    "number of heads": "heads follow the hidden size (heads= may only restate r·heads: the "
                       "head size is kept)",
    "vocabulary": "the vocabulary is the embedding table fixed by the tokenizer, not a "
                  "Pattention, so adding parameter tokens cannot change it",
}
_ALIASES = {"hidden_size": "hidden size", "d_model": "hidden size", "width": "hidden size",
            "num_heads": "number of heads", "vocab": "vocabulary", "vocab_size": "vocabulary"}


def refuse_unsupported(requests: dict[str, object]) -> None:
    """Raise GrowthError for any growth request grow() does not take, explaining why."""
    for key in requests:
        if key in _ALIASES:
            what = _ALIASES[key]
            raise GrowthError(f"cannot grow the {what} with {key}=: {_CANNOT_GROW[what]}")
        raise GrowthError(f"grow() got an unknown argument {key!r}; it grows qkv, proj, ffn, "
                          f"hidden (heads follow) and layers")


def parse_growth_request(text: str) -> dict[str, Any]:
    """``"hidden=2x,layers=2x,how=stack"`` → :func:`grow`'s keyword arguments (sizes stay text:
    :func:`plan_growth` checks them; ``heads`` is a count, ``width_noise`` a number; the old key
    ``strategy`` is passed on, for :meth:`GrowthOptions.of` to warn about)."""
    usage = (f"growth request {text!r} is malformed: expected key=value,... with keys "
             f"{', '.join(REQUEST_KEYS)} (e.g. hidden=2x,layers=2x,how=stack)")
    kwargs: dict[str, Any] = {}
    for item in str(text).split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in (*REQUEST_KEYS, OLD_RECIPE_KEY) or not value or key in kwargs:
            raise GrowthError(usage)
        if key == "heads":
            if not value.isdecimal() or int(value) < 1:
                raise GrowthError(f"heads={value!r} must be a positive count")
            kwargs[key] = int(value)
        elif key == "width_noise":
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise GrowthError(f"width_noise={value!r} must be a number") from None
        else:
            kwargs[key] = value
    return kwargs
