"""The learning rate as a pure function of the step: warmup, then cosine, WSD or constant.

A linear warmup, then cosine, warmup-stable-decay or constant. A growth may restart that schedule
(``growth_lr: restart`` for every growth, or the ``official-released`` recipe for its own) and may
set the peak of the stages after it (``lr=``, at once or over ``lr_ramp`` steps): one schedule
family whose peak is piecewise constant or linear (:class:`Stage`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import TrainConfig

SCHEDULES = ("cosine", "wsd", "constant")


@dataclass(frozen=True)
class Stage:
    """What a growth at step ``step`` does to the schedule. ``restart``: warm up again and decay
    anew over the steps to the next restart (or the end). ``lr``: the peak from then on (None:
    unchanged); ``ramp``: steps over which the peak moves linearly from its value before the
    growth to ``lr`` (0: at once; step ``step + i`` gets the fraction (i + 1)/ramp)."""

    step: int
    restart: bool = False
    lr: float | None = None
    ramp: int = 0


def peak_at(step: int, cfg: TrainConfig, stages: Sequence[Stage] = ()) -> float:
    """The peak learning rate in force at ``step``: ``cfg.lr`` until a growth sets another."""
    peak, start, target = cfg.lr, None, None
    for stage in sorted((s for s in stages if s.lr is not None), key=lambda s: s.step):
        if stage.step > step:
            break
        # the value just before this growth (a ramp in progress counts where it has got to)
        start = _ramped(stage.step - 1, peak, start, target)
        peak, target = stage.lr, stage
    return _ramped(step, peak, start, target)


def _ramped(step: int, peak: float, start: float | None, stage: Stage | None) -> float:
    if stage is None or start is None or stage.ramp == 0 or step >= stage.step + stage.ramp:
        return peak
    return start + (peak - start) * (step - stage.step + 1) / stage.ramp


def lr_at(step: int, cfg: TrainConfig, growth: Sequence[int | Stage] = ()) -> float:
    """Learning rate of optimizer step ``step`` (0-based), a pure function of the step.

    Linear warmup over ``warmup_steps`` (step 0 already has peak/warmup), then ``cosine`` down to
    ``min_lr`` at the last step, ``wsd`` (stable at the peak, then a linear decay to ``min_lr``
    over the last ``decay_fraction`` of the steps) or ``constant``. ``growth``: the run's growth
    steps (ints) or :class:`Stage`s. A stage restarts the schedule when it says so or when
    ``growth_lr`` is ``restart`` (every growth): the steps from it to the next restart (or the
    end) run their own warmup and decay, as the released code trains each size. The peak is
    :func:`peak_at`, ``cfg.lr`` unless a stage sets another.
    """
    stages = [g if isinstance(g, Stage) else Stage(int(g)) for g in growth]
    restart_all = cfg.growth_lr == "restart"
    start, end = 0, cfg.steps
    for g in sorted(s.step for s in stages if s.restart or restart_all):
        if g <= step:
            start = g
        elif g < end:
            end = g
            break
    peak = peak_at(step, cfg, stages)
    s, n = step - start, end - start
    warmup = min(cfg.warmup_steps, n)
    if s < warmup:
        return peak * (s + 1) / warmup
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        progress = (s - warmup) / max(n - 1 - warmup, 1)
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (peak -
                                                                                  cfg.min_lr)
    decay = max(1, round(cfg.decay_fraction * n))  # wsd
    decay_start = max(n - decay, warmup)
    if s < decay_start:
        return peak
    progress = (s - decay_start + 1) / (n - decay_start)
    return peak - progress * (peak - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (the schedule, not the optimizer, owns the rate)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
