"""Controlled experiments: named arms trained over seeds, curves, statistics, reports and plots.

:mod:`.common` is the generic machinery (any set of arms), :mod:`.stats` the one statistics
rule; :mod:`.frontier` is the loss-vs-compute experiment behind ``tokenformer scale``.
"""

from .common import Arm, Curve, Event, Point, run_arms
from .stats import Paired, Spread, paired, spread

__all__ = ["Arm", "Curve", "Event", "Paired", "Point", "Spread", "paired", "run_arms", "spread"]
