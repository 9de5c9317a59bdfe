"""Generic machinery for controlled experiments: arms over seeds, curves, statistics, tables, plots.

An :class:`Arm` is one training recipe. Running it for a seed returns a :class:`Curve`: evaluation
points carrying cumulative training FLOPs and wall-clock, plus events (e.g. growth points). All
arms of a seed see the same data order (the dataset's batches are a pure function of
(seed, step)) and run in one process one after another, so per-seed differences between arms are
paired: :func:`tokenformer.experiments.stats.paired` compares two arms seed by seed (a t-based
95 % interval; resolved only when it excludes 0).

Arms of one seed may share work (e.g. a base model that several growth recipes branch from)
through the per-seed ``shared`` dict that :func:`run_arms` passes to every arm of that seed.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..io import atomic_write, atomic_write_text

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


# ------------------------------------------------------------------------- saved state
RERUN_RECORDED = "delete it to rerun the runs it records"


def damaged(path: str | Path, detail: str, redo: str = RERUN_RECORDED) -> CheckpointError:
    """The one error line for a file an experiment saved to resume from that cannot be used:
    the file, what is wrong with it and what to do (``redo``: deleting it costs only the work it
    records, which a rerun then repeats)."""
    return CheckpointError(f"{path} is damaged ({detail}); {redo}")


def read_saved_json(path: str | Path, valid: Callable[[Any], bool],
                    redo: str = RERUN_RECORDED) -> Any:
    """The JSON an experiment saved at ``path``; :func:`damaged` when it is unreadable, not JSON
    (a crash of another writer, a disk error, an edit) or not what ``valid`` accepts."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError included
        raise damaged(path, f"not readable JSON: {str(exc).splitlines()[0]}", redo) from None
    if not valid(data):
        raise damaged(path, "not the record this experiment writes", redo)
    return data


def is_mapping_of(data: Any, key: str, kind: type = dict) -> bool:
    """``data`` is a dict whose ``key`` holds a dict (or ``kind``) of dicts."""
    inner = data.get(key) if isinstance(data, dict) else None
    return isinstance(inner, kind) and all(isinstance(v, dict) for v in (
        inner.values() if isinstance(inner, dict) else inner))


def run_arms(arms: Sequence[Arm], seeds: Sequence[int], *,
             partial: str | Path | None = None, settings: dict[str, Any] | None = None,
             progress: bool | None = None) -> dict[str, dict[int, Curve]]:
    """Run every arm for its seeds, seed-major, and return ``{arm: {seed: curve}}``.

    Seed-major order lets the arms of a seed share work through ``shared`` and frees it before
    the next seed. With ``partial``, each finished (arm, seed) is saved there atomically and a
    rerun with the same ``settings`` skips what is already done (a long run survives a crash).
    """
    from ..progress import progress_bar

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


# ---------------------------------------------------------------------------------- LR sweeps
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


# ------------------------------------------------------------------------------------- tables
def fmt(value: float | None, digits: int = 4) -> str:
    """A number for a table: ``—`` for missing, scientific notation for large magnitudes."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one letter per column (l, r, c), default l then r."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule[a] for a in align) + " |"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return "\n".join(lines)


def to_json(data: Any) -> str:
    """JSON with NaN/inf written as null (strict JSON readers reject them)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(data), indent=1, allow_nan=False) + "\n"


# -------------------------------------------------------------------------------------- plots
AXIS_LABELS = {"flops": "cumulative training FLOPs", "wall": "wall-clock (s, training only)",
               "step": "step", "tokens": "tokens",
               "loss": "validation loss (nats/token)", "bpb": "validation bits per byte",
               "accuracy": "test accuracy (top-1)"}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_curves(curves: dict[str, list[Curve]], path: str | Path, *, x: str = "flops",
                y: str = "loss", labels: dict[str, str] | None = None, title: str = "",
                logx: bool = True, ylim: tuple[float, float] | None = None, dpi: int = 110
                ) -> Path:
    """One curve per arm (mean over seeds, min–max band when several; tab10 colours in arm
    order), events marked by dots. Written atomically as PNG."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # lazy: the ``plot`` extra

    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    cmap = colormaps["tab10"]
    for i, (name, runs) in enumerate(curves.items()):
        mean = mean_curve(runs)
        xs, ys = mean.column(x), mean.column(y)
        color = cmap(i % 10)[:3]
        ax.plot(xs, ys, linestyle="-", color=color, linewidth=1.4,
                label=(labels or {}).get(name, name))
        if len(runs) > 1:
            lo = [min(c) for c in zip(*(r.column(y) for r in runs), strict=True)]
            hi = [max(c) for c in zip(*(r.column(y) for r in runs), strict=True)]
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        for event in mean.events:
            # the first evaluation of the grown model sits at the event's step
            after = [i for i, p in enumerate(mean.points) if p.step == event.step]
            if after:
                ax.plot([xs[after[-1]]], [ys[after[-1]]], "o", color=color, markersize=4)
    if logx:
        ax.set_xscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    ax.set_title(title + ("  (dots: growth)" if any(c[0].events for c in curves.values())
                          else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    return path


# ------------------------------------------------------------------------------------ machine
def machine_summary() -> dict[str, Any]:
    """The CPU model, core and thread counts and versions, recorded in every results.json."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__}
    info["summary"] = (f"{cpu}, {info['cpus']} CPUs ({info['torch_threads']} torch threads), "
                       f"torch {torch.__version__}, Python {info['python']}")
    return info
