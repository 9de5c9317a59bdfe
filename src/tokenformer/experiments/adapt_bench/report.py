"""adapt-bench results → intervals, paired comparisons, the verdict, report.md and the plot.

Every interval and test is the experiments' one rule (:mod:`..common.stats`), written in this
report's ``results.json`` shape (mean, half-width, p, n).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...data.corpora import CODE_SOURCE
from ...io.files import atomic_write_text
from ..common import stats
from ..common.report import have_matplotlib, markdown_table, to_json
from .plan import LABELS, base_of


def t_interval(values: Sequence[float]) -> dict[str, float]:
    """Mean, t-based 95 % half-width and p-value against 0, in this report's ``results.json``
    shape (:func:`..common.stats.t_interval`: the experiments' one rule)."""
    return _as_dict(stats.t_interval(values))


def _as_dict(ci: stats.Interval) -> dict[str, float]:
    return {"mean": ci.mean, "half": ci.mean - ci.low, "p": ci.p_value, "n": ci.n}


def _runs(results: dict[str, Any], arm: str, budget: float | None) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["arm"] == arm and r.get("budget") == budget]



def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per (arm, budget): interval of each metric; per budget: paired comparisons.

    ``forgetting`` is the old-domain loss after adapting minus the arm's own base's (the
    Transformer++ base starts from another KJV loss than the TokenFormer's)."""
    for r in results["runs"]:
        r["forgetting"] = r["old_loss"] - results["base_loss"][base_of(r["arm"])]["kjv"]
    cells = []
    for arm in results["preset"]["arms"]:
        for budget in ([None] if arm == "full" else results["preset"]["budgets"]):
            runs = _runs(results, arm, budget)
            if not runs:
                continue
            cell = {"arm": arm, "budget": budget, "size": runs[0]["size"], "lr": runs[0]["lr"],
                    "trainable": runs[0]["trainable"], "share": runs[0]["trainable"]
                    / results["base_parameters"]["tokenformer"], "seeds": len(runs)}
            for key in ("new_loss", "old_loss", "forgetting", "old_loss_off", "step_ms",
                        "file_bytes"):
                vals = [r[key] for r in runs if key in r]
                if vals:
                    cell[key] = t_interval(vals)
            if arm.startswith("tok"):
                cell["off_exact"] = all(r["off_equals_base"] for r in runs)
                cell["base_unchanged"] = all(r["base_unchanged"] for r in runs)
            cells.append(cell)
    comparisons = []
    pairs = [("tok-ffn", "lora-ffn"), ("tok-all", "lora-ffn"), ("tok-ffn", "lora-tpp"),
             ("tok-all", "lora-tpp"), ("tok-ffn", "tok-all"), ("lora-ffn", "lora-tpp")]
    for budget in results["preset"]["budgets"]:
        for a, b in pairs:
            ra = {r["seed"]: r for r in _runs(results, a, budget)}
            rb = {r["seed"]: r for r in _runs(results, b, budget)}
            seeds = sorted(set(ra) & set(rb))
            if not seeds:
                continue
            for metric in ("new_loss", "forgetting"):
                ci = stats.t_interval([ra[s][metric] - rb[s][metric] for s in seeds])
                comparisons.append({"a": a, "b": b, "budget": budget, "metric": metric,
                                    **_as_dict(ci), "resolved": ci.excludes_zero})
    return {"cells": cells, "comparisons": comparisons}


# ----------------------------------------------------------------------------------- report
def _pm(entry: dict[str, float] | None, digits: int = 4) -> str:
    if not entry:
        return "—"
    if math.isnan(entry["half"]):
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} ± {entry['half']:.{digits}f}"


def verdict(results: dict[str, Any]) -> list[str]:
    lines = []
    seeds = results["preset"]["seeds"]
    for c in results["summary"]["comparisons"]:
        what = (f"{c['a']} − {c['b']} at budget {c['budget']:.1%}: "
                f"{c['metric'].replace('_', '-').replace('new-loss', 'new-domain loss')} "
                f"{c['mean']:+.4f}")
        if c["n"] < 2:
            lines.append(f"{what} (one seed: not resolved)")
            continue
        better = c["a"] if c["mean"] < 0 else c["b"]
        status = f"{better} better" if c["resolved"] else "not resolved"
        lines.append(f"{what} ± {c['half']:.4f} (95 % CI, {c['n']} seeds, p = {c['p']:.3g}): "
                     f"{status}")
    exact = [c for c in results["summary"]["cells"] if "off_exact" in c]
    if exact:
        ok = all(c["off_exact"] and c["base_unchanged"] for c in exact)
        lines.append("token adapters switched off: old-domain loss equal to the base's "
                     + ("exactly, and the base tensors bitwise unchanged, in every run" if ok
                        else "NOT in every run (see the table)"))
    if seeds < 3:
        lines.append(f"{seeds} seed(s): a smoke run, not evidence (the full preset runs 3)")
    return lines


def report_markdown(results: dict[str, Any], plots: Sequence[str]) -> str:
    s, p = results["summary"], results["preset"]
    header = ["arm", "budget", "size", "trainable (% base)", "LR", "new-domain loss",
              "old-domain loss (on)", "forgetting", "old (off)", "off = base", "step ms",
              "file KB"]
    rows = []
    for c in s["cells"]:
        rows.append([LABELS[c["arm"]], "—" if c["budget"] is None else f"{c['budget']:.1%}",
                     c["size"] if c["arm"] != "full" else "all",
                     f"{c['trainable']:,} ({c['share']:.2%})", f"{c['lr']:g}",
                     _pm(c.get("new_loss")), _pm(c.get("old_loss")), _pm(c.get("forgetting")),
                     _pm(c.get("old_loss_off")),
                     {True: "exact", False: "NO"}.get(c.get("off_exact"), "—"),
                     f"{c['step_ms']['mean']:.0f}", f"{c['file_bytes']['mean'] / 1024:.1f}"])
    base = results["base_loss"]
    lines = [
        f"# adapt-bench ({results['preset_name']})", "",
        f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ",
        f"Wall-clock of this invocation: {results['elapsed_s'] / 60:.1f} min (runs and bases "
        f"reused from an earlier invocation in the same directory are not re-timed)", "",
        f"Bases pretrained on KJV ({p['base_steps']} steps × {p['batch_size']} × "
        f"{p['seq_len']} bytes): TokenFormer `{p['model']}` "
        f"({results['base_parameters']['tokenformer']:,} parameters) KJV val loss "
        f"{base['tokenformer']['kjv']:.4f}, code val loss {base['tokenformer']['code']:.4f}; "
        f"Transformer++ ({results['base_parameters']['transformer++']:,}) KJV "
        f"{base['transformer++']['kjv']:.4f}, code {base['transformer++']['code']:.4f}. "
        + (f"Pretraining took {results['base_train_s']['tokenformer']:.0f} s / "
           f"{results['base_train_s']['transformer++']:.0f} s. " if results.get("base_train_s")
           else "")
        + f"Adaptation: {p['steps']} steps on the code corpus ({CODE_SOURCE}), {p['seeds']} "
        f"seed(s); losses in nats/byte, ± = t-based 95 % interval over seeds.", "",
        markdown_table(header, rows), "",
        "LR picks (per arm and budget, tuning seed "
        f"{p['tune_seed']}): " + "; ".join(
            (f"{a}: {v['lr']:g} of {v['grid']}"
             + (f" (grid extended by {', '.join(f'{x:g}' for x in v['added'])})"
                if v.get("added") else "")
             + (" (**still at the grid's edge**)" if v["edge"] else "")
             if len(v["grid"]) > 1 else f"{a}: {v['lr']:g} (fixed, not tuned)")
            for a, v in results["tuning"].items()), "",
        "## Verdict", "", *[f"- {v}" for v in results["verdict_lines"]], "",
        *[f"![{name}]({name})" for name in plots], ""]
    return "\n".join(lines)


def make_plots(results: dict[str, Any], out: Path) -> list[str]:
    if not have_matplotlib():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for arm in results["preset"]["arms"]:
        cells = [c for c in results["summary"]["cells"] if c["arm"] == arm]
        if not cells:
            continue
        xs = [c["trainable"] for c in cells]
        for ax, key in zip(axes, ("new_loss", "forgetting"), strict=True):
            ys = [c[key]["mean"] for c in cells]
            err = [0 if math.isnan(c[key]["half"]) else c[key]["half"] for c in cells]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=LABELS[arm])
    from matplotlib.ticker import NullFormatter

    axes[0].set_title("new domain (code): val loss vs trainable parameters")
    axes[1].set_title("forgetting: KJV val loss after adapting − own base's")
    axes[1].axhline(0.0, color="grey", ls="--", lw=1, label="base (token adapters off)")
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("trainable parameters")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("val loss (nats/byte)")
    axes[1].set_ylabel("Δ val loss (nats/byte)")
    axes[0].legend(fontsize=7)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    name = "pareto.png"
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return [name]


def write(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """Add the summary and the verdict to ``results``; write ``results.json``, the plot and
    ``report.md`` into ``out`` (each atomically but the plot)."""
    results["summary"] = summarize(results)
    results["verdict_lines"] = verdict(results)
    atomic_write_text(out / "results.json", to_json(results))
    plots = make_plots(results, out)
    atomic_write_text(out / "report.md", report_markdown(results, plots))
    return results
