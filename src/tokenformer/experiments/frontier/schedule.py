"""A run of the frontier as data: its stages (sizes), cooldown branches and LR schedule.


Every run uses one schedule family, warmup–stable–decay (WSD): linear warmup over
``warmup_steps``, a stable phase at the peak LR, and a linear cooldown to ``min_lr_ratio`` × peak
over the last ``decay_fraction`` of the run's steps. A run's schedule is a record the trainer
reads (:func:`run_schedule`, a :class:`~tokenformer.training.schedule.LrSchedule`): this module
does no LR arithmetic of its own. One *stable run* per (arm, seed) trains at
the peak LR and, at each budget of a log-spaced FLOP grid, a *cooldown branch* starts from a copy
of its state and decays for ``decay_fraction`` of that budget's steps. The branch's final
validation loss is the arm's point at that budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ...ops.growth import resets_optimizer
from ...training.schedule import LrSchedule, LrStage, wsd_decay_start
from .arms import GROWING_ARMS
from .presets import SCHEDULE_FAMILY, Preset, size_key


@dataclass(frozen=True)
class Stage:
    """One model size of a run, trained from step ``start`` on (a scratch run has one)."""

    size: str  # a size name; a stack/clone chain's first stage "<size>/half-depth|-width"
    config: Any  # TokenFormerConfig or baselines.TransformerConfig
    start: int
    flops_per_step: float  # training FLOPs of one optimizer step (the analytic count)
    # the swept size whose LR this stage takes under the per-stage policy (None: its own size)
    lr_size: str | None = None


@dataclass(frozen=True)
class Branch:
    """The cooldown at one budget: stable phase to ``decay_start``, linear decay to ``steps``."""

    budget_index: int
    budget: float
    steps: int
    decay_start: int
    flops: float  # cumulative training FLOPs at the branch's end (≈ budget, whole steps)


@dataclass(frozen=True)
class Run:
    """One stable run (with its cooldown branches) of one arm and seed."""

    id: str
    arm: str
    kind: str  # scratch | chain | widen | sweep
    family: str
    seed: int
    stages: tuple[Stage, ...]
    branches: tuple[Branch, ...]
    lr: float | None  # sweeps: the grid value; otherwise the chosen LR of ``lr_from``
    lr_from: str  # "<family>-<size>": whose sweep sets the LR
    recipe: str | None = None  # chains: the growing arm (a key of arms.GROWING_ARMS)
    schedule: str = SCHEDULE_FAMILY
    lr_policy: str = "final-size"  # chains: LR_POLICIES (a one-stage run has one LR anyway)
    # v5's reuse family: the base run (its id) whose cooled branch at budget index
    # ``origin_budget`` this run starts from (grown first by ``recipe``'s operator when it has
    # one), and the steps that base trained (the data stream continues after them)
    origin: str | None = None
    origin_budget: int | None = None
    data_offset: int = 0

    @property
    def steps(self) -> int:
        """Steps the stable phase runs (to the last branch point)."""
        return max(b.decay_start for b in self.branches)

    @property
    def total_steps(self) -> int:
        return self.steps + sum(b.steps - b.decay_start for b in self.branches)

    def total_flops(self) -> float:
        stable = flops_at(self.stages, self.steps)
        return stable + sum(b.flops - flops_at(self.stages, b.decay_start)
                            for b in self.branches)

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "arm": self.arm, "kind": self.kind, "family": self.family,
                "seed": self.seed, "schedule": self.schedule, "lr": self.lr,
                "lr_from": self.lr_from, "recipe": self.recipe, "lr_policy": self.lr_policy,
                "stages": [{"size": s.size, "start": s.start, "flops_per_step": s.flops_per_step,
                            "lr_from": stage_lr_key(self, s),
                            "parameters": s.config.num_parameters(),
                            "non_embedding_parameters": s.config.num_parameters(
                                non_embedding=True), "config": s.config.to_dict()}
                           for s in self.stages],
                "branches": [dataclasses.asdict(b) for b in self.branches],
                "stable_steps": self.steps, "total_steps": self.total_steps,
                "total_flops": self.total_flops(),
                **({"origin": self.origin, "origin_budget": self.origin_budget,
                    "data_offset": self.data_offset} if self.origin_budget is not None else {})}


def decay_start(steps: int, preset: Preset) -> int:
    """Where the cooldown of a ``steps``-step WSD run starts (the trainer's rule)."""
    return wsd_decay_start(steps, preset.warmup_steps, preset.decay_fraction)


def stage_index(stages: tuple[Stage, ...], step: int) -> int:
    """The index of the stage training step ``step`` (a growth at step g happens before step g
    runs)."""
    return max(i for i, s in enumerate(stages) if s.start <= step)


def size_at(stages: tuple[Stage, ...], step: int) -> Stage:
    """The stage training step ``step``."""
    return stages[stage_index(stages, step)]


def stage_lr_key(run: Run, stage: Stage) -> str:
    """The sweep (``"<family>-<size>"``) whose chosen LR ``stage`` trains at: its own size's
    (or, for a half-depth/half-width stage, the nearest swept size's) under "per-stage", the
    final size's (``run.lr_from``) under "final-size"."""
    if run.lr_policy == "final-size":
        return run.lr_from
    return size_key(run.family, stage.lr_size or stage.size)


def stage_lrs(run: Run, chosen: dict[str, float]) -> tuple[float, ...]:
    """The peak LR of each stage of ``run`` from the sweeps' ``chosen`` LR per size key (a sweep
    run: its grid value)."""
    if run.lr is not None:
        return (run.lr,) * len(run.stages)
    return tuple(chosen[stage_lr_key(run, s)] for s in run.stages)


def horizon_stage_lrs(run: Run, lr_at: dict[str, dict[int, float]]) -> tuple[float, ...]:
    """v4: the peak LR of each stage of ``run`` from the horizon stage's choice per (size key,
    budget index) ``lr_at``: "final-size" takes the final size's LR chosen at the run's final
    budget for every stage; "per-stage" takes each stage's size's LR chosen at the last budget
    the run cools that stage down at (the final budget for a stage it never cools down), each
    at the nearest budget that size ran when it did not run that one."""
    def at(key: str, j: int) -> float:
        table = lr_at[key]
        return table[min(table, key=lambda k: (abs(k - j), -k))]

    last = run.branches[-1].budget_index
    out = []
    for stage in run.stages:
        reads = [b.budget_index for b in run.branches
                 if size_at(run.stages, max(b.decay_start - 1, 0)) is stage]
        out.append(at(stage_lr_key(run, stage), max(reads) if reads and run.lr_policy
                      != "final-size" else last))
    return tuple(out)


def restarts(run: Run) -> bool:
    """Whether the run's growths restart the optimizer and the warmup (official-released)."""
    growing = GROWING_ARMS.get(run.recipe or "")
    return (growing is not None and growing.kind == "chain" and growing.shape == "size"
            and resets_optimizer(growing.method))


def run_schedule(run: Run, lrs: tuple[float, ...], steps: int, preset: Preset) -> LrSchedule:
    """The LR schedule of ``run`` on a segment whose cooldown branch ends at ``steps`` (a stable
    segment passes its run's longest branch): the WSD schedule (warmup, stable, a linear decay
    over the last ``decay_fraction`` of ``steps`` to ``min_lr_ratio`` × the peak) whose peak is
    piecewise the LR of the stage in force (``lrs``, :func:`stage_lrs`: it moves at once at a
    growth step), and, for a restarting recipe, a linear warmup again over ``warmup_steps``
    after each growth (``restarts="warmup"``: the decay stays the run's). A cooldown branch
    trains the size reached at its decay start to its end, past a later growth of the stable
    run: its peak is that size's, so the stages from its decay start on are left out."""
    decay_from = decay_start(steps, preset)
    restart = restarts(run)
    stages = tuple(LrStage(s.start, restart, lrs[i]) for i, s in enumerate(run.stages)
                   if i > 0 and s.start < decay_from)
    return LrSchedule(lrs[0], lrs[0] * preset.min_lr_ratio, steps, preset.warmup_steps, "wsd",
                      preset.decay_fraction, stages, restarts="warmup",
                      min_ratio=preset.min_lr_ratio)


def flops_at(stages: tuple[Stage, ...], step: int) -> float:
    """Cumulative training FLOPs of the stable run after ``step`` steps."""
    total = 0.0
    for i, s in enumerate(stages):
        end = stages[i + 1].start if i + 1 < len(stages) else math.inf
        total += max(0, min(step, end) - s.start) * s.flops_per_step
    return total


def branch_for(stages: tuple[Stage, ...], index: int, budget: float, preset: Preset
               ) -> Branch | None:
    """The branch whose total FLOPs are closest to ``budget`` (the branch cools down the size
    reached at its decay start; no growth inside a cooldown). None below ``min_steps``."""
    def total(n: int) -> float:
        start = decay_start(n, preset)
        return flops_at(stages, start) + (n - start) * size_at(stages, max(start - 1, 0)
                                                                ).flops_per_step

    lo, hi = 1, 1
    while total(hi) < budget:
        hi *= 2
    while lo < hi:  # smallest n with total(n) >= budget
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if total(mid) < budget else (lo, mid)
    n = lo if lo == 1 or abs(total(lo) - budget) <= abs(total(lo - 1) - budget) else lo - 1
    if n < preset.min_steps:
        return None
    return Branch(index, budget, n, decay_start(n, preset), total(n))
