"""``results.json`` → the frontier's numbers: arms, envelopes, paired comparisons, answers.

Nothing here trains or reads anything but the results. The from-scratch *envelope* of a family
at a budget is its size with the lowest mean validation loss over seeds at that budget; its
per-seed values are that size's seeds, so comparisons with a chain (same seeds, same batches)
are paired (:mod:`..common.stats`). In v3 the size was picked by the mean of the same seeds,
which favours the envelope slightly (a minimum over sizes); v4 picks it (and its LR) on the
tuning seeds and values it on the held-out ones (``results["tuning"]["envelope"]``).
Envelopes of two families (TokenFormer vs Transformer++, a product-key family vs each) are
compared the same way, seed by seed, at every budget.
"""

from __future__ import annotations

import math
from typing import Any

from ..common.stats import answer_family, paired, t_interval
from .presets import DENSE_FAMILIES, size_key
from .questions import TREND_READINGS

FAMILY_LABEL = {"tokenformer": "TokenFormer", "transformer++": "Transformer++",
                "tokenformer-gelu": "plain-GELU TokenFormer (the MLP control)",
                "tokenformer-pk16": "product-key TokenFormer (16× FFN tokens)",
                "tokenformer-pk64": "product-key TokenFormer (64× FFN tokens)"}


def envelope_pairs(families: list[str]) -> list[tuple[str, str]]:
    """The envelope comparisons (a, b) the report makes among ``families``: TokenFormer vs
    Transformer++, and every product-key family vs each of them (issue 18: does parameter count
    at constant FLOPs buy loss?)."""
    base = [f for f in ("tokenformer", "transformer++") if f in families]
    pairs = [("tokenformer", "transformer++")] if len(base) == 2 else []
    return pairs + [(f, b) for f in families if f not in DENSE_FAMILIES for b in base]


# ------------------------------------------------------------------------------------ tables
def as_loss(value: Any) -> float:
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
                as_loss(b["loss"]), b["flops"], b["tokens"])
            arm.setdefault("sizes", {})[b["budget_index"]] = b["size"]
    return out


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def envelope(results: dict[str, Any], family: str) -> dict[int, dict[str, Any]]:
    """Per budget index: the family's best from-scratch size and its per-seed losses and FLOPs.
    v4 (``results["tuning"]["envelope"]``): the (size, LR) the TUNING seeds chose, valued on
    its held-out seeds; v3: the size with the lowest mean loss over the seeds it is scored on."""
    table = arms(results)
    scratch = {a: v for a, v in table.items() if v["kind"] == "scratch" and v["family"] == family}
    chosen = ((results.get("tuning") or {}).get("envelope") or {}).get(family)
    out: dict[int, dict[str, Any]] = {}
    for j in range(len(results["budgets"])):
        cands = {a: v["budgets"][j] for a, v in scratch.items() if j in v["budgets"]}
        if chosen is not None:  # v4: never a choice on the scored seeds
            pick = chosen.get(str(j))
            cands = {a: c for a, c in cands.items()
                     if pick is not None and a == size_key(family, pick["size"])}
        if not cands:
            continue
        best = min(cands, key=lambda a: (mean_of([x[0] for x in cands[a].values()]), a))
        seeds = cands[best]
        out[j] = {"arm": best, "size": scratch[best]["stages"][0]["size"],
                  "loss": {s: x[0] for s, x in seeds.items()},
                  "flops": {s: x[1] for s, x in seeds.items()},
                  "tokens": mean_of([x[2] for x in seeds.values()]),
                  "parameters": scratch[best]["stages"][0]["parameters"],
                  "non_embedding_parameters": scratch[best]["stages"][0][
                      "non_embedding_parameters"],
                  "mean": mean_of([x[0] for x in seeds.values()])}
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


def analyse(results: dict[str, Any]) -> dict[str, Any]:
    """Envelopes, paired comparisons per budget, compute-to-reach and the answers to the
    pre-registered questions (the numbers of the report; :func:`.report.summarize` adds the
    verdict's prose)."""
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
    summary["reuse_reach"] = reuse_reach(results, table, envs)
    return summary


def reuse_reach(results: dict[str, Any], table: dict[str, Any], envs: dict[str, Any]
                ) -> list[dict[str, Any]]:
    """v5's endpoint (b) (docs/frontier-v5.md): per reuse question and X cell, per held-out
    seed, the incremental compute X' at which the rival's loss curve (its points at every X it
    ran, linear in log X) comes down to the grown arm's loss at X, as the ratio X' / X (> 1: the
    rival needs more). A t interval of log2 ratio over the seeds when every seed's curve reaches
    it; otherwise the seeds that do not are bounds (``above``: the rival needs more than its
    largest X; ``below``: it is already lower at its smallest) and no interval is given."""
    reuse = (results.get("tuning") or {}).get("reuse") or {}
    budgets = results["budgets"]
    out = []
    for q in (results.get("preset") or {}).get("questions") or []:
        level = reuse.get(q["a"], {}).get("level")
        if not q["family"].startswith("reuse-") or level is None:
            continue
        a, b = side_values(q["a"], table, envs), side_values(q["b"], table, envs)
        rival = sorted(b)
        for i in sorted(a):
            x = budgets[i] / budgets[level]
            per_seed: dict[int, Any] = {}
            for seed, loss in sorted(a[i].items()):
                js = [j for j in rival if seed in b[j]]
                xs = [budgets[j] / budgets[level] for j in js]
                ys = [b[j][seed] for j in js]
                reach = _crossing_log(xs, ys, loss) if ys else None
                per_seed[seed] = (reach / x if reach is not None else
                                  "below" if ys and ys[0] <= loss else "above")
            row: dict[str, Any] = {"question": q["id"], "family": q["family"],
                                   "budget_index": i, "x": x, "per_seed": per_seed}
            ratios = [r for r in per_seed.values() if not isinstance(r, str)]
            if len(ratios) == len(per_seed) and len(ratios) >= 2:
                ci = t_interval([math.log2(r) for r in ratios])
                row.update(ratio=2 ** ci.mean, low=2 ** ci.low, high=2 ** ci.high,
                           p_value=ci.p_value)
            out.append(row)
    return out


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
    mean_loss = mean_of([x[0] for x in seeds.values()])
    mean_x = _crossing_log([mean_of(list(env[k]["flops"].values())) for k in js],
                           [env[k]["mean"] for k in js], mean_loss)
    chain_flops = mean_of([x[1] for x in seeds.values()])
    out: dict[str, Any] = {"budget_index": j, "chain_loss": mean_loss,
                           "chain_flops": chain_flops, "per_seed": ratios,
                           "ratio_of_means": None if mean_x is None else mean_x / chain_flops}
    if mean_x is None and js:  # off the grid: a bound from the envelope's first or last point
        first, last = env[js[0]], env[js[-1]]
        if mean_loss >= first["mean"]:
            out["at_most"] = mean_of(list(first["flops"].values())) / chain_flops
        elif mean_loss < min(env[k]["mean"] for k in js):
            out["more_than"] = mean_of(list(last["flops"].values())) / chain_flops
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
        arm["seconds_per_step"] = mean_of(list(arm["per_seed"].values()))
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


def side_values(side: str, table: dict[str, Any], envs: dict[str, Any]
                ) -> dict[int, dict[int, float]]:
    """A question's side: one term, or ``"x - y"`` (x − y per budget and seed both have)."""
    values = [_term_values(t.strip(), table, envs) for t in side.split(" - ")]
    if len(values) == 1:
        return values[0]
    x, y = values
    return {j: {s: x[j][s] - y[j][s] for s in sorted(set(x[j]) & set(y[j]))}
            for j in sorted(set(x) & set(y))}


def _trend_test(q: dict[str, Any], a: dict[int, dict[int, float]],
                b: dict[int, dict[int, float]], js: list[int], budgets: list[float],
                order: int) -> dict[str, Any]:
    """A "trend" question's test: per seed that has every budget of ``js``, the least-squares
    slope of a − b against log2(budget) (``scipy.stats.linregress``); the slopes are the
    values the t-test and Holm act on (nats per doubling of compute)."""
    from scipy.stats import linregress  # lazy: only reports need scipy

    seeds = sorted(set.intersection(*(set(a[j]) & set(b[j]) for j in js))) if js else []
    x = [math.log2(budgets[j]) for j in js]
    slopes = ([float(linregress(x, [a[j][s] - b[j][s] for j in js]).slope) for s in seeds]
              if len(js) >= 2 else [])
    return {"question": q, "budget_index": None, "budget": None, "budgets_read": js,
            "seeds": seeds if slopes else [], "diffs": slopes, "margin": q["margin"],
            "order": order}


def _chain_terms(q: dict[str, Any], table: dict[str, Any]) -> list[str]:
    """The growing arms (chains) a question's sides name."""
    terms = [t.strip() for side in (q["a"], q["b"]) for t in side.split(" - ")]
    return [t for t in terms if t in table and table[t]["kind"] in ("chain", "widen")]


def _grown_at(arm: dict[str, Any], j: int) -> bool:
    """Whether the chain's size cooled down at budget j is past its first size."""
    return arm.get("sizes", {}).get(j, arm["stages"][0]["size"]) != arm["stages"][0]["size"]


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
        a, b = side_values(q["a"], table, envs), side_values(q["b"], table, envs)
        js = [j for j in sorted(set(a) & set(b)) if set(a[j]) & set(b[j])]
        if q["budgets"] == "trend-grown":  # v5: only where every chain has grown
            js = [j for j in js if all(_grown_at(table[t], j) for t in _chain_terms(q, table))]
        if q["budgets"] in TREND_READINGS:
            tests.append(_trend_test(q, a, b, js, results["budgets"], len(tests)))
            continue
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
