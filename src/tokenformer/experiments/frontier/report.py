"""``results.json`` → ``report.md``: the summary (:mod:`.analysis`'s numbers and the verdict's
prose), written as markdown section by section (:mod:`.report_markdown`), and the plots
(:mod:`.plots`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...io.files import atomic_write_text
from ..common.stats import describe, format_p
from .analysis import FAMILY_LABEL, analyse, arms, envelope_pairs
from .plots import make_plots
from .presets import DENSE_FAMILIES
from .report_markdown import report_markdown


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """:func:`.analysis.analyse`'s numbers and the verdict read off them."""
    summary = analyse(results)
    summary["verdict"] = verdict(results, summary)
    return summary


# ----------------------------------------------------------------------------------- verdict
def _budget(results: dict[str, Any], j: int) -> str:
    return f"{results['budgets'][j]:.2g}"


def verdict(results: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    """Plain-language answers read off the paired comparisons (no other source)."""
    lines: list[str] = []
    comps = summary["comparisons"]
    n_seeds = len(summary["seeds"])
    chains = [c for c in comps if c["question"] == "chain vs envelope"]
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for c in chains:
        by_arm.setdefault(c["a"], []).append(c)
    families = {arm: v["family"] for arm, v in arms(results).items()}
    for arm, cs in by_arm.items():
        below = [c for c in cs if c["winner"] == arm]
        above = [c for c in cs if c["winner"] is not None and c["winner"] != arm]
        grown = [c for c in cs if c["chain_size"] != c["first_size"]] or cs
        best = min(grown, key=lambda c: c["mean"] if c["mean"] is not None and
                   math.isfinite(c["mean"]) else math.inf)
        family = FAMILY_LABEL.get(families.get(arm, ""), families.get(arm, ""))
        head = f"**{arm} vs the {family} from-scratch envelope:** "
        if below:
            head += ("below it (unadjusted interval excludes 0) at "
                     + ", ".join(f"{_budget(results, c['budget_index'])} FLOPs "
                                 f"(Δloss {describe(c)})" for c in below) + ". ")
        elif n_seeds < 2:
            head += "one seed: no interval. "
        else:
            head += (f"no unadjusted interval below it at any of its {len(cs)} budgets. ")
        if above:
            # before its first growth a chain is its first size (at its final size's LR under
            # the final-size policy): a gap there measures that start, not growth
            head += ("Above it (unadjusted interval excludes 0) at " + ", ".join(
                _budget(results, c["budget_index"])
                + (" (not yet grown)" if c["chain_size"] == c["first_size"] else "")
                for c in above) + " FLOPs. ")
        head += (f"Closest once grown: {_budget(results, best['budget_index'])} FLOPs "
                 f"(chain at {best['chain_size']}), Δloss {describe(best)} vs {best['b']}.")
        lines.append(head)
    for arm, r in summary["reach"].items():
        head = f"**Compute to reach {arm}'s final loss ({r['chain_loss']:.4f}) along the envelope**"
        if r.get("ratio") is not None:
            lines.append(f"{head} instead: ×{r['ratio']:.2f} of the chain's FLOPs [95 % interval "
                         f"×{r['low']:.2f}–×{r['high']:.2f}, {format_p(r['p_value'])}] (< 1: "
                         f"from scratch is cheaper).")
        elif r.get("ratio_of_means") is not None:
            lines.append(f"{head}: ×{r['ratio_of_means']:.2f} of the chain's FLOPs (mean curves; "
                         f"no interval: "
                         + ("one seed" if n_seeds < 2 else "some seed is off the grid") + ").")
        elif r.get("more_than") is not None:
            lines.append(f"{head}: more than ×{r['more_than']:.2f} of the chain's FLOPs (the chain "
                         f"ends below every envelope point of the grid; mean curves).")
        elif r.get("at_most") is not None:
            lines.append(f"{head}: at most ×{r['at_most']:.2f} of the chain's FLOPs (the envelope "
                         f"is already below it at its first budget; mean curves).")
        else:
            lines.append(f"{head}: not measurable on the budget grid.")
    same = [c for c in comps if c["question"] == "chain vs same size from scratch"]
    for arm in dict.fromkeys(c["a"] for c in same):
        cs = [c for c in same if c["a"] == arm]
        below = [c for c in cs if c["winner"] == arm]
        above = [c for c in cs if c["winner"] is not None and c["winner"] != arm]
        last = cs[-1]
        lines.append(f"**{arm} vs from scratch at the size it has reached (the paper's "
                     f"comparison, not the best size):** lower (unadjusted interval excludes 0) at "
                     f"{len(below)}, "
                     f"higher at {len(above)} of {len(cs)} budgets after its first "
                     f"growth; at {_budget(results, last['budget_index'])} FLOPs "
                     f"Δloss {describe(last)} vs {last['b']}.")
    anneal = [c for c in comps if c["question"] == "anneal vs held"]
    if anneal:
        last = anneal[-1]
        resolved = [c for c in anneal if c["winner"] is not None]
        lines.append("**Θ's factor annealed to √n after exact growth (point 5's hypothesis):** "
                     + (f"at the largest budget Δloss {describe(last)} (anneal − held) → "
                        f"{last['verdict']} (unadjusted); interval excludes 0 at "
                        f"{len(resolved)} of {len(anneal)} "
                        f"budgets" + (" (" + ", ".join(f"{c['winner']} better at "
                                                      f"{_budget(results, c['budget_index'])}"
                                                      for c in resolved) + ")" if resolved
                                      else "") + "."))
    for fa, fb in envelope_pairs(sorted({f for c in comps for f in c.get("families", ())})):
        cs = [c for c in comps if c["question"] == f"{fa} vs {fb}"]
        if not cs:
            continue
        la, lb = FAMILY_LABEL[fa], FAMILY_LABEL[fb]
        a_better = [c for c in cs if c["winner"] == c["a"]]
        b_better = [c for c in cs if c["winner"] == c["b"]]
        line = (f"**{la} envelope vs {lb} envelope:** {la} lower (unadjusted interval "
                f"excludes 0) at {len(a_better)}, "
                f"{lb} lower at {len(b_better)} of {len(cs)} budgets; ")
        if fa in DENSE_FAMILIES:
            line += f"at the largest, Δloss {describe(cs[-1])} ({la} − {lb})."
        else:  # product keys: every budget, with the parameters each envelope spends
            line += ("Δloss (" + la + " − " + lb + ") " + "; ".join(
                f"at {_budget(results, c['budget_index'])} FLOPs {describe(c)} "
                f"({c['parameters'][0]:,} vs {c['parameters'][1]:,} non-embedding parameters)"
                for c in cs) + ".")
        lines.append(line)
    edges = [k for k, s in results["sweeps"].items() if s["at_edge"]]
    if edges:
        lines.append("**WARNING: the chosen LR is at the edge of its sweep grid** for "
                     + ", ".join(edges) + " even after extending it: the optimum may lie "
                     "beyond; those sizes' points are upper bounds on their tuned loss.")
    rough = [k for k, s in results["sweeps"].items() if s.get("unimodal") is False]
    if rough:
        lines.append("**Non-monotone LR sweeps** (the mean loss over the grid dips twice): "
                     + ", ".join(rough) + ": their picks rest on noisy or multimodal curves.")
    split = [k for k, s in results["sweeps"].items() if len(s.get("seed_argmins", ())) > 1]
    if split:
        lines.append("**Sweep seeds disagree** on the best LR for " + ", ".join(
            f"{k} ({', '.join(f'{x:.3g}' for x in results['sweeps'][k]['seed_argmins'])})"
            for k in split) + ": the pick is the argmin of their mean.")
    if n_seeds < 2:
        lines.append("One seed: no interval exists and no question is resolved; this run "
                     "shows the shape of the frontier, not a verdict.")
    return lines


def write(results: dict[str, Any], out: str | Path, plots: bool = True) -> dict[str, Any]:
    """report.md (and the plots unless ``plots`` is False) for ``results``; returns the
    summary."""
    out = Path(out)
    summary = summarize(results)
    names = make_plots(results, out, summary) if plots else []
    atomic_write_text(out / "report.md", report_markdown(results, summary, names))
    return summary
