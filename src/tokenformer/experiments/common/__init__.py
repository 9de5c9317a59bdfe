"""What every experiment shares: arms over seeds, LR sweeps, the statistics rule, report helpers.

:mod:`.arms` runs named recipes over seeds into curves (resumable), :mod:`.sweep` tunes a
learning rate, :mod:`.stats` is the one decision rule for seed-paired comparisons,
:mod:`.report` formats tables, JSON and plots, :mod:`.machine` records the machine,
:mod:`.saved` reads saved state or says it is damaged.
"""

from .arms import Arm, Curve, Event, Point, fingerprint, mean_curve, run_arms
from .machine import machine_summary
from .report import fmt, have_matplotlib, markdown_table, plot_curves, to_json
from .saved import damaged, is_mapping_of, read_saved_json
from .stats import Paired, Spread, paired, spread, t_interval
from .sweep import LRSweep, extend_grid, sweep_lr

__all__ = [
           "Arm",
           "Curve",
           "Event",
           "LRSweep",
           "Paired",
           "Point",
           "Spread",
           "damaged",
           "extend_grid",
           "fingerprint",
           "fmt",
           "have_matplotlib",
           "is_mapping_of",
           "machine_summary",
           "markdown_table",
           "mean_curve",
           "paired",
           "plot_curves",
           "read_saved_json",
           "run_arms",
           "spread",
           "sweep_lr",
           "t_interval",
           "to_json",
]
