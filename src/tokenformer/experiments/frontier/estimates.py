"""A preset's training time from measured seconds per step (``benchmarks/frontier_steps.py``):
the steps each run trains at each size, their seconds, and the wall time over parallel workers."""

from __future__ import annotations

import math

from .presets import Preset, is_tuning_seed, size_key
from .schedule import Run, size_at


def steps_by_size(run: Run) -> dict[str, int]:
    """Optimizer steps the run trains at each size: its stable phase and every cooldown."""
    out: dict[str, int] = {}
    for i, s in enumerate(run.stages):
        end = run.stages[i + 1].start if i + 1 < len(run.stages) else run.steps
        out[s.size] = out.get(s.size, 0) + max(0, min(end, run.steps) - s.start)
    for b in run.branches:
        size = size_at(run.stages, max(b.decay_start - 1, 0)).size
        out[size] = out.get(size, 0) + b.steps - b.decay_start
    return out


def estimate_seconds(preset: Preset, runs: list[Run], seconds_per_step: dict[str, float]
                     ) -> float:
    """Training time of ``runs`` from measured seconds per step of each ``"<family>-<size>"``,
    plus one evaluation per branch (:func:`eval_batches` forward passes ≈ a third of a step
    each). Evaluation FLOPs aside, the runner does nothing else of weight."""
    total = 0.0
    for run in runs:
        final = run.stages[-1]
        for size, steps in steps_by_size(run).items():
            # a half-depth/half-width stage is no swept size: the final size's, scaled by FLOPs
            stage = next(s for s in run.stages if s.size == size)
            total += steps * seconds_per_step.get(
                size_key(run.family, size), seconds_per_step[size_key(run.family, final.size)]
                * stage.flops_per_step / final.flops_per_step)
        last = final.size
        total += len(run.branches) * eval_batches(preset, run) / 3 * seconds_per_step[
            size_key(run.family, last)]
    return total


def eval_batches(preset: Preset, run: Run) -> int:
    """Batches one evaluation of ``run``'s branch reads: ``eval_batches`` (v4), or v5's whole
    window (tuning seeds: the tuning window, or its ``tuning_batches``; held-out seeds: the
    scoring window), at least the asked share of ``validation.tokens``."""
    v = preset.validation
    if v is None:
        return preset.eval_batches
    if is_tuning_seed(run.seed):
        whole = math.ceil(v.tokens * v.tuning_share / preset.tokens_per_step)
        return whole if v.tuning_batches is None else min(whole, v.tuning_batches)
    return math.ceil(v.tokens * (1 - v.tuning_share) / preset.tokens_per_step)


def parallel_seconds(preset: Preset, phases: list[list[Run]],
                     seconds_per_step: dict[str, float], jobs: int) -> float:
    """Wall time of ``phases`` (run one after another: the sweeps, the from-scratch runs, the
    chains) when each phase's runs are spread over ``jobs`` workers (``scale --jobs``), longest
    first onto the least busy worker (each run's time: :func:`estimate_seconds`)."""
    total = 0.0
    for runs in phases:
        loads = [0.0] * max(1, jobs)
        for t in sorted((estimate_seconds(preset, [r], seconds_per_step) for r in runs),
                        reverse=True):
            loads[loads.index(min(loads))] += t
        total += max(loads)
    return total
