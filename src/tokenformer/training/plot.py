"""Loss curves of training runs against step, tokens, FLOPs and wall-clock (matplotlib, optional).

``plot_runs([run_dir, ...], "curves.png")`` reads each run's ``metrics.jsonl``: training loss as a
thin line, validation loss as markers, growth events as dotted vertical lines.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..io.files import atomic_path
from ..io.metrics import read_metrics

AXES = (("step", "step"), ("tokens", "tokens"), ("flops", "training FLOPs"),
        ("elapsed", "wall-clock (s)"))


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'tokenformer[plot]'") from None
    return plt


def plot_runs(run_dirs: list[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    """Draw a 2×2 figure of the runs' losses and write it to ``out`` (PNG) atomically."""
    runs = [(Path(d), read_metrics(d)) for d in run_dirs]  # fails before matplotlib loads
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for (key, label), ax in zip(AXES, axes.flat, strict=True):
        for i, (path, records) in enumerate(runs):
            color = f"C{i % 10}"
            train = [r for r in records if r["type"] == "train"]
            evals = [r for r in records if r["type"] == "eval"]
            ax.plot([r[key] for r in train], [r["loss"] for r in train], color=color,
                    alpha=0.35, linewidth=0.8)
            if evals:
                ax.plot([r[key] for r in evals], [r["val_loss"] for r in evals], "o-",
                        color=color, markersize=3, label=f"{path.name} (val)")
            for r in records:
                if r["type"] == "grow":
                    ax.axvline(r[key], color=color, linestyle=":", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("loss (nats/token)")
        if key in ("tokens", "flops"):
            ax.ticklabel_format(style="sci", axis="x", scilimits=(0, 0))
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or "training (thin: train loss, markers: validation, dotted: growth)")
    fig.tight_layout()
    out = Path(out)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return out
