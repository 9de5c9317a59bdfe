"""Ablation results → summary (paired statistics, the paper's claims, verdict) → report.md, plots.

A pure function of ``results.json`` (:func:`rerender` redoes it without training): per-variant
spread over seeds, paired comparisons with the study's reference by the one statistics rule
(:mod:`..common.stats`), each of the paper's claims checked, the verdict's prose, the markdown
report and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from ...io.files import atomic_write, atomic_write_text
from ..common.arms import Curve
from ..common.report import have_matplotlib, markdown_table, plot_curves, to_json
from ..common.stats import RULE, Spread, describe, paired, spread
from .plan import SCHEMA, STUDIES, TASKS, Study, Task, paper_claims


# ------------------------------------------------------------------------------------ summary
def _curve(data: dict[str, Any]) -> Curve:
    """A saved curve. results.json stores non-finite numbers as null: a null loss is a diverged
    run's inf (its bpb too); otherwise a null bpb is the NaN of a task without one (vision)."""
    def point(p: dict[str, Any]) -> dict[str, Any]:
        diverged = p["loss"] is None
        return {**p, "loss": math.inf if diverged else p["loss"],
                "bpb": (math.inf if diverged else math.nan) if p["bpb"] is None else p["bpb"]}

    return Curve.from_dict({**data, "points": [point(p) for p in data["points"]]})


def final_values(results: dict[str, Any], variant: str, column: str) -> dict[int, float]:
    """The last evaluation's ``column`` per seed."""
    runs = results["variants"][variant]["runs"]
    return {int(s): _curve(c).column(column)[-1] for s, c in runs.items()}


def _spread(values: Iterable[float]) -> dict[str, Any]:
    vals = list(values)
    if all(math.isfinite(v) for v in vals):
        return dataclasses.asdict(spread(vals))
    # a diverged seed: the mean is infinite and the spread undefined
    return dataclasses.asdict(Spread(statistics.fmean(vals), math.nan, min(vals), max(vals),
                                     len(vals)))


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per-variant spread over seeds, paired comparisons with the reference, the paper's claims
    checked one by one, and the verdict."""
    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    names = list(results["variants"])
    finals = {n: final_values(results, n, task.metric) for n in names}
    variants = {}
    for n in names:
        entry = {"metric": _spread(finals[n].values()),
                 "loss": _spread(final_values(results, n, "loss").values()),
                 "per_seed": finals[n]}
        diverged = [int(s) for s, c in results["variants"][n]["runs"].items()
                    if "diverged" in c["info"]]
        if diverged:
            entry["diverged_seeds"] = diverged
        variants[n] = entry

    def compare(a: str, b: str) -> dict[str, Any]:
        return paired(a, b, finals[a], finals[b], task.metric, task.lower_is_better).to_dict()

    ref = study.reference
    comparisons = [compare(n, ref) for n in names if n != ref and ref in finals]
    claims = []
    for a, b, kind in paper_claims(study):
        if a in finals and b in finals:
            c = compare(a, b)
            if kind == "better":
                status = ("agrees" if c["winner"] == a else "contradicts" if c["winner"] == b
                          else "not resolved")
            else:
                status = "agrees" if c["winner"] is None else "differs"
            claims.append({"a": a, "b": b, "kind": kind, "paper": [study.paper[a],
                                                                     study.paper[b]],
                           "status": status, "comparison": c})
    summary = {"metric": task.metric, "variants": variants, "comparisons": comparisons,
               "claims": claims}
    if "tuning" in results:  # results before the LR sweeps have neither key
        summary["lrs"] = {n: {"lr": v["lr"], "status": (v.get("sweep") or {}).get("status",
                                                                              "pinned")}
                          for n, v in results["variants"].items()}
        summary["tuning_seed"] = (results["tuning"] or {}).get("seed")
    summary["verdict"] = verdict(study, task, summary)
    return summary


def _fmt_spread(task: Task, s: dict[str, Any]) -> str:
    sp = Spread(**s)
    if not task.percent:
        return str(sp)
    if sp.n == 1 or not math.isfinite(sp.mean):
        return task.fmt(sp.mean)
    return f"{100 * sp.mean:.2f} ± {100 * sp.std:.2f} %"


def _fmt_diff(task: Task, c: dict[str, Any]) -> str:
    """Mean difference, its 95 % t interval and p (:func:`..common.stats.describe`)."""
    if c["n"] and (c["mean"] is None or not math.isfinite(c["mean"])):
        return "a run diverged"
    if task.percent:
        return describe(c, digits=2, scale=100, unit=" pt")
    return describe(c)


def verdict(study: Study, task: Task, summary: dict[str, Any]) -> list[str]:
    """Plain-language lines: the ranking here, each paper claim checked, and the overall answer."""
    lab = study.labels
    v = summary["variants"]
    sign = 1 if task.lower_is_better else -1
    ranked = sorted(v, key=lambda n: sign * v[n]["metric"]["mean"])
    lines = ["Ranking here (best first, mean over seeds): "
             + " > ".join(f"{lab[n]} ({task.fmt(v[n]['metric']['mean'])})" for n in ranked)
             + "."]
    for c in summary["claims"]:
        a, b, cmp = lab[c["a"]], lab[c["b"]], c["comparison"]
        here = (f"here {_fmt_diff(task, cmp)} ({task.metric}, {c['a']} − {c['b']}, "
                f"{cmp['n']} seed{'s' if cmp['n'] != 1 else ''}: {cmp['verdict']})")
        if c["kind"] == "better":
            lines.append(f"Paper: {a} beats {b} ({c['paper'][0]} vs {c['paper'][1]} %); {here} "
                         f"→ **{c['status']}**.")
        else:
            lines.append(f"Paper: {a} ≈ {b} ({c['paper'][0]} vs {c['paper'][1]} %); {here} "
                         f"→ **{c['status']}**.")
    claims = summary["claims"]
    better = [c for c in claims if c["kind"] == "better"]
    ties = [c for c in claims if c["kind"] == "tie"]

    def pairs(cs: list[dict[str, Any]]) -> str:
        return ", ".join(f"{c['a']} vs {c['b']}" for c in cs)

    if not claims:
        lines.append("The variants run here include no pair the paper compares.")
    if better:
        agree = [c for c in better if c["status"] == "agrees"]
        against = [c for c in better if c["status"] == "contradicts"]
        if len(agree) == len(better):
            lines.append("**The paper's ranking holds here**: every pair it ranks has an "
                         "interval in its direction (unadjusted for the number of pairs).")
        elif against:
            lines.append(f"**The paper's ranking does not hold here**: reversed (unadjusted "
                         f"interval excludes 0) for "
                         f"{pairs(against)}; {len(agree)} of {len(better)} pairs agree.")
        else:
            lines.append(f"**Not resolved**: {len(agree)} of {len(better)} pairs the paper ranks "
                         f"are resolved in its direction, none against it; the rest have a 95 % "
                         f"interval that includes 0.")
    if ties:
        differ = [c for c in ties if c["status"] == "differs"]
        if not differ:
            lines.append("**Not resolved apart**, where the paper finds the variants equal "
                         "(every 95 % interval includes 0; no equivalence test was run, so this "
                         "does not show them equal).")
        else:
            lines.append("**Unlike the paper**, variants it finds equal differ here (unadjusted "
                         "interval excludes 0): "
                         + "; ".join(f"{c['a']} vs {c['b']}: {c['comparison']['winner']} better "
                                     f"({_fmt_diff(task, c['comparison'])})"
                                     for c in differ) + ".")
    ref = study.reference
    for verdict_, word in (("better", "better"), ("worse", "worse")):
        names = [c["a"] for c in summary["comparisons"]
                 if c["winner"] is not None and (c["winner"] == c["a"]) == (verdict_ == "better")]
        if names:
            lines.append(f"Resolved {word} than the default `{ref}` here: "
                         + ", ".join(f"`{n}`" for n in names) + ".")
    return lines + _lr_lines(summary)


def _lr_lines(summary: dict[str, Any]) -> list[str]:
    """What the verdict says about the learning rates: tuned per variant (and any still at the
    edge of its grid), or pinned."""
    lrs = summary.get("lrs")
    if not lrs:
        return []
    if all(v["status"] == "pinned" for v in lrs.values()):
        lr = next(iter(lrs.values()))["lr"]
        return [f"**LR not tuned**: every variant trained at lr {lr:.3g} (`--lr`); a variant "
                f"may lose only because that LR suits another."]
    lines = [f"LRs tuned per variant (argmin over the sweep, seed {summary['tuning_seed']}): "
             + ", ".join(f"`{n}` {v['lr']:.3g} ({v['status']})" for n, v in lrs.items()) + "."]
    edge = [n for n, v in lrs.items() if v["status"] == "at edge"]
    if edge:
        lines.append("**Warning: LR still at the edge of its grid** after the extensions for "
                     + ", ".join(f"`{n}`" for n in edge) + ": its best LR may lie beyond, so "
                     "comparisons with it may handicap it.")
    return lines


# ---------------------------------------------------------------------------- report, plots
def curves_of(results: dict[str, Any]) -> dict[str, list[Curve]]:
    return {n: [_curve(c) for _, c in sorted(v["runs"].items(), key=lambda x: int(x[0]))]
            for n, v in results["variants"].items()}


def plot_final(results: dict[str, Any], path: str | Path) -> Path:
    """Final metric per variant (every seed, mean ± std) beside the paper's ImageNet top-1."""
    from matplotlib.figure import Figure

    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    s = results["summary"]["variants"]
    names = list(results["variants"])
    k = 100 if task.percent else 1
    fig = Figure(figsize=(10, 1.4 + 0.55 * len(names)), layout="constrained")
    here, paper = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    ys = range(len(names))
    for y, n in zip(ys, names, strict=True):
        vals = [k * x for x in s[n]["per_seed"].values() if math.isfinite(x)]
        here.plot(vals, [y] * len(vals), "o", color="tab:blue", alpha=0.45, markersize=5)
        m = s[n]["metric"]
        if math.isfinite(m["mean"]):
            here.errorbar([k * m["mean"]], [y], xerr=[k * m["std"]], fmt="D", color="black",
                          capsize=4, markersize=6)
        if n in study.paper:
            paper.barh([y], [study.paper[n]], color="tab:orange", height=0.5)
            paper.annotate(f"{study.paper[n]:.1f}", (study.paper[n], y), xytext=(3, -3),
                           textcoords="offset points", fontsize=8)
        else:
            paper.annotate("not in the paper", (0.02, y), xycoords=("axes fraction", "data"),
                           fontsize=8, color="gray", va="center")
    here.set_yticks(list(ys), [study.labels[n] for n in names])
    here.invert_yaxis()
    unit = " (%)" if task.percent else ""
    better = "lower" if task.lower_is_better else "higher"
    here.set_xlabel(f"{task.label}{unit}, {better} is better")
    here.set_title(f"here: {results['task']} ({len(results['seeds'])} seeds; dots: seeds, "
                   f"diamond: mean ± std)", fontsize=9)
    lo = min(study.paper.values()) if study.paper else 0
    paper.set_xlim(lo - 4, max(study.paper.values(), default=100) + 1.5)
    paper.set_xlabel("ImageNet top-1 (%), higher is better")
    paper.set_title("paper (base model, ImageNet)", fontsize=9)
    for ax in (here, paper):
        ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"Ablation: {study.title}", fontsize=10)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    return path


def plot_sweeps(results: dict[str, Any], path: str | Path) -> Path:
    """The sweep's metric against the LR per variant (log x), the chosen LR starred."""
    from matplotlib.figure import Figure

    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    k = 100 if task.percent else 1
    fig = Figure(figsize=(8, 4.8), layout="constrained")
    ax = fig.add_subplot()
    for i, (n, v) in enumerate(results["variants"].items()):
        points = [q for q in v["sweep"]["points"] if q["metric"] is not None
                  and math.isfinite(q["metric"])]
        color = f"C{i % 10}"
        ax.plot([q["lr"] for q in points], [k * q["metric"] for q in points], marker="o",
                markersize=4, color=color, label=f"{study.labels[n]} ({v['sweep']['status']})")
        chosen = [q for q in points if q["lr"] == v["sweep"]["chosen"]]
        if chosen:
            ax.plot([chosen[0]["lr"]], [k * chosen[0]["metric"]], marker="*", markersize=14,
                    color=color, markeredgecolor="black", linestyle="none")
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate (warmup, cosine to lr/10)")
    unit = " (%)" if task.percent else ""
    better = "lower" if task.lower_is_better else "higher"
    ax.set_ylabel(f"{task.label}{unit}, {better} is better")
    tuning = results["tuning"]
    ax.set_title(f"{study.title}: LR sweeps ({results['task']}, seed {tuning['seed']}, "
                 f"{tuning['steps']} steps; ★ chosen)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    return path


def make_plots(results: dict[str, Any], out: str | Path) -> list[str]:
    if not have_matplotlib():
        return []
    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    curves = curves_of(results)
    plot_final(results, Path(out) / "final.png")
    sweep = []
    if results.get("tuning"):
        plot_sweeps(results, Path(out) / "sweep.png")
        sweep = ["sweep.png"]
    finals = [c.final.metrics.get(task.metric, c.final.bpb) for runs in curves.values()
              for c in runs]
    finals = [f for f in finals if math.isfinite(f)]
    ylim = None
    if finals:  # the first evaluations are far off: keep the end of training legible
        lo, hi = min(finals), max(finals)
        pad = max(hi - lo, 0.02)
        if task.lower_is_better:
            ylim = (lo - 0.3 * pad, hi + 3 * pad)
        else:
            ylim = (lo - 3 * pad, hi + 0.3 * pad)
            if task.percent:  # a fraction: stay within [0, 1]
                ylim = (max(0.0, ylim[0]), min(1.0, ylim[1]))
    plot_curves(curves, Path(out) / "curves.png", x="step", y=task.metric, logx=False,
                labels=study.labels, ylim=ylim,
                title=f"{study.title}: {task.label} during training (mean over seeds, band: "
                      f"min–max)")
    return ["final.png", "curves.png", *sweep]


def report_markdown(results: dict[str, Any], plots: Sequence[str]) -> str:
    study, task = STUDIES[results["study"]], TASKS[results["task"]]
    s, p = results["summary"], results["preset"]
    ref = study.reference
    by_b = {c["a"]: c for c in s["comparisons"]}
    rows = []
    for n, v in s["variants"].items():
        c = by_b.get(n)
        vs = "reference" if n == ref else (f"{_fmt_diff(task, c)} → {c['verdict']}" if c
                                           else "—")
        extra = f" (diverged: seeds {v['diverged_seeds']})" if "diverged_seeds" in v else ""
        rows.append([f"`{n}`", study.labels[n] + extra, _fmt_spread(task, v["metric"]),
                     str(Spread(**v["loss"])), vs,
                     f"{study.paper[n]:.1f}" if n in study.paper else "not in the paper"])
    data = results["data"]
    tuning = results.get("tuning")
    lr_text = (f"LR tuned per variant (below), grid centred on {p['lr']:.3g}"
               if tuning else f"LR {p['lr']:.3g} for every variant (not tuned)"
               if "tuning" in results else f"LR {p['lr']}")  # (older results: no sweep keys)
    lines = [
        f"# Ablation: {study.title} ({results['task']})", "",
        f"Command: `{results['command']}`  ",
        f"Preset `{p['name']}`: model `{p['base']}`"
        + "".join(f" {k}={v}" for k, v in p["model"].items()) + f", varying `{study.key}`, "
        f"{p['steps']} steps × batch {p['batch_size']}"
        + (f" × {p['seq_len']} tokens" if results["task"] == "lm" else " images")
        + f", seeds {results['seeds']}; {lr_text}.  ",
        f"Data: {data}.  ",
        f"Machine: {results['machine']['summary']}; load average {results['load'][0]:.1f} at the "
        f"start, {results['load'][1]:.1f} at the end. Wall-clock: {results['wall_clock']:.0f} s.",
        "", "## Verdict", "", *[f"- {line}" for line in s["verdict"]], "",
        "## Results", "",
        f"Final {task.label} (mean ± sample std over seeds) and loss; *vs `{ref}`* is the paired "
        f"difference per seed (variant − `{ref}`): mean [95 % interval], p. {RULE} "
        "The paper's column is ImageNet top-1 (%) of its base "
        "model: a different task and scale, shown for the ordering only.", "",
        markdown_table(["variant", "meaning", task.label, "loss", f"vs `{ref}`",
                        "paper (ImageNet top-1 %)"], rows, "lllrll"), "",
    ]
    if tuning:
        lines += _sweep_section(results)
    if plots:
        lines += [f"![{p_}]({p_})" for p_ in plots] + [""]
    else:
        lines += ["Plots skipped: matplotlib is not installed (`pip install 'tokenformer[plot]'`).",
                  ""]
    lines += ["## Method", "",
              f"- Every variant differs from the others only in `{study.key}`; model "
              "initialisation (seeded by the seed) and batch order (a pure function of seed and "
              "step) are the same for every variant of a seed, so the comparisons are paired.",
              "- " + ("LM: `tokenformer.training.lm.train` (AdamW, warmup + cosine, weight "
                      "decay 0.1, clip 1.0); validation loss over fixed windows of the held-out "
                      "split; bits per byte = loss / ln 2 / bytes per token."
                      if results["task"] == "lm" else
                      "Vision: `train_vision` on scikit-learn digits (1437 training / 360 test "
                      "images, random 1-pixel shifts), the digits recipe of docs/vision.md; "
                      "top-1 over the 360 test images."),
              f"- Evaluated every {p['eval_every']} steps and at the end; each run's model is "
              "kept in `runs/<variant>-seed<k>/final` (the sweep's in "
              "`sweeps/<variant>-lr<LR>-seed<k>/final`).", ""]
    return "\n".join(lines)


def _sweep_section(results: dict[str, Any]) -> list[str]:
    """The LR sweeps as a table: one row per variant, one column per LR tried."""
    task = TASKS[results["task"]]
    tuning = results["tuning"]
    lrs = sorted({q["lr"] for v in results["variants"].values() for q in v["sweep"]["points"]})
    rows = []
    for n, v in results["variants"].items():
        sw = v["sweep"]
        by_lr = {q["lr"]: q for q in sw["points"]}
        cells = []
        for lr in lrs:
            q = by_lr.get(lr)
            text = "" if q is None else ("diverged" if q["diverged"] else task.fmt(q["metric"]))
            cells.append(f"**{text}**" if lr == sw["chosen"] else text)
        status = {"at edge": "**at edge**",
                  "extended": "extended (" + ", ".join(f"{x:.3g}" for x in sw["added"]) + ")"
                  }.get(sw["status"], sw["status"])
        rows.append([f"`{n}`", *cells, f"{sw['chosen']:.3g}", status])
    initial = ", ".join(f"{x:.3g}" for x in tuning["grid"])
    return ["## Learning rates", "",
            f"Every variant is trained with its own LR: {tuning['steps']} steps of the same "
            f"schedule (warmup, cosine to lr/10) with seed {tuning['seed']} (not a reported "
            f"seed) at each LR of the factor-2 grid {initial}; the LR is the argmin of the "
            f"final {task.label} (ties: the smaller LR). When the argmin is the grid's smallest "
            f"or largest LR, the grid grows by one factor beyond it (at most "
            f"{tuning['max_extensions']} times per side); a choice still at an edge is "
            f"flagged. Cells: {task.label} at that LR, the chosen one in bold.", "",
            markdown_table(["variant", *(f"{x:.3g}" for x in lrs), "chosen", "grid"], rows,
                           "l" + "r" * len(lrs) + "rl"), ""]


def write_outputs(results: dict[str, Any], out: str | Path) -> list[str]:
    """results.json, the plots and report.md, each written atomically."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", to_json(results))
    plots = make_plots(results, out)
    atomic_write_text(out / "report.md", report_markdown(results, plots))
    return plots


def rerender(out: str | Path) -> dict[str, Any]:
    """Recompute the summary of ``out/results.json`` and rewrite it, the report and the plots
    (after a change to the statistics or the report; nothing is retrained)."""
    path = Path(out) / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: not an ablation output directory")
    results = json.loads(path.read_text())
    if results.get("schema") != SCHEMA:
        raise ConfigError(f"{path} is not a tokenformer ablate result ({results.get('schema')})")
    results["summary"] = summarize(results)
    write_outputs(results, out)
    return results
