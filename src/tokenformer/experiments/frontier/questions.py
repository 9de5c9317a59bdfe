"""The frontier's pre-registered questions and their equivalence margin.

**Pre-registered questions** (:class:`Question`): each preset carries the questions its verdict
answers, with their endpoints, multiplicity families and equivalence margins, fixed here before
anything runs; ``--plan`` prints them and the report states them before any result
(``report.answers``: raw p, Holm-adjusted p within the family, TOST where equivalence is asked,
and the decision word of :mod:`..common.stats`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..common.report import markdown_table
from .arms import GROWING_ARMS

# how a question reads the budgets: "final", "all", "trend", "trend-grown" (Question's docstring)
BUDGET_READINGS = ("final", "all", "trend", "trend-grown")
TREND_READINGS = ("trend", "trend-grown")


@dataclass(frozen=True)
class Question:
    """A pre-registered question: the difference ``a − b`` of validation loss, paired by seed,
    at ``budgets`` ("final": the largest budget every term was read at; "all": each budget every
    term was read at, one test each; "trend": per seed, the least-squares slope of a − b
    against log2(budget) over every budget all terms were read at (``scipy.stats.linregress``),
    then one t-test of those slopes against 0 across seeds: nats per doubling of compute;
    "trend-grown" (v5): the same over the budgets where every chain the question names has
    grown past its first size, so that a gap before the growth does not make the slope). A
    side is an arm name (``tokenformer-S2``, ``chain-paper``),
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



def versus_envelope(qid: str, arm: str, family: str, family_name: str) -> Question:
    return Question(qid, f"Does {arm}, grown into the envelope's best size, end below, above or "
                         f"within ±{MARGIN:g} nats of the {family} envelope at its final budget?",
                    arm, f"envelope:{family}", family_name, margin=MARGIN, margin_why=MARGIN_WHY)


# The full preset's questions (issue 25): four families, Holm within each.
G_QUESTION_ARMS = ("chain-paper", "chain-official-init", "chain-official-released",
               "chain-exact-anneal", "chain-stack", "widen-zero", "widen-net2net", "widen-stack",
               "widen-duplicate")
GROWTH_QUESTIONS = tuple(
    versus_envelope(f"G{i}", arm, GROWING_ARMS[arm].family, "growth")
    for i, arm in enumerate(G_QUESTION_ARMS, start=1))
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
    versus_envelope("C1", "chain-gelu", "tokenformer-gelu", "control"),
    Question("C2", "Is TokenFormer's growth gap (paper chain − its envelope) distinguishable "
                   "from the plain-GELU control's (zero-key chain − its envelope)? This "
                   "separates parameter tokens from wider MLP projections.",
             "chain-paper - envelope:tokenformer", "chain-gelu - envelope:tokenformer-gelu",
             "control", margin=MARGIN, margin_why=MARGIN_WHY),
)


# ---------------------------------------------------------------- v4 (issue 35)
# The chain's LR policy is a pre-registered factor: the final size's LR is the primary arm
# (chain-paper-final-lr), per-stage the secondary (chain-paper). The token recipes that v3
# showed equal to paper (official-init, official-released, exact-anneal: gaps 0.036–0.042),
# G_stack (a 2-block CPU model stacks from 1 block) and MLP widening (its shapes are not on a
# width-scaled Transformer++ grid) answer nothing new at this scale: docs/frontier-v4.md.
V4_GROWTH_QUESTIONS = (
    versus_envelope("G1", "chain-paper-final-lr", "tokenformer", "growth"),
    versus_envelope("G2", "chain-paper", "tokenformer", "growth"),
)
V4_CONTROL_QUESTIONS = (
    versus_envelope("C1", "chain-gelu-final-lr", "tokenformer-gelu", "control"),
    Question("C2", "Is TokenFormer's growth gap (the primary chain − its envelope) "
                   "distinguishable from the plain-GELU control's (zero-key chain − its "
                   "envelope)? This separates parameter tokens from wider MLP projections.",
             "chain-paper-final-lr - envelope:tokenformer",
             "chain-gelu-final-lr - envelope:tokenformer-gelu", "control", margin=MARGIN,
             margin_why=MARGIN_WHY),
)
TREND_QUESTIONS = (
    Question("T1", "Does TokenFormer's growth gap (the primary chain − its envelope) shrink or "
                   "grow with compute (slope per doubling, over the budgets the chain is read)?",
             "chain-paper-final-lr", "envelope:tokenformer", "trend", budgets="trend"),
    Question("T2", "Does TokenFormer − Transformer++ (envelopes) change with compute (slope "
                   "per doubling)?",
             "envelope:tokenformer", "envelope:transformer++", "trend", budgets="trend"),
    Question("T3", "Does TokenFormer − the plain-GELU control (envelopes) change with compute "
                   "(slope per doubling)?",
             "envelope:tokenformer", "envelope:tokenformer-gelu", "trend", budgets="trend"),
)
V4_QUESTIONS = (V4_GROWTH_QUESTIONS + LR_POLICY_QUESTIONS + ARCHITECTURE_QUESTIONS
                + V4_CONTROL_QUESTIONS + TREND_QUESTIONS)


def question_lines(questions: tuple[Question, ...] | list[Any]) -> list[str]:
    """The pre-registered questions as markdown (``--plan`` and the report print the same
    lines, from a preset's :class:`Question` objects or their dicts in ``results.json``)."""
    qs = [q if isinstance(q, dict) else dataclasses.asdict(q) for q in questions]
    if not qs:
        return ["No pre-registered questions: this preset reports descriptively only."]
    rows = [[q["id"], q["family"], q["text"], f"({q['a']}) − ({q['b']})", q["budgets"],
             f"difference and TOST ±{q['margin']:g}" if q["margin"] is not None
             else "slope per doubling vs 0" if q["budgets"] in TREND_READINGS else "difference"]
            for q in qs]
    why = list(dict.fromkeys(q["margin_why"] for q in qs if q["margin"] is not None))
    families = list(dict.fromkeys(q["family"] for q in qs))
    return [markdown_table(["id", "family", "question", "Δ validation loss (paired by seed)",
                            "budgets", "test"], rows, "llllll"), "",
            f"Holm–Bonferroni within each family ({', '.join(families)}); a question is "
            f"*resolved* only when its Holm-adjusted p < 0.05, *equivalent within ±m* only when "
            f"its Holm-adjusted TOST p < 0.05, otherwise *not resolved*.",
            *(f"Margin: {w}" for w in why)]


# ---------------------------------------------------------------- v5 (issue 46)
# The reuse family (docs/frontier-v5.md): per k, the grown base against each rival at every X
# cell of that k; one multiplicity family per rival. The margin: v4's G1 paired sd.
V5_MARGIN_WHY = (
    "0.02 nats: 1.35 × the paired sd of v4's G1 over its 8 held-out seeds (0.0148), and ≈ 0.13 "
    "doublings of compute along v4's TokenFormer envelope (0.151 nats per doubling between its "
    "last two budgets), i.e. ±10 % of compute: smaller gaps are not worth a claim at this scale.")
# rival → (its term, given the final size's from-scratch arm and k's arm suffix; what it is)
REUSE_RIVALS = {
    "R1": (lambda final, at: final, "the grown size trained from scratch (the paper's Fig. 3, "
                                    "right)"),
    "R2": (lambda final, at: "envelope:tokenformer", "the best from-scratch size (the "
                                                     "compute-optimal frontier)"),
    "R3": (lambda final, at: f"continued{at}", "the base trained on at its own size"),
    "R4": (lambda final, at: f"tpp-grown{at}", "Transformer++'s base of the same k grown by "
                                               "HyperCloning"),
}


def k_label(k: float) -> str:
    """The name of a reuse level: ``"k400"``, ``"k126.5"``."""
    return f"k{k:g}"


def continuing_arm(arm: str, k: float) -> str:
    """The arm name of a continuing arm at level k: ``"grown@k400"``."""
    return f"{arm}@{k_label(k)}"


def reuse_questions(ks: tuple[float, ...], final_arm: str,
                    rivals: tuple[str, ...] = tuple(REUSE_RIVALS)) -> tuple[Question, ...]:
    """Per rival and k: grown@k − the rival at every X cell of k (budgets "all"), the rival's
    own multiplicity family, TOST at ±0.02 (``final_arm``: the final size's from-scratch arm,
    R1's term)."""
    out = []
    for rival in rivals:
        term, what = REUSE_RIVALS[rival]
        for k in ks:
            at = f"@{k_label(k)}"
            out.append(Question(
                f"{rival}-{k_label(k)}",
                f"Given X times its compute more, does the base finished at k = {k:g} tokens "
                f"per parameter and grown end below, above or within ±{MARGIN:g} nats of "
                f"{what}, at each X?",
                continuing_arm("grown", k), term(final_arm, at), f"reuse-{rival}",
                budgets="all", margin=MARGIN, margin_why=V5_MARGIN_WHY))
    return tuple(out)


# G1 kept as the replication of v4's cumulative question, its margin justified from v4's spread
V5_G1 = dataclasses.replace(V4_GROWTH_QUESTIONS[0], margin_why=V5_MARGIN_WHY)
V5_TREND = Question(
    "T1", "Does TokenFormer's growth gap (the G1 chain − its envelope) shrink or grow with "
          "compute once the chain has grown (slope per doubling, over the budgets after its "
          "first growth)?", "chain-paper-final-lr", "envelope:tokenformer", "trend",
    budgets="trend-grown")
