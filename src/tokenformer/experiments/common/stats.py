"""Statistics of seed-paired comparisons: the one decision rule every experiment reports with.

The one decision rule: two arms are compared on the seeds both ran (same data order, so the
per-seed differences are paired); the mean difference gets a two-sided t-based 95 % confidence
interval (Student's t with n − 1 degrees of freedom, :func:`scipy.stats.t`) and the p-value of the
paired t-test against 0. A comparison is **resolved** only when that interval excludes 0 (the same
as p < 0.05); with one seed nothing is resolved. Reports use exactly these words.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

CONFIDENCE = 0.95


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


RULE = ("Differences are paired by seed (same batches); the interval is the two-sided 95 % "
        "Student-t confidence interval of the mean difference (scipy.stats.t, n − 1 degrees of "
        "freedom) and p the paired t-test's p-value. A difference is *resolved* only when its "
        "interval excludes 0; with one seed nothing is resolved.")
