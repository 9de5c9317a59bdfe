"""The frontier experiment's plan: presets → the list of runs (pure data, nothing is trained).

Every run uses one schedule family, warmup–stable–decay (WSD): linear warmup over
``warmup_steps``, a stable phase at the peak LR, and a linear cooldown to ``min_lr_ratio`` × peak
over the last ``decay_fraction`` of the run's steps. One *stable run* per (arm, seed) trains at
the peak LR and, at each budget of a log-spaced FLOP grid, a *cooldown branch* starts from a copy
of its state and decays for ``decay_fraction`` of that budget's steps. The branch's final
validation loss is the arm's point at that budget. A growth chain is one stable run that grows
at fixed fractions of the largest budget; its branches cool down whatever size it has reached.

LR sweeps: per (family, size), a grid of peak LRs at ``sweep_steps`` steps (same WSD family,
seed 0, one branch at the end); the final runs of that size use the argmin (the runner extends
the grid when the argmin sits on an edge). A chain uses the LR of its final size for its whole
run: the LR does not move at growth.

A chain is named by its growth recipe, optionally with old-token options in the ``--grow-at``
syntax: ``exact``, ``official-init:freeze_old=forever``, ``paper:noise_old=0.01,freeze_old=200``
(:func:`chain_spec`). ``official`` (the default arm, named before the recipes were) is
``official-init``. ``official-released`` is not a chain here: it restarts the LR schedule at each
growth, outside the one WSD family every run of this experiment follows.

Families: ``tokenformer``, ``transformer++`` (matched to each TokenFormer size in non-embedding
parameters) and the product-key TokenFormers ``tokenformer-pk16``/``-pk64`` (each size's FFN
replaced by product keys over ≈ 16×/64× its tokens at the dense FLOPs per token; issue 18, preset
``sparse``); the last two train from scratch only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...models.baselines import matched_config
from ...models.config import TokenFormerConfig, flops_per_token
from ...ops.growth import NEW_ROW_MOMENTS, RELEASED, STRATEGIES
from ...training.growth_events import OLD_TOKEN_KEYS, parse_options
from ..common.report import markdown_table

SCHEDULE_FAMILY = "wsd"
SIZE_NAMES = ("S1", "S2", "S3", "S4", "S5", "S6")
# product-key TokenFormers (issue 18): family → FFN tokens as a multiple of the dense size's
PRODUCT_KEY_FAMILIES = {"tokenformer-pk16": 16, "tokenformer-pk64": 64}
DENSE_FAMILIES = ("tokenformer", "transformer++")  # a preset's default
FAMILIES = (*DENSE_FAMILIES, *PRODUCT_KEY_FAMILIES)  # every family a preset may name
# a product-key size's FFN forward FLOPs/token may differ from the dense size's by at most this
# (k is an integer: one more selected token changes the FFN's count by 2d + Θ's work)
PK_FLOPS_TOLERANCE = 0.01
# growth recipes of TokenFormer chains (each may add old-token options: chain_spec)
CHAINS = (*(s for s in STRATEGIES if s != RELEASED), "exact-anneal")
DEFAULT_CHAINS = ("exact", "paper", "official", "exact-anneal")  # the presets' arms
WIDENINGS = ("zero", "net2net")  # MLP widening of the Transformer++ chain
MAX_EPOCHS = 4.0  # no run may see the training split more often than this


@dataclass(frozen=True)
class Preset:
    """Everything that defines one frontier experiment except the data and the device."""

    name: str
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    # (qkv, proj, ffn) of the smallest size: the smallest whose matched Transformer++ still has an
    # MLP of a useful width (42 units; its attention alone is 4·d² parameters per block)
    base_tokens: tuple[int, int, int] = (24, 24, 96)
    num_sizes: int = 5
    factor: int = 2  # tokens (≈ non-embedding parameters) multiply by this from size to size
    seq_len: int = 128
    batch_size: int = 16
    max_budget: float = 4e12  # training FLOPs of the largest budget
    num_budgets: int = 6
    budget_ratio: float = 2.0  # consecutive budgets differ by this factor
    warmup_steps: int = 30
    decay_fraction: float = 0.2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    min_steps: int = 100  # a size runs a budget only when that is at least this many steps
    lr_grid: tuple[float, ...] = (1e-3, 2e-3, 4e-3, 8e-3)
    sweep_steps: int = 250
    max_extensions: int = 2  # grid points the runner may add beyond an edge, per side
    seeds: int = 3
    families: tuple[str, ...] = DENSE_FAMILIES
    chains: tuple[str, ...] = DEFAULT_CHAINS
    widenings: tuple[str, ...] = WIDENINGS
    # cumulative fraction of max_budget at which the chains grow, one per growth: the chain is
    # S1 → S2 → … → S(len + 1)
    growth_fractions: tuple[float, ...] = (0.125, 0.25, 0.5)
    anneal_steps: int = 100  # exact-anneal: steps over which Θ's factor moves to √n
    new_row_moments: str = "mean"  # carried AdamW state at growth: grow.NEW_ROW_MOMENTS
    eval_batches: int = 8
    dtype: str = "fp32"
    pattention_impl: str = "auto"
    expected_hours: str = ""  # documented expectation (the gpu preset's, not measured here)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def budgets(self) -> list[float]:
        """The log-spaced FLOP grid, smallest first, ending at ``max_budget``."""
        return [self.max_budget / self.budget_ratio ** (self.num_budgets - 1 - i)
                for i in range(self.num_budgets)]

    @property
    def sizes(self) -> tuple[str, ...]:
        """Size names S1… (the same names in every family: a family's Si is built from the
        dense TokenFormer Si)."""
        return SIZE_NAMES[:self.num_sizes]

    @property
    def chain_sizes(self) -> tuple[str, ...]:
        return SIZE_NAMES[:len(self.growth_fractions) + 1]

    def validate(self) -> None:
        if not 2 <= self.num_sizes <= len(SIZE_NAMES):
            raise ConfigError(f"frontier: num_sizes must be in 2..{len(SIZE_NAMES)}")
        if len(self.lr_grid) < 4 or any(
                b <= a for a, b in itertools.pairwise(self.lr_grid)):
            raise ConfigError("frontier: lr_grid needs >= 4 increasing values")
        if self.num_budgets < 2 or self.budget_ratio <= 1:
            raise ConfigError("frontier: need >= 2 budgets with budget_ratio > 1")
        if len(self.growth_fractions) + 1 > self.num_sizes or any(
                not 0 < f < 1 for f in self.growth_fractions) or list(
                self.growth_fractions) != sorted(set(self.growth_fractions)):
            raise ConfigError("frontier: growth_fractions must increase inside (0, 1), at most "
                              "one per size after the first")
        for family in self.families:
            if family not in FAMILIES:
                raise ConfigError(f"frontier: unknown family {family!r}")
        for chain in self.chains:
            chain_spec(chain)
        if (self.chains and "tokenformer" not in self.families) or (
                self.widenings and "transformer++" not in self.families):
            raise ConfigError("frontier: a chain needs its family's from-scratch sizes")
        if self.new_row_moments not in NEW_ROW_MOMENTS:
            raise ConfigError(f"frontier: new_row_moments must be one of {NEW_ROW_MOMENTS}")
        if not 0 < self.decay_fraction < 1 or self.seeds < 1:
            raise ConfigError("frontier: decay_fraction in (0, 1) and seeds >= 1")


def chain_spec(chain: str) -> tuple[str, dict[str, Any]]:
    """A chain's recipe and its old-token options (``freeze_old``, ``noise_old``):
    ``"exact:freeze_old=100"`` → ``("exact", {"freeze_old": 100})``."""
    recipe, _, options = chain.partition(":")
    if recipe == RELEASED:
        raise ConfigError(f"frontier: chain {chain!r}: {RELEASED} restarts the LR schedule at "
                          f"each growth, outside this experiment's one WSD family; use "
                          f"official-init here (tokenformer train --grow-at runs {RELEASED})")
    if recipe not in CHAINS:
        raise ConfigError(f"frontier: unknown chain {chain!r}; choose from {CHAINS}, each "
                          f"optionally followed by :freeze_old=N|forever,noise_old=X")
    usage = (f"frontier: chain {chain!r} is malformed: expected RECIPE or RECIPE:key=value,... "
             f"with keys {', '.join(OLD_TOKEN_KEYS)}")
    return recipe, (parse_options(options, f"frontier: chain {chain!r}", OLD_TOKEN_KEYS, usage)
                    if options else {})


_CPU = Preset(name="full")
PRESETS: dict[str, Preset] = {
    # one seed, TokenFormer sizes S1–S4 and one chain (paper recipe), a shorter grid
    "quick": dataclasses.replace(
        _CPU, name="quick", num_sizes=4, max_budget=1.5e12, num_budgets=4, seeds=1,
        families=("tokenformer",), chains=("paper",), widenings=(), sweep_steps=60,
        min_steps=60, warmup_steps=20, growth_fractions=(0.125, 0.25, 0.5), anneal_steps=50),
    "full": _CPU,
    # issue 18: product keys with 16× the FFN tokens at the dense FLOPs/token vs dense TokenFormer
    # and Transformer++, from scratch only, S1–S2 (the full preset's envelope sizes up to 2e12
    # FLOPs; S3 never was) and three budgets over one decade; sized for well under 60 min of
    # one CPU thread on shared cores (the product-key FFN is 5–9× slower per FLOP on this CPU,
    # docs/sparse.md), hence also min_steps as in the quick preset and shorter sweeps
    "sparse": dataclasses.replace(
        _CPU, name="sparse", num_sizes=2, families=("tokenformer", "transformer++",
                                                    "tokenformer-pk16"),
        chains=(), widenings=(), growth_fractions=(), max_budget=1e12, num_budgets=3,
        budget_ratio=10 ** 0.5, min_steps=60, sweep_steps=200),
    "gpu": dataclasses.replace(
        _CPU, name="gpu", hidden_size=256, num_layers=6, num_heads=8,
        base_tokens=(128, 128, 512), seq_len=512, batch_size=32, max_budget=2e16,
        warmup_steps=200, min_steps=500, sweep_steps=2000, anneal_steps=500,
        lr_grid=(2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3), eval_batches=16, dtype="bf16",
        expected_hours="≈ 3 h of training FLOPs (1.4e18) on one A100-80GB at an assumed 40 % "
                       "bf16 MFU (125 TFLOP/s achieved), up to ≈ 6 h as the small sizes run "
                       "below that; not measured; needs --data with >= 2e8 training tokens "
                       "(<= 4 epochs)"),
}


def get_preset(name: str, **overrides: Any) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown scale preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = dataclasses.replace(PRESETS[name], **overrides)
    preset.validate()
    return preset


# --------------------------------------------------------------------------------- run specs
@dataclass(frozen=True)
class Stage:
    """One model size of a run, trained from step ``start`` on (a scratch run has one)."""

    size: str
    config: Any  # TokenFormerConfig or baselines.TransformerConfig
    start: int
    flops_per_step: float  # training FLOPs of one optimizer step (the analytic count)


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
    recipe: str | None = None  # chains: growth recipe (or widening)
    schedule: str = SCHEDULE_FAMILY

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
                "lr_from": self.lr_from, "recipe": self.recipe,
                "stages": [{"size": s.size, "start": s.start, "flops_per_step": s.flops_per_step,
                            "parameters": s.config.num_parameters(),
                            "non_embedding_parameters": s.config.num_parameters(
                                non_embedding=True), "config": s.config.to_dict()}
                           for s in self.stages],
                "branches": [dataclasses.asdict(b) for b in self.branches],
                "stable_steps": self.steps, "total_steps": self.total_steps,
                "total_flops": self.total_flops()}


def decay_start(steps: int, preset: Preset) -> int:
    """Where the cooldown of a ``steps``-step WSD run starts (as ``train.lr_at`` computes it)."""
    decay = max(1, round(preset.decay_fraction * steps))
    return max(steps - decay, min(preset.warmup_steps, steps))


def size_at(stages: tuple[Stage, ...], step: int) -> Stage:
    """The stage training step ``step`` (a growth at step g happens before step g runs)."""
    return [s for s in stages if s.start <= step][-1]


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


def size_key(family: str, size: str) -> str:
    """``"<family>-<size>"``: the name of that size's from-scratch arm, the key of the LR sweep
    that sets its LR (a run's ``lr_from``) and of its measured seconds per step."""
    return f"{family}-{size}"


def arch(family: str) -> str:
    """The model architecture (``baselines.model_class`` / the trainer's ``arch``) of a family:
    a product-key family is a TokenFormer."""
    return "transformer++" if family == "transformer++" else "tokenformer"


def product_key_config(dense: TokenFormerConfig, ratio: int, name: str | None = None
                       ) -> TokenFormerConfig:
    """``dense`` with its FFN Pattention replaced by product keys over n = s² ≈ ``ratio`` × its
    FFN tokens (s = the nearest integer to √(ratio·n)) and the top-k whose analytic FFN FLOPs per
    token are closest to the dense FFN's (``config.projection_flops``: sub-key scores 2·s·d,
    min(k, s)² candidate sums, Θ over k, k value rows 2·k·d). Everything else is ``dense``'s, so
    the whole model's FLOPs per token match too."""
    target = dense.projection_flops()[1]
    s = round(math.sqrt(ratio * dense.ffn_tokens))
    base = dataclasses.replace(dense, ffn_keys="product", ffn_tokens=s * s, ffn_scale=None,
                               name=name or f"{dense.name}-pk{ratio}")

    def ffn(k: int) -> float:
        return dataclasses.replace(base, ffn_product_k=k).projection_flops()[1]

    lo, hi = 1, s * s  # ffn(k) increases with k: the smallest k with ffn(k) >= target
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ffn(mid) < target else (lo, mid)
    k = min((lo, max(lo - 1, 1)), key=lambda c: (abs(ffn(c) - target), c))
    if abs(ffn(k) / target - 1) > PK_FLOPS_TOLERANCE:
        raise ConfigError(f"frontier: no top-k of {s * s} product keys matches the dense FFN's "
                          f"{target:.0f} FLOPs/token within {PK_FLOPS_TOLERANCE:.0%}")
    return dataclasses.replace(base, ffn_product_k=k)


def model_configs(preset: Preset, family: str, vocab_size: int) -> list[Any]:
    """Every size of ``family``: TokenFormers with ``factor``× the tokens per size, the
    Transformer++ matched to each in non-embedding parameters (MLP width), and the product-key
    TokenFormers matched to each in FLOPs per token (:func:`product_key_config`)."""

    out = []
    for i, name in enumerate(preset.sizes):
        q, p, f = (n * preset.factor ** i for n in preset.base_tokens)
        tf = TokenFormerConfig(vocab_size=vocab_size, hidden_size=preset.hidden_size,
                               num_layers=preset.num_layers, num_heads=preset.num_heads,
                               qkv_tokens=q, proj_tokens=p, ffn_tokens=f,
                               max_seq_len=preset.seq_len, eos_token_id=None,
                               name=f"tokenformer-{name}")
        if family in PRODUCT_KEY_FAMILIES:
            out.append(product_key_config(tf, PRODUCT_KEY_FAMILIES[family], f"{family}-{name}"))
        else:
            out.append(tf if family == "tokenformer" else
                       matched_config(tf, family, name=f"{family}-{name}"))
    return out


def _stage(preset: Preset, size: str, config: Any, start: int) -> Stage:
    per_token = flops_per_token(config, preset.seq_len, training=True)["total"]
    return Stage(size, config, start, per_token * preset.tokens_per_step)


def sweep_run(preset: Preset, family: str, size: str, lr: float, vocab_size: int) -> Run:
    """One LR sweep point: ``sweep_steps`` WSD steps at peak ``lr``, seed 0, one branch."""
    config = model_configs(preset, family, vocab_size)[preset.sizes.index(size)]
    stage = _stage(preset, size, config, 0)
    n = preset.sweep_steps
    branch = Branch(0, n * stage.flops_per_step, n, decay_start(n, preset),
                    n * stage.flops_per_step)
    key = size_key(family, size)
    return Run(f"sweep/{key}/lr={lr:.6g}", f"sweep-{key}", "sweep", family, 0, (stage,),
               (branch,), lr, key)


def chain_stages(preset: Preset, configs: list[Any]) -> tuple[Stage, ...]:
    """The chain's sizes and growth steps: it grows when its cumulative FLOPs reach
    ``growth_fractions`` × ``max_budget``."""
    stages = [_stage(preset, preset.sizes[0], configs[0], 0)]
    for i, fraction in enumerate(preset.growth_fractions, start=1):
        prev = stages[-1]
        spent = flops_at(tuple(stages), prev.start)  # the earlier stages, in full
        steps = max(1, round((fraction * preset.max_budget - spent) / prev.flops_per_step))
        stages.append(_stage(preset, preset.sizes[i], configs[i], prev.start + steps))
    return tuple(stages)


def plan(preset: Preset, vocab_size: int, train_tokens: int | None = None) -> list[Run]:
    """Every final run (scratch sizes, chains, widenings) for every seed, seed-major. Sweep runs
    are :func:`sweep_plan`'s. ``train_tokens`` checks that no run repeats the corpus more than
    ``MAX_EPOCHS`` times."""
    preset.validate()
    budgets = preset.budgets
    runs: list[Run] = []
    for seed in range(preset.seeds):
        for family in preset.families:
            configs = model_configs(preset, family, vocab_size)
            for size, config in zip(preset.sizes, configs, strict=True):
                stages = (_stage(preset, size, config, 0),)
                key = size_key(family, size)
                runs.append(_with_branches(preset, key, "scratch", family, seed, stages,
                                           budgets, key))
            chain = preset.chain_sizes
            recipes = {"tokenformer": preset.chains, "transformer++": preset.widenings}.get(
                family, ())  # product-key families: from scratch only
            for recipe in recipes:
                arm = (f"chain-{recipe}" if family == "tokenformer" else f"widen-{recipe}")
                stages = chain_stages(preset, configs[:len(chain)])
                runs.append(_with_branches(preset, arm, "chain" if family == "tokenformer"
                                           else "widen", family, seed, stages, budgets,
                                           size_key(family, chain[-1]), recipe))
    if train_tokens is not None:
        for run in runs:
            epochs = run.total_steps * preset.tokens_per_step / train_tokens
            if epochs > MAX_EPOCHS:
                raise ConfigError(f"frontier: {run.id} would see the training split "
                                  f"{epochs:.1f} times (> {MAX_EPOCHS:g}); lower max_budget or "
                                  f"use a larger corpus (--data)")
    return runs


def _with_branches(preset: Preset, arm: str, kind: str, family: str, seed: int,
                   stages: tuple[Stage, ...], budgets: list[float], lr_from: str,
                   recipe: str | None = None) -> Run:
    branches = tuple(b for i, budget in enumerate(budgets)
                     if (b := branch_for(stages, i, budget, preset)) is not None)
    if not branches:
        raise ConfigError(f"frontier: {arm} has no budget of >= {preset.min_steps} steps")
    if len(stages) > 1 and kind == "chain":
        gaps = [b.start - a.start for a, b in itertools.pairwise(stages)]
        if min(gaps) <= preset.anneal_steps:
            raise ConfigError("frontier: anneal_steps must be shorter than every chain stage")
    return Run(f"{arm}/seed{seed}", arm, kind, family, seed, stages, branches, None, lr_from,
               recipe)


def sweep_plan(preset: Preset, vocab_size: int) -> list[Run]:
    """The initial LR grid of every (family, size) the final runs use."""
    return [sweep_run(preset, family, size, lr, vocab_size)
            for family in preset.families for size in preset.sizes for lr in preset.lr_grid]


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
    plus one evaluation per branch (``eval_batches`` forward passes ≈ a third of a step each).
    Evaluation FLOPs aside, the runner does nothing else of weight."""
    total = 0.0
    for run in runs:
        for size, steps in steps_by_size(run).items():
            total += steps * seconds_per_step[size_key(run.family, size)]
        last = run.stages[-1].size
        total += len(run.branches) * preset.eval_batches / 3 * seconds_per_step[
            size_key(run.family, last)]
    return total


def describe(preset: Preset, vocab_size: int) -> str:
    """The plan as text (``tokenformer scale --plan``): every arm's sizes, growth steps, budgets
    run and FLOPs; sweeps; nothing is trained."""

    runs = plan(preset, vocab_size)
    sweeps = sweep_plan(preset, vocab_size)
    rows = []
    for run in runs:
        if run.seed:
            continue
        seeds = sum(r.arm == run.arm for r in runs)
        rows.append([run.arm, str(seeds), " → ".join(f"{s.size}@{s.start}" for s in run.stages),
                     ", ".join(f"{b.budget:.2g}:{b.steps}" for b in run.branches),
                     f"{run.total_steps:,}", f"{run.total_flops():.3g}", run.lr_from])
    total = sum(r.total_flops() for r in runs)
    sweep_flops = sum(r.total_flops() for r in sweeps)
    return "\n".join([
        f"preset {preset.name}: {len(sweeps)} LR-sweep runs ({sweep_flops:.3g} FLOPs), "
        f"{len(runs)} final runs ({total:.3g} FLOPs), schedule {SCHEDULE_FAMILY} for all",
        markdown_table(["arm", "seeds", "sizes@start step", "budget:steps", "steps/seed",
                        "FLOPs/seed", "LR from"], rows, "lrllrrl"),
        "time: python benchmarks/frontier_steps.py --preset NAME --cpu-time (measures the step "
        "times here and estimates the whole preset)"])
