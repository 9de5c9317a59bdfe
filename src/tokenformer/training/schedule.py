"""The learning rate as a pure function of the step: warmup, then cosine, WSD or constant.

A linear warmup, then cosine, warmup-stable-decay or constant, restarted per stage between
growths with ``growth_lr: restart``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .config import TrainConfig

SCHEDULES = ("cosine", "wsd", "constant")


def lr_at(step: int, cfg: TrainConfig, growth_steps: Sequence[int] = ()) -> float:
    """Learning rate of optimizer step ``step`` (0-based), a pure function of the step.

    Linear warmup over ``warmup_steps`` (step 0 already has lr/warmup), then ``cosine`` down to
    ``min_lr`` at the last step, ``wsd`` (stable at ``lr``, then a linear decay to ``min_lr`` over
    the last ``decay_fraction`` of the steps) or ``constant``. With ``growth_lr: restart`` every
    stage between growth steps runs its own schedule from warmup, as the released code does.
    """
    start, end = 0, cfg.steps
    if cfg.growth_lr == "restart":
        for g in sorted(growth_steps):
            if g <= step:
                start = g
            elif g < end:
                end = g
                break
    s, n = step - start, end - start
    warmup = min(cfg.warmup_steps, n)
    if s < warmup:
        return cfg.lr * (s + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = (s - warmup) / max(n - 1 - warmup, 1)
        return cfg.min_lr + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (cfg.lr -
                                                                                  cfg.min_lr)
    decay = max(1, round(cfg.decay_fraction * n))  # wsd
    decay_start = max(n - decay, warmup)
    if s < decay_start:
        return cfg.lr
    progress = (s - decay_start + 1) / (n - decay_start)
    return cfg.lr - progress * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (the schedule, not the optimizer, owns the rate)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
