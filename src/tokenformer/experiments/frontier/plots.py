"""The frontier's plots from ``results.json``: the loss-vs-FLOPs frontier per family with each
growing arm's gap to its envelope, v5's reuse family (loss against the incremental compute X
per level k, and each rival's paired gap), the LR sweeps, and loss against wall-clock."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ...io.files import atomic_write
from ..common.report import have_matplotlib
from .analysis import (
    FAMILY_LABEL,
    analyse,
    arms,
    as_loss,
    envelope,
    mean_of,
    side_values,
    wall_clock,
)
from .presets import DENSE_FAMILIES, size_key
from .questions import k_label

STYLES = {"tokenformer": "-", "transformer++": "--", "tokenformer-pk16": ":",
          "tokenformer-pk64": "-.", "tokenformer-gelu": (0, (3, 1, 1, 1))}
ENVELOPE_COLOR = {"tokenformer": "black", "transformer++": "dimgray",
                  "tokenformer-gelu": "tab:olive",
                  "tokenformer-pk16": "tab:red", "tokenformer-pk64": "tab:purple"}


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
    # a family with no envelope (v5's Transformer++: only R4's base) would be an empty panel
    families = sorted((f for f in {v["family"] for v in table.values()}
                       if envelope(results, f)), key=lambda f: order.get(f, 99))
    growing = {f: [a for a, v in table.items() if v["kind"] in ("chain", "widen")
                   and v["family"] == f] for f in families}
    rows = 2 if any(growing.values()) else 1
    fig = Figure(figsize=(5.2 * len(families), 4.2 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, len(families), squeeze=False)
    gaps = ([c for c in (summary or analyse(results))["comparisons"]
             if c["question"] == "chain vs envelope"] if rows == 2 else [])
    sizes = results["sizes"]
    shade = colormaps["viridis"]
    for col, family in enumerate(families):
        ax = axes[0][col]

        def band(seeds_by_j: dict[int, dict[int, Any]], ax: Any = ax, **kw: Any) -> None:
            js = sorted(seeds_by_j)
            xs = [mean_of([x[1] for x in seeds_by_j[j].values()]) for j in js]
            ys = [mean_of([x[0] for x in seeds_by_j[j].values()]) for j in js]
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
        ax.plot([mean_of(list(env[j]["flops"].values())) for j in js],
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
        if rows == 2 and not growing[family]:  # an empty log axis says nothing: say why
            axes[1][col].axis("off")
            axes[1][col].text(0.5, 0.5, f"no growing arm of {FAMILY_LABEL[family]}\nin this "
                              "preset", ha="center", va="center", fontsize=9,
                              transform=axes[1][col].transAxes)
        elif rows == 2:
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
    series = reuse_series(results)
    if series:
        _reuse_plot(results, series, summary or analyse(results), out)
        written.append("reuse.png")

    sweeps = results["sweeps"]
    families = sorted({s["family"] for s in sweeps.values()})
    fig = Figure(figsize=(5 * len(families), 4), layout="constrained")
    for k, family in enumerate(families):
        ax = fig.add_subplot(1, len(families), k + 1)
        for i, s in enumerate(v for v in sweeps.values() if v["family"] == family):
            xs = [p["lr"] for p in s["points"]]
            ys = [as_loss(p["loss"]) for p in s["points"]]
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
                    [mean_of([x[0] for x in seeds[j].values()]) for j in js], marker="o",
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


# ------------------------------------------------------------------------- v5's reuse family
REUSE_STYLE = {"grown": ("tab:blue", "s", "grown (the paper's recipe)"),
               "R1": ("tab:gray", "v", "R1 grown size from scratch"),
               "R2": ("black", "o", "R2 best size from scratch"),
               "R3": ("tab:orange", "^", "R3 base trained on"),
               "R4": ("tab:red", "D", "R4 Transformer++ HyperCloned")}


def reuse_series(results: dict[str, Any]) -> dict[float, dict[str, Any]]:
    """Per level k of v5's reuse family: the finished bases' held-out losses (TokenFormer's
    and Transformer++'s, X = 0) and, per curve ("grown", "R1"…"R4": the grown arm and each
    reuse question's rival), {X: {seed: loss}} at every budget it ran, X = the budget over
    the base's compute. Empty without a reuse family."""
    reuse = (results.get("tuning") or {}).get("reuse") or {}
    table = arms(results)
    envs = {f: envelope(results, f) for f in {v["family"] for v in table.values()}}
    budgets = results["budgets"]
    out: dict[float, dict[str, Any]] = {}
    for q in (results.get("preset") or {}).get("questions") or []:
        tuned = reuse.get(q["a"])
        if not q["family"].startswith("reuse-") or tuned is None:
            continue
        level = tuned["level"]
        row = out.setdefault(tuned["k"], {"level": level, "curves": {}, "bases": {}})

        def by_x(values: dict[int, dict[int, float]], level: int = level
                 ) -> dict[float, dict[int, float]]:
            return {budgets[i] / budgets[level]: dict(seeds) for i, seeds in sorted(
                values.items()) if seeds}

        row["curves"]["grown"] = by_x(side_values(q["a"], table, envs))
        row["curves"][q["family"].removeprefix("reuse-")] = by_x(side_values(q["b"], table,
                                                                             envs))
    base_size = ((results.get("preset") or {}).get("reuse") or {}).get("base")
    families = {v["family"] for v in table.values() if v["kind"] == "reuse"}
    for row in out.values():  # the finished bases the continuations start from
        for family in sorted(families):
            base = table.get(size_key(family, base_size)) if base_size else None
            if base is not None and row["level"] in base["budgets"]:
                row["bases"][family] = {s: x[0] for s, x in
                                        base["budgets"][row["level"]].items()}
    return out


def _reuse_plot(results: dict[str, Any], series: dict[float, dict[str, Any]],
                summary: dict[str, Any], out: Path) -> None:
    """reuse.png: one column per level k. Top: validation loss against the incremental
    compute X (log) for the grown base and every rival (mean over held-out seeds, band
    min–max), the finished bases' losses as horizontal lines (X = 0: nothing more spent).
    Bottom: each pre-registered answer, grown − rival with its 95 % paired t interval, the
    ±margin shaded (symlog: R1's gaps are tenths of a nat, R3's and R4's hundredths)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullFormatter

    ks = sorted(series)
    fig = Figure(figsize=(4.6 * len(ks), 8.4), layout="constrained")
    axes = fig.subplots(2, len(ks), squeeze=False)
    answers = [a for a in summary.get("answers") or []
               if a["question"]["family"].startswith("reuse-") and a.get("n")]
    budgets = results["budgets"]
    for col, k in enumerate(ks):
        row = series[k]
        ax = axes[0][col]
        for name, curve in row["curves"].items():
            color, marker, label = REUSE_STYLE.get(name, ("tab:green", "x", name))
            xs = sorted(curve)
            ax.plot(xs, [mean_of(list(curve[x].values())) for x in xs], color=color,
                    marker=marker, markersize=4, linewidth=2.0 if name == "grown" else 1.1,
                    label=label)
            if any(len(curve[x]) > 1 for x in xs):
                ax.fill_between(xs, [min(curve[x].values()) for x in xs],
                                [max(curve[x].values()) for x in xs], color=color, alpha=0.12,
                                linewidth=0)
        for family, losses in row["bases"].items():
            ax.axhline(mean_of(list(losses.values())), linewidth=1,
                       color="tab:blue" if family == "tokenformer" else "tab:red",
                       linestyle="--" if family == "tokenformer" else ":",
                       label=f"{FAMILY_LABEL.get(family, family)} base (X = 0)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("incremental compute X (× the base's training FLOPs)")
        ax.set_ylabel("validation loss (nats/token)")
        ax.set_title(f"base finished at k = {k:g} tokens/parameter", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if col == 0:  # one legend: the columns share their curves
            ax.legend(fontsize=6.5)
        ax = axes[1][col]
        rivals = sorted({a["question"]["family"].removeprefix("reuse-") for a in answers})
        for i, rival in enumerate(rivals):
            rows = sorted((a for a in answers if a["question"]["id"] == f"{rival}-{k_label(k)}"),
                          key=lambda a: a["budget_index"])
            if not rows:
                continue
            shift = 1 + 0.06 * (i - (len(rivals) - 1) / 2)  # side by side
            xs = [budgets[a["budget_index"]] / budgets[row["level"]] * shift for a in rows]
            color, marker, label = REUSE_STYLE.get(rival, ("tab:green", "x", rival))
            ax.errorbar(xs, [a["mean"] for a in rows],
                        yerr=[[a["mean"] - a["ci_low"] for a in rows],
                              [a["ci_high"] - a["mean"] for a in rows]],
                        color=color, marker=marker, markersize=4, capsize=2, linewidth=1,
                        linestyle="none", label=f"grown − {label}")
        margin = next((a["margin"] for a in answers if a.get("margin")), None)
        if margin:
            ax.axhspan(-margin, margin, color="tab:green", alpha=0.12, linewidth=0,
                       label=f"±{margin:g} (equivalence margin)")
        ax.axhline(0.0, color="black", linewidth=1)
        ax.set_yscale("symlog", linthresh=0.05)
        ticks = [-1, -0.5, -0.2, -0.1, -0.05, -0.02, 0, 0.02, 0.05, 0.1, 0.2, 0.5, 1]
        ax.yaxis.set_major_locator(FixedLocator(ticks))
        ax.yaxis.set_major_formatter("{x:g}")
        ax.yaxis.set_minor_locator(FixedLocator([]))
        xs_grown = sorted(row["curves"].get("grown") or [1.0])
        ax.set_xscale("log")
        ax.set_xlim(xs_grown[0] / 1.6, xs_grown[-1] * 1.6)  # the X cells, not R1/R2's reach
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("incremental compute X")
        ax.set_ylabel("grown − rival (nats; 95 % paired t interval)")
        ax.set_title("< 0: growing wins (symlog beyond ±0.05)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if col == 0:
            ax.legend(fontsize=6.5, loc="upper left")
    atomic_write(out / "reuse.png", lambda tmp: fig.savefig(tmp, format="png", dpi=110))
