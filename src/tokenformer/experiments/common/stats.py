"""Statistics of seed-paired comparisons: the one decision rule every experiment reports with.

The one decision rule: two arms are compared on the seeds both ran (same data order, so the
per-seed differences are paired); the mean difference gets a two-sided t-based 95 % confidence
interval (Student's t with n − 1 degrees of freedom, :func:`scipy.stats.t`) and the p-value of the
paired t-test against 0. A comparison is **resolved** only when that interval excludes 0 (the same
as p < 0.05); with one seed nothing is resolved. Reports use exactly these words.

Pre-registered questions (:func:`answer_family`) add the two corrections a verdict needs once
there is more than one question: the p-values of one stated *family* of questions are adjusted by
Holm–Bonferroni (:func:`holm`, ``statsmodels.stats.multitest.multipletests(method="holm")``), and a
claim of "no difference" needs a paired equivalence test with a margin fixed before the run
(:func:`tost_paired`, two one-sided t-tests, ``statsmodels.stats.weightstats.ttost_paired``). The
decision words (:func:`decision`): **resolved** only when the Holm-adjusted p is below
``ALPHA`` (the interval of the step-down excludes 0); **equivalent within ±m** only when the
Holm-adjusted TOST p is below ``ALPHA`` at the question's margin m; otherwise **not resolved**.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE  # the level of every test a decision word rests on


@dataclass
class Spread:
    """Mean and spread of one quantity over seeds (``std`` is the sample std; 0 for one seed)."""

    mean: float
    std: float
    min: float
    max: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.4f}" if self.n == 1 else f"{self.mean:.4f} ± {self.std:.4f}"


def spread(values: Iterable[float]) -> Spread:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread of no values")
    std = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return Spread(statistics.fmean(vals), std, min(vals), max(vals), len(vals))


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with its t-based confidence interval and the two-sided p-value of
    "the true mean is 0" (NaN bounds and p for fewer than two values)."""

    mean: float
    low: float
    high: float
    p_value: float
    n: int

    @property
    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Student-t interval of the mean: mean ± t_{(1+c)/2, n−1} · s / √n, and the p-value of the
    one-sample t-test against 0. Zero spread with a non-zero mean is an exact result: the
    interval is the point and p = 0."""
    from scipy import stats  # lazy: only experiments need scipy

    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(vals)
    if n == 1:
        return Interval(mean, math.nan, math.nan, math.nan, 1)
    se = statistics.stdev(vals) / math.sqrt(n)
    if se == 0:
        return Interval(mean, mean, mean, 1.0 if mean == 0 else 0.0, n)
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * se
    p = float(2 * stats.t.sf(abs(mean) / se, n - 1))
    return Interval(mean, mean - half, mean + half, p, n)


@dataclass
class Paired:
    """Seed-by-seed comparison of arms ``a`` and ``b`` on one metric (``diffs`` = a − b).

    ``winner`` is ``a`` or ``b`` only when the 95 % t interval of the mean difference excludes 0
    (see the module docstring); otherwise ``None``: the comparison is not resolved.
    """

    a: str
    b: str
    metric: str
    diffs: list[float]
    mean: float
    spread: float  # sample std of the differences (inf for one seed)
    n: int
    winner: str | None
    ci_low: float = math.nan
    ci_high: float = math.nan
    p_value: float = math.nan

    @property
    def verdict(self) -> str:
        if self.winner is not None:
            return f"{self.winner} better"
        if self.n == 0:
            return "no common seeds"
        return "not resolved (one seed)" if self.n == 1 else "not resolved"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


def paired(a: str, b: str, a_values: dict[int, float], b_values: dict[int, float],
           metric: str = "loss", lower_is_better: bool = True) -> Paired:
    """Compare two arms on the seeds both ran; see :class:`Paired` for the decision rule.

    A value may be ``inf`` (e.g. a diverged run, or the compute of an arm that never reaches a
    target): then no interval exists; the mean is ±inf when every seed agrees on the sign (NaN
    otherwise) and the comparison is not resolved: a t-test cannot rank infinities.
    """
    seeds = sorted(set(a_values) & set(b_values))
    diffs = [_diff(float(a_values[s]), float(b_values[s])) for s in seeds]
    n = len(diffs)
    if not diffs:
        return Paired(a, b, metric, [], math.nan, math.nan, 0, None)
    if not all(math.isfinite(d) for d in diffs):
        mean = math.inf if all(d > 0 for d in diffs) else (
            -math.inf if all(d < 0 for d in diffs) else math.nan)
        return Paired(a, b, metric, diffs, mean, math.nan, n, None)
    ci = t_interval(diffs)
    sd = statistics.stdev(diffs) if n > 1 else math.inf
    winner = None
    if ci.excludes_zero:
        winner = a if (ci.mean < 0) == lower_is_better else b
    return Paired(a, b, metric, diffs, ci.mean, sd, n, winner, ci.low, ci.high, ci.p_value)


def _diff(x: float, y: float) -> float:
    """x − y, except 0 for two equal infinities (both runs failed alike); a NaN on either side
    stays NaN (no interval: not a tie)."""
    return 0.0 if math.isinf(x) and x == y else x - y


def describe(c: dict[str, Any], digits: int = 4, scale: float = 1.0, unit: str = "") -> str:
    """``+0.0123 [−0.0040, +0.0286], p = 0.12`` (one seed: the difference alone)."""
    if c["n"] == 0:
        return "no common seeds"
    mean = c["mean"]
    if mean is None or not math.isfinite(mean):
        return "not finite in some seed (no interval)"
    text = f"{scale * mean:+.{digits}f}{unit}"
    if c["n"] < 2 or c.get("ci_low") is None or math.isnan(c["ci_low"]):
        return text
    return (f"{text} [{scale * c['ci_low']:+.{digits}f}, {scale * c['ci_high']:+.{digits}f}], "
            f"{format_p(c['p_value'])}")


def format_p(p: float | None) -> str:
    """``p = 0.123``, ``p < 0.001``, or ``p —`` when there is none."""
    if p is None or math.isnan(p):
        return "p —"
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


# ------------------------------------------------------------ multiplicity and equivalence
def holm(p_values: Sequence[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values of one family, in the input order (statsmodels'
    ``multipletests(method="holm")``: with p₍₁₎ ≤ … ≤ p₍ₘ₎, p̃₍ᵢ₎ = min(1, max_{k≤i} (m−k+1)·p₍ₖ₎)).

    The family's size m is the number of tests the questions fixed, not how many could be
    computed: a test without a p-value (one seed, a non-finite difference) counts as p = 1 and
    its adjusted value stays NaN."""
    from statsmodels.stats.multitest import multipletests  # lazy: only reports need it

    ps = [float(p) for p in p_values]
    if not ps:
        return []
    filled = [1.0 if math.isnan(p) else p for p in ps]
    adjusted = multipletests(filled, alpha=ALPHA, method="holm")[1]
    return [math.nan if math.isnan(p) else float(a) for p, a in zip(ps, adjusted, strict=True)]


@dataclass(frozen=True)
class Tost:
    """Paired two one-sided t-tests of "|mean difference| < margin" (``p_value`` = the larger of
    the two one-sided p-values; small means equivalent within ±margin)."""

    margin: float
    p_value: float
    t_lower: float  # (mean + margin) / se: tests H0 mean <= -margin
    p_lower: float
    t_upper: float  # (mean - margin) / se: tests H0 mean >= +margin
    p_upper: float
    df: int


def tost_paired(diffs: Sequence[float], margin: float) -> Tost:
    """TOST on paired differences (a − b per seed) with the equivalence interval (−margin,
    +margin), by ``statsmodels.stats.weightstats.ttost_paired``. Fewer than two finite
    differences: NaN (no test). Zero spread: exact (p 0 inside the margin, 1 outside)."""
    from statsmodels.stats.weightstats import ttost_paired  # lazy: only reports need it

    if margin <= 0:
        raise ValueError("an equivalence margin must be positive")
    vals = [float(d) for d in diffs]
    n = len(vals)
    nan = Tost(margin, math.nan, math.nan, math.nan, math.nan, math.nan, max(n - 1, 0))
    if n < 2 or not all(math.isfinite(d) for d in vals):
        return nan
    if statistics.stdev(vals) == 0:
        inside = abs(vals[0]) < margin
        p = 0.0 if inside else 1.0
        return Tost(margin, p, math.inf if inside else -math.inf, p,
                    -math.inf if inside else math.inf, p, n - 1)
    # ttost_paired(x1, x0, low, upp) tests x1 − x0 in (low, upp): x0 = 0 gives the differences
    p, (t1, p1, _), (t2, p2, _) = ttost_paired(np.array(vals), np.zeros(n), -margin, margin)
    return Tost(margin, float(p), float(t1), float(p1), float(t2), float(p2), n - 1)


RESOLVED = "resolved"
NOT_RESOLVED = "not resolved"


def equivalent_word(margin: float) -> str:
    return f"equivalent within ±{margin:g}"


def decision(p_adjusted: float, tost_adjusted: float | None = None,
             margin: float | None = None) -> str:
    """The decision word of one pre-registered test (module docstring): ``resolved`` when the
    Holm-adjusted p of the difference is below ALPHA, ``equivalent within ±m`` when the
    Holm-adjusted TOST p at margin m is (both can hold: a small but certain difference inside
    the margin), else ``not resolved``."""
    different = not math.isnan(p_adjusted) and p_adjusted < ALPHA
    same = (margin is not None and tost_adjusted is not None and not math.isnan(tost_adjusted)
            and tost_adjusted < ALPHA)
    if different and same:
        return f"{RESOLVED} ({equivalent_word(margin)})"
    if different:
        return RESOLVED
    return equivalent_word(margin) if same else NOT_RESOLVED


def answer_family(tests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Answer every test of one multiplicity family. Each test is a dict with ``diffs`` (paired
    differences a − b per seed) and ``margin`` (None: a difference question; a number: the
    question asks for equivalence too). Adds ``n``, ``mean``, ``ci_low``/``ci_high`` (the 95 %
    t interval, unadjusted), ``p_value`` and ``p_holm``; for equivalence questions ``tost``
    (:class:`Tost` as a dict) and ``tost_holm``; and ``decision``. Holm runs over all tests of
    the family for the difference p-values, and over the equivalence tests for the TOST ones."""
    out = []
    for test in tests:
        diffs = [float(d) for d in test["diffs"]]
        finite = bool(diffs) and all(math.isfinite(d) for d in diffs)
        ci = t_interval(diffs) if finite else Interval(
            statistics.fmean(diffs) if diffs else math.nan, math.nan, math.nan, math.nan,
            len(diffs))
        row = {**test, "n": len(diffs), "mean": ci.mean, "ci_low": ci.low, "ci_high": ci.high,
               "p_value": ci.p_value}
        if test.get("margin") is not None:
            row["tost"] = asdict(tost_paired(diffs, test["margin"]))
        out.append(row)
    for row, adjusted in zip(out, holm([r["p_value"] for r in out]), strict=True):
        row["p_holm"] = adjusted
    equivalence = [r for r in out if "tost" in r]
    for row, adjusted in zip(equivalence, holm([r["tost"]["p_value"] for r in equivalence]),
                             strict=True):
        row["tost_holm"] = adjusted
    for row in out:
        row["decision"] = decision(row["p_holm"], row.get("tost_holm"), row.get("margin"))
    return out


RULE_INTERVAL = ("Differences are paired by seed (same batches); the interval is the two-sided "
                 "95 % Student-t confidence interval of the mean difference (scipy.stats.t, "
                 "n − 1 degrees of freedom) and p the paired t-test's p-value.")
RULE = (RULE_INTERVAL + " A difference is *resolved* only when its interval excludes 0; with one "
        "seed nothing is resolved.")


# ------------------------------------------------------------------ power before a run
def paired_power(delta: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t-test at level ``alpha`` to resolve a true mean difference
    ``delta`` from ``n`` seeds whose differences have standard deviation ``sd`` (Student's
    noncentral t, :func:`scipy.stats.nct`, n − 1 degrees of freedom). A family of m questions
    under Holm: ``alpha`` / m is Holm's first (Bonferroni) step, so the power is a lower bound."""
    from scipy import stats  # lazy: only experiments need scipy

    if n < 2:
        raise ValueError(f"power needs >= 2 seeds (a t-test has n − 1 degrees of freedom), "
                         f"got {n}")
    df, ncp = n - 1, delta / (sd / math.sqrt(n))
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    return float(1 - stats.nct.cdf(crit, df, ncp) + stats.nct.cdf(-crit, df, ncp))


def tost_power(margin: float, sd: float, n: int, delta: float = 0.0,
               alpha: float = ALPHA) -> float:
    """Power of the paired TOST at level ``alpha`` to show equivalence within ±``margin`` when
    the true mean difference is ``delta``: the probability that the (1 − 2α) interval
    x̄ ± t·s/√n lies inside ±margin, integrated over the sample sd s (s² ~ sd² χ²(n−1)/(n−1),
    independent of x̄ ~ N(delta, sd²/n))."""
    from scipy import integrate, stats  # lazy: only experiments need scipy

    if n < 2:
        raise ValueError(f"power needs >= 2 seeds (a t-test has n − 1 degrees of freedom), "
                         f"got {n}")
    df, se = n - 1, sd / math.sqrt(n)
    crit = float(stats.t.ppf(1 - alpha, df))

    def inside(chi2: float) -> float:
        half = margin - crit * sd * math.sqrt(chi2 / df) / math.sqrt(n)
        if half <= 0:
            return 0.0
        p = stats.norm.cdf((half - delta) / se) - stats.norm.cdf((-half - delta) / se)
        return float(p * stats.chi2.pdf(chi2, df))

    top = df * (margin * math.sqrt(n) / (crit * sd)) ** 2  # beyond it the interval is too wide
    return float(integrate.quad(inside, 0.0, top, limit=200)[0])
