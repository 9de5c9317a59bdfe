"""The frontier's plots from ``results.json``: the loss-vs-FLOPs frontier per family with each
growing arm's gap to its envelope, the LR sweeps, and loss against measured wall-clock."""

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
    wall_clock,
)
from .presets import DENSE_FAMILIES

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
    families = sorted({v["family"] for v in table.values()}, key=lambda f: order.get(f, 99))
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
