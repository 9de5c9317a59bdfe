"""The frontier's presets: every setting of an experiment but the data and the device.

Sizes: S1… as before (``base_tokens`` × ``factor``^(k−1) for Sk); ``first_size`` 0 or −1 adds
S0 (``base_tokens`` / ``factor``) and S-1 (/ ``factor``²) below S1, for the TokenFormer families
only: a Transformer++ block at d = 64 has more parameters in its attention alone (4·d² per
block) than TokenFormer S0, so no *matched* Transformer++ exists there (and product keys need an
FFN to multiply). With ``tpp_widths`` (v4, issue 35) Transformer++ scales its width instead:
size Sk has hidden size ``tpp_widths[k % 2]`` · 2^(k // 2), ``tpp_heads`` · 2^(k // 2) heads and
an MLP of 8/3 · d (:func:`tpp_shape`), so it has every size of the preset and Sk at half width
is exactly S(k−2) (the shape HyperCloning starts from is a from-scratch size).

Families: ``tokenformer``, ``transformer++`` (matched to each TokenFormer size in non-embedding
parameters), ``tokenformer-gelu`` (Θ = plain GELU: every Pattention a GELU MLP, the critics'
control; same sizes as TokenFormer) and the product-key TokenFormers ``tokenformer-pk16``/``-pk64``
(each size's FFN replaced by product keys over ≈ 16×/64× its tokens at the dense FLOPs per
token; issue 18, preset ``sparse``), which train from scratch only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ...data.corpora import parse_corpus
from ...errors import ConfigError
from ...ops.growth import NEW_ROW_MOMENTS, recipe_names
from ...ops.growth.widening import WIDENINGS
from .arms import CONTINUING_ARMS, GROWING_ARMS, LR_POLICIES, SHAPES
from .questions import (
    ARCHITECTURE_QUESTIONS,
    BUDGET_READINGS,
    CONTROL_QUESTIONS,
    G_QUESTION_ARMS,
    GROWTH_QUESTIONS,
    LR_POLICY_QUESTIONS,
    V4_QUESTIONS,
    V5_G1,
    V5_TREND,
    Question,
    continuing_arm,
    reuse_questions,
)

SCHEDULE_FAMILY = "wsd"
SIZE_NAMES = ("S-1", "S0", "S1", "S2", "S3", "S4", "S5", "S6")
# product-key TokenFormers (issue 18): family → FFN tokens as a multiple of the dense size's
PRODUCT_KEY_FAMILIES = {"tokenformer-pk16": 16, "tokenformer-pk64": 64}
DENSE_FAMILIES = ("tokenformer", "transformer++")  # a preset's default
# TokenFormers with another Θ (issue 25): family → config ``norm``. "gelu": no normalisation,
# every Pattention a GELU MLP (the critics' control)
THETA_FAMILIES = {"tokenformer-gelu": "gelu"}
# every family a preset may name
FAMILIES = (*DENSE_FAMILIES, *THETA_FAMILIES, *PRODUCT_KEY_FAMILIES)
# families with sizes below S1 (no matched Transformer++ or product-key FFN exists there; a
# width-scaled Transformer++, ``tpp_widths``, starts at S0)
SMALL_SIZE_FAMILIES = ("tokenformer", *THETA_FAMILIES)
HORIZON_FACTORS = (0.5, 1.0, 2.0)  # v4: full-length runs at these multiples of the sweep's pick
# a product-key size's FFN forward FLOPs/token may differ from the dense size's by at most this
# (k is an integer: one more selected token changes the FFN's count by 2d + Θ's work)
PK_FLOPS_TOLERANCE = 0.01
MAX_EPOCHS = 4.0  # no run may see the training split more often than this
# tuning seeds are SWEEP_SEED + i (LR sweeps, horizon runs, every choice): never a held-out seed
SWEEP_SEED = 1000


def is_tuning_seed(seed: int) -> bool:
    """Whether ``seed`` is a tuning seed (chooses, never scored) rather than a held-out one."""
    return seed >= SWEEP_SEED


@dataclass(frozen=True)
class HeldOut:
    """v5 (issue 46): the validation data as whole random documents of the corpus (the embedded
    one's chapters, a pysource corpus' files), drawn with ``seed`` until >= ``tokens`` are held
    out; the first drawn documents, up to ``tuning_share`` of them, are the tuning window
    (every run on a tuning seed is evaluated there, on the whole window), the rest the scoring
    window (every held-out run). v4 scored and chose on the same tail of the corpus.
    ``tuning_batches``: the tuning runs read a fixed, evenly spread subset of their window
    (the time budget; docs/frontier-v5.md)."""

    tokens: int = 1_000_000
    tuning_share: float = 0.5
    seed: int = 0
    # a tuning-seed run evaluates this many batches evenly spread over the tuning window (None:
    # all of it); held-out runs always read the whole scoring window
    tuning_batches: int | None = None


@dataclass(frozen=True)
class Reuse:
    """v5's primary family (issue 46; docs/frontier-v5.md): a finished ``base`` (a size of the
    TokenFormer family, trained and cooled at each of ``tokens_per_parameter``, whose compute
    C(k) is a budget of the grid) continued for X · C(k) more FLOPs, X in ``increments`` (each a
    whole number of grid steps below 1, so that X · C(k) is a grid budget too) by each of
    ``arms`` (keys of :data:`.arms.CONTINUING_ARMS`): grown into ``final`` and trained on, or
    trained on at its size, or Transformer++'s base of the same k grown by its own operator.
    The from-scratch rivals (``final``'s size, the envelope) are the family's held-out runs at
    those budgets."""

    base: str = "S0"
    final: str = "S2"
    tokens_per_parameter: tuple[float, ...] = (40.0, 126.5, 400.0)
    increments: tuple[float, ...] = (0.1, 0.316, 1.0)
    arms: tuple[str, ...] = ("grown", "continued", "tpp-grown")


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
    # 0 / -1: the sizes start at S0 = S1 / factor or S-1 = S1 / factor² (TokenFormer families)
    first_size: int = 1
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
    # seeds SWEEP_SEED + i that choose every LR and (with horizon_factors) every best size
    tuning_seeds: int = 2
    # v4 (issue 35): full-length runs on the tuning seeds at these multiples of the short sweep's
    # pick choose each (family, size, budget)'s LR and the envelope's size; the held-out seeds
    # (0..seeds-1) only score. () is the v3 protocol: the sweep's pick, the envelope chosen on
    # the seeds it is scored on (quick, sparse)
    horizon_factors: tuple[float, ...] = ()
    # a size runs budget j only when it is within this many sizes of the predicted optimum at j
    # (None: every budget of >= min_steps steps)
    size_window: int | None = None
    # Transformer++ by width (v4): hidden sizes of S0 and S1 (module docstring); None: v3's MLP
    # matched to each TokenFormer size
    tpp_widths: tuple[int, int] | None = None
    tpp_heads: int = 2
    max_extensions: int = 2  # grid points the runner may add beyond an edge, per side
    seeds: int = 5
    families: tuple[str, ...] = DENSE_FAMILIES
    recipes: tuple[str, ...] = ()  # arms that grow: keys of GROWING_ARMS
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
    # ---- v5 (issue 46; docs/frontier-v5.md). At their defaults (v4's protocol) these fields
    # are left out of the experiment's record (:func:`preset_record`), so every earlier
    # preset keeps its fingerprint
    validation: HeldOut | None = None  # None: the corpus' tail, the same for tuning and scoring
    reuse: Reuse | None = None  # the reuse family
    # the horizon stage adds a factor beyond an end pick this many times per side, as the sweep
    # does (v4: 0)
    horizon_extensions: int = 0
    # sizes added beyond a budget's tuning optimum when it is the smallest or largest size run
    # there, per budget and side (v4: 0)
    window_extensions: int = 0
    # the chains' tuning grid: every stage before the last at these multiples of the final
    # size's LR (v4: (), every stage at the final stage's factor) ...
    chain_small_factors: tuple[float, ...] = ()
    # ... and every growth step at these multiples of the envelope rule's step (v4: (), the rule)
    growth_time_factors: tuple[float, ...] = ()

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
        first = SIZE_NAMES.index(f"S{self.first_size}")
        return SIZE_NAMES[first:first + self.num_sizes]

    @property
    def chains(self) -> tuple[str, ...]:
        """The arms that grow Pattention tokens (GROWING_ARMS kind "chain")."""
        return tuple(r for r in self.recipes if GROWING_ARMS[r].kind == "chain")

    @property
    def widenings(self) -> tuple[str, ...]:
        """The Transformer++ arms that widen the MLP (GROWING_ARMS kind "widen")."""
        return tuple(r for r in self.recipes if GROWING_ARMS[r].kind == "widen")

    def arm_names(self) -> set[str]:
        """Every arm a question may name: each family's from-scratch sizes, the recipes and
        the reuse family's continuing arms at each k."""
        reuse = ({continuing_arm(a, k) for a in self.reuse.arms
                  for k in self.reuse.tokens_per_parameter} if self.reuse is not None else set())
        return {size_key(f, s) for f in self.families for s in family_sizes(self, f)} | set(
            self.recipes) | reuse

    def validate(self) -> None:
        if self.first_size not in (-1, 0, 1) or not (
                2 <= self.num_sizes <= len(SIZE_NAMES) - self.first_size - 1):
            raise ConfigError(f"frontier: first_size must be -1, 0 or 1 and num_sizes in "
                              f"2..{len(SIZE_NAMES) - self.first_size - 1}")
        if self.first_size < 1 and any(n % self.factor ** (1 - self.first_size)
                                       for n in self.base_tokens):
            raise ConfigError(f"frontier: S{self.first_size} needs base_tokens divisible by "
                              f"factor^{1 - self.first_size}")
        if any(f <= 0 for f in self.horizon_factors) or len(set(self.horizon_factors)) != len(
                self.horizon_factors) or (self.size_window is not None and self.size_window < 1):
            raise ConfigError("frontier: horizon_factors distinct and positive, size_window >= 1")
        if self.tpp_widths is not None and (len(self.tpp_widths) != 2 or any(
                w % self.tpp_heads or 8 * w % 3 for w in self.tpp_widths)):
            raise ConfigError("frontier: tpp_widths: two hidden sizes divisible by tpp_heads "
                              "and by 3 (an MLP of exactly 8/3 · d)")
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
            if arm not in GROWING_ARMS:
                raise ConfigError(f"frontier: unknown growing arm {arm!r}; choose from "
                                  f"{', '.join(GROWING_ARMS)}")
            growing = GROWING_ARMS[arm]
            if growing.family not in self.families:
                raise ConfigError(f"frontier: {arm} needs the {growing.family} family's "
                                  f"from-scratch sizes (its envelope and LRs)")
            if growing.shape not in SHAPES:
                raise ConfigError(f"frontier: {arm}: unknown shape {growing.shape!r}")
            methods = ((recipe_names() if growing.kind == "chain" else WIDENINGS)
                       if growing.shape == "size" else (SHAPES[growing.shape],))
            if growing.method not in methods:
                raise ConfigError(f"frontier: {arm}: unknown {growing.kind} method "
                                  f"{growing.method!r}")
            if growing.shape == "clone" and growing.kind != "widen":
                raise ConfigError(f"frontier: {arm}: hidden-size duplication is a "
                                  f"Transformer++ arm here (TokenFormer sizes differ in tokens)")
            if (growing.kind != "chain" or growing.shape != "size") and (
                    growing.freeze_old is not None or growing.noise_old):
                raise ConfigError(f"frontier: {arm}: freeze_old/noise_old act on the parameter "
                                  f"tokens a growth of tokens keeps")
            if growing.lr_policy not in LR_POLICIES:
                raise ConfigError(f"frontier: {arm}: LR policy {growing.lr_policy!r} is not "
                                  f"available ({', '.join(LR_POLICIES)})")
        if self.new_row_moments not in NEW_ROW_MOMENTS:
            raise ConfigError(f"frontier: new_row_moments must be one of {NEW_ROW_MOMENTS}")
        if not 0 < self.decay_fraction < 1 or self.seeds < 1 or self.tuning_seeds < 1:
            raise ConfigError("frontier: decay_fraction in (0, 1), seeds and tuning_seeds >= 1")
        if self.corpus is not None:
            parse_corpus(self.corpus)
        self._validate_v5()
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
            if q.budgets not in BUDGET_READINGS or (q.margin is not None and (
                    q.margin <= 0 or not q.margin_why)):
                raise ConfigError(f"frontier: question {q.id}: budgets one of "
                                  f"{', '.join(BUDGET_READINGS)}; a margin must be positive "
                                  f"and justified")


    def _validate_v5(self) -> None:
        """The v5 fields (issue 46): held-out documents, the reuse family, the extensions and
        the chains' tuning grid."""
        v = self.validation
        if v is not None and (v.tokens < 2 or not 0 < v.tuning_share < 1 or (
                v.tuning_batches is not None and v.tuning_batches < 1)):
            raise ConfigError("frontier: validation: tokens >= 2, tuning_share in (0, 1), "
                              "tuning_batches >= 1 or None")
        if min(self.horizon_extensions, self.window_extensions) < 0 or any(
                f <= 0 for f in (*self.chain_small_factors, *self.growth_time_factors)):
            raise ConfigError("frontier: extensions >= 0, chain factors positive")
        if any(f > 1 for f in self.growth_time_factors):
            raise ConfigError("frontier: growth_time_factors <= 1 (a growth moves earlier only: "
                              "later, it would leave its budget's share)")
        r = self.reuse
        if r is None:
            return
        if "tokenformer" not in self.families or not self.horizon_factors:
            raise ConfigError("frontier: reuse needs the tokenformer family and the horizon "
                              "stage (its LRs are tuned at each length)")
        order = list(self.sizes)
        if r.base not in order or r.final not in order or order.index(r.final) <= order.index(
                r.base):
            raise ConfigError(f"frontier: reuse: base and final must be sizes of the preset "
                              f"({', '.join(order)}), the final one larger")
        for arm in r.arms:
            if arm not in CONTINUING_ARMS:
                raise ConfigError(f"frontier: reuse: unknown arm {arm!r}; choose from "
                                  f"{', '.join(CONTINUING_ARMS)}")
            if CONTINUING_ARMS[arm].family == "transformer++" and self.tpp_widths is None:
                raise ConfigError(f"frontier: reuse: {arm} needs the width-scaled "
                                  f"Transformer++ (tpp_widths)")
            if CONTINUING_ARMS[arm].family == "transformer++" and "transformer++" in \
                    self.families:  # its base runs would take the family's run ids
                raise ConfigError(f"frontier: reuse: {arm} bases Transformer++ at S0 under the "
                                  f"family's own run ids: drop transformer++ from families")
        if "grown" not in r.arms:
            raise ConfigError("frontier: reuse: the grown arm is the family's subject")
        ks, xs = r.tokens_per_parameter, r.increments
        if not ks or any(k <= 0 for k in ks) or list(ks) != sorted(set(ks)):
            raise ConfigError("frontier: reuse: tokens_per_parameter increasing and positive")
        if not xs or any(x <= 0 or x > 1 for x in xs) or list(xs) != sorted(set(xs)):
            raise ConfigError("frontier: reuse: increments increasing, in (0, 1]")
        for x in xs:
            steps = increment_steps(self, x)
            if abs(self.budget_ratio ** -steps / x - 1) > 0.01:
                raise ConfigError(f"frontier: reuse: increment {x:g} is not a whole number of "
                                  f"budget steps (budget_ratio {self.budget_ratio:g}) below 1")


def increment_steps(preset: Preset, x: float) -> int:
    """How many budgets of the grid an increment X lies below its base's budget (X =
    budget_ratio^-m): the cell (k at budget j, X) reads budget j − m."""
    return round(-math.log(x) / math.log(preset.budget_ratio))


# The v5 fields of a Preset and their defaults (v4's protocol), which preset_record leaves out
V5_FIELDS = ("validation", "reuse", "horizon_extensions", "window_extensions",
             "chain_small_factors", "growth_time_factors")


def preset_record(preset: Preset) -> dict[str, Any]:
    """The preset as an experiment records it (``experiment.json``'s settings, which its
    fingerprint hashes, and ``results.json``): every field, but the v5 fields only where they
    differ from their defaults, so a preset of an earlier protocol keeps the record, and the
    fingerprint, it had (a v4 folder resumes)."""
    record = dataclasses.asdict(preset)
    defaults = {f.name: f.default for f in dataclasses.fields(Preset) if f.name in V5_FIELDS}
    for name, default in defaults.items():
        if getattr(preset, name) == default:
            del record[name]
    return record


def size_key(family: str, size: str) -> str:
    """``"<family>-<size>"``: the name of that size's from-scratch arm, the key of the LR sweep
    that sets its LR (a run's ``lr_from``) and of its measured seconds per step."""
    return f"{family}-{size}"


def family_sizes(preset: Preset, family: str) -> tuple[str, ...]:
    """The sizes ``family`` runs: every preset size for the TokenFormer families, from S1 on for
    the others (no matched Transformer++ or product-key FFN exists below S1; module docstring)."""
    if family in SMALL_SIZE_FAMILIES:
        return preset.sizes
    if family == "transformer++" and preset.tpp_widths is not None:
        return preset.sizes
    return tuple(s for s in preset.sizes if s not in ("S-1", "S0"))


def tpp_shape(preset: Preset, size: str) -> tuple[int, int, int]:
    """(hidden size, heads, MLP width) of the width-scaled Transformer++ ``size`` (module
    docstring): two interleaved series that double every two sizes, so that S(k−2) is Sk at
    half width with the same head size, and an MLP of exactly 8/3 · d."""
    if preset.tpp_widths is None:
        raise ConfigError("frontier: this preset matches Transformer++ by MLP (no tpp_widths)")
    k = int(size[1:])
    d, heads = preset.tpp_widths[k % 2] * 2 ** (k // 2), preset.tpp_heads * 2 ** (k // 2)
    if d != int(d) or heads != int(heads) or heads < 1 or 8 * d % 3:
        raise ConfigError(f"frontier: no width-scaled Transformer++ {size} for tpp_widths "
                          f"{preset.tpp_widths} and tpp_heads {preset.tpp_heads}")
    return int(d), int(heads), int(8 * d // 3)


FULL_GROWING_ARMS = (*G_QUESTION_ARMS, "chain-paper-final-lr", "chain-gelu")

# v3's full preset (issue 25), the base of the presets that keep its protocol (quick, sparse,
# gpu): 2.5e12 FLOPs, 11 growing arms × 5 seeds, LRs from 250-step sweeps, the envelope chosen
# on the seeds it is scored on
FULL_V3 = Preset(name="full-v3", first_size=0, num_sizes=4, max_budget=2.5e12,
             families=("tokenformer", "transformer++", "tokenformer-gelu"),
             recipes=FULL_GROWING_ARMS, seeds=5,
             questions=GROWTH_QUESTIONS + LR_POLICY_QUESTIONS + ARCHITECTURE_QUESTIONS
             + CONTROL_QUESTIONS)
# v4 (issue 35; every choice and its reason: docs/frontier-v4.md): tuning seeds choose every LR
# (a 200-step sweep, then full-length runs at ×½, ×1, ×2 of its pick) and every best size; 8
# held-out seeds score the envelope's (size, LR) and the chains. Sizes S-1…S3 (TokenFormer and
# the plain-GELU control; Transformer++ S-1…S3 scaled in width, MLP 8/3·d), each run only at the
# budgets within one size of the predicted optimum (26 tokens per parameter: v3's measured
# envelope, which the prediction reproduces), so every budget read has a size on each side of
# it; 4 budgets 3.1e11 … 2.5e12; two growing arms (the paper chain at its final size's LR, the
# primary; per-stage, the secondary) for 8 questions in 4 families; the plain-GELU chain
# (C1, C2) is trimmed to fit 100 minutes (docs/frontier-v4.md).
# benchmarks/frontier_steps.py --preset full --cpu-time predicts its time (docs/frontier-v4.md)
_CPU = dataclasses.replace(
    FULL_V3, name="full", first_size=-1, num_sizes=5, num_budgets=4, seeds=8, tuning_seeds=2,
    horizon_factors=HORIZON_FACTORS, size_window=1, tpp_widths=(36, 48), tpp_heads=2,
    tokens_per_parameter=26.0, sweep_steps=200,
    recipes=("chain-paper-final-lr", "chain-paper"),
    questions=tuple(q for q in V4_QUESTIONS if q.family != "control"))
# issue 35: the v4 protocol on one H200 in <= 11 minutes over <= 2 calls, on real text: the
# Python sources of the installed torch, transformers and sympy (1.26e8 bytes here, pinned by
# their versions, recorded with a sha256; never downloaded). TokenFormer S-1…S2 (d 256, 4
# blocks) and Transformer++ S-1…S2 by width (d 72…216, MLP 8/3·d), each size only at the
# budgets within one size of the predicted optimum (20 tokens per parameter, Chinchilla's: this
# corpus is not v3's): every size is that optimum at a budget or the one size each side of it
# the edge rule asks for. Two growing arms (the paper chain at its final size's LR, and
# per-stage), 8 held-out and 2 tuning seeds; stacking, HyperCloning and the plain-GELU control
# are left out (their reasons: docs/frontier-v4.md). Its 7-min estimate was measured at ≈ 22 min
# on one H200, whose run records were lost (docs/results/frontier-gpu.md).
GPU_CODE = dataclasses.replace(
    _CPU, name="gpu-code", hidden_size=256, num_layers=4, num_heads=4, num_sizes=4,
    base_tokens=(64, 64, 256), seq_len=512, batch_size=128, max_budget=4e14,
    num_budgets=3, warmup_steps=30, min_steps=100, sweep_steps=150, anneal_steps=50,
    lr_grid=(5e-4, 1e-3, 2e-3, 4e-3), eval_batches=16, dtype="bf16",
    tokens_per_parameter=20.0, families=("tokenformer", "transformer++"),
    tpp_widths=(108, 144), tpp_heads=2, recipes=("chain-paper-final-lr", "chain-paper"),
    questions=tuple(q for q in V4_QUESTIONS if q.id in ("G1", "G2", "L1", "A1", "T1", "T2")),
    corpus="pysource:torch,transformers,sympy",
    expected_hours="≈ 7 min of one H200 (bf16) with --jobs 8, estimated, not measured: "
                   "benchmarks/frontier_steps.py --preset gpu-code --gpu-ms-per-step 32 "
                   "--jobs 8 --contention 1.5 (the 32 ms/step measured for gpu-30m's sweep "
                   "runs, launch-bound; 8 runs at once assumed to cost 1.5× each; --jobs 4 at "
                   "1.25×: 11.5 min). Resumable: --out docs/results/frontier-gpu, committed "
                   "between calls.")
# v5 (issue 46; every choice and its reason: docs/frontier-v5.md). The reuse family first: the
# base S0 (d 32, context 32: 50 % of its FLOPs in Pattention) trained and cooled at k = 40, 126.5,
# 400 tokens per parameter, whose compute C(k) is the budget grid (√10 apart; 7.74e11 =
# 400 · 12,352 parameters · 156,672 training FLOPs per token), continued for X = 0.1, 0.316, 1 ×
# C(k) by the grown base (paper recipe, S0 → S2), the base trained on (R3) and Transformer++'s
# base of the same k grown by HyperCloning (R4), against S2 from scratch (R1) and the envelope
# (R2) at X · C(k); G1 and T1 (post-growth budgets) replicate v4's cumulative question with the
# chain tuned on a small-stage × final-stage LR grid at two growth times. Validation: >= 1e6
# bytes of random chapters, a tuning and a scoring window.
FULL_V5 = dataclasses.replace(
    _CPU, name="full", hidden_size=32, num_heads=2, seq_len=32, batch_size=64,
    max_budget=7.74e11, num_budgets=3, budget_ratio=10 ** 0.5, warmup_steps=20, min_steps=80,
    lr_grid=(2e-3, 4e-3, 8e-3, 1.6e-2), families=("tokenformer",), tpp_widths=(24, 36),
    tpp_heads=2, recipes=("chain-paper-final-lr",), validation=HeldOut(tuning_batches=64),
    reuse=Reuse(),
    horizon_extensions=2, window_extensions=2, chain_small_factors=(1.0, 2.0),
    growth_time_factors=(1.0, 0.5),
    expected_hours="100–115 min with --jobs 2 on 2 idle cores (docs/frontier-v5.md: 99 min by "
                   "benchmarks/frontier_steps.py --cpu-time on a busy machine, before the "
                   "extensions past an edge; re-measure on idle cores)",
    questions=(*reuse_questions(Reuse().tokens_per_parameter, size_key("tokenformer", "S2")),
               V5_G1, V5_TREND))
# v5's GPU preset (issue 46 point 6; docs/frontier-v5.md "GPU preset"): the reuse family at
# >= 10M non-embedding parameters on real text. TokenFormer d 512, 4 blocks, 8 heads, context
# 256, batch 64; S0 = (320, 320, 1280) tokens: 10.5M non-embedding parameters, 90 % of its
# training FLOPs in Pattention; grown into S2 (41.9M). The corpus bounds k: the installed
# packages' Python sources (1.17e8 bytes on the device's image) allow k <= 20 at <= 4 epochs of
# what a model reads, its base's included (R3 at k = 20, X = 1: 3.7; k = 31.6 put it at 5.9);
# k = 6.32, 20 (√10 apart, the grid's ratio); X = 0.316, 1. R4: Transformer++ d 480 (11.1M) grown by
# HyperCloning to d 960. The prior of the predicted envelope is 10 tokens per parameter (the
# bases are under-trained against Chinchilla's 20: the envelope at X · C(k) lies below S0; the
# window extends past an edge at run time). Planned, not run: its size in leases comes from the
# first lease's measured step times.
GPU_V5 = dataclasses.replace(
    FULL_V5, name="gpu-v5", hidden_size=512, num_layers=4, num_heads=8,
    base_tokens=(640, 640, 2560), first_size=-1, num_sizes=5, seq_len=256, batch_size=64,
    # max_budget: C(k = 20) = 20 × C(1), the base's compute at one token per parameter
    max_budget=20 * 7.368106948192323e14, num_budgets=2, budget_ratio=10 ** 0.5,
    warmup_steps=50, min_steps=100,
    sweep_steps=150, lr_grid=(2.5e-4, 5e-4, 1e-3, 2e-3), dtype="bf16", tpp_widths=(480, 672),
    tpp_heads=8, recipes=(), chain_small_factors=(), growth_time_factors=(),
    horizon_extensions=1, window_extensions=1, tokens_per_parameter=10.0,
    corpus="pysource:torch,transformers,sympy",
    validation=HeldOut(tokens=1_000_000, tuning_batches=16),
    reuse=Reuse(tokens_per_parameter=(6.32, 20.0), increments=(0.316, 1.0)),
    questions=reuse_questions((6.32, 20.0), size_key("tokenformer", "S2")),
    expected_hours="1.8e18 training FLOPs: ≈ 2.5 h of one H200 at an assumed 200 TFLOP/s "
                   "achieved (≈ 17 leases of 9 min), not measured; resize it from the first "
                   "lease's step times (benchmarks/frontier_steps.py --preset gpu-v5 "
                   "--measured DIR)")
PRESETS: dict[str, Preset] = {
    # v5's reuse family in miniature (issue 46): the base S0 finished at k = 126.5, grown (S0 →
    # S2) and trained on (R3) for X = 0.316 and 1 of its compute, against S2 from scratch (R1);
    # one tuning and one held-out seed, no factor around the sweeps' picks: the shape of the
    # answer, nothing resolved (the README's first command: <= 5 minutes on 2 idle cores)
    "quick": dataclasses.replace(
        FULL_V5, name="quick", first_size=0, num_sizes=3, max_budget=2.45e11, num_budgets=2,
        seeds=1, tuning_seeds=1, horizon_factors=(1.0,), horizon_extensions=0,
        window_extensions=0, sweep_steps=60, recipes=(), chain_small_factors=(),
        growth_time_factors=(), validation=HeldOut(tokens=200_000),
        expected_hours="about 4 min on 2 idle cores (3.8 min predicted on one worker)",
        reuse=Reuse(tokens_per_parameter=(126.5,), increments=(0.316, 1.0),
                    arms=("grown", "continued")),
        questions=reuse_questions((126.5,), size_key("tokenformer", "S2"), ("R1", "R3"))),
    # v3's quick preset (the committed docs/results/quick): one seed, one sweep seed,
    # TokenFormer S0–S3 and the paper chain following the measured envelope. Its record keeps
    # the name "quick" (the experiment's fingerprint covers it)
    "quick-v3": dataclasses.replace(
        FULL_V3, name="quick", max_budget=1.5e12, num_budgets=4, seeds=1, tuning_seeds=1,
        families=("tokenformer",), recipes=("chain-paper",), sweep_steps=60,
        min_steps=60, warmup_steps=20, anneal_steps=50, questions=GROWTH_QUESTIONS[:1]),
    "full": FULL_V5,
    # v4 (docs/frontier-v4.md, the committed docs/results/frontier-v4): its record keeps the
    # name "full", so its plan text and fingerprint are v4's (a v4 folder resumes with it)
    "full-v4": _CPU,
    # issue 18: product keys with 16× the FFN tokens at the dense FLOPs/token vs dense TokenFormer
    # and Transformer++, from scratch only, S1–S2 (the full preset's envelope sizes up to 2e12
    # FLOPs; S3 never was) and three budgets over one decade; sized for well under 60 min of
    # one CPU thread on shared cores (the product-key FFN is 5–9× slower per FLOP on this CPU,
    # docs/sparse.md), hence also min_steps as in the quick preset and shorter sweeps. Its
    # seeds and single sweep seed are those of the documented run (docs/sparse.md).
    "sparse": dataclasses.replace(
        FULL_V3, name="sparse", first_size=1, num_sizes=2,
        families=("tokenformer", "transformer++", "tokenformer-pk16"), recipes=(),
        questions=(), seeds=3, tuning_seeds=1, max_budget=1e12, num_budgets=3,
        budget_ratio=10 ** 0.5, min_steps=60, sweep_steps=200),
    "gpu": dataclasses.replace(
        FULL_V3, name="gpu", hidden_size=256, num_layers=6, num_heads=8,
        base_tokens=(128, 128, 512), seq_len=512, batch_size=32, max_budget=2e16,
        warmup_steps=200, min_steps=500, sweep_steps=2000, anneal_steps=500,
        lr_grid=(2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3), eval_batches=16, dtype="bf16",
        # L1 reads every budget, and its smallest ones have their predicted best size at S0,
        # the grid's edge (plan._refuse_edge_of_grid)
        questions=tuple(q for q in FULL_V3.questions if q.id != "L1"),
        expected_hours="≈ 3 h of training FLOPs (1.4e18) on one A100-80GB at an assumed 40 % "
                       "bf16 MFU (125 TFLOP/s achieved), up to ≈ 6 h as the small sizes run "
                       "below that; not measured; needs --data with >= 2e8 training tokens "
                       "(<= 4 epochs)"),
    "gpu-code": GPU_CODE,
    "gpu-v5": GPU_V5,
}


def get_preset(name: str, **overrides: Any) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown scale preset {name!r}; choose one of {', '.join(PRESETS)}")
    preset = dataclasses.replace(PRESETS[name], **overrides)
    preset.validate()
    return preset
