"""Arms over seeds: one training recipe per arm, its evaluation curve per seed, run resumably.

An :class:`Arm` is one training recipe. Running it for a seed returns a :class:`Curve`: evaluation
points carrying cumulative training FLOPs and wall-clock, plus events (e.g. growth points). All
arms of a seed see the same data order (the dataset's batches are a pure function of
(seed, step)) and run in one process one after another, so per-seed differences between arms are
paired: :func:`tokenformer.experiments.common.stats.paired` compares two arms seed by seed (a
t-based 95 % interval; resolved only when it excludes 0).

Arms of one seed may share work (e.g. a base model that several growth recipes branch from)
through the per-seed ``shared`` dict that :func:`run_arms` passes to every arm of that seed.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...io.files import atomic_write_text
from ...io.progress import progress_bar
from .saved import damaged, is_mapping_of, read_saved_json

POINT_FIELDS = ("step", "tokens", "flops", "wall", "loss", "bpb", "stage")


# ------------------------------------------------------------------------------------- curves
@dataclass
class Point:
    """One evaluation: ``flops`` and ``wall`` are cumulative over the whole arm (every stage)."""

    step: int
    tokens: int
    flops: float
    wall: float
    loss: float
    bpb: float
    stage: int = 0  # index of the model size the point was measured on (growth increments it)
    metrics: dict[str, float] = field(default_factory=dict)  # task metrics, e.g. accuracy


@dataclass
class Event:
    """Something that happened between evaluations, e.g. a growth step (``label`` says which)."""

    step: int
    tokens: int
    flops: float
    wall: float
    label: str


@dataclass
class Curve:
    """An arm's evaluation curve for one seed, in step order."""

    points: list[Point]
    events: list[Event] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> Point:
        return self.points[-1]

    def column(self, name: str) -> list[float]:
        return [p.metrics[name] if name in p.metrics else getattr(p, name) for p in self.points]

    def to_dict(self) -> dict[str, Any]:
        return {"points": [asdict(p) for p in self.points],
                "events": [asdict(e) for e in self.events], "info": self.info}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Curve:
        return cls([Point(**p) for p in data["points"]], [Event(**e) for e in data["events"]],
                   dict(data.get("info", {})))


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """Pointwise mean over seeds (every seed evaluates at the same steps, so points align)."""
    if len(curves) == 1:
        return curves[0]
    steps = [[p.step for p in c.points] for c in curves]
    if any(s != steps[0] for s in steps):
        raise ValueError("curves of different seeds were evaluated at different steps")

    def mean_point(ps: Sequence[Point]) -> Point:
        return Point(ps[0].step, ps[0].tokens, statistics.fmean(p.flops for p in ps),
                     statistics.fmean(p.wall for p in ps), statistics.fmean(p.loss for p in ps),
                     statistics.fmean(p.bpb for p in ps), ps[0].stage,
                     {k: statistics.fmean(p.metrics[k] for p in ps) for k in ps[0].metrics})

    def mean_event(es: Sequence[Event]) -> Event:
        return Event(es[0].step, es[0].tokens, statistics.fmean(e.flops for e in es),
                     statistics.fmean(e.wall for e in es), es[0].label)

    return Curve([mean_point(ps) for ps in zip(*(c.points for c in curves), strict=True)],
                 [mean_event(es) for es in zip(*(c.events for c in curves), strict=True)],
                 dict(curves[0].info))


# ------------------------------------------------------------------------------------- runner
@dataclass
class Arm:
    """A named recipe. ``run(seed, shared)`` trains it and returns its curve for that seed.

    ``shared`` is a dict private to the seed and common to all its arms: an arm may store work
    there (e.g. a trained base model) for later arms to branch from. ``seeds`` caps how many of
    the experiment's seeds the arm runs (None: all of them).
    """

    name: str
    run: Callable[[int, dict[str, Any]], Curve]
    label: str = ""
    seeds: int | None = None


def fingerprint(settings: dict[str, Any]) -> str:
    """A short hash of the settings, to refuse reusing partial results of another experiment."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_arms(arms: Sequence[Arm], seeds: Sequence[int], *,
             partial: str | Path | None = None, settings: dict[str, Any] | None = None,
             progress: bool | None = None) -> dict[str, dict[int, Curve]]:
    """Run every arm for its seeds, seed-major, and return ``{arm: {seed: curve}}``.

    Seed-major order lets the arms of a seed share work through ``shared`` and frees it before
    the next seed. With ``partial``, each finished (arm, seed) is saved there atomically and a
    rerun with the same ``settings`` skips what is already done (a long run survives a crash).
    """
    key = fingerprint(settings or {})
    done: dict[str, dict[int, Curve]] = {arm.name: {} for arm in arms}
    if partial is not None and Path(partial).is_file():
        saved = read_saved_json(partial, lambda d: is_mapping_of(d, "curves"))
        if saved.get("fingerprint") == key:
            try:
                for name, runs in saved["curves"].items():
                    if name in done:
                        done[name] = {int(s): Curve.from_dict(c) for s, c in runs.items()}
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise damaged(partial, f"a saved curve does not parse: {exc}") from None
    jobs = [(seed, arm) for i, seed in enumerate(seeds) for arm in arms
            if arm.seeds is None or i < arm.seeds]
    # A line per finished run when stderr is not a terminal (a log, nohup, CI).
    bar = progress_bar(len(jobs), "arms", progress=progress, unit="run", every=1)
    for i, seed in enumerate(seeds):
        shared: dict[str, Any] = {}
        for arm in arms:
            if arm.seeds is not None and i >= arm.seeds:
                continue
            if seed in done[arm.name]:
                bar.set_postfix_str(f"{arm.name} seed {seed} (saved earlier)")
            else:
                bar.set_postfix_str(f"{arm.name} seed {seed}")
                done[arm.name][seed] = arm.run(seed, shared)
                if partial is not None:
                    curves = {n: {str(s): c.to_dict() for s, c in r.items()}
                              for n, r in done.items()}
                    atomic_write_text(partial, json.dumps({"fingerprint": key, "curves": curves}))
            bar.update(1)
        shared.clear()
    bar.close()
    return done
