"""Controlled experiments: named arms trained over seeds, curves, statistics, reports and plots.

:mod:`.common` is the generic machinery (any set of arms); :mod:`.scale` is the progressive
scaling experiment behind ``tokenformer scale``.
"""

from .common import Arm, Curve, Event, Paired, Point, Spread, paired, run_arms, spread

__all__ = ["Arm", "Curve", "Event", "Paired", "Point", "Spread", "paired", "run_arms", "spread"]
