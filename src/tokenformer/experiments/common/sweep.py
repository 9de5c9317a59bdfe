"""LR sweeps: measure a grid of learning rates, growing it past an edge argmin, pick the argmin.

Every experiment tunes its learning rates with this one rule (``scale``, ``ablate``,
``adapt-bench``), so no arm loses only because a shared LR suits another.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def extend_grid(grid: list[float], losses: dict[float, float]) -> float | None:
    """The LR to add when the argmin of ``losses`` sits on an edge of ``grid`` (one log step
    beyond it), else None."""
    ordered = sorted(grid)
    best = min(ordered, key=lambda lr: (losses[lr], lr))
    if best == ordered[0]:
        return ordered[0] * ordered[0] / ordered[1]
    if best == ordered[-1]:
        return ordered[-1] * ordered[-1] / ordered[-2]
    return None


@dataclass
class LRSweep:
    """An LR sweep: every LR tried (``grid``, sorted once extended), its value (lower is
    better), the LRs added beyond the initial grid, and the argmin (ties: the smaller LR)."""

    grid: list[float]
    values: dict[float, float]
    added: list[float]
    chosen: float

    @property
    def at_edge(self) -> bool:
        return self.chosen in (min(self.grid), max(self.grid))

    @property
    def unimodal(self) -> bool:
        """Whether the values fall (weakly) towards the argmin from both sides of the grid: a
        sweep that is not (a second dip) is noisy or multimodal, and its pick less robust."""
        ordered = [self.values[lr] for lr in sorted(self.grid)]
        best = ordered.index(min(ordered))
        steps = list(itertools.pairwise(ordered))
        return (all(a >= b for a, b in steps[:best]) and all(a <= b for a, b in steps[best:]))

    @property
    def status(self) -> str:
        """``inside`` the initial grid, ``extended`` to get there, or still ``at edge``."""
        return "at edge" if self.at_edge else "extended" if self.added else "inside"


def sweep_lr(grid: Sequence[float], measure: Callable[[float], float], *,
             max_extensions: int = 2,
             on_extend: Callable[[float], None] | None = None) -> LRSweep:
    """Measure every LR of ``grid`` (in its order); while the argmin sits on an edge, add one
    log step beyond it (:func:`extend_grid`) and measure that, at most ``max_extensions`` times
    per side. ``on_extend`` hears of each LR added before it is measured. A non-finite value
    (a diverged run) counts as the worst, +inf."""
    initial = list(grid)
    if len(initial) < 2:
        raise ValueError("an LR sweep needs at least two learning rates")
    low = min(initial)
    lrs, values, added = list(initial), {}, []
    while True:
        for lr in lrs:
            if lr not in values:
                value = float(measure(lr))
                values[lr] = value if math.isfinite(value) else math.inf
        extra = extend_grid(lrs, values)
        below = extra is not None and extra < low
        if extra is None or sum((x < low) == below for x in added) >= max_extensions:
            break
        added.append(extra)
        if on_extend is not None:
            on_extend(extra)
        lrs = sorted([*lrs, extra])
    return LRSweep(lrs, values, added, min(lrs, key=lambda lr: (values[lr], lr)))
