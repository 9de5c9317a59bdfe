"""``results.json`` → the frontier's summary, verdict, ``report.md`` and plots.

Nothing here trains or reads anything but the results. The from-scratch *envelope* of a family
at a budget is its size with the lowest mean validation loss over seeds at that budget; its
per-seed values are that size's seeds, so comparisons with a chain (same seeds, same batches)
are paired (:mod:`..common.stats`). Picking the size by the mean of the same seeds favours the
envelope slightly (a minimum over sizes); the verdict names a chain better only when its
interval excludes 0 in spite of that. Envelopes of two families (TokenFormer vs Transformer++, a
product-key family vs each) are compared the same way, seed by seed, at every budget.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...io.files import atomic_write, atomic_write_text
from ..common.report import fmt, have_matplotlib, markdown_table
from ..common.stats import (
    RULE_INTERVAL,
    answer_family,
    describe,
    format_p,
    paired,
    spread,
    t_interval,
)
from .plan import CHAIN_RULE, LR_RULE
from .presets import DENSE_FAMILIES, size_key
from .questions import question_lines
from .recipes import RECIPES

# the paired comparisons outside the questions: the same interval, but no decision word
DESCRIPTIVE_RULE = (RULE_INTERVAL + " These intervals are unadjusted for the many comparisons "
                    "made: the decision words belong to the pre-registered answers alone.")
FAMILY_LABEL = {"tokenformer": "TokenFormer", "transformer++": "Transformer++",
                "tokenformer-gelu": "plain-GELU TokenFormer (the MLP control)",
                "tokenformer-pk16": "product-key TokenFormer (16× FFN tokens)",
                "tokenformer-pk64": "product-key TokenFormer (64× FFN tokens)"}
STYLES = {"tokenformer": "-", "transformer++": "--", "tokenformer-pk16": ":",
          "tokenformer-pk64": "-.", "tokenformer-gelu": (0, (3, 1, 1, 1))}
ENVELOPE_COLOR = {"tokenformer": "black", "transformer++": "dimgray",
                  "tokenformer-gelu": "tab:olive",
                  "tokenformer-pk16": "tab:red", "tokenformer-pk64": "tab:purple"}


def envelope_pairs(families: list[str]) -> list[tuple[str, str]]:
    """The envelope comparisons (a, b) the report makes among ``families``: TokenFormer vs
    Transformer++, and every product-key family vs each of them (issue 18: does parameter count
    at constant FLOPs buy loss?)."""
    base = [f for f in ("tokenformer", "transformer++") if f in families]
    pairs = [("tokenformer", "transformer++")] if len(base) == 2 else []
    return pairs + [(f, b) for f in families if f not in DENSE_FAMILIES for b in base]


# ------------------------------------------------------------------------------------ tables
def _loss(value: Any) -> float:
    return math.inf if value is None else float(value)


def arms(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per arm: kind, family, sizes, and per budget index {seed: (loss, flops, tokens)}."""
    out: dict[str, dict[str, Any]] = {}
    for run in results["runs"].values():
        arm = out.setdefault(run["arm"], {"kind": run["kind"], "family": run["family"],
                                          "recipe": run["recipe"], "lr": run["lr"],
                                          "stages": run["stages"], "budgets": {}})
        for b in run["branches"]:
            arm["budgets"].setdefault(b["budget_index"], {})[run["seed"]] = (
                _loss(b["loss"]), b["flops"], b["tokens"])
            arm.setdefault("sizes", {})[b["budget_index"]] = b["size"]
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def envelope(results: dict[str, Any], family: str) -> dict[int, dict[str, Any]]:
    """Per budget index: the family's best from-scratch size (lowest mean loss over the seeds
    every size ran) and its per-seed losses and FLOPs."""
    table = arms(results)
    scratch = {a: v for a, v in table.items() if v["kind"] == "scratch" and v["family"] == family}
    out: dict[int, dict[str, Any]] = {}
    for j in range(len(results["budgets"])):
        cands = {a: v["budgets"][j] for a, v in scratch.items() if j in v["budgets"]}
        if not cands:
            continue
        best = min(cands, key=lambda a: (_mean([x[0] for x in cands[a].values()]), a))
        seeds = cands[best]
        out[j] = {"arm": best, "size": scratch[best]["stages"][0]["size"],
                  "loss": {s: x[0] for s, x in seeds.items()},
                  "flops": {s: x[1] for s, x in seeds.items()},
                  "tokens": _mean([x[2] for x in seeds.values()]),
                  "parameters": scratch[best]["stages"][0]["parameters"],
                  "non_embedding_parameters": scratch[best]["stages"][0][
                      "non_embedding_parameters"],
                  "mean": _mean([x[0] for x in seeds.values()])}
    return out


def _crossing_log(flops: list[float], losses: list[float], target: float) -> float | None:
    """FLOPs where the curve, piecewise linear in log FLOPs, first comes down to ``target``;
    None when it does not within the grid (never, or already at its first budget)."""
    for i in range(1, len(flops)):
        y0, y1 = losses[i - 1], losses[i]
        if y0 > target >= y1 and math.isfinite(y0):
            t = (y0 - target) / (y0 - y1)
            return math.exp(math.log(flops[i - 1]) + t * (math.log(flops[i]) -
                                                          math.log(flops[i - 1])))
    return None


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Envelopes, paired comparisons per budget, compute-to-reach, sweeps and the verdict."""
    table = arms(results)
    families = sorted({v["family"] for v in table.values()})
    envs = {f: envelope(results, f) for f in families}
    comparisons: list[dict[str, Any]] = []

    def compare(name: str, a: dict[int, float], b: dict[int, float], label_a: str,
                label_b: str, j: int) -> dict[str, Any]:
        c = paired(label_a, label_b, a, b).to_dict()
        c.update(question=name, budget_index=j, budget=results["budgets"][j])
        comparisons.append(c)
        return c

    for arm, v in table.items():
        if v["kind"] not in ("chain", "widen"):
            continue
        env = envs.get(v["family"], {})
        for j, seeds in sorted(v["budgets"].items()):
            if j in env:
                c = compare("chain vs envelope", {s: x[0] for s, x in seeds.items()},
                            env[j]["loss"], arm, f"{v['family']} envelope ({env[j]['size']})", j)
                c.update(chain_size=v["sizes"][j], first_size=v["stages"][0]["size"])
            # the paper's comparison: the grown model against the same size trained from
            # scratch with the same compute (not against the best size)
            same_arm = size_key(v["family"], v["sizes"][j])
            same = table.get(same_arm)
            if (v["sizes"][j] != v["stages"][0]["size"] and same is not None
                    and j in same["budgets"]):
                c = compare("chain vs same size from scratch", {s: x[0] for s, x in seeds.items()},
                            {s: x[0] for s, x in same["budgets"][j].items()}, arm, same_arm, j)
                c.update(chain_size=v["sizes"][j])
    if "chain-exact" in table and "chain-exact-anneal" in table:
        ex, an = table["chain-exact"]["budgets"], table["chain-exact-anneal"]["budgets"]
        for j in sorted(set(ex) & set(an)):
            compare("anneal vs held", {s: x[0] for s, x in an[j].items()},
                    {s: x[0] for s, x in ex[j].items()}, "chain-exact-anneal", "chain-exact", j)
    for fa, fb in envelope_pairs(families):
        ea, eb = envs[fa], envs[fb]
        for j in sorted(set(ea) & set(eb)):
            c = compare(f"{fa} vs {fb}", ea[j]["loss"], eb[j]["loss"],
                        f"{FAMILY_LABEL[fa]} envelope ({ea[j]['size']})",
                        f"{FAMILY_LABEL[fb]} envelope ({eb[j]['size']})", j)
            c.update(families=[fa, fb], parameters=[ea[j]["non_embedding_parameters"],
                                                    eb[j]["non_embedding_parameters"]])
    reach = {arm: compute_to_reach(table[arm], envs[table[arm]["family"]])
             for arm, v in table.items() if v["kind"] in ("chain", "widen")
             and envs.get(v["family"])}
    summary = {"envelopes": {f: {str(j): {k: e[k] for k in ("arm", "size", "mean", "tokens",
                                                              "parameters",
                                                              "non_embedding_parameters")}
                                  for j, e in env.items()} for f, env in envs.items()},
               "comparisons": comparisons, "reach": reach,
               "seeds": sorted({r["seed"] for r in results["runs"].values()})}
    summary["answers"] = answers(results)
    summary["verdict"] = verdict(results, summary)
    return summary


def compute_to_reach(arm: dict[str, Any], env: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """At the chain's largest budget: the FLOPs the envelope needs to reach the chain's loss,
    over the chain's FLOPs (< 1: training from scratch at the best size gets there cheaper).
    Per seed on that seed's envelope curve; the interval is a t interval of log ratios."""
    j = max(arm["budgets"])
    seeds = arm["budgets"][j]
    js = sorted(env)
    ratios: dict[int, float | None] = {}
    for s, (loss, flops, _) in seeds.items():
        xs = [env[k]["flops"][s] for k in js if s in env[k]["flops"]]
        ys = [env[k]["loss"][s] for k in js if s in env[k]["loss"]]
        x = _crossing_log(xs, ys, loss)
        ratios[s] = None if x is None else x / flops
    mean_loss = _mean([x[0] for x in seeds.values()])
    mean_x = _crossing_log([_mean(list(env[k]["flops"].values())) for k in js],
                           [env[k]["mean"] for k in js], mean_loss)
    chain_flops = _mean([x[1] for x in seeds.values()])
    out: dict[str, Any] = {"budget_index": j, "chain_loss": mean_loss,
                           "chain_flops": chain_flops, "per_seed": ratios,
                           "ratio_of_means": None if mean_x is None else mean_x / chain_flops}
    if mean_x is None and js:  # off the grid: a bound from the envelope's first or last point
        first, last = env[js[0]], env[js[-1]]
        if mean_loss >= first["mean"]:
            out["at_most"] = _mean(list(first["flops"].values())) / chain_flops
        elif mean_loss < min(env[k]["mean"] for k in js):
            out["more_than"] = _mean(list(last["flops"].values())) / chain_flops
    logs = [math.log(r) for r in ratios.values() if r is not None]
    if len(logs) == len(ratios) and len(logs) >= 2:
        ci = t_interval(logs)
        out.update(ratio=math.exp(ci.mean), low=math.exp(ci.low), high=math.exp(ci.high),
                   p_value=ci.p_value)
    return out


def wall_clock(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per from-scratch arm: measured seconds per training step (mean over its seeds' final runs,
    stable phase and cooldowns; the runner's per-step tokens/s) and, per budget index, the
    training seconds of that budget's run (its steps × seconds per step). Machine-dependent:
    read from ``timing``, never from the training results."""
    timing = results.get("timing", {}).get("runs", {})
    out: dict[str, dict[str, Any]] = {}
    for run_id, run in results["runs"].items():
        t = timing.get(run_id, {}).get("step_time", {})
        size = run["stages"][0]["size"]
        if run["kind"] != "scratch" or not t.get(size) or not t[size][0]:
            continue
        n, total = t[size]
        arm = out.setdefault(run["arm"], {"family": run["family"], "size": size,
                                          "per_seed": {}, "steps": {}})
        arm["per_seed"][run["seed"]] = total / n
        for b in run["branches"]:
            arm["steps"][b["budget_index"]] = b["steps"]
    for arm in out.values():
        arm["seconds_per_step"] = _mean(list(arm["per_seed"].values()))
        arm["seconds"] = {j: steps * arm["seconds_per_step"] for j, steps in arm["steps"].items()}
    return out


# ------------------------------------------------------------------ pre-registered questions
def _term_values(term: str, table: dict[str, Any], envs: dict[str, Any]
                 ) -> dict[int, dict[int, float]]:
    """Per budget index, per seed: the validation loss of an arm or ``envelope:<family>``."""
    if term.startswith("envelope:"):
        return {j: dict(e["loss"]) for j, e in envs.get(term.split(":", 1)[1], {}).items()}
    arm = table.get(term)
    if arm is None:
        return {}
    return {j: {s: x[0] for s, x in seeds.items()} for j, seeds in arm["budgets"].items()}


def _side_values(side: str, table: dict[str, Any], envs: dict[str, Any]
                 ) -> dict[int, dict[int, float]]:
    """A question's side: one term, or ``"x - y"`` (x − y per budget and seed both have)."""
    values = [_term_values(t.strip(), table, envs) for t in side.split(" - ")]
    if len(values) == 1:
        return values[0]
    x, y = values
    return {j: {s: x[j][s] - y[j][s] for s in sorted(set(x[j]) & set(y[j]))}
            for j in sorted(set(x) & set(y))}


def answers(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every pre-registered question of ``results["preset"]`` answered: one test per budget it
    asks about (paired differences a − b by seed), Holm within each family and TOST where a
    margin is set (:func:`..common.stats.answer_family`). A question whose arms did not run
    (e.g. a chain whose envelope never changed size) gets a row without data: not resolved."""
    questions = (results.get("preset") or {}).get("questions") or []
    if not questions:
        return []
    table = arms(results)
    envs = {f: envelope(results, f) for f in {v["family"] for v in table.values()}}
    tests: list[dict[str, Any]] = []
    for q in questions:
        a, b = _side_values(q["a"], table, envs), _side_values(q["b"], table, envs)
        js = [j for j in sorted(set(a) & set(b)) if set(a[j]) & set(b[j])]
        if q["budgets"] == "final":
            js = js[-1:]
        if not js:
            tests.append({"question": q, "budget_index": None, "budget": None, "seeds": [],
                          "diffs": [], "margin": q["margin"], "order": len(tests)})
        for j in js:
            seeds = sorted(set(a[j]) & set(b[j]))
            tests.append({"question": q, "budget_index": j, "budget": results["budgets"][j],
                          "seeds": seeds, "diffs": [a[j][s] - b[j][s] for s in seeds],
                          "margin": q["margin"], "order": len(tests)})
    out = []
    for family in dict.fromkeys(t["question"]["family"] for t in tests):
        out += answer_family([t for t in tests if t["question"]["family"] == family])
    return sorted(out, key=lambda r: r["order"])  # back in the questions' order


def _p(p: float | None) -> str:
    """A p-value in a table cell: ``0.123``, ``< 0.001`` or — (no test)."""
    return format_p(p).removeprefix("p = ").removeprefix("p ")


def answer_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The answers table's rows: raw and Holm-adjusted p side by side, TOST where asked."""
    out = []
    for r in rows:
        q = r["question"]
        tost = r.get("tost")
        out.append([q["id"], q["family"],
                    "—" if r["budget"] is None else f"{r['budget']:.2g}",
                    "no data (an arm did not run)" if not r["diffs"] else
                    f"{r['mean']:+.4f}" + ("" if math.isnan(r["ci_low"]) else
                                           f" [{r['ci_low']:+.4f}, {r['ci_high']:+.4f}]"),
                    str(r["n"]), _p(r["p_value"]), _p(r["p_holm"]),
                    "—" if tost is None else
                    f"±{tost['margin']:g}: {_p(tost['p_value'])} (Holm {_p(r['tost_holm'])})",
                    f"**{r['decision']}**"])
    return out


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


# ------------------------------------------------------------------------------------- plots
def make_plots(results: dict[str, Any], out: Path, summary: dict[str, Any] | None = None
               ) -> list[str]:
    if not have_matplotlib():
        return []
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter


    written = []
    table = arms(results)
    cmap = colormaps["tab10"]
    styles = STYLES
    # one column per family: its from-scratch sizes, envelope and growing arms (top), and each
    # growing arm's gap to the envelope with its 95 % paired interval (bottom): the gaps are
    # hundredths of a nat, invisible on the loss axis
    order = {f: i for i, f in enumerate(FAMILY_LABEL)}
    families = sorted({v["family"] for v in table.values()}, key=lambda f: order.get(f, 99))
    growing = {f: [a for a, v in table.items() if v["kind"] in ("chain", "widen")
                   and v["family"] == f] for f in families}
    rows = 2 if any(growing.values()) else 1
    fig = Figure(figsize=(5.2 * len(families), 4.2 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, len(families), squeeze=False)
    gaps = ([c for c in (summary or summarize(results))["comparisons"]
             if c["question"] == "chain vs envelope"] if rows == 2 else [])
    sizes = results["sizes"]
    shade = colormaps["viridis"]
    for col, family in enumerate(families):
        ax = axes[0][col]

        def band(seeds_by_j: dict[int, dict[int, Any]], ax: Any = ax, **kw: Any) -> None:
            js = sorted(seeds_by_j)
            xs = [_mean([x[1] for x in seeds_by_j[j].values()]) for j in js]
            ys = [_mean([x[0] for x in seeds_by_j[j].values()]) for j in js]
            ax.plot(xs, ys, marker=kw.pop("marker", "o"), markersize=3, **kw)
            if any(len(seeds_by_j[j]) > 1 for j in js):
                ax.fill_between(xs, [min(x[0] for x in seeds_by_j[j].values()) for j in js],
                                [max(x[0] for x in seeds_by_j[j].values()) for j in js],
                                color=kw.get("color"), alpha=0.15, linewidth=0)

        for v in table.values():
            if v["kind"] == "scratch" and v["family"] == family:  # light (small) to dark
                k = sizes.index(v["stages"][0]["size"])
                band(v["budgets"], color=shade(0.85 - 0.75 * k / max(len(sizes) - 1, 1)),
                     linestyle=styles[family], linewidth=0.9, alpha=0.8,
                     label=f"{v['stages'][0]['size']} from scratch")
        env = envelope(results, family)
        js = sorted(env)
        ax.plot([_mean(list(env[j]["flops"].values())) for j in js],
                [env[j]["mean"] for j in js], color=ENVELOPE_COLOR.get(family, "black"),
                linestyle=styles[family], linewidth=2.2, label="envelope (best size)")
        for i, arm in enumerate(growing[family]):
            band(table[arm]["budgets"], color=cmap(i % 10), linewidth=1.4, marker="s",
                 label=arm)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # 3×10¹¹ labels overlap otherwise
        ax.set_xlabel("cumulative training FLOPs")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(f"{FAMILY_LABEL[family]} (mean over seeds, band: min–max)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
        if rows == 2:
            ax = axes[1][col]
            for i, arm in enumerate(growing[family]):
                cs = sorted((c for c in gaps if c["a"] == arm and c["n"] > 0
                             and math.isfinite(c["mean"])), key=lambda c: c["budget"])
                if not cs:
                    continue
                shift = 1 + 0.03 * (i - (len(growing[family]) - 1) / 2)  # side by side

                def half(c: dict[str, Any], end: str) -> float:  # one seed: no interval
                    return abs(c[end] - c["mean"]) if math.isfinite(c[end]) else 0.0

                xs = [c["budget"] * shift for c in cs]
                ys = [c["mean"] for c in cs]
                ax.errorbar(xs, ys, yerr=[[half(c, "ci_low") for c in cs],
                                          [half(c, "ci_high") for c in cs]],
                            marker="s", markersize=3, capsize=2, linewidth=1, color=cmap(i % 10),
                            label=arm)
            ax.axhline(0.0, color="black", linewidth=1)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("budget (FLOPs)")
            ax.set_ylabel("arm − envelope (nats; 95 % paired t interval)")
            ax.set_title("gap to the from-scratch envelope (< 0: growth wins)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            if growing[family]:
                ax.legend(fontsize=6.5)
    atomic_write(out / "frontier.png", lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    written.append("frontier.png")

    sweeps = results["sweeps"]
    families = sorted({s["family"] for s in sweeps.values()})
    fig = Figure(figsize=(5 * len(families), 4), layout="constrained")
    for k, family in enumerate(families):
        ax = fig.add_subplot(1, len(families), k + 1)
        for i, s in enumerate(v for v in sweeps.values() if v["family"] == family):
            xs = [p["lr"] for p in s["points"]]
            ys = [_loss(p["loss"]) for p in s["points"]]
            ax.plot(xs, ys, marker="o", markersize=3, color=cmap(i % 10), label=s["size"])
            ax.plot([s["chosen"]], [min(ys)], marker="*", markersize=11, color=cmap(i % 10))
        ax.set_xscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("validation loss after the sweep run")
        ax.set_title(f"{FAMILY_LABEL[family]} LR sweeps (★ chosen)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    atomic_write(out / "lr_sweeps.png", lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    written.append("lr_sweeps.png")

    clock = wall_clock(results)
    if any(v["family"] not in DENSE_FAMILIES for v in clock.values()):  # product keys ran
        fig = Figure(figsize=(10, 6), layout="constrained")
        ax = fig.add_subplot()
        for arm, w in clock.items():
            js = sorted(w["seconds"])
            seeds = table[arm]["budgets"]
            k = sizes.index(w["size"])
            ax.plot([w["seconds"][j] for j in js],
                    [_mean([x[0] for x in seeds[j].values()]) for j in js], marker="o",
                    markersize=3, linestyle=styles[w["family"]],
                    color=ENVELOPE_COLOR.get(w["family"], "black"),
                    alpha=1.0 - 0.25 * k, label=f"{arm} ({1000 * w['seconds_per_step']:.0f} "
                                                f"ms/step)")
        ax.set_xscale("log")
        ax.set_xlabel("training seconds of the budget's run (its steps × measured s/step, one "
                      "thread)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title("Loss vs wall-clock (mean over seeds)", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        atomic_write(out / "frontier_wallclock.png",
                     lambda tmp: fig.savefig(tmp, format="png", dpi=110))
        written.append("frontier_wallclock.png")
    return written


# ------------------------------------------------------------------------------------ report
def chain_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """Each chain beside the envelope it followed: the measured best size per budget, the
    chain's size there, and whether its final size is the envelope's best at its final
    budget (the rule of plan's module docstring)."""
    followed = results.get("chain_envelopes") or {}
    growing = [a for a, v in table.items() if v["kind"] in ("chain", "widen")]
    if not growing or not followed:
        return []
    budgets = results["budgets"]
    rows = []
    for arm in growing:
        v = table[arm]
        best = {int(j): z for j, z in followed.get(v["family"], {}).items()}
        final = max(v["sizes"])
        rows.append([arm, " → ".join(f"{st['size']}@{st['start']}" for st in v["stages"]),
                     *(f"{best.get(j, '—')} / {v['sizes'].get(j, '—')}"
                       for j in range(len(budgets))),
                     "yes" if best.get(final) == v["sizes"][final] else "**no**"])
    return ["## Chains follow the envelope", "",
            "Per budget: the family's measured best from-scratch size / the size the chain "
            "cooled down there (— : not read). The last column checks that the chain ends at "
            "the envelope's best size at its final budget.", "",
            markdown_table(["arm", "sizes@start step", *(f"{b:.2g}" for b in budgets),
                            "ends at the best"], rows, "l" * (len(budgets) + 3)), ""]


def lr_text(lr: float | list[float]) -> str:
    """A run's peak LR, or its per-stage LRs in stage order."""
    return " → ".join(f"{x:.3g}" for x in lr) if isinstance(lr, list) else f"{lr:.3g}"


def recipe_lines(results: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """The growing arms: each one's recipe as the plan defines it, its LR policy and LRs."""
    growing = [a for a, v in table.items() if v["kind"] in ("chain", "widen")]
    if not growing:
        return []
    rows = []
    for arm in growing:
        recipe = RECIPES.get(arm)
        run = next(r for r in results["runs"].values() if r["arm"] == arm)
        rows.append([arm, recipe.label if recipe else "—", run.get("lr_policy", "final-size"),
                     lr_text(table[arm]["lr"])])
    return ["## Growing arms", "",
            "Every arm that grows, by the recipe the plan defines for it (`RECIPES` in "
            "`experiments/frontier/recipes.py`), its LR policy and its peak LR per stage.", "",
            markdown_table(["arm", "recipe", "LR policy", "peak LR per stage"], rows, "llll"),
            ""]


def report_markdown(results: dict[str, Any], summary: dict[str, Any], plots: list[str]) -> str:
    p = results["preset"]
    table = arms(results)
    pk = [f for f in p["families"] if f not in DENSE_FAMILIES]
    growth = bool(p.get("recipes") or p.get("chains") or p.get("widenings"))
    pk_stages = [v["stages"][0] for v in table.values()
                 if v["kind"] == "scratch" and v["family"] in pk]
    m = results["machine"]
    timing = results["timing"]
    lines = [f"# Loss-vs-compute frontier: preset `{p['name']}`", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['torch_threads']} torch threads, torch "
             f"{m['torch']}; Pattention implementation: {results['pattention_impl']}; "
             f"{results['device']} {results['dtype']}.  ",
             f"Wall-clock: {timing['wall_clock']:.0f} s"
             + (" (this invocation resumed an earlier one; runs it loaded are not included)"
                if timing["resumed"] else "") + ".  ",
             f"Data: {results['data']['name']} ({results['data']['train_tokens']:,} training "
             f"tokens), seeds {summary['seeds']}.", "",
             "## Pre-registered questions", "",
             "Fixed in the preset before anything ran (`tokenformer scale --plan` prints "
             "them).", "", *question_lines(p.get("questions") or []), ""]
    if summary.get("answers"):
        lines += ["## Answers", "",
                  "Δ = a − b in validation loss, paired by seed: mean [95 % t interval, "
                  "unadjusted]; p: paired t-test; Holm: adjusted within the question's family; "
                  "TOST: the paired equivalence test at the margin (its p Holm-adjusted over the "
                  "family's equivalence questions).", "",
                  markdown_table(["id", "family", "budget", "Δ = a − b", "seeds", "p", "Holm p",
                                  "TOST", "decision"], answer_rows(summary["answers"]),
                                 "llllrrrll"), ""]
    lines += ["## Descriptive reading", "",
              "Each comparison on its own, without multiplicity correction: what the curves "
              "show, not a verdict (the answers above are).", "",
              *[f"- {line}" for line in summary["verdict"]], "", DESCRIPTIVE_RULE, ""]
    if plots:
        lines += [f"![{name}]({name})" for name in plots] + [""]
    lines += ["## Envelopes: the best from-scratch size per budget", "",
              "Tokens per parameter of the envelope's size (training tokens / non-embedding "
              "parameters) is this setup's measured compute-optimal ratio at that budget.", ""]
    rows = []
    for family, env in summary["envelopes"].items():
        for j, e in sorted(env.items(), key=lambda kv: int(kv[0])):
            rows.append([FAMILY_LABEL[family], f"{results['budgets'][int(j)]:.3g}", e["size"],
                         f"{e['mean']:.4f}", f"{e['non_embedding_parameters']:,}",
                         f"{e['tokens']:,.0f}",
                         f"{e['tokens'] / e['non_embedding_parameters']:.1f}"])
    lines += [markdown_table(["family", "budget (FLOPs)", "best size", "loss",
                              "non-emb. params", "tokens", "tokens/param"], rows, "llllrrr"), ""]
    lines += recipe_lines(results, table)
    lines += chain_lines(results, table)
    lines += ["## Every arm", "",
              "Validation loss at each budget (mean ± sample std over seeds; — : the size "
              "would train fewer than min_steps steps at that budget).", ""]
    header = ["arm", "LR", *(f"{b:.2g}" for b in results["budgets"])]
    rows = []
    for arm, v in table.items():
        cells = []
        for j in range(len(results["budgets"])):
            seeds = v["budgets"].get(j)
            if not seeds:
                cells.append("—")
                continue
            s = spread(x[0] for x in seeds.values())
            cells.append(str(s) if math.isfinite(s.mean) else f"{s.mean:.4f}")
        rows.append([arm, lr_text(v["lr"]), *cells])
    lines += [markdown_table(header, rows, "l" * len(header)), ""]
    if summary["comparisons"]:
        rows = [[c["question"], f"{c['budget']:.2g}", c["a"], c["b"], describe(c), str(c["n"]),
                 c["verdict"]] for c in summary["comparisons"]]
        lines += ["## Paired comparisons (unadjusted)", "", "Δ = a − b in validation loss: "
                  "mean [95 % interval], p; each on its own (no multiplicity correction).", "",
                  markdown_table(["comparison", "budget", "a", "b", "Δloss", "seeds",
                                  "unadjusted"],
                                 rows, "lrlllrl"), ""]
    clock = wall_clock(results)
    if clock:
        dense = {w["size"]: w["seconds_per_step"] for w in clock.values()
                 if w["family"] == "tokenformer"}
        rows = []
        for arm, w in clock.items():
            sps = w["seconds_per_step"]
            cells = []
            for j in range(len(results["budgets"])):
                seeds = table[arm]["budgets"].get(j)
                cells.append("—" if not seeds else
                             f"{_mean([x[0] for x in seeds.values()]):.4f} @ "
                             f"{w['seconds'][j]:.0f} s")
            rows.append([arm, f"{1000 * sps:.1f}",
                         f"{sps / dense[w['size']]:.2f}x" if w["size"] in dense else "—",
                         *cells])
        lines += ["## Wall-clock", "",
                  "Measured seconds per training step of each from-scratch arm (mean over its "
                  "seeds' final runs, from the trainer's tokens/s; the machine and its load at "
                  "the time, not the FLOP count) and, per budget, the mean loss at the training "
                  "seconds of that budget's run (steps × s/step; evaluation excluded). Equal "
                  "FLOPs per token do not mean equal time.", "",
                  markdown_table(["arm", "ms/step", "vs dense TokenFormer",
                                  *(f"{b:.2g} FLOPs" for b in results["budgets"])], rows,
                                 "lrr" + "l" * len(results["budgets"])), ""]
    rows = []
    for key, s in results["sweeps"].items():
        rows.append([key, ", ".join(f"{q['lr']:.3g}: {fmt(_loss(q['loss']))}"
                                    for q in s["points"]), f"{s['chosen']:.3g}",
                     "**at the edge**" if s["at_edge"] else ("extended: " + ", ".join(
                         f"{x:.3g}" for x in s["added"]) if s["added"] else "inside"),
                     {True: "yes", False: "**no**"}.get(s.get("unimodal"), "—"),
                     ", ".join(f"{x:.3g}" for x in s.get("seed_argmins", ())) or "—"])
    lines += ["## LR sweeps", "",
              LR_RULE.format(seeds=p.get("sweep_seeds", 1), steps=p["sweep_steps"])
              + f" At most {p['max_extensions']} extensions per side; a choice still at an "
                f"edge is flagged. Loss: the mean over the sweep seeds."
              + (" Growing arms: `per-stage` trains each stage at its own size's chosen LR "
                 "(the peak moves at once at the growth step; a half-depth or half-width first "
                 "stage takes the LR of the swept size nearest in non-embedding parameters), "
                 "`final-size` the whole run at its final size's LR." if growth else ""), "",
              markdown_table(["family-size", "LR: loss", "chosen", "grid", "unimodal",
                              "each seed's argmin"], rows, "llllll"), ""]
    lines += ["## Method", "",
              f"- Sizes: TokenFormer d = {p['hidden_size']}, {p['num_layers']} layers, "
              f"{p['num_heads']} heads, (qkv, proj, ffn) tokens {tuple(p['base_tokens'])} × "
              f"{p['factor']}^k for S1… ; Transformer++ matched to each in non-embedding "
              f"parameters (MLP width). Batch {p['batch_size']} × {p['seq_len']} tokens.",
              *([f"- Product-key families ({', '.join(pk)}): size Si is TokenFormer Si with "
                 f"its FFN Pattention replaced by product keys (`ffn_keys=\"product\"`) over "
                 f"n = s² ≈ R × Si's FFN tokens (s the integer nearest √(R·n)) and the top-k "
                 f"whose analytic FFN FLOPs/token (sub-key scores 2·s·d, min(k, s)² candidate "
                 f"sums, Θ over k, k value rows 2·k·d) are closest to the dense FFN's (within "
                 f"1 %): equal FLOPs per token, many times the parameters. Sizes: "
                 + "; ".join(f"{st['size']} n = {st['config']['ffn_tokens']:,}, k = "
                             f"{st['config']['ffn_product_k']}, "
                             f"{st['non_embedding_parameters']:,} non-emb. parameters"
                             for st in pk_stages) + "."] if pk else []),
              f"- One schedule family for every arm: WSD, {p['warmup_steps']} warmup steps, "
              f"stable at the peak LR, linear cooldown to {p['min_lr_ratio']} × peak over the "
              f"last {p['decay_fraction']:.0%} of a budget's steps, branched off the stable run "
              f"at each budget ({p['num_budgets']} budgets, ×{p['budget_ratio']:g} apart, up to "
              f"{p['max_budget']:.3g} FLOPs). AdamW β (0.9, 0.95), weight decay "
              f"{p['weight_decay']}, clipping {p['grad_clip']}.",
              *([f"- {CHAIN_RULE.format(share=p.get('min_stage_share', 0.4))} Growth happens "
                 f"in the stable phase; AdamW moments carried, new rows' second moments "
                 f"`{p['new_row_moments']}`; a branch cools down the size reached at its decay "
                 f"start. `exact-anneal`: exact growth, then Θ's factor moves linearly from its "
                 f"held value to √n of the new size over {p['anneal_steps']} steps. "
                 f"`official-released`: a fresh AdamW and a linear warmup again over "
                 f"{p['warmup_steps']} steps at each growth (the released run's restart; its "
                 f"new decay is each budget's cooldown, as for every arm). `*-stack` (G_stack): "
                 f"the final size at half depth, its blocks repeated in order at the growth "
                 f"(moments copied). `widen-duplicate` (HyperCloning): the final Transformer++ "
                 f"size at half hidden size and heads, every width axis duplicated with "
                 f"zero-sum noise (function-preserving), moments tiled and rescaled. `widen-*` "
                 f"by size: the Transformer++ chain grown by MLP widening (zero: new units' "
                 f"outgoing weights zero; net2net: duplicated units, split outgoing weights), "
                 f"moments carried (new units zero). `chain-gelu`: the plain-GELU control grown "
                 f"with zero new keys (exactly function-preserving for that Θ)."]
                if growth else []),
              "- FLOPs: `flops_per_token(config, seq_len, training=True)` × tokens (matmuls "
              "2·m·n·k, token-token attention over the full context T, backward = 2× forward); "
              "evaluation not counted. Validation loss on "
              f"{p['eval_batches']} fixed batches of the held-out split at each branch's end.",
              "- Every run of a seed sees the same batches (a pure function of seed and step), "
              "so differences between arms are paired by seed.", ""]
    return "\n".join(lines)


def write(results: dict[str, Any], out: str | Path, plots: bool = True) -> dict[str, Any]:
    """report.md (and the plots unless ``plots`` is False) for ``results``; returns the
    summary."""

    out = Path(out)
    summary = summarize(results)
    names = make_plots(results, out, summary) if plots else []
    atomic_write_text(out / "report.md", report_markdown(results, summary, names))
    return summary
