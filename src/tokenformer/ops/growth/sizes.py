"""Sizes of a growth request: counts and multipliers (``768``, ``"2x"``), whole width multiples,
and where inserted blocks go."""

from __future__ import annotations

import math
import numbers
import re

from ...errors import GrowthError

_MULTIPLIER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*[xX×]\s*$")


def size_request(spec: object, current: int) -> int | float | None:
    """The count a size spec asks for, before the caller's rounding and bounds (grow's
    :func:`resolve_size`, prune's ``prune_size``): an int (numpy integers too) or "768" is that
    count; "2x" / "0.5x" is that multiple of ``current`` (a float); anything else (a bool
    included) is None, malformed."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, numbers.Integral):
        return int(spec)
    if isinstance(spec, str) and spec.strip().isdecimal():  # not isdigit: int() refuses '²'
        return int(spec)
    if isinstance(spec, str) and (match := _MULTIPLIER.match(spec)):
        return float(match.group(1)) * current
    return None


def resolve_size(spec: int | str | None, current: int, what: str, *,
                 adds: str = "parameter tokens or blocks") -> int:
    """The new count for ``what``: ``None`` keeps ``current``; an int or "768" is absolute;
    "2x" / "1.5x" multiplies ``current`` (the product must be a whole number). Never smaller
    (``adds``: what this growth adds, for the refusal)."""
    if spec is None:
        return current
    if isinstance(spec, bool):
        raise GrowthError(f"{what}: expected a count or a multiplier like '2x', got {spec!r}")
    request = size_request(spec, current)
    if request is None:
        raise GrowthError(f"{what}: malformed size {spec!r}; give a count like 1536 or a "
                          f"multiplier like '2x' or '1.5x'")
    if isinstance(request, float) and abs(request - round(request)) > 1e-9:  # a multiplier
        raise GrowthError(f"{what}: {str(spec).strip()} of {current} is {request:g}, not a "
                          f"whole number; give an absolute count instead")
    new = round(request)
    if new < current:
        raise GrowthError(f"{what}: cannot shrink from {current} to {new}; growth only adds "
                          f"{adds}")
    return new


def width_factor(spec: int | str | None, current: int, what: str) -> int:
    """The whole multiple r a width request asks for: ``"2x"``, ``"4x"``, or an absolute size
    that is r times ``current``; None is 1. Anything else is one GrowthError saying what is
    possible (768 → 1024 is not: duplication makes whole copies)."""
    if spec is None:
        return 1
    request = size_request(spec, current)
    if request is None:
        raise GrowthError(f"{what}: malformed size {spec!r}; give a whole multiple like '2x' or "
                          f"a size like {2 * current}")
    if request < current:
        raise GrowthError(f"{what}: cannot shrink from {current} to {request:g}; width growth "
                          f"only duplicates units (a factor of at least 1x)")
    ratio = request / current
    if abs(ratio - round(ratio)) > 1e-9:
        raise GrowthError(
            f"{what}: {current} → {request:g} is not a whole multiple of {current}; width growth "
            f"duplicates every unit, so the new size must be {current}·r "
            f"({', '.join(str(current * r) for r in (2, 3, 4))}, ...)")
    return round(ratio)


def default_positions(old_layers: int, new_layers: int) -> list[int]:
    """Indices in the grown model of ``new_layers - old_layers`` inserted blocks, spread evenly:
    old block i is followed by round((i+1)·k/L) − round(i·k/L) new ones (k added, L old)."""
    k = new_layers - old_layers
    per_gap = [math.floor((i + 1) * k / old_layers + 0.5) - math.floor(i * k / old_layers + 0.5)
               for i in range(old_layers)]
    positions, index = [], 0
    for count in per_gap:
        index += 1  # the old block
        positions += range(index, index + count)
        index += count
    return positions


def layer_plan(old_layers: int, new_layers: int, positions: list[int] | None
               ) -> list[tuple[int, bool]]:
    """For each block of the grown model: (old block it comes from or is templated on, is_new)."""
    added = new_layers - old_layers
    if positions is None:
        positions = default_positions(old_layers, new_layers)
    positions = [int(p) for p in positions]
    if len(positions) != added:
        raise GrowthError(f"positions lists {len(positions)} new blocks but growing from "
                          f"{old_layers} to {new_layers} layers inserts {added}")
    if len(set(positions)) != added or any(not 0 <= p < new_layers for p in positions):
        raise GrowthError(f"positions must be distinct indices in the grown model, 0 to "
                          f"{new_layers - 1}; got {positions}")
    inserted, plan, old = set(positions), [], 0
    for index in range(new_layers):
        if index in inserted:  # a set: planning N blocks is O(N), not O(N²)
            plan.append((max(old - 1, 0), True))  # templated on the old block before it
        else:
            plan.append((old, False))
            old += 1
    return plan
