"""The frontier's presets: every setting of an experiment but the data and the device.

Sizes: S1… as before (``base_tokens`` × ``factor``^(k−1) for Sk); ``first_size = 0`` adds S0
(``base_tokens`` / ``factor``) below today's S1, for the TokenFormer families only: a
Transformer++ block at d = 64 has more parameters in its attention alone (4·d² per block) than
TokenFormer S0, so no matched Transformer++ exists there (and product keys need an FFN to
multiply).

Families: ``tokenformer``, ``transformer++`` (matched to each TokenFormer size in non-embedding
parameters), ``tokenformer-gelu`` (Θ = plain GELU: every Pattention a GELU MLP, the critics'
control; same sizes as TokenFormer) and the product-key TokenFormers ``tokenformer-pk16``/``-pk64``
(each size's FFN replaced by product keys over ≈ 16×/64× its tokens at the dense FLOPs per
token; issue 18, preset ``sparse``), which train from scratch only.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from ...data.synthetic import parse_spec
from ...errors import ConfigError
from ...ops.growth import NEW_ROW_MOMENTS, STRATEGIES
from ...ops.widening import WIDENINGS
from .questions import (
    ARCHITECTURE_QUESTIONS,
    CONTROL_QUESTIONS,
    GROWTH_ARMS,
    GROWTH_QUESTIONS,
    LR_POLICY_QUESTIONS,
    Question,
)
from .recipes import LR_POLICIES, RECIPES, SHAPES

SCHEDULE_FAMILY = "wsd"
SIZE_NAMES = ("S0", "S1", "S2", "S3", "S4", "S5", "S6")
# product-key TokenFormers (issue 18): family → FFN tokens as a multiple of the dense size's
PRODUCT_KEY_FAMILIES = {"tokenformer-pk16": 16, "tokenformer-pk64": 64}
DENSE_FAMILIES = ("tokenformer", "transformer++")  # a preset's default
# TokenFormers with another Θ (issue 25): family → config ``norm``. "gelu": no normalisation,
# every Pattention a GELU MLP (the critics' control)
THETA_FAMILIES = {"tokenformer-gelu": "gelu"}
# every family a preset may name
FAMILIES = (*DENSE_FAMILIES, *THETA_FAMILIES, *PRODUCT_KEY_FAMILIES)
# families with sizes below S1 (no matched Transformer++ or product-key FFN exists there)
SMALL_SIZE_FAMILIES = ("tokenformer", *THETA_FAMILIES)
# a product-key size's FFN forward FLOPs/token may differ from the dense size's by at most this
# (k is an integer: one more selected token changes the FFN's count by 2d + Θ's work)
PK_FLOPS_TOLERANCE = 0.01
MAX_EPOCHS = 4.0  # no run may see the training split more often than this
SWEEP_SEED = 1000  # LR sweeps use seeds SWEEP_SEED + i: tuning never sees a final run's batches


@dataclass(frozen=True)
class Preset:
    """Everything that defines one frontier experiment except the data and the device."""

    name: str
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 2
    # (qkv, proj, ffn) of S1: the smallest size whose matched Transformer++ still has an MLP of a
    # useful width (42 units; its attention alone is 4·d² parameters per block)
    base_tokens: tuple[int, int, int] = (24, 24, 96)
    first_size: int = 1  # 0: the sizes start at S0 = S1 / factor (TokenFormer families only)
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
    sweep_seeds: int = 2  # the LR is the argmin of the mean over these seeds (module docstring)
    max_extensions: int = 2  # grid points the runner may add beyond an edge, per side
    seeds: int = 5
    families: tuple[str, ...] = DENSE_FAMILIES
    recipes: tuple[str, ...] = ()  # arms that grow: keys of RECIPES
    # a budget is read only when the chain's current size has trained this share of its steps
    min_stage_share: float = 0.4
    # the prior of --plan's predicted envelope (tokens per non-embedding parameter of the best
    # size); the run replaces the prediction by the measured envelope
    tokens_per_parameter: float = 40.0
    # "measured": chains follow the envelope the from-scratch runs measured (the protocol);
    # "predicted": the plan-time prediction (chains fixed before anything runs: tests)
    follow: str = "measured"
    questions: tuple[Question, ...] = ()  # the pre-registered questions (module docstring)
    anneal_steps: int = 100  # exact-anneal: steps over which Θ's factor moves to √n
    new_row_moments: str = "mean"  # carried AdamW state at growth: grow.NEW_ROW_MOMENTS
    eval_batches: int = 8
    dtype: str = "fp32"
    pattention_impl: str = "auto"
    expected_hours: str = ""  # documented expectation (the gpu presets', not measured here)
    # the corpus when --data is not given: None is the embedded KJV; "synthetic:<tokens>" the
    # generated corpus of data.synthetic (gpu-30m: large enough that nothing repeats > 4 times)
    corpus: str | None = None

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
        """Size names from S{first_size} (the same names in every family: a family's Si is
        built from the dense TokenFormer Si; :func:`family_sizes` says which a family has)."""
        return SIZE_NAMES[self.first_size:self.first_size + self.num_sizes]

    @property
    def chains(self) -> tuple[str, ...]:
        """The arms that grow Pattention tokens (RECIPES kind "chain")."""
        return tuple(r for r in self.recipes if RECIPES[r].kind == "chain")

    @property
    def widenings(self) -> tuple[str, ...]:
        """The Transformer++ arms that widen the MLP (RECIPES kind "widen")."""
        return tuple(r for r in self.recipes if RECIPES[r].kind == "widen")

    def arm_names(self) -> set[str]:
        """Every arm a question may name: each family's from-scratch sizes and the recipes."""
        return {size_key(f, s) for f in self.families for s in family_sizes(self, f)} | set(
            self.recipes)

    def validate(self) -> None:
        if self.first_size not in (0, 1) or not (
                2 <= self.num_sizes <= len(SIZE_NAMES) - self.first_size):
            raise ConfigError(f"frontier: first_size must be 0 or 1 and num_sizes in "
                              f"2..{len(SIZE_NAMES) - self.first_size}")
        if self.first_size == 0 and any(n % self.factor for n in self.base_tokens):
            raise ConfigError("frontier: S0 needs base_tokens divisible by factor")
        if len(self.lr_grid) < 4 or any(
                b <= a for a, b in itertools.pairwise(self.lr_grid)):
            raise ConfigError("frontier: lr_grid needs >= 4 increasing values")
        if self.num_budgets < 2 or self.budget_ratio <= 1:
            raise ConfigError("frontier: need >= 2 budgets with budget_ratio > 1")
        if not 0 < self.min_stage_share < 1 or self.tokens_per_parameter <= 0 or (
                self.follow not in ("measured", "predicted")):
            raise ConfigError("frontier: min_stage_share in (0, 1), tokens_per_parameter > 0, "
                              "follow 'measured' or 'predicted'")
        for family in self.families:
            if family not in FAMILIES:
                raise ConfigError(f"frontier: unknown family {family!r}")
        for arm in self.recipes:
            if arm not in RECIPES:
                raise ConfigError(f"frontier: unknown recipe {arm!r}; choose from "
                                  f"{', '.join(RECIPES)}")
            recipe = RECIPES[arm]
            if recipe.family not in self.families:
                raise ConfigError(f"frontier: {arm} needs the {recipe.family} family's "
                                  f"from-scratch sizes (its envelope and LRs)")
            if recipe.shape not in SHAPES:
                raise ConfigError(f"frontier: {arm}: unknown shape {recipe.shape!r}")
            methods = ((STRATEGIES if recipe.kind == "chain" else WIDENINGS)
                       if recipe.shape == "size" else (SHAPES[recipe.shape],))
            if recipe.method not in methods:
                raise ConfigError(f"frontier: {arm}: unknown {recipe.kind} method "
                                  f"{recipe.method!r}")
            if recipe.shape == "clone" and recipe.kind != "widen":
                raise ConfigError(f"frontier: {arm}: hidden-size duplication is a "
                                  f"Transformer++ arm here (TokenFormer sizes differ in tokens)")
            if (recipe.kind != "chain" or recipe.shape != "size") and (
                    recipe.freeze_old is not None or recipe.noise_old):
                raise ConfigError(f"frontier: {arm}: freeze_old/noise_old act on the parameter "
                                  f"tokens a growth of tokens keeps")
            if recipe.lr_policy not in LR_POLICIES:
                raise ConfigError(f"frontier: {arm}: LR policy {recipe.lr_policy!r} is not "
                                  f"available ({', '.join(LR_POLICIES)})")
        if self.new_row_moments not in NEW_ROW_MOMENTS:
            raise ConfigError(f"frontier: new_row_moments must be one of {NEW_ROW_MOMENTS}")
        if not 0 < self.decay_fraction < 1 or self.seeds < 1 or self.sweep_seeds < 1:
            raise ConfigError("frontier: decay_fraction in (0, 1), seeds and sweep_seeds >= 1")
        if self.corpus is not None:
            parse_spec(self.corpus)
        arms = self.arm_names()
        ids = [q.id for q in self.questions]
        if len(set(ids)) != len(ids):
            raise ConfigError("frontier: question ids must be unique")
        for q in self.questions:
            for term in q.terms():
                known = (term.split(":", 1)[1] in self.families if term.startswith("envelope:")
                         else term in arms)
                if not known:
                    raise ConfigError(f"frontier: question {q.id} names {term!r}, which the "
                                      f"preset does not run")
            if q.budgets not in ("final", "all") or (q.margin is not None and (
                    q.margin <= 0 or not q.margin_why)):
                raise ConfigError(f"frontier: question {q.id}: budgets 'final' or 'all'; a "
                                  f"margin must be positive and justified")


def size_key(family: str, size: str) -> str:
    """``"<family>-<size>"``: the name of that size's from-scratch arm, the key of the LR sweep
    that sets its LR (a run's ``lr_from``) and of its measured seconds per step."""
    return f"{family}-{size}"


def family_sizes(preset: Preset, family: str) -> tuple[str, ...]:
    """The sizes ``family`` runs: every preset size for the TokenFormer families, from S1 on for
    the others (no matched Transformer++ or product-key FFN exists below S1; module docstring)."""
    if family in SMALL_SIZE_FAMILIES:
        return preset.sizes
    return tuple(s for s in preset.sizes if s != "S0")


FULL_RECIPES = (*GROWTH_ARMS, "chain-paper-final-lr", "chain-gelu")

# full: 2.5e12 FLOPs at most (v2 ran 4e12 with 7 arms): with 11 growing arms × 5 seeds that is
# ≈ 72 min of --jobs 2 on 2 idle Zen 4 cores (benchmarks/frontier_steps.py), inside the issue's
# 2 h; v2's envelopes put TokenFormer's best size at S2 only from ≈ 2–4e12, so the chains
# still walk S0 → S1 (→ S2) and Transformer++'s S1 → S2 (docs/results.md)
_CPU = Preset(name="full", first_size=0, num_sizes=4, max_budget=2.5e12,
              families=("tokenformer", "transformer++", "tokenformer-gelu"),
              recipes=FULL_RECIPES,
              questions=GROWTH_QUESTIONS + LR_POLICY_QUESTIONS + ARCHITECTURE_QUESTIONS
              + CONTROL_QUESTIONS)
PRESETS: dict[str, Preset] = {
    # one seed, one sweep seed: TokenFormer S0–S3 and the paper chain following the measured
    # envelope; its question is stated and answered, but one seed resolves nothing
    "quick": dataclasses.replace(
        _CPU, name="quick", max_budget=1.5e12, num_budgets=4, seeds=1, sweep_seeds=1,
        families=("tokenformer",), recipes=("chain-paper",), sweep_steps=60,
        min_steps=60, warmup_steps=20, anneal_steps=50, questions=GROWTH_QUESTIONS[:1]),
    "full": _CPU,
    # issue 18: product keys with 16× the FFN tokens at the dense FLOPs/token vs dense TokenFormer
    # and Transformer++, from scratch only, S1–S2 (the full preset's envelope sizes up to 2e12
    # FLOPs; S3 never was) and three budgets over one decade; sized for well under 60 min of
    # one CPU thread on shared cores (the product-key FFN is 5–9× slower per FLOP on this CPU,
    # docs/sparse.md), hence also min_steps as in the quick preset and shorter sweeps. Its
    # seeds and single sweep seed are those of the documented run (docs/sparse.md).
    "sparse": dataclasses.replace(
        _CPU, name="sparse", first_size=1, num_sizes=2,
        families=("tokenformer", "transformer++", "tokenformer-pk16"), recipes=(),
        questions=(), seeds=3, sweep_seeds=1, max_budget=1e12, num_budgets=3,
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
    # issue 26: the v3 protocol on one H100 in ≈ 25 min of bf16 (an estimate, see
    # expected_hours), TokenFormer S0–S2 (1.0–4.2 M non-embedding parameters), Transformer++
    # S1–S2 and the plain-GELU control, their chains following the measured envelopes, 5 seeds,
    # 2 sweep seeds; the generated corpus (3e7 bytes: the largest run reads 8.7e7 tokens, < 4×
    # its 2.85e7 training bytes), so nothing is downloaded or carried
    "gpu-30m": dataclasses.replace(
        _CPU, name="gpu-30m", hidden_size=256, num_layers=4, num_heads=4,
        base_tokens=(128, 128, 512), first_size=0, num_sizes=3, seq_len=512, batch_size=128,
        max_budget=1e15, num_budgets=4, warmup_steps=50, min_steps=120, sweep_steps=150,
        anneal_steps=50, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3), eval_batches=16, dtype="bf16",
        tokens_per_parameter=20.0, recipes=("chain-paper", "chain-gelu"),
        # G6 (widen-zero) left out: its plan puts Transformer++ at S1 only, so the arm never
        # grows and the question would get no data (plan._refuse_unplanned_questions)
        questions=tuple(q for q in GROWTH_QUESTIONS + ARCHITECTURE_QUESTIONS
                        + CONTROL_QUESTIONS if q.id in ("G1", "A1", "A2", "C1", "C2")),
        corpus="synthetic:30000000",
        expected_hours="≈ 26 min on one H100 (bf16), NOT measured: 50 final runs + 64 sweep "
                       "runs ≈ 55 k steps of 65,536 tokens (the predicted chains), timed at an "
                       "assumed 15 ms of per-step overhead (eager launches of 4 layers × 5 "
                       "Pattentions) plus the step's FLOPs at 100 TFLOP/s; the GPU session "
                       "measures it and adjusts max_budget. Resumable across 10-minute calls."),
}


def get_preset(name: str, **overrides: Any) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown scale preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = dataclasses.replace(PRESETS[name], **overrides)
    preset.validate()
    return preset
