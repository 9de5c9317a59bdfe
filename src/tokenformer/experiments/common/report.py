"""Report helpers shared by the experiments: table numbers and markdown, strict JSON, plots."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ...io.files import atomic_write
from .arms import Curve, mean_curve


# ------------------------------------------------------------------------------------- tables
def fmt(value: float | None, digits: int = 4) -> str:
    """A number for a table: ``—`` for missing, scientific notation for large magnitudes."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:.{digits}f}"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]],
                   align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one letter per column (l, r, c), default l then r."""
    align = align or "l" + "r" * (len(header) - 1)
    rule = {"l": ":---", "r": "---:", "c": ":---:"}
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule[a] for a in align) + " |"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(c if isinstance(c, str) else fmt(c) for c in row) + " |")
    return "\n".join(lines)


def to_json(data: Any) -> str:
    """JSON with NaN/inf written as null (strict JSON readers reject them)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(data), indent=1, allow_nan=False) + "\n"



# -------------------------------------------------------------------------------------- plots
AXIS_LABELS = {"flops": "cumulative training FLOPs", "wall": "wall-clock (s, training only)",
               "step": "step", "tokens": "tokens",
               "loss": "validation loss (nats/token)", "bpb": "validation bits per byte",
               "accuracy": "test accuracy (top-1)"}


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_curves(curves: dict[str, list[Curve]], path: str | Path, *, x: str = "flops",
                y: str = "loss", labels: dict[str, str] | None = None, title: str = "",
                logx: bool = True, ylim: tuple[float, float] | None = None, dpi: int = 110
                ) -> Path:
    """One curve per arm (mean over seeds, min–max band when several; tab10 colours in arm
    order), events marked by dots. Written atomically as PNG."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # lazy: the ``plot`` extra

    fig = Figure(figsize=(10, 5.6), layout="constrained")
    ax = fig.add_subplot()
    cmap = colormaps["tab10"]
    for i, (name, runs) in enumerate(curves.items()):
        mean = mean_curve(runs)
        xs, ys = mean.column(x), mean.column(y)
        color = cmap(i % 10)[:3]
        ax.plot(xs, ys, linestyle="-", color=color, linewidth=1.4,
                label=(labels or {}).get(name, name))
        if len(runs) > 1:
            lo = [min(c) for c in zip(*(r.column(y) for r in runs), strict=True)]
            hi = [max(c) for c in zip(*(r.column(y) for r in runs), strict=True)]
            ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        for event in mean.events:
            # the first evaluation of the grown model sits at the event's step
            after = [i for i, p in enumerate(mean.points) if p.step == event.step]
            if after:
                ax.plot([xs[after[-1]]], [ys[after[-1]]], "o", color=color, markersize=4)
    if logx:
        ax.set_xscale("log")
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_xlabel(AXIS_LABELS.get(x, x))
    ax.set_ylabel(AXIS_LABELS.get(y, y))
    ax.set_title(title + ("  (dots: growth)" if any(c[0].events for c in curves.values())
                          else ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
    return path
