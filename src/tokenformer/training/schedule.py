"""The learning rate as a pure function of the step and one small record, :class:`LrSchedule`.

A linear warmup, then cosine, warmup-stable-decay or constant. A growth may restart that schedule
(``growth_lr: restart`` for every growth, or the ``official-released`` recipe for its own) and may
set the peak of the stages after it (``lr=``, at once or over ``lr_ramp`` steps): one schedule
family whose peak is piecewise constant or linear (:class:`LrStage`).

What a restart does is the schedule's one post-growth warmup rule (:data:`RESTARTS`): a run
trained by ``fit`` from its own config starts the schedule again (warmup, then a new decay over
the steps to the next restart or the end: the released code); the frontier's runs, which all
follow one WSD family whose cooldown is each budget's, warm up again and keep the run's decay
(``restarts="warmup"``). A TrainConfig's schedule is :meth:`TrainConfig.lr_schedule
<tokenformer.training.config.TrainConfig.lr_schedule>`; this module reads no config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import ConfigError

SCHEDULES = ("cosine", "wsd", "constant")
# What a restarting growth does: "schedule": warm up again, then a new decay over the steps to the
# next restart (or the end); "warmup": warm up again over warmup_steps, the decay staying the run's.
RESTARTS = ("schedule", "warmup")


@dataclass(frozen=True)
class LrStage:
    """What a growth at step ``step`` does to the schedule. ``restart``: warm up again (and, by
    the schedule's :data:`RESTARTS` rule, decay anew over the steps to the next restart or the
    end). ``lr``: the peak from then on (None: unchanged); ``ramp``: steps over which the peak
    moves linearly from its value before the growth to ``lr`` (0: at once; step ``step + i``
    gets the fraction (i + 1)/ramp)."""

    step: int
    restart: bool = False
    lr: float | None = None
    ramp: int = 0


@dataclass(frozen=True)
class LrSchedule:
    """Everything the learning rate of a step depends on (:func:`lr_at`).

    ``peak``: the peak until a stage sets another; ``min_lr``: where every decay ends, or, with
    ``min_ratio``, that fraction of the peak in force (the frontier: each stage cools down to
    ``min_lr_ratio`` × its own LR). ``steps``: the run's (or the cooldown branch's) length;
    ``warmup_steps``: the linear warmup, at the start and after each restart; ``shape``: one of
    :data:`SCHEDULES`; ``decay_fraction``: WSD's decay, the last fraction of the steps (of a
    restarted schedule's). ``stages``: the growths' :class:`LrStage`; ``restart_all``: every
    growth restarts (``growth_lr: restart``); ``restarts``: what a restart does
    (:data:`RESTARTS`)."""

    peak: float
    min_lr: float
    steps: int
    warmup_steps: int
    shape: str = "cosine"
    decay_fraction: float = 0.2
    stages: tuple[LrStage, ...] = ()
    restart_all: bool = False
    restarts: str = "schedule"
    min_ratio: float | None = None

    def __post_init__(self) -> None:  # a misspelt name would quietly run another schedule
        for name, value, allowed in (("shape", self.shape, SCHEDULES),
                                     ("restarts", self.restarts, RESTARTS)):
            if value not in allowed:
                raise ConfigError(f"LrSchedule {name}={value!r}: choose one of "
                                  f"{', '.join(allowed)}")


def peak_at(step: int, schedule: LrSchedule) -> float:
    """The peak learning rate in force at ``step``: ``schedule.peak`` until a growth sets
    another."""
    peak, start, target = schedule.peak, None, None
    for stage in sorted((s for s in schedule.stages if s.lr is not None), key=lambda s: s.step):
        if stage.step > step:
            break
        # the value just before this growth (a ramp in progress counts where it has got to)
        start = _ramped(stage.step - 1, peak, start, target)
        peak, target = stage.lr, stage
    return _ramped(step, peak, start, target)


def _ramped(step: int, peak: float, start: float | None, stage: LrStage | None) -> float:
    if stage is None or start is None or stage.ramp == 0 or step >= stage.step + stage.ramp:
        return peak
    return start + (peak - start) * (step - stage.step + 1) / stage.ramp


def lr_at(step: int, schedule: LrSchedule) -> float:
    """Learning rate of optimizer step ``step`` (0-based), a pure function of the step.

    Linear warmup over ``warmup_steps`` (step 0 already has peak/warmup), then ``cosine`` down to
    the floor at the last step, ``wsd`` (stable at the peak, then a linear decay to the floor
    over the last ``decay_fraction`` of the steps) or ``constant``. A stage restarts when it says
    so or when ``restart_all``: under ``restarts="schedule"`` the steps from it to the next
    restart (or the end) run their own warmup and decay, as the released code trains each size;
    under ``"warmup"`` the schedule runs on and its value is ramped again, linearly over
    ``warmup_steps`` from the restart. The peak is :func:`peak_at`.
    """
    restarts = sorted(s.step for s in schedule.stages if s.restart or schedule.restart_all)
    start, end = 0, schedule.steps
    if schedule.restarts == "schedule":
        for g in restarts:
            if g <= step:
                start = g
            elif g < end:
                end = g
                break
    peak = peak_at(step, schedule)
    floor = schedule.min_lr if schedule.min_ratio is None else peak * schedule.min_ratio
    lr = _shaped(step - start, end - start, peak, floor, schedule)
    if schedule.restarts == "warmup":
        since = [g for g in restarts if g <= step]
        if since:
            lr *= min(1.0, (step - since[-1] + 1) / schedule.warmup_steps)
    return lr


def _shaped(s: int, n: int, peak: float, floor: float, schedule: LrSchedule) -> float:
    """Step ``s`` of ``n`` of the schedule's warmup and shape, from ``peak`` down to ``floor``."""
    warmup = min(schedule.warmup_steps, n)
    if s < warmup:
        return peak * (s + 1) / warmup
    if schedule.shape == "constant":
        return peak
    if schedule.shape == "cosine":
        progress = (s - warmup) / max(n - 1 - warmup, 1)
        return floor + 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))) * (peak - floor)
    decay_start = wsd_decay_start(n, schedule.warmup_steps, schedule.decay_fraction)
    if s < decay_start:
        return peak
    progress = (s - decay_start + 1) / (n - decay_start)
    return peak - progress * (peak - floor)


def wsd_decay_start(steps: int, warmup_steps: int, decay_fraction: float) -> int:
    """The step a WSD schedule of ``steps`` steps starts its decay at: the last
    ``decay_fraction`` of the steps (at least one), never inside the warmup."""
    decay = max(1, round(decay_fraction * steps))
    return max(steps - decay, min(warmup_steps, steps))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into every param group (the schedule, not the optimizer, owns the rate)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
