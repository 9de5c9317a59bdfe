"""The paper's ablations (``tokenformer ablate``), rerun here on the LM or the vision TokenFormer.

Two studies, each varying one config field of an otherwise fixed model and recipe:

* ``theta``: the nonlinearity × normalisation inside Θ (``norm``): exp + L1 (``softmax``, the
  official "softmax" = softmax × n), GELU + L1 (``gelu_l1_norm``), the paper's GELU + L2
  (``l2_norm_gelu``: L2-normalise, then GELU, the released default) and ``gelu_l2_norm``
  (GELU, then L2-normalise; in the released code, not in the paper's table).
* ``norm``: learnable weight and/or bias in the block LayerNorms (``block_norm``): none (the
  official non-parametric norm), bias only, weight only, both.

Every variant trains with the same budget, initialisation seed and data order per seed (the
task's batches are a pure function of (seed, step)) through the task's own front end:
:func:`tokenformer.train.train` for the LM (embedded corpus or a prepared directory, validation
bits per byte) and :func:`tokenformer.commands.vision.train_vision` for the vision model (digits,
test top-1). The arms/seeds machinery, paired statistics, tables and curves are
:mod:`.common`'s; this module adds the variants, the paper's numbers and the verdict.

Every variant gets its own tuned learning rate (the experiments' rule: no arm may lose only
because the shared LR suits another): before the reported seeds, each variant trains at every
LR of a factor-2 log grid centred on the preset's LR, with a tuning seed that is not one of the
reported seeds; the argmin of the validation metric is its LR, the grid growing past an edge
argmin (:func:`.common.sweep_lr`). The schedule family (warmup, cosine to lr/10) is the same for
every variant. ``lr=`` (``--lr``) pins one LR for all variants instead.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import BLOCK_NORMS
from ..errors import ConfigError, DivergedError
from ..pattention import THETA_VARIANTS
from ..progress import inner_progress
from .common import (
    Arm,
    Curve,
    LRSweep,
    Point,
    have_matplotlib,
    markdown_table,
    plot_curves,
    run_arms,
    sweep_lr,
    to_json,
)
from .stats import RULE, Spread, describe, paired, spread

SCHEMA = "tokenformer-ablate/1"
PARTIAL = ".partial.json"  # finished final runs, for a rerun to resume
SWEEP_PARTIAL = ".partial-sweep.json"  # finished LR-sweep runs, likewise
TUNING_SEED = 100  # the LR sweeps' seed: never one of the reported seeds (see tuning_seed)
# Paper claims "a better than b" only above this gap (ImageNet top-1 points); below it the
# paper's numbers are read as a tie.
PAPER_TIE = 0.15


# ---------------------------------------------------------------------------------- studies
@dataclass(frozen=True)
class Study:
    """One ablation: the config field it varies, its variants and the paper's numbers."""

    name: str
    key: str  # field of TokenFormerConfig and TokenFormerViTConfig the variants set
    variants: tuple[str, ...]  # in display order
    reference: str  # the official default: every variant is compared with it
    labels: dict[str, str]
    paper: dict[str, float]  # ImageNet top-1 (%) of the paper's base model; absent: not ablated
    title: str


STUDIES: dict[str, Study] = {
    "theta": Study(
        "theta", "norm", ("softmax", "gelu_l1_norm", "l2_norm_gelu", "gelu_l2_norm"),
        "l2_norm_gelu",
        {"softmax": "exp + L1 (softmax × n)", "gelu_l1_norm": "GELU + L1",
         "l2_norm_gelu": "GELU + L2 (L2 norm, then GELU; default)",
         "gelu_l2_norm": "GELU, then L2 norm"},
        {"softmax": 79.6, "gelu_l1_norm": 81.7, "l2_norm_gelu": 82.5},
        "Θ: nonlinearity × normalisation"),
    "norm": Study(
        "norm", "block_norm", ("none", "bias", "weight", "both"), "none",
        {"none": "neither (non-parametric; default)", "bias": "bias only",
         "weight": "weight only", "both": "weight + bias"},
        {"none": 82.5, "bias": 82.5, "both": 82.6},
        "block LayerNorm: learnable weight / bias"),
}
# The studies cover exactly the options the model offers.
assert set(STUDIES["theta"].variants) == set(THETA_VARIANTS)
assert set(STUDIES["norm"].variants) == set(BLOCK_NORMS)


@dataclass(frozen=True)
class Task:
    metric: str  # the Point column compared: "bpb" or "accuracy"
    label: str
    lower_is_better: bool
    percent: bool  # shown ×100 with a % sign


TASKS: dict[str, Task] = {
    "lm": Task("bpb", "validation bits per byte", True, False),
    "vision": Task("accuracy", "test top-1 accuracy", False, True),
}


# ---------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class AblationPreset:
    """The fixed model and recipe every variant trains with (per task)."""

    name: str
    base: str  # model preset: TokenFormerConfig's (lm) or TokenFormerViTConfig's (vision)
    model: dict[str, Any] = field(default_factory=dict)  # config overrides on ``base``
    steps: int = 300
    batch_size: int = 16
    eval_every: int = 50
    seeds: int = 3
    lr: float | None = None  # None: the task's default recipe; the sweep grid's centre
    warmup_steps: int | None = None
    tune: bool = True  # sweep the LR per variant; False: every variant trains at ``lr``
    sweep_points: int = 5  # factor-2 log grid centred on ``lr``: lr × 2^k, k = -2..2
    max_extensions: int = 2  # per side, when the argmin sits on an edge of the grid
    seq_len: int = 128  # lm only
    eval_batches: int = 8  # lm only
    # The documented runs (docs/ablations.md) predate the C++ kernel as the default: pinned to
    # the pure-PyTorch paths they ran with, so they reproduce bit for bit (pattention.py).
    pattention_impl: str = "torch"

    def validate(self) -> None:
        for key in ("steps", "batch_size", "seeds", "seq_len", "eval_batches"):
            if getattr(self, key) < 1:
                raise ConfigError(f"ablate: {key} must be >= 1, got {getattr(self, key)}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"ablate: lr must be a positive number, got {self.lr}")
        if self.tune and self.sweep_points < 2:
            raise ConfigError(f"ablate: sweep_points must be >= 2, got {self.sweep_points}")
        if self.max_extensions < 0:
            raise ConfigError(f"ablate: max_extensions must be >= 0, got {self.max_extensions}")
        if self.eval_every < 0:
            raise ConfigError(f"ablate: eval_every must be >= 0, got {self.eval_every}")


# Sized on a 2-core CPU (docs/ablations.md): "full" is 4 variants × (5-point LR sweep + 5
# seeds) × 400 steps per (study, task); "quick" is the same sweep and 2 seeds at 120 steps. The
# grids are centred on the LRs of the fixed-LR runs before the sweeps (LM 2e-3, vision 3e-3).
_LM = dict(base="tiny", lr=2e-3, warmup_steps=20, seq_len=128, batch_size=16)
_VISION = dict(base="vit-digits-tiny", lr=3e-3, batch_size=64)
PRESETS: dict[str, dict[str, AblationPreset]] = {
    "lm": {"quick": AblationPreset("quick", steps=120, eval_every=40, seeds=2, eval_batches=4,
                                   **_LM),
           "full": AblationPreset("full", steps=400, eval_every=50, seeds=5, **_LM)},
    "vision": {"quick": AblationPreset("quick", steps=120, eval_every=40, seeds=2, **_VISION),
               "full": AblationPreset("full", steps=400, eval_every=50, seeds=5, **_VISION)},
}


def get_preset(task: str, name: str, **overrides: Any) -> AblationPreset:
    check_task(task)
    if name not in PRESETS[task]:
        raise ConfigError(f"unknown ablate preset {name!r}; choose one of "
                          f"{', '.join(PRESETS[task])}")
    preset = dataclasses.replace(PRESETS[task][name], **overrides)
    preset.validate()
    return preset


def base_lr(task: str, preset: AblationPreset) -> float:
    """The preset's LR, else the task's default recipe's: the fixed LR, or the sweep's centre."""
    if preset.lr is not None:
        return preset.lr
    if task == "lm":
        from ..train import TrainConfig

        return TrainConfig.lr
    from ..commands.vision import DIGITS_TRAIN

    return float(DIGITS_TRAIN["lr"])


def lr_grid(centre: float, points: int) -> list[float]:
    """``points`` LRs a factor 2 apart, centred (geometrically) on ``centre``: for 5 points
    centre × 1/4, 1/2, 1, 2, 4; for 4 points centre × 2^±0.5, 2^±1.5."""
    return [centre * 2.0 ** (k - (points - 1) / 2) for k in range(points)]


def tuning_seed(seeds: Sequence[int]) -> int:
    """The LR sweeps' seed: :data:`TUNING_SEED`, or the first seed after the reported ones when
    they reach it, so the LR is never chosen on a seed that is then reported."""
    return TUNING_SEED if TUNING_SEED not in seeds else max(seeds) + 1


def check_task(task: str) -> Task:
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return TASKS[task]


def get_study(name: str) -> Study:
    if name not in STUDIES:
        raise ConfigError(f"unknown study {name!r}; choose one of {', '.join(STUDIES)}")
    return STUDIES[name]


def select_variants(study: Study, variants: Sequence[str] | str | None) -> list[str]:
    """The variants to run, in the study's display order; names are checked."""
    if variants is None:
        return list(study.variants)
    if isinstance(variants, str):
        variants = [v.strip() for v in variants.split(",") if v.strip()]
    if not variants:
        raise ConfigError(f"--variants names no variant; choose from {', '.join(study.variants)}")
    unknown = [v for v in variants if v not in study.variants]
    if unknown:
        raise ConfigError(f"unknown {study.name} variant {unknown[0]!r} (study {study.name} "
                          f"varies {study.key}); choose from {', '.join(study.variants)}")
    if len(set(variants)) != len(variants):
        raise ConfigError(f"--variants names a variant twice: {', '.join(variants)}")
    return [v for v in study.variants if v in variants]


# ----------------------------------------------------------------------------------- training
def _points(records: list[dict[str, Any]], task: str) -> list[Point]:
    points = []
    for r in records:
        if r["type"] != "eval":
            continue
        if task == "lm":
            points.append(Point(r["step"], r["tokens"], r["flops"], r["train_time"],
                                r["val_loss"], r["val_bpb"]))
        else:
            points.append(Point(r["step"], r["tokens"], r["flops"], r["train_time"], r["loss"],
                                math.nan, metrics={"accuracy": r["accuracy"]}))
    return points


def train_variant(task: str, study: Study, variant: str, preset: AblationPreset, seed: int,
                  run_dir: str | Path, *, data: str | Path | None = None,
                  progress: bool | None = None) -> Curve:
    """Train one variant for one seed into ``run_dir``; its evaluation curve.

    A run whose loss becomes non-finite is recorded, not fatal: its curve ends with a point at the
    step it diverged, with the worst possible metric, and ``info["diverged"]`` holds that step.
    """
    from ..checkpoint import read_metrics

    run_dir = Path(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)  # a crashed attempt of this very arm
    overrides: dict[str, Any] = {**preset.model, study.key: variant}
    lr = base_lr(task, preset)
    # the schedule family is the same at every LR: warmup, then cosine down to lr / 10
    recipe: dict[str, Any] = {"steps": preset.steps, "batch_size": preset.batch_size,
                              "eval_interval": preset.eval_every, "seed": seed,
                              "pattention_impl": preset.pattention_impl, "lr": lr,
                              "min_lr": lr / 10}
    if preset.warmup_steps is not None:
        recipe["warmup_steps"] = preset.warmup_steps
    diverged = None
    try:
        if task == "lm":
            from ..train import TrainConfig, train

            cfg = TrainConfig(model={"preset": preset.base, **overrides},
                              data=str(data) if data is not None else "default",
                              seq_len=preset.seq_len, eval_batches=preset.eval_batches,
                              samples=0, device="cpu", out=str(run_dir), **recipe)
            train(cfg, progress=progress, print_fn=lambda _: None)
        else:
            from ..commands.vision import train_vision

            train_vision(preset.base, "digits", out=run_dir, progress=progress,
                         model_overrides=overrides, **recipe)
    except DivergedError:  # its last training record holds the step, tokens and FLOPs
        diverged = [r for r in read_metrics(run_dir) if r["type"] == "train"][-1]
    records = read_metrics(run_dir)
    points = _points(records, task)
    info: dict[str, Any] = {"run_dir": str(run_dir), "lr": lr}
    if diverged is not None:
        worst = math.inf if TASKS[task].lower_is_better else 0.0
        metrics = {} if task == "lm" else {"accuracy": worst}
        points.append(Point(diverged["step"], diverged["tokens"], diverged["flops"],
                            diverged["train_time"], math.inf, math.inf if task == "lm" else
                            math.nan, metrics=metrics))
        info["diverged"] = diverged["step"]
    return Curve(points, info=info)


# ------------------------------------------------------------------------------------ summary
def _curve(data: dict[str, Any]) -> Curve:
    """A saved curve. results.json stores non-finite numbers as null: a null loss is a diverged
    run's inf (its bpb too); otherwise a null bpb is the NaN of a task without one (vision)."""
    def point(p: dict[str, Any]) -> dict[str, Any]:
        diverged = p["loss"] is None
        return {**p, "loss": math.inf if diverged else p["loss"],
                "bpb": (math.inf if diverged else math.nan) if p["bpb"] is None else p["bpb"]}

    return Curve.from_dict({**data, "points": [point(p) for p in data["points"]]})


def final_values(results: dict[str, Any], variant: str, column: str) -> dict[int, float]:
    """The last evaluation's ``column`` per seed."""
    runs = results["variants"][variant]["runs"]
    return {int(s): _curve(c).column(column)[-1] for s, c in runs.items()}


def _spread(values: Iterable[float]) -> dict[str, Any]:
    vals = list(values)
    if all(math.isfinite(v) for v in vals):
        return dataclasses.asdict(spread(vals))
    # a diverged seed: the mean is infinite and the spread undefined
    return dataclasses.asdict(Spread(statistics.fmean(vals), math.nan, min(vals), max(vals),
                                     len(vals)))


def _claims(study: Study) -> list[tuple[str, str, str]]:
    """The paper's pairwise statements as (a, b, "better" | "tie"): a above b by more than
    PAPER_TIE points, or within it of b."""
    out = []
    names = [v for v in study.variants if v in study.paper]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            gap = study.paper[a] - study.paper[b]
            if abs(gap) <= PAPER_TIE:
                out.append((a, b, "tie"))
            else:
                out.append((a, b, "better") if gap > 0 else (b, a, "better"))
    return out


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per-variant spread over seeds, paired comparisons with the reference, the paper's claims
    checked one by one, and the verdict."""
    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    names = list(results["variants"])
    finals = {n: final_values(results, n, task.metric) for n in names}
    variants = {}
    for n in names:
        entry = {"metric": _spread(finals[n].values()),
                 "loss": _spread(final_values(results, n, "loss").values()),
                 "per_seed": finals[n]}
        diverged = [int(s) for s, c in results["variants"][n]["runs"].items()
                    if "diverged" in c["info"]]
        if diverged:
            entry["diverged_seeds"] = diverged
        variants[n] = entry

    def compare(a: str, b: str) -> dict[str, Any]:
        return paired(a, b, finals[a], finals[b], task.metric, task.lower_is_better).to_dict()

    ref = study.reference
    comparisons = [compare(n, ref) for n in names if n != ref and ref in finals]
    claims = []
    for a, b, kind in _claims(study):
        if a in finals and b in finals:
            c = compare(a, b)
            if kind == "better":
                status = ("agrees" if c["winner"] == a else "contradicts" if c["winner"] == b
                          else "not resolved")
            else:
                status = "agrees" if c["winner"] is None else "differs"
            claims.append({"a": a, "b": b, "kind": kind, "paper": [study.paper[a],
                                                                     study.paper[b]],
                           "status": status, "comparison": c})
    summary = {"metric": task.metric, "variants": variants, "comparisons": comparisons,
               "claims": claims}
    if "tuning" in results:  # results before the LR sweeps have neither key
        summary["lrs"] = {n: {"lr": v["lr"], "status": (v.get("sweep") or {}).get("status",
                                                                              "pinned")}
                          for n, v in results["variants"].items()}
        summary["tuning_seed"] = (results["tuning"] or {}).get("seed")
    summary["verdict"] = verdict(study, task, summary)
    return summary


def _fmt(task: Task, value: float | None, digits: int = 4) -> str:
    if value is None or math.isnan(value):
        return "—"
    if task.percent and math.isfinite(value):
        return f"{100 * value:.2f} %"
    return f"{value:.{digits}f}"


def _fmt_spread(task: Task, s: dict[str, Any]) -> str:
    sp = Spread(**s)
    if not task.percent:
        return str(sp)
    if sp.n == 1 or not math.isfinite(sp.mean):
        return _fmt(task, sp.mean)
    return f"{100 * sp.mean:.2f} ± {100 * sp.std:.2f} %"


def _fmt_diff(task: Task, c: dict[str, Any]) -> str:
    """Mean difference, its 95 % t interval and p (:func:`stats.describe`)."""
    if c["n"] and (c["mean"] is None or not math.isfinite(c["mean"])):
        return "a run diverged"
    if task.percent:
        return describe(c, digits=2, scale=100, unit=" pt")
    return describe(c)


def verdict(study: Study, task: Task, summary: dict[str, Any]) -> list[str]:
    """Plain-language lines: the ranking here, each paper claim checked, and the overall answer."""
    lab = study.labels
    v = summary["variants"]
    sign = 1 if task.lower_is_better else -1
    ranked = sorted(v, key=lambda n: sign * v[n]["metric"]["mean"])
    lines = ["Ranking here (best first, mean over seeds): "
             + " > ".join(f"{lab[n]} ({_fmt(task, v[n]['metric']['mean'])})" for n in ranked)
             + "."]
    for c in summary["claims"]:
        a, b, cmp = lab[c["a"]], lab[c["b"]], c["comparison"]
        here = (f"here {_fmt_diff(task, cmp)} ({task.metric}, {c['a']} − {c['b']}, "
                f"{cmp['n']} seed{'s' if cmp['n'] != 1 else ''}: {cmp['verdict']})")
        if c["kind"] == "better":
            lines.append(f"Paper: {a} beats {b} ({c['paper'][0]} vs {c['paper'][1]} %); {here} "
                         f"→ **{c['status']}**.")
        else:
            lines.append(f"Paper: {a} ≈ {b} ({c['paper'][0]} vs {c['paper'][1]} %); {here} "
                         f"→ **{c['status']}**.")
    claims = summary["claims"]
    better = [c for c in claims if c["kind"] == "better"]
    ties = [c for c in claims if c["kind"] == "tie"]

    def pairs(cs: list[dict[str, Any]]) -> str:
        return ", ".join(f"{c['a']} vs {c['b']}" for c in cs)

    if not claims:
        lines.append("The variants run here include no pair the paper compares.")
    if better:
        agree = [c for c in better if c["status"] == "agrees"]
        against = [c for c in better if c["status"] == "contradicts"]
        if len(agree) == len(better):
            lines.append("**The paper's ranking holds here**: every pair it ranks is resolved in "
                         "its direction.")
        elif against:
            lines.append(f"**The paper's ranking does not hold here**: reversed (resolved) for "
                         f"{pairs(against)}; {len(agree)} of {len(better)} pairs agree.")
        else:
            lines.append(f"**Not resolved**: {len(agree)} of {len(better)} pairs the paper ranks "
                         f"are resolved in its direction, none against it; the rest have a 95 % "
                         f"interval that includes 0.")
    if ties:
        differ = [c for c in ties if c["status"] == "differs"]
        if not differ:
            lines.append("**As in the paper**, the variants it finds equal are not resolved "
                         "apart here (every 95 % interval includes 0).")
        else:
            lines.append("**Unlike the paper**, variants it finds equal differ here (resolved): "
                         + "; ".join(f"{c['a']} vs {c['b']}: {c['comparison']['winner']} better "
                                     f"({_fmt_diff(task, c['comparison'])})"
                                     for c in differ) + ".")
    ref = study.reference
    for verdict_, word in (("better", "better"), ("worse", "worse")):
        names = [c["a"] for c in summary["comparisons"]
                 if c["winner"] is not None and (c["winner"] == c["a"]) == (verdict_ == "better")]
        if names:
            lines.append(f"Resolved {word} than the default `{ref}` here: "
                         + ", ".join(f"`{n}`" for n in names) + ".")
    return lines + _lr_lines(summary)


def _lr_lines(summary: dict[str, Any]) -> list[str]:
    """What the verdict says about the learning rates: tuned per variant (and any still at the
    edge of its grid), or pinned."""
    lrs = summary.get("lrs")
    if not lrs:
        return []
    if all(v["status"] == "pinned" for v in lrs.values()):
        lr = next(iter(lrs.values()))["lr"]
        return [f"**LR not tuned**: every variant trained at lr {lr:.3g} (`--lr`); a variant "
                f"may lose only because that LR suits another."]
    lines = [f"LRs tuned per variant (argmin over the sweep, seed {summary['tuning_seed']}): "
             + ", ".join(f"`{n}` {v['lr']:.3g} ({v['status']})" for n, v in lrs.items()) + "."]
    edge = [n for n, v in lrs.items() if v["status"] == "at edge"]
    if edge:
        lines.append("**Warning: LR still at the edge of its grid** after the extensions for "
                     + ", ".join(f"`{n}`" for n in edge) + ": its best LR may lie beyond, so "
                     "comparisons with it may handicap it.")
    return lines


# ---------------------------------------------------------------------------- report, plots
def curves_of(results: dict[str, Any]) -> dict[str, list[Curve]]:
    return {n: [_curve(c) for _, c in sorted(v["runs"].items(), key=lambda x: int(x[0]))]
            for n, v in results["variants"].items()}


def plot_final(results: dict[str, Any], path: str | Path) -> Path:
    """Final metric per variant (every seed, mean ± std) beside the paper's ImageNet top-1."""
    from matplotlib.figure import Figure

    from ..io import atomic_write

    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    s = results["summary"]["variants"]
    names = list(results["variants"])
    k = 100 if task.percent else 1
    fig = Figure(figsize=(10, 1.4 + 0.55 * len(names)), layout="constrained")
    here, paper = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    ys = range(len(names))
    for y, n in zip(ys, names, strict=True):
        vals = [k * x for x in s[n]["per_seed"].values() if math.isfinite(x)]
        here.plot(vals, [y] * len(vals), "o", color="tab:blue", alpha=0.45, markersize=5)
        m = s[n]["metric"]
        if math.isfinite(m["mean"]):
            here.errorbar([k * m["mean"]], [y], xerr=[k * m["std"]], fmt="D", color="black",
                          capsize=4, markersize=6)
        if n in study.paper:
            paper.barh([y], [study.paper[n]], color="tab:orange", height=0.5)
            paper.annotate(f"{study.paper[n]:.1f}", (study.paper[n], y), xytext=(3, -3),
                           textcoords="offset points", fontsize=8)
        else:
            paper.annotate("not in the paper", (0.02, y), xycoords=("axes fraction", "data"),
                           fontsize=8, color="gray", va="center")
    here.set_yticks(list(ys), [study.labels[n] for n in names])
    here.invert_yaxis()
    unit = " (%)" if task.percent else ""
    better = "lower" if task.lower_is_better else "higher"
    here.set_xlabel(f"{task.label}{unit}, {better} is better")
    here.set_title(f"here: {results['task']} ({len(results['seeds'])} seeds; dots: seeds, "
                   f"diamond: mean ± std)", fontsize=9)
    lo = min(study.paper.values()) if study.paper else 0
    paper.set_xlim(lo - 4, max(study.paper.values(), default=100) + 1.5)
    paper.set_xlabel("ImageNet top-1 (%), higher is better")
    paper.set_title("paper (base model, ImageNet)", fontsize=9)
    for ax in (here, paper):
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Ablation: {study.title}", fontsize=10)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    return path


def plot_sweeps(results: dict[str, Any], path: str | Path) -> Path:
    """The sweep's metric against the LR per variant (log x), the chosen LR starred."""
    from matplotlib.figure import Figure

    from ..io import atomic_write

    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    k = 100 if task.percent else 1
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for i, (n, v) in enumerate(results["variants"].items()):
        points = [q for q in v["sweep"]["points"] if q["metric"] is not None
                  and math.isfinite(q["metric"])]
        color = f"C{i % 10}"
        ax.plot([q["lr"] for q in points], [k * q["metric"] for q in points], marker="o",
                markersize=4, color=color, label=f"{study.labels[n]} ({v['sweep']['status']})")
        chosen = [q for q in points if q["lr"] == v["sweep"]["chosen"]]
        if chosen:
            ax.plot([chosen[0]["lr"]], [k * chosen[0]["metric"]], marker="*", markersize=14,
                    color=color, markeredgecolor="black", linestyle="none")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate (warmup, cosine to lr/10)")
    unit = " (%)" if task.percent else ""
    better = "lower" if task.lower_is_better else "higher"
    ax.set_ylabel(f"{task.label}{unit}, {better} is better")
    tuning = results["tuning"]
    ax.set_title(f"{study.title}: LR sweeps ({results['task']}, seed {tuning['seed']}, "
                 f"{tuning['steps']} steps; ★ chosen)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    return path


def make_plots(results: dict[str, Any], out: str | Path) -> list[str]:
    if not have_matplotlib():
        return []
    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    curves = curves_of(results)
    plot_final(results, Path(out) / "final.png")
    sweep = []
    if results.get("tuning"):
        plot_sweeps(results, Path(out) / "sweep.png")
        sweep = ["sweep.png"]
    finals = [c.final.metrics.get(task.metric, c.final.bpb) for runs in curves.values()
              for c in runs]
    finals = [f for f in finals if math.isfinite(f)]
    ylim = None
    if finals:  # the first evaluations are far off: keep the end of training legible
        lo, hi = min(finals), max(finals)
        pad = max(hi - lo, 0.02)
        if task.lower_is_better:
            ylim = (lo - 0.3 * pad, hi + 3 * pad)
        else:
            ylim = (lo - 3 * pad, hi + 0.3 * pad)
            if task.percent:  # a fraction: stay within [0, 1]
                ylim = (max(0.0, ylim[0]), min(1.0, ylim[1]))
    plot_curves(curves, Path(out) / "curves.png", x="step", y=task.metric, logx=False,
                labels=study.labels, ylim=ylim,
                title=f"{study.title}: {task.label} during training (mean over seeds, band: "
                      f"min–max)")
    return ["final.png", "curves.png", *sweep]


def report_markdown(results: dict[str, Any], plots: Sequence[str]) -> str:
    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    s, p = results["summary"], results["preset"]
    ref = study.reference
    by_b = {c["a"]: c for c in s["comparisons"]}
    rows = []
    for n, v in s["variants"].items():
        c = by_b.get(n)
        vs = "reference" if n == ref else (f"{_fmt_diff(task, c)} → {c['verdict']}" if c
                                           else "—")
        extra = f" (diverged: seeds {v['diverged_seeds']})" if "diverged_seeds" in v else ""
        rows.append([f"`{n}`", study.labels[n] + extra, _fmt_spread(task, v["metric"]),
                     str(Spread(**v["loss"])), vs,
                     f"{study.paper[n]:.1f}" if n in study.paper else "not in the paper"])
    data = results["data"]
    tuning = results.get("tuning")
    lr_text = (f"LR tuned per variant (below), grid centred on {p['lr']:.3g}"
               if tuning else f"LR {p['lr']:.3g} for every variant (not tuned)"
               if "tuning" in results else f"LR {p['lr']}")  # (older results: no sweep keys)
    lines = [
        f"# Ablation: {study.title} ({results['task']})", "",
        f"Command: `{results['command']}`  ",
        f"Preset `{p['name']}`: model `{p['base']}`"
        + "".join(f" {k}={v}" for k, v in p["model"].items()) + f", varying `{study.key}`, "
        f"{p['steps']} steps × batch {p['batch_size']}"
        + (f" × {p['seq_len']} tokens" if results["task"] == "lm" else " images")
        + f", seeds {results['seeds']}; {lr_text}.  ",
        f"Data: {data}.  ",
        f"Machine: {results['machine']['summary']}; load average {results['load'][0]:.1f} at the "
        f"start, {results['load'][1]:.1f} at the end. Wall-clock: {results['wall_clock']:.0f} s.",
        "", "## Verdict", "", *[f"- {line}" for line in s["verdict"]], "",
        "## Results", "",
        f"Final {task.label} (mean ± sample std over seeds) and loss; *vs `{ref}`* is the paired "
        f"difference per seed (variant − `{ref}`): mean [95 % interval], p. {RULE} "
        "The paper's column is ImageNet top-1 (%) of its base "
        "model: a different task and scale, shown for the ordering only.", "",
        markdown_table(["variant", "meaning", task.label, "loss", f"vs `{ref}`",
                        "paper (ImageNet top-1 %)"], rows, "lllrll"), "",
    ]
    if tuning:
        lines += _sweep_section(results)
    if plots:
        lines += [f"![{p_}]({p_})" for p_ in plots] + [""]
    else:
        lines += ["Plots skipped: matplotlib is not installed (`pip install 'tokenformer[plot]'`).",
                  ""]
    lines += ["## Method", "",
              f"- Every variant differs from the others only in `{study.key}`; model "
              "initialisation (seeded by the seed) and batch order (a pure function of seed and "
              "step) are the same for every variant of a seed, so the comparisons are paired.",
              "- " + ("LM: `tokenformer.train.train` (AdamW, warmup + cosine, weight decay 0.1, "
                      "clip 1.0); validation loss over fixed windows of the held-out split; "
                      "bits per byte = loss / ln 2 / bytes per token."
                      if results["task"] == "lm" else
                      "Vision: `train_vision` on scikit-learn digits (1437 training / 360 test "
                      "images, random 1-pixel shifts), the digits recipe of docs/vision.md; "
                      "top-1 over the 360 test images."),
              f"- Evaluated every {p['eval_every']} steps and at the end; each run's model is "
              "kept in `runs/<variant>-seed<k>/final` (the sweep's in "
              "`sweeps/<variant>-lr<LR>-seed<k>/final`).", ""]
    return "\n".join(lines)


def _sweep_section(results: dict[str, Any]) -> list[str]:
    """The LR sweeps as a table: one row per variant, one column per LR tried."""
    task = TASKS[results["task"]]
    tuning = results["tuning"]
    lrs = sorted({q["lr"] for v in results["variants"].values() for q in v["sweep"]["points"]})
    rows = []
    for n, v in results["variants"].items():
        sw = v["sweep"]
        by_lr = {q["lr"]: q for q in sw["points"]}
        cells = []
        for lr in lrs:
            q = by_lr.get(lr)
            text = "" if q is None else ("diverged" if q["diverged"] else _fmt(task, q["metric"]))
            cells.append(f"**{text}**" if lr == sw["chosen"] else text)
        status = {"at edge": "**at edge**",
                  "extended": "extended (" + ", ".join(f"{x:.3g}" for x in sw["added"]) + ")"
                  }.get(sw["status"], sw["status"])
        rows.append([f"`{n}`", *cells, f"{sw['chosen']:.3g}", status])
    initial = ", ".join(f"{x:.3g}" for x in tuning["grid"])
    return ["## Learning rates", "",
            f"Every variant is trained with its own LR: {tuning['steps']} steps of the same "
            f"schedule (warmup, cosine to lr/10) with seed {tuning['seed']} (not a reported "
            f"seed) at each LR of the factor-2 grid {initial}; the LR is the argmin of the "
            f"final {task.label} (ties: the smaller LR). When the argmin is the grid's smallest "
            f"or largest LR, the grid grows by one factor beyond it (at most "
            f"{tuning['max_extensions']} times per side); a choice still at an edge is "
            f"flagged. Cells: {task.label} at that LR, the chosen one in bold.", "",
            markdown_table(["variant", *(f"{x:.3g}" for x in lrs), "chosen", "grid"], rows,
                           "l" + "r" * len(lrs) + "rl"), ""]


def write_outputs(results: dict[str, Any], out: str | Path) -> list[str]:
    """results.json, the plots and report.md, each written atomically."""
    from ..io import atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", to_json(results))
    plots = make_plots(results, out)
    atomic_write_text(out / "report.md", report_markdown(results, plots))
    return plots


def rerender(out: str | Path) -> dict[str, Any]:
    """Recompute the summary of ``out/results.json`` and rewrite it, the report and the plots
    (after a change to the statistics or the report; nothing is retrained)."""
    import json

    path = Path(out) / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: not an ablation output directory")
    results = json.loads(path.read_text())
    if results.get("schema") != SCHEMA:
        raise ConfigError(f"{path} is not a tokenformer ablate result ({results.get('schema')})")
    results["summary"] = summarize(results)
    write_outputs(results, out)
    return results


# ------------------------------------------------------------------------------------ runner
def _final(curve: Curve, task: str) -> tuple[float, float]:
    """(the task's metric, the loss) at a curve's last evaluation."""
    last = curve.final
    metric = last.bpb if task == "lm" else last.metrics.get("accuracy", math.nan)
    return metric, last.loss


def _sweep_record(sweep: LRSweep, curves: dict[float, Curve], task: str) -> dict[str, Any]:
    points = []
    for lr in sweep.grid:
        metric, loss = _final(curves[lr], task)
        points.append({"lr": lr, "metric": metric, "loss": loss,
                       "diverged": "diverged" in curves[lr].info})
    return {"points": points, "chosen": sweep.chosen, "added": sweep.added,
            "status": sweep.status}


def run_ablation(study: str, task: str, preset: str | AblationPreset = "quick", *,
                 seeds: int | None = None, variants: Sequence[str] | str | None = None,
                 steps: int | None = None, lr: float | None = None,
                 data: str | Path | None = None,
                 out: str | Path | None = None, progress: bool | None = None,
                 command: str | None = None,
                 print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Tune each variant's LR, then train every variant of ``study`` on ``task`` for every seed
    at its LR; write ``report.md``, ``results.json``, ``final.png``, ``curves.png`` and
    ``sweep.png`` into ``out``; return the results.

    ``lr`` pins one LR for every variant and skips the sweeps. ``data`` (LM only): a prepared
    dataset directory instead of the embedded corpus. A run interrupted part-way (in the sweeps
    or the final runs) resumes from ``out/.partial-sweep.json`` and ``out/.partial.json`` when
    rerun with the same settings.
    """
    from .. import __version__
    from .common import machine_summary

    st, tk = get_study(study), check_task(task)
    if seeds is not None and seeds < 1:
        raise ConfigError(f"--seeds must be >= 1, got {seeds}")
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ConfigError(f"--lr must be a positive number, got {lr}")
    if data is not None and task != "lm":
        raise ConfigError("--data applies to --task lm only; the vision ablations run on digits")
    p = get_preset(task, preset) if isinstance(preset, str) else preset
    p = dataclasses.replace(p, **{k: v for k, v in (("seeds", seeds), ("steps", steps))
                                  if v is not None})
    if lr is not None:
        p = dataclasses.replace(p, lr=lr, tune=False)
    p.validate()
    p = dataclasses.replace(p, lr=base_lr(task, p))  # recorded: the task default made explicit
    names = select_variants(st, variants)
    out = Path(out if out is not None else f"runs/ablate-{study}-{task}-{p.name}")
    if task == "lm":
        from ..data import TokenDataset, default_dataset

        # opened once here: a bad directory fails before anything trains, the corpus is cached
        dataset = TokenDataset.open(data) if data is not None else default_dataset(
            progress=progress is not False)
        data_info = (f"{data}" if data is not None else
                     "embedded corpus (King James Bible), bytes tokenizer") + (
            f", {int(dataset.meta['val_tokens']):,} validation tokens")
    else:
        data_info = "scikit-learn digits (8×8, 1437 train / 360 test)"
    seed_list = list(range(p.seeds))
    settings = {"study": study, "task": task, "preset": dataclasses.asdict(p), "data": data_info,
                "variants": names, "version": __version__}

    def trainer(variant: str, lr_: float, folder: str) -> Callable[[int, Any], Curve]:
        return lambda seed, _shared: train_variant(
            task, st, variant, dataclasses.replace(p, lr=lr_), seed,
            out / folder / f"{variant}-{'' if folder == 'runs' else f'lr{lr_:.4g}-'}seed{seed}",
            data=data, progress=inner_progress(progress))

    out.mkdir(parents=True, exist_ok=True)
    n_sweep = len(names) * p.sweep_points if p.tune else 0
    print_fn(f"ablate: study {study} ({st.key}: {', '.join(names)}), task {task}, preset "
             f"{p.name}, {n_sweep} LR-sweep runs + {len(names) * len(seed_list)} runs → {out}")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    tuning: dict[str, Any] | None = None
    sweeps: dict[str, dict[str, Any]] = {}
    if p.tune:
        grid = lr_grid(base_lr(task, p), p.sweep_points)
        seed = tuning_seed(seed_list)
        tuning = {"seed": seed, "metric": tk.metric, "steps": p.steps, "grid": grid,
                  "max_extensions": p.max_extensions}
        sweep_arms: list[Arm] = []
        for n in names:
            curves_n: dict[float, Curve] = {}

            def measure(lr_: float, n: str = n, curves_n: dict[float, Curve] = curves_n
                        ) -> float:
                # every sweep run so far is passed: run_arms restores the finished ones from
                # the partial file and saves them all again with the new one
                sweep_arms.append(Arm(f"{n}@{lr_!r}", trainer(n, lr_, "sweeps")))
                curve = run_arms(sweep_arms, [seed], partial=out / SWEEP_PARTIAL,
                                 settings={**settings, "tuning": tuning},
                                 progress=False)[sweep_arms[-1].name][seed]
                curves_n[lr_] = curve
                metric, _ = _final(curve, task)
                print_fn(f"ablate: LR sweep {n} lr {lr_:.3g} (seed {seed}): {tk.metric} "
                         f"{_fmt(tk, metric)}")
                return metric if tk.lower_is_better else -metric

            sweep = sweep_lr(grid, measure, max_extensions=p.max_extensions)
            sweeps[n] = _sweep_record(sweep, curves_n, task)
            print_fn(f"ablate: {n}: lr {sweep.chosen:.3g} ({sweep.status})")
    lrs = {n: sweeps[n]["chosen"] if n in sweeps else base_lr(task, p) for n in names}
    arms = [Arm(n, trainer(n, lrs[n], "runs"), label=st.labels[n]) for n in names]
    curves = run_arms(arms, seed_list, partial=out / PARTIAL,
                      settings={**settings, "lrs": lrs}, progress=progress)
    results: dict[str, Any] = {
        "schema": SCHEMA, "command": command or f"run_ablation({study!r}, {task!r}, {p.name!r})",
        "study": study, "task": task, "key": st.key, "metric": tk.metric,
        "preset": dataclasses.asdict(p), "seeds": seed_list, "data": data_info,
        "pattention_impl": p.pattention_impl, "machine": machine_summary(),
        "load": [load0, os.getloadavg()[0]],
        "wall_clock": time.perf_counter() - t0,
        "tuning": tuning,
        "variants": {n: {"label": st.labels[n], "paper": st.paper.get(n), "lr": lrs[n],
                         "sweep": sweeps.get(n),
                         "runs": {str(s): c.to_dict() for s, c in sorted(curves[n].items())}}
                     for n in names},
    }
    results["summary"] = summarize(results)
    write_outputs(results, out)
    (out / PARTIAL).unlink(missing_ok=True)
    (out / SWEEP_PARTIAL).unlink(missing_ok=True)
    print_fn(f"ablate: done in {results['wall_clock']:.0f} s; report: {out / 'report.md'}")
    for line in results["summary"]["verdict"]:
        print_fn(f"- {line}")
    return results
