"""Controlled experiments: each a folder whose data flows one way, plan → run → report.

:mod:`.common` is what they share (arms over seeds, LR sweeps, the one statistics rule, report
helpers). The experiments: :mod:`.frontier` (loss vs compute, ``tokenformer scale``),
:mod:`.ablate` (the paper's ablations, ``tokenformer ablate``), :mod:`.adapt_bench` (token
adapters vs LoRA, ``tokenformer adapt-bench``) and :mod:`.sparse` (top-k Pattention and pruning,
``tokenformer sparse-study``). In each, ``plan`` is pure data (presets, arms), ``run`` trains and
measures (resumable where long) and ``report`` turns the results into statistics, the verdict's
prose, markdown and plots.
"""

from .common.arms import Arm, Curve, Event, Point, run_arms
from .common.stats import Paired, Spread, paired, spread

__all__ = ["Arm", "Curve", "Event", "Paired", "Point", "Spread", "paired", "run_arms", "spread"]
