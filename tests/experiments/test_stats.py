"""The statistics every pre-registered question is answered with: Holm–Bonferroni within a family
and the paired equivalence test (TOST), each against statsmodels AND against the formulas
computed by hand here, and the decision words they allow."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from scipy import stats
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.weightstats import ttost_paired

from tokenformer.experiments.common.stats import (
    answer_family,
    decision,
    holm,
    tost_paired,
)


def holm_by_hand(ps: list[float]) -> list[float]:
    """Holm's step-down: sort ascending, p̃₍ᵢ₎ = min(1, max_{k≤i} (m − k + 1)·p₍ₖ₎)."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):  # rank k − 1
        running = max(running, (m - rank) * ps[i])
        out[i] = min(1.0, running)
    return out


def test_holm_hand_computed_and_statsmodels():
    ps = [0.01, 0.04, 0.03, 0.005]
    # by hand: sorted 0.005, 0.01, 0.03, 0.04 → 4·0.005 = 0.02, 3·0.01 = 0.03,
    # 2·0.03 = 0.06, max(0.06, 1·0.04) = 0.06; back in input order:
    assert holm(ps) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm(ps) == pytest.approx(holm_by_hand(ps), abs=1e-15)
    assert holm(ps) == pytest.approx(list(multipletests(ps, method="holm")[1]), abs=1e-15)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ps = list(rng.uniform(0, 0.3, size=rng.integers(1, 9)))
        assert holm(ps) == pytest.approx(holm_by_hand(ps), abs=1e-12)
    assert holm([0.6, 0.7]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == []


def test_holm_turns_the_v2_runs_growth_claims_into_not_resolved():
    """Issue 25: "growth beats S4 from scratch" had p 0.017–0.041 (and 0.117) over four
    recipes; Holm over those four gives 0.068–0.117: none below 0.05."""
    adjusted = holm([0.117, 0.041, 0.017, 0.021])
    assert adjusted == pytest.approx([0.117, 0.082, 0.068, 0.068], abs=1e-12)
    assert all(p >= 0.05 for p in adjusted)


def test_holm_counts_a_missing_test_as_a_member_of_the_family():
    # m = 3 (the questions fixed it), the NaN counts as p = 1: 3·0.01, max(0.03, 2·0.02)
    adjusted = holm([0.01, math.nan, 0.02])
    assert adjusted[0] == pytest.approx(0.03) and adjusted[2] == pytest.approx(0.04)
    assert math.isnan(adjusted[1])


def tost_by_hand(diffs: list[float], margin: float) -> tuple[float, float, float, float, float]:
    """Two one-sided t-tests: H0 mean ≤ −m (t₁ = (d̄ + m)/se, p₁ = P(T > t₁)) and H0 mean ≥ +m
    (t₂ = (d̄ − m)/se, p₂ = P(T < t₂)), T ~ t(n − 1); TOST p = max(p₁, p₂)."""
    n = len(diffs)
    mean = sum(diffs) / n
    se = statistics.stdev(diffs) / math.sqrt(n)
    t1, t2 = (mean + margin) / se, (mean - margin) / se
    p1, p2 = stats.t.sf(t1, n - 1), stats.t.cdf(t2, n - 1)
    return max(p1, p2), t1, p1, t2, p2


@pytest.mark.parametrize("diffs,margin,equivalent", [
    ([0.004, -0.006, 0.010, 0.002, -0.001], 0.02, True),  # tight around 0: equivalent
    ([0.015, 0.025, 0.018, 0.030, 0.012], 0.02, False),  # mean 0.02: at the margin
    ([0.05, -0.04, 0.03, -0.02, 0.01], 0.02, False),  # too noisy to claim anything
])
def test_tost_hand_computed_and_statsmodels(diffs, margin, equivalent):
    r = tost_paired(diffs, margin)
    p, t1, p1, t2, p2 = tost_by_hand(diffs, margin)
    assert (r.p_value, r.t_lower, r.p_lower, r.t_upper, r.p_upper) == pytest.approx(
        (p, t1, p1, t2, p2), rel=1e-10)
    a = np.array(diffs) + 1.0  # statsmodels on the two arms' values, not the differences
    sm_p, (sm_t1, sm_p1, _), (sm_t2, sm_p2, _) = ttost_paired(a, a - np.array(diffs), -margin,
                                                              margin)
    assert (r.p_value, r.t_lower, r.p_lower, r.t_upper, r.p_upper) == pytest.approx(
        (sm_p, sm_t1, sm_p1, sm_t2, sm_p2), rel=1e-9)
    assert r.df == len(diffs) - 1 and (r.p_value < 0.05) is equivalent


def test_tost_edge_cases():
    assert math.isnan(tost_paired([0.01], 0.02).p_value)  # one seed: no test
    assert math.isnan(tost_paired([0.01, math.inf], 0.02).p_value)
    assert tost_paired([0.01, 0.01, 0.01], 0.02).p_value == 0.0  # no spread, inside
    assert tost_paired([0.03, 0.03], 0.02).p_value == 1.0  # no spread, outside
    with pytest.raises(ValueError):
        tost_paired([0.0, 0.1], 0.0)


def test_decision_words():
    assert decision(0.01) == "resolved"
    assert decision(0.2) == "not resolved"
    assert decision(math.nan) == "not resolved"
    assert decision(0.2, 0.01, 0.02) == "equivalent within ±0.02"
    assert decision(0.2, 0.2, 0.02) == "not resolved"
    assert decision(0.01, 0.01, 0.02) == "resolved (equivalent within ±0.02)"
    assert decision(0.2, math.nan, 0.02) == "not resolved"


def test_answer_family_adjusts_within_the_family_and_decides():
    """Two difference questions whose raw p-values (0.03, 0.04) are each below 0.05 but not
    after Holm over the family (0.06, 0.06), and one equivalence question; every number is
    recomputed here from the formulas."""
    a = [0.010, 0.030, 0.020, 0.025, 0.015]
    tests = [{"id": "Q1", "diffs": a, "margin": None},
             {"id": "Q2", "diffs": [0.004, -0.006, 0.010, 0.002, -0.001], "margin": 0.02},
             {"id": "Q3", "diffs": [0.01, 0.05, -0.01, 0.04, 0.0], "margin": None}]
    rows = answer_family(tests)
    raw = [stats.ttest_1samp(t["diffs"], 0).pvalue for t in tests]
    for row, p in zip(rows, raw, strict=True):
        assert row["p_value"] == pytest.approx(p, rel=1e-10)
    assert [r["p_holm"] for r in rows] == pytest.approx(holm_by_hand(raw), rel=1e-10)
    half = stats.t.ppf(0.975, 4) * statistics.stdev(a) / math.sqrt(5)
    assert (rows[0]["ci_low"], rows[0]["ci_high"]) == pytest.approx((0.02 - half, 0.02 + half))
    assert rows[0]["decision"] == "resolved"  # p 0.003 × 3 still < 0.05
    # the only equivalence test of the family: its TOST p is its own Holm p
    assert rows[1]["tost_holm"] == pytest.approx(tost_by_hand(tests[1]["diffs"], 0.02)[0])
    assert rows[1]["decision"] == "equivalent within ±0.02"
    assert "tost" not in rows[2] and rows[2]["decision"] == "not resolved"
    # raw p below 0.05 twice (0.031, 0.049), not after Holm over the two (0.062, 0.062)
    pair = answer_family([{"diffs": d, "margin": None} for d in (
        [0.04, 0.02, 0.05, 0.0, 0.03], [0.04, 0.01, 0.05, 0.0, 0.03])])
    assert [round(r["p_value"], 3) for r in pair] == [0.031, 0.049]
    assert [r["p_holm"] for r in pair] == pytest.approx([2 * pair[0]["p_value"]] * 2)
    assert [r["decision"] for r in pair] == ["not resolved", "not resolved"]
    one_seed = answer_family([{"diffs": [0.1], "margin": 0.02}])[0]
    assert one_seed["decision"] == "not resolved" and math.isnan(one_seed["p_holm"])
