"""The frontier experiment's plan: presets → the list of runs (pure data, nothing is trained).

Every run uses one schedule family, warmup–stable–decay (WSD): linear warmup over
``warmup_steps``, a stable phase at the peak LR, and a linear cooldown to ``min_lr_ratio`` × peak
over the last ``decay_fraction`` of the run's steps. One *stable run* per (arm, seed) trains at
the peak LR and, at each budget of a log-spaced FLOP grid, a *cooldown branch* starts from a copy
of its state and decays for ``decay_fraction`` of that budget's steps. The branch's final
validation loss is the arm's point at that budget.

**Chains follow the envelope** (issue 25; :func:`follow_envelope`). The *envelope* of a family
at a budget is its from-scratch size with the lowest mean validation loss over seeds there
(``report.envelope``). The runner trains every from-scratch run first, reads the measured
envelope, and only then plans each chain from it by this rule:

1. Target sizes: at budget j the chain should be at t_j = the smallest of the envelope's best
   sizes at budgets j, j+1, …, last (a non-decreasing sequence, so a noisy envelope never asks a
   chain to shrink). The chain therefore starts at t_first, at or below the smallest budget's best
   size, and ends at t_last = the envelope's best size at its final budget.
2. Growth points: the chain grows from t_{j−1} to t_j (one growth, possibly over several sizes)
   right after budget j−1's cooldown branch point, i.e. as soon as the budget grid says the next
   size becomes the envelope's best, while budget j−1 still reads t_{j−1}.
3. Minimum share: a budget is read only when the size the chain cools down there has trained at
   least ``min_stage_share`` (40 %) of that budget's steps (stable steps since its growth plus
   the cooldown). Where rule 2 would give the new size less than that at budget j, the growth
   moves earlier, to the latest step that gives it the share; a budget that then falls short is
   not read for that chain (reported as —).
A chain whose targets never change is no chain (the envelope's best size is the same at every
budget): it is not run. ``tokenformer scale --plan`` shows the chains of a *predicted* envelope
(the size whose tokens per non-embedding parameter is closest, in log, to the preset's
``tokens_per_parameter`` prior: 40, the v2 full run's measured compute-optimal ratio at its
largest budget); the run replaces it by the measured one before any chain trains.

Sizes: S1… as before (``base_tokens`` × ``factor``^(k−1) for Sk); ``first_size = 0`` adds S0
(``base_tokens`` / ``factor``) below today's S1, for the TokenFormer families only: a
Transformer++ block at d = 64 has more parameters in its attention alone (4·d² per block) than
TokenFormer S0, so no matched Transformer++ exists there (and product keys need an FFN to
multiply).

**LR rule** (issue 25): per (family, size), a grid of peak LRs, each run for ``sweep_steps`` steps
(same WSD family, one branch at the end) with ``sweep_seeds`` seeds (sweep seeds
``SWEEP_SEED`` + i, not the final runs' seeds); the final runs of that size use the argmin of the
**mean over sweep seeds**, picked inside the grid (the runner extends the grid by one factor
beyond an edge argmin, at most ``max_extensions`` times per side). Every verdict-bearing preset
has ≥ 2 sweep seeds; the report flags a sweep whose mean curve is not unimodal (non-monotone on a
side of its minimum) or whose seeds pick different LRs. A chain trains each stage at its own size's
chosen LR (``lr_policy`` "per-stage": the peak moves at once at the growth step; a half-depth or
half-width first stage takes the LR of the swept size nearest in non-embedding parameters), or
the whole run at its final size's LR ("final-size", v2's policy: the compared factor).

**Pre-registered questions** (:class:`Question`): each preset carries the questions its verdict
answers, with their endpoints, multiplicity families and equivalence margins, fixed here before
anything runs; ``--plan`` prints them and the report states them before any result
(``report.answers``: raw p, Holm-adjusted p within the family, TOST where equivalence is asked,
and the decision word of :mod:`..common.stats`).

A growing arm is an entry of :data:`RECIPES` (a :class:`Recipe`): its family, its operator and
recipe (``method``), and its old-token options (``freeze_old``, ``noise_old``: issue 24's, as in
``--grow-at``). ``chain-official-init`` is the released initialisation with the optimizer carried;
``chain-official-released`` adds the released run's restart at each growth: a fresh AdamW and
a linear warmup again over ``warmup_steps``. The released run's new cosine has no place in the
one WSD family every run here follows; its counterpart is each budget's cooldown, which every
arm gets (:func:`run_lr`). ``chain-stack``/``widen-stack`` (G_stack) and ``widen-duplicate``
(HyperCloning) grow once, into the same final size as the size-walking chains, from that size
at half depth or half width, at a branch point of their own stages by the same rule
(:func:`reshaped_chain`).

Families: ``tokenformer``, ``transformer++`` (matched to each TokenFormer size in non-embedding
parameters), ``tokenformer-gelu`` (Θ = plain GELU: every Pattention a GELU MLP, the critics'
control; same sizes as TokenFormer) and the product-key TokenFormers ``tokenformer-pk16``/``-pk64``
(each size's FFN replaced by product keys over ≈ 16×/64× its tokens at the dense FLOPs per
token; issue 18, preset ``sparse``), which train from scratch only.

Arms that grow are entries of :data:`RECIPES` (one :class:`Recipe` each): the extension point
for issue 24's operators (see the comment above it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any

from ...data.synthetic import parse_spec
from ...errors import ConfigError
from ...models.baselines import matched_config
from ...models.config import TokenFormerConfig, flops_per_token
from ...ops.growth import NEW_ROW_MOMENTS, STRATEGIES, resets_optimizer
from ...ops.widening import WIDENINGS
from ...training.config import TrainConfig
from ...training.schedule import lr_at
from ..common.report import markdown_table

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
# "per-stage": each stage at its own size's tuned LR, switched at the growth step (the default);
# "final-size": the whole chain at its final size's LR (v2's policy, kept as the compared factor)
LR_POLICIES = ("per-stage", "final-size")
# how a chain's stages differ (Recipe.shape): "size" walks the family's sizes (tokens or MLP
# width); "stack" starts at the final size with half its blocks and stacks them (G_stack);
# "clone" starts at the final size with half the hidden size and heads and duplicates them
# (HyperCloning)
SHAPES = {"size": None, "stack": "stack", "clone": "duplicate"}


@dataclass(frozen=True)
class Recipe:
    """An arm that grows (a chain): through which family's sizes, by which operator.

    ``kind`` "chain" is a TokenFormer-family arm, "widen" a Transformer++ one. ``shape`` "size"
    walks the family's sizes: a chain grows Pattention tokens with
    ``ops.growth.grow_with_optimizer`` (``method`` is its ``strategy``; ``official-released``
    also restarts the optimizer and the warmup at each growth), a widen arm widens the MLP with
    ``ops.widening.widen_mlp`` (``method`` is its method). ``shape`` "stack" (method "stack")
    and "clone" (method "duplicate", ``width_noise``: ops.cloning's symmetry-breaking noise)
    reach the final size from a half-depth or half-width model instead (:data:`SHAPES`,
    :func:`reshaped_chain`). ``anneal``: after an exact growth Θ's factor moves to √n over
    ``anneal_steps``. The chain follows ``family``'s envelope and takes its LRs from that
    family's sweeps by ``lr_policy`` (:data:`LR_POLICIES`, :func:`stage_lrs`)."""

    arm: str
    family: str
    kind: str
    method: str
    anneal: bool = False
    lr_policy: str = "per-stage"
    label: str = ""
    shape: str = "size"
    width_noise: float = 0.0
    # old tokens after each growth (ops.growth.grow): frozen for N steps or "forever", noised
    freeze_old: int | str | None = None
    noise_old: float = 0.0


# One entry per arm that grows (issues 24, 25). A new field of Recipe needs a default that keeps
# the other arms unchanged. Every chain runs each stage at its own size's LR ("per-stage") unless
# it says otherwise.
HYPERCLONING_NOISE = 0.32  # the HyperCloning release's symmetry-breaking noise (SNR 10 dB)
RECIPES: dict[str, Recipe] = {r.arm: r for r in (
    Recipe("chain-paper", "tokenformer", "chain", "paper",
           label="paper: new keys zero, new values initialised, Θ's factor follows n"),
    Recipe("chain-paper-final-lr", "tokenformer", "chain", "paper", lr_policy="final-size",
           label="paper, the whole chain at its final size's LR (v2's LR policy)"),
    Recipe("chain-official-init", "tokenformer", "chain", "official-init",
           label="official-init: the released code's initialisation of new tokens, optimizer "
                 "carried"),
    Recipe("chain-official-released", "tokenformer", "chain", "official-released",
           label="official-released: official-init plus a fresh optimizer and a warmup restart "
                 "at each growth (the released run's restart, in this experiment's WSD family)"),
    Recipe("chain-exact", "tokenformer", "chain", "exact",
           label="exact: function-preserving, Θ's factor held"),
    Recipe("chain-exact-anneal", "tokenformer", "chain", "exact", anneal=True,
           label="exact, then Θ's factor annealed to √n"),
    Recipe("chain-stack", "tokenformer", "chain", "stack", shape="stack",
           label="G_stack: the final size at half depth, its blocks stacked (TokenFormer)"),
    Recipe("widen-zero", "transformer++", "widen", "zero",
           label="Transformer++ MLP widened, new units' outgoing weights zero"),
    Recipe("widen-net2net", "transformer++", "widen", "net2net",
           label="Transformer++ MLP widened by Net2Net (duplicated units, split weights)"),
    Recipe("widen-stack", "transformer++", "widen", "stack", shape="stack",
           label="G_stack: the final size at half depth, its blocks stacked (Transformer++)"),
    Recipe("widen-duplicate", "transformer++", "widen", "duplicate", shape="clone",
           width_noise=HYPERCLONING_NOISE,
           label="HyperCloning: the final size at half hidden size and heads, duplicated "
                 "(zero-sum noise 0.32)"),
    Recipe("chain-gelu", "tokenformer-gelu", "chain", "paper",
           label="plain-GELU control: zero new keys (exactly function-preserving for this Θ)"),
    # frozen vs trained old tokens (issue 24): not in a preset's arms until a question uses them
    Recipe("chain-exact-frozen", "tokenformer", "chain", "exact", freeze_old="forever",
           label="exact, old tokens frozen for ever (only the new tokens train)"),
    Recipe("chain-exact-noised", "tokenformer", "chain", "exact", noise_old=0.01,
           label="exact, old tokens noised at growth (std 1 % of each tensor's rms)"),
    Recipe("chain-paper-frozen", "tokenformer", "chain", "paper", freeze_old="forever",
           label="paper, old tokens frozen for ever (only the new tokens train)"),
)}


@dataclass(frozen=True)
class Question:
    """A pre-registered question: the difference ``a − b`` of validation loss, paired by seed,
    at ``budgets`` ("final": the largest budget every term was read at; "all": each budget every
    term was read at, one test each). A side is an arm name (``tokenformer-S2``, ``chain-paper``),
    ``envelope:<family>``, or two of those as ``"x - y"`` (a gap; then a − b is a difference of
    gaps). ``family`` is the multiplicity family Holm adjusts over. With ``margin`` the question
    asks for equivalence too: TOST at ±margin nats (``margin_why``: its justification)."""

    id: str
    text: str
    a: str
    b: str
    family: str
    budgets: str = "final"
    margin: float | None = None
    margin_why: str = ""

    def terms(self) -> list[str]:
        return [t.strip() for side in (self.a, self.b) for t in side.split(" - ")]


# The equivalence margin of every preset's questions, and why (issue 25: fixed before the run,
# justified from seed spread).
MARGIN = 0.02
MARGIN_WHY = (
    "0.02 nats: about the per-seed sd of paired differences at the two largest budgets of the v2 "
    "full run (0.002–0.026, median ≈ 0.016: chain − envelope 0.002–0.025, TokenFormer − "
    "Transformer++ at S2 0.017–0.026), so 5 seeds can show equivalence when the true gap is "
    "near 0; and ≈ 0.2 doublings of compute along that run's envelope (0.10 nats per doubling "
    "from 2e12 to 4e12 FLOPs), i.e. ±15 % compute: smaller gaps are not worth a claim at this "
    "scale.")


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


def _versus_envelope(qid: str, arm: str, family: str, family_name: str) -> Question:
    return Question(qid, f"Does {arm}, grown into the envelope's best size, end below, above or "
                         f"within ±{MARGIN:g} nats of the {family} envelope at its final budget?",
                    arm, f"envelope:{family}", family_name, margin=MARGIN, margin_why=MARGIN_WHY)


# The full preset's questions (issue 25): four families, Holm within each.
GROWTH_ARMS = ("chain-paper", "chain-official-init", "chain-official-released",
               "chain-exact-anneal", "chain-stack", "widen-zero", "widen-net2net", "widen-stack",
               "widen-duplicate")
GROWTH_QUESTIONS = tuple(
    _versus_envelope(f"G{i}", arm, RECIPES[arm].family, "growth")
    for i, arm in enumerate(GROWTH_ARMS, start=1))
LR_POLICY_QUESTIONS = (
    Question("L1", "Does training each stage at its own size's tuned LR (per-stage) end lower, "
                   "higher or within ±0.02 nats of the whole chain at its final size's LR, at "
                   "each budget the chain is read?",
             "chain-paper", "chain-paper-final-lr", "lr-policy", budgets="all", margin=MARGIN,
             margin_why=MARGIN_WHY),
)
ARCHITECTURE_QUESTIONS = (
    Question("A1", "Is TokenFormer's envelope below, above or within ±0.02 nats of "
                   "Transformer++'s at the largest budget?",
             "envelope:tokenformer", "envelope:transformer++", "architecture", margin=MARGIN,
             margin_why=MARGIN_WHY),
    Question("A2", "Is TokenFormer's envelope distinguishable from the plain-GELU control's "
                   "(every projection a GELU MLP) at the largest budget?",
             "envelope:tokenformer", "envelope:tokenformer-gelu", "architecture", margin=MARGIN,
             margin_why=MARGIN_WHY),
)
CONTROL_QUESTIONS = (
    _versus_envelope("C1", "chain-gelu", "tokenformer-gelu", "control"),
    Question("C2", "Is TokenFormer's growth gap (paper chain − its envelope) distinguishable "
                   "from the plain-GELU control's (zero-key chain − its envelope)? This "
                   "separates parameter tokens from wider MLP projections.",
             "chain-paper - envelope:tokenformer", "chain-gelu - envelope:tokenformer-gelu",
             "control", margin=MARGIN, margin_why=MARGIN_WHY),
)
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
        tokens_per_parameter=20.0, recipes=("chain-paper", "widen-zero", "chain-gelu"),
        questions=tuple(q for q in GROWTH_QUESTIONS + ARCHITECTURE_QUESTIONS
                        + CONTROL_QUESTIONS if q.id in ("G1", "G6", "A1", "A2", "C1", "C2")),
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


# --------------------------------------------------------------------------------- run specs
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
    recipe: str | None = None  # chains: growth recipe (or widening)
    schedule: str = SCHEDULE_FAMILY
    lr_policy: str = "final-size"  # chains: LR_POLICIES (a one-stage run has one LR anyway)

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
                "total_flops": self.total_flops()}


def decay_start(steps: int, preset: Preset) -> int:
    """Where the cooldown of a ``steps``-step WSD run starts (as ``train.lr_at`` computes it)."""
    decay = max(1, round(preset.decay_fraction * steps))
    return max(steps - decay, min(preset.warmup_steps, steps))


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


def restarts(run: Run) -> bool:
    """Whether the run's growths restart the optimizer and the warmup (official-released)."""
    recipe = RECIPES.get(run.recipe or "")
    return (recipe is not None and recipe.kind == "chain" and recipe.shape == "size"
            and resets_optimizer(recipe.method))


def run_lr(run: Run, lrs: tuple[float, ...], step: int, steps: int, preset: Preset) -> float:
    """The LR of optimizer step ``step`` of ``run`` whose cooldown branch ends at ``steps``: the
    WSD schedule (``training.schedule.lr_at``: warmup, stable, linear decay over the last
    ``decay_fraction`` of ``steps`` to ``min_lr_ratio`` × the peak) whose peak is piecewise the
    LR of the stage in force (``lrs``, :func:`stage_lrs`: it moves at once at a growth step),
    and, for a restarting recipe, a linear warmup again over ``warmup_steps`` after each
    growth. A stable segment passes its run's longest branch as ``steps``. A cooldown branch
    trains the size reached at its decay start to its end, past a later growth of the stable
    run: its peak is that size's."""
    decay_from = decay_start(steps, preset)
    i = stage_index(run.stages, step if step < decay_from else decay_from - 1)
    lr = lr_at(step, _wsd(steps, lrs[i], preset.min_lr_ratio, preset.warmup_steps,
                          preset.decay_fraction))
    if i > 0 and restarts(run):
        lr *= min(1.0, (step - run.stages[i].start + 1) / preset.warmup_steps)
    return lr


@functools.lru_cache(maxsize=64)
def _wsd(steps: int, peak: float, min_lr_ratio: float, warmup_steps: int,
         decay_fraction: float) -> TrainConfig:
    """The WSD schedule's config (built once per branch and peak: ``run_lr`` is called at every
    training step, and a TrainConfig validates itself on construction)."""
    return TrainConfig(steps=steps, lr=peak, min_lr=peak * min_lr_ratio, schedule="wsd",
                       warmup_steps=warmup_steps, decay_fraction=decay_fraction)


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


def family_sizes(preset: Preset, family: str) -> tuple[str, ...]:
    """The sizes ``family`` runs: every preset size for the TokenFormer families, from S1 on for
    the others (no matched Transformer++ or product-key FFN exists below S1; module docstring)."""
    if family in SMALL_SIZE_FAMILIES:
        return preset.sizes
    return tuple(s for s in preset.sizes if s != "S0")


def size_tokens(preset: Preset, size: str) -> tuple[int, int, int]:
    """(qkv, proj, ffn) tokens of ``size``: ``base_tokens`` × factor^(k−1) for Sk (S0: ÷ factor)."""
    k = int(size[1:])
    if k == 0:
        return tuple(n // preset.factor for n in preset.base_tokens)  # type: ignore[return-value]
    return tuple(n * preset.factor ** (k - 1) for n in preset.base_tokens)  # type: ignore


def model_configs(preset: Preset, family: str, vocab_size: int) -> dict[str, Any]:
    """Every size of ``family`` (:func:`family_sizes`), by name: TokenFormers with ``factor``×
    the tokens per size (``norm`` of :data:`THETA_FAMILIES` for those families), the
    Transformer++ matched to each in non-embedding parameters (MLP width), and the product-key
    TokenFormers matched to each in FLOPs per token (:func:`product_key_config`)."""

    out: dict[str, Any] = {}
    for name in family_sizes(preset, family):
        q, p, f = size_tokens(preset, name)
        tf = TokenFormerConfig(vocab_size=vocab_size, hidden_size=preset.hidden_size,
                               num_layers=preset.num_layers, num_heads=preset.num_heads,
                               qkv_tokens=q, proj_tokens=p, ffn_tokens=f,
                               max_seq_len=preset.seq_len, eos_token_id=None,
                               norm=THETA_FAMILIES.get(family, "l2_norm_gelu"),
                               name=f"{family}-{name}" if family in THETA_FAMILIES
                               else f"tokenformer-{name}")
        if family in PRODUCT_KEY_FAMILIES:
            out[name] = product_key_config(tf, PRODUCT_KEY_FAMILIES[family], f"{family}-{name}")
        elif family == "transformer++":
            out[name] = matched_config(tf, family, name=f"{family}-{name}")
        else:
            out[name] = tf
    return out


def _stage(preset: Preset, size: str, config: Any, start: int) -> Stage:
    per_token = flops_per_token(config, preset.seq_len, training=True)["total"]
    return Stage(size, config, start, per_token * preset.tokens_per_step)


def sweep_seeds(preset: Preset) -> list[int]:
    """The seeds every LR-sweep point runs (module docstring: never a final run's seed)."""
    return [SWEEP_SEED + i for i in range(preset.sweep_seeds)]


def sweep_run(preset: Preset, family: str, size: str, lr: float, vocab_size: int,
              seed: int = SWEEP_SEED) -> Run:
    """One LR sweep point: ``sweep_steps`` WSD steps at peak ``lr``, one seed, one branch."""
    config = model_configs(preset, family, vocab_size)[size]
    stage = _stage(preset, size, config, 0)
    n = preset.sweep_steps
    branch = Branch(0, n * stage.flops_per_step, n, decay_start(n, preset),
                    n * stage.flops_per_step)
    key = size_key(family, size)
    return Run(f"sweep/{key}/lr={lr:.6g}/seed{seed}", f"sweep-{key}", "sweep", family, seed,
               (stage,), (branch,), lr, key)


# ------------------------------------------------------------------ chains follow the envelope
Envelope = dict[int, str]  # budget index → the family's best from-scratch size there


def predicted_envelope(preset: Preset, family: str, vocab_size: int) -> Envelope:
    """The plan-time guess of ``family``'s envelope (before anything has run): at each budget,
    the size whose training tokens per non-embedding parameter are closest in log to
    ``tokens_per_parameter``, among the sizes that run that budget (>= min_steps)."""
    out: Envelope = {}
    configs = model_configs(preset, family, vocab_size)
    for j, budget in enumerate(preset.budgets):
        ratios = {}
        for size, config in configs.items():
            b = branch_for((_stage(preset, size, config, 0),), j, budget, preset)
            if b is not None:
                tokens = b.steps * preset.tokens_per_step
                ratios[size] = abs(math.log(tokens / config.num_parameters(non_embedding=True)
                                            / preset.tokens_per_parameter))
        if ratios:
            out[j] = min(ratios, key=lambda z: (ratios[z], z))
    return out


def chain_targets(best: Envelope, order: tuple[str, ...]) -> dict[int, str]:
    """Rule 1 of the module docstring: at budget j the smallest of the envelope's best sizes
    at budgets j, j+1, … (sizes compared by their place in ``order``)."""
    js = sorted(best)
    return {j: min((best[k] for k in js if k >= j), key=order.index) for j in js}


def follow_envelope(preset: Preset, configs: dict[str, Any], best: Envelope
                    ) -> tuple[Stage, ...]:
    """A chain's stages by the module docstring's rule: start at the first target size, grow
    into each later target right after the previous budget's branch point, earlier where the
    new size would otherwise have less than ``min_stage_share`` of the next budget's steps."""
    order = tuple(configs)
    targets = chain_targets(best, order)
    js = sorted(targets)
    budgets = preset.budgets
    stages = [_stage(preset, targets[js[0]], configs[targets[js[0]]], 0)]
    for prev, j in itertools.pairwise(js):
        size = targets[j]
        if size == stages[-1].size:
            continue

        def with_growth(step: int, size: str = size) -> tuple[Stage, ...]:
            return (*stages, _stage(preset, size, configs[size], step))

        def has_share(step: int, j: int = j) -> bool:
            b = branch_for(with_growth(step), j, budgets[j], preset)
            return b is not None and b.steps - step >= preset.min_stage_share * b.steps

        before = branch_for(tuple(stages), prev, budgets[prev], preset)
        step = before.decay_start if before is not None else stages[-1].start + 1
        if not has_share(step):  # the latest earlier step that gives the share (monotone)
            lo, hi = stages[-1].start + 1, step - 1
            if lo > hi or not has_share(lo):
                raise ConfigError(f"frontier: {size} cannot get {preset.min_stage_share:.0%} "
                                  f"of budget {budgets[j]:.3g}'s steps in a chain; lower "
                                  f"min_stage_share or space the budgets wider")
            while lo < hi:  # the largest step in [lo, hi] with the share
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if has_share(mid) else (lo, mid - 1)
            step = lo
        stages.append(_stage(preset, size, configs[size], step))
    return tuple(stages)


def reshaped_chain(preset: Preset, recipe: Recipe, configs: dict[str, Any], best: Envelope,
                   sized: tuple[Stage, ...]) -> tuple[Stage, ...]:
    """A stack or clone chain (``recipe.shape``): it ends where the size-walking chain ``sized``
    of the same envelope ends (the envelope's best size at the final budget), from that size at
    half depth (blocks stacked, G_stack) or at half hidden size and heads (duplicated,
    HyperCloning), and grows once, by :func:`follow_envelope`'s rule on the two-size envelope
    "the half copy until the budget where the chain's target becomes the final size" (so the
    growth sits at a branch point of its own stages, as for every chain). Its first stage
    takes, under the per-stage policy, the LR of the family's swept size nearest in
    non-embedding parameters (log). One stage when ``sized`` never grows (not run)."""
    if len(sized) < 2:
        return sized[:1]
    final = sized[-1]
    c = final.config
    if recipe.shape == "stack":
        if c.num_layers % 2:
            raise ConfigError(f"frontier: {recipe.arm} stacks half the blocks: num_layers "
                              f"must be even")
        small, name = dataclasses.replace(c, num_layers=c.num_layers // 2), "half-depth"
    else:
        if c.hidden_size % 2 or c.num_heads % 2:
            raise ConfigError(f"frontier: {recipe.arm} duplicates half the width: hidden size "
                              f"and heads must be even")
        small = dataclasses.replace(c, hidden_size=c.hidden_size // 2, num_heads=c.num_heads // 2)
        name = "half-width"
    params = small.num_parameters(non_embedding=True)
    nearest = min(configs, key=lambda z: (abs(math.log(
        configs[z].num_parameters(non_embedding=True) / params)), z))
    half = f"{final.size}/{name}"
    targets = chain_targets(best, tuple(configs))
    two = follow_envelope(preset, {half: small, final.size: c},
                          {j: final.size if z == final.size else half
                           for j, z in targets.items()})
    return (dataclasses.replace(two[0], lr_size=nearest), *two[1:])


def reads_budget(stages: tuple[Stage, ...], branch: Branch, preset: Preset) -> bool:
    """Rule 3: the size cooled down at ``branch`` has trained >= min_stage_share of its steps."""
    stage = size_at(stages, max(branch.decay_start - 1, 0))
    return branch.steps - stage.start >= preset.min_stage_share * branch.steps


def plan(preset: Preset, vocab_size: int, train_tokens: int | None = None,
         envelopes: dict[str, Envelope] | None = None, kinds: tuple[str, ...] | None = None
         ) -> list[Run]:
    """Every final run (from-scratch sizes, then the chains) for every seed, seed-major within
    each. Chains follow ``envelopes[family]`` (the measured envelope; the runner passes it once
    the from-scratch runs are done) or, without it, :func:`predicted_envelope`; a chain whose
    target never changes is left out. ``kinds`` keeps only runs of those kinds. Sweep runs are
    :func:`sweep_plan`'s. ``train_tokens`` checks that no run repeats the corpus more than
    ``MAX_EPOCHS`` times."""
    preset.validate()
    budgets = preset.budgets
    runs: list[Run] = []
    configs = {f: model_configs(preset, f, vocab_size) for f in preset.families}
    for seed in range(preset.seeds):
        for family in preset.families:
            for size, config in configs[family].items():
                stages = (_stage(preset, size, config, 0),)
                key = size_key(family, size)
                runs.append(_with_branches(preset, key, "scratch", family, seed, stages,
                                           budgets, key))
    chains = {}
    for arm in preset.recipes:
        recipe = RECIPES[arm]
        best = (envelopes or {}).get(recipe.family) or predicted_envelope(
            preset, recipe.family, vocab_size)
        stages = follow_envelope(preset, configs[recipe.family], best)
        if recipe.shape != "size":
            stages = reshaped_chain(preset, recipe, configs[recipe.family], best, stages)
        if len(stages) > 1:
            chains[arm] = stages
    for seed in range(preset.seeds):
        for arm, stages in chains.items():
            recipe = RECIPES[arm]
            runs.append(dataclasses.replace(
                _with_branches(preset, arm, recipe.kind, recipe.family, seed, stages, budgets,
                               size_key(recipe.family, stages[-1].size), arm),
                lr_policy=recipe.lr_policy))
    if kinds is not None:
        runs = [r for r in runs if r.kind in kinds]
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
                     if (b := branch_for(stages, i, budget, preset)) is not None
                     and reads_budget(stages, b, preset))
    if not branches:
        raise ConfigError(f"frontier: {arm} has no budget of >= {preset.min_steps} steps")
    if len(stages) > 1 and recipe is not None and RECIPES[recipe].anneal:
        gaps = [b.start - a.start for a, b in itertools.pairwise(stages)]
        if min(gaps) <= preset.anneal_steps:
            raise ConfigError("frontier: anneal_steps must be shorter than every chain stage")
    return Run(f"{arm}/seed{seed}", arm, kind, family, seed, stages, branches, None, lr_from,
               recipe)


def sweep_plan(preset: Preset, vocab_size: int) -> list[Run]:
    """The initial LR grid of every (family, size) the final runs use, for every sweep seed."""
    return [sweep_run(preset, family, size, lr, vocab_size, seed)
            for family in preset.families for size in family_sizes(preset, family)
            for lr in preset.lr_grid for seed in sweep_seeds(preset)]


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
        final = run.stages[-1]
        for size, steps in steps_by_size(run).items():
            # a half-depth/half-width stage is no swept size: the final size's, scaled by FLOPs
            stage = next(s for s in run.stages if s.size == size)
            total += steps * seconds_per_step.get(
                size_key(run.family, size), seconds_per_step[size_key(run.family, final.size)]
                * stage.flops_per_step / final.flops_per_step)
        last = final.size
        total += len(run.branches) * preset.eval_batches / 3 * seconds_per_step[
            size_key(run.family, last)]
    return total


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


CHAIN_RULE = (
    "Chains follow the envelope: at budget j a chain should be at the smallest of the envelope's "
    "best sizes at budgets j, j+1, …; it starts there (at or below the smallest budget's best "
    "size), grows into each next target right after the previous budget's branch point, earlier "
    "where the new size would get less than {share:.0%} of the next budget's steps, and a budget "
    "is read only when the size cooled down there has trained {share:.0%} of that budget's "
    "steps. It ends at the envelope's best size at its final budget. A stack or clone chain "
    "grows once, at the same step, into the same final size from its half-depth or half-width "
    "copy. Each stage trains at its own size's tuned LR (per-stage), unless the arm is "
    "final-size (the whole chain at its final size's LR).")
LR_RULE = (
    "LR: per family and size, the argmin of the mean final validation loss over {seeds} sweep "
    "seed(s) of {steps}-step WSD runs on a factor-2 grid, picked inside the grid (extended "
    "beyond an edge argmin); non-monotone sweeps and seeds that disagree are flagged.")


def question_lines(questions: tuple[Question, ...] | list[Any]) -> list[str]:
    """The pre-registered questions as markdown (``--plan`` and the report print the same
    lines, from a preset's :class:`Question` objects or their dicts in ``results.json``)."""
    qs = [q if isinstance(q, dict) else dataclasses.asdict(q) for q in questions]
    if not qs:
        return ["No pre-registered questions: this preset reports descriptively only."]
    rows = [[q["id"], q["family"], q["text"], f"({q['a']}) − ({q['b']})", q["budgets"],
             f"difference and TOST ±{q['margin']:g}" if q["margin"] is not None
             else "difference"] for q in qs]
    why = list(dict.fromkeys(q["margin_why"] for q in qs if q["margin"] is not None))
    families = list(dict.fromkeys(q["family"] for q in qs))
    return [markdown_table(["id", "family", "question", "Δ validation loss (paired by seed)",
                            "budgets", "test"], rows, "llllll"), "",
            f"Holm–Bonferroni within each family ({', '.join(families)}); a question is "
            f"*resolved* only when its Holm-adjusted p < 0.05, *equivalent within ±m* only when "
            f"its Holm-adjusted TOST p < 0.05, otherwise *not resolved*.",
            *(f"Margin: {w}" for w in why)]


def describe(preset: Preset, vocab_size: int) -> str:
    """The plan as text (``tokenformer scale --plan``): the pre-registered questions, the chain
    and LR rules, every arm's sizes, growth steps, budgets run and FLOPs (chains on the
    predicted envelope); sweeps; nothing is trained."""

    runs = plan(preset, vocab_size)
    sweeps = sweep_plan(preset, vocab_size)
    rows = []
    for run in runs:
        if run.seed:
            continue
        seeds = sum(r.arm == run.arm for r in runs)
        rows.append([run.arm, str(seeds), " → ".join(f"{s.size}@{s.start}" for s in run.stages),
                     ", ".join(f"{b.budget:.2g}:{b.steps}" for b in run.branches),
                     f"{run.total_steps:,}", f"{run.total_flops():.3g}",
                     " → ".join(dict.fromkeys(stage_lr_key(run, s) for s in run.stages))])
    total = sum(r.total_flops() for r in runs)
    sweep_flops = sum(r.total_flops() for r in sweeps)
    families = sorted({RECIPES[a].family for a in preset.recipes})
    predicted = [f"- {f}: " + ", ".join(f"{preset.budgets[j]:.2g} {z}" for j, z in
                                        predicted_envelope(preset, f, vocab_size).items())
                 for f in families]
    return "\n".join([
        f"preset {preset.name}: {len(sweeps)} LR-sweep runs ({sweep_flops:.3g} FLOPs), "
        f"{len(runs)} final runs ({total:.3g} FLOPs), schedule {SCHEDULE_FAMILY} for all", "",
        "Pre-registered questions (fixed before anything runs):", "",
        *question_lines(preset.questions), "",
        CHAIN_RULE.format(share=preset.min_stage_share),
        LR_RULE.format(seeds=preset.sweep_seeds, steps=preset.sweep_steps), "",
        *([f"Chains below follow the envelope PREDICTED from {preset.tokens_per_parameter:g} "
           f"tokens per non-embedding parameter (budget: best size)"
           + ("; the run replaces it by the measured envelope before any chain trains:"
              if preset.follow == "measured" else " (this preset keeps it):"), *predicted, ""]
          if families else []),
        markdown_table(["arm", "seeds", "sizes@start step", "budget:steps", "steps/seed",
                        "FLOPs/seed", "LR from (per stage)"], rows, "lrllrrl"),
        "time: python benchmarks/frontier_steps.py --preset NAME --cpu-time (measures the step "
        "times here and estimates the whole preset)"])
