"""One part of the sparse study, measured and reported: the settings object of a part (:mod:`.plan`)
says which, :mod:`.run` measures it (rows only) and :mod:`.report` turns the rows into the
part's result (intervals, paired tests), the dict ``tokenformer sparse-study`` prints and saves."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import report, run
from .plan import CompareMLP, PruneCurve, PruneSeeds, Quality, TrainArms

Part = TrainArms | Quality | PruneCurve | CompareMLP | PruneSeeds

# settings class → (what measures it, what reports its rows); prune-seeds has two results
# (rows and the LR sweeps) and a re-render path, so it is handled apart
_PARTS: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], dict[str, Any]]]] = {
    TrainArms: (run.train_arms, report.train_arms),
    Quality: (run.quality, report.quality),
    PruneCurve: (run.prune_curve, report.prune_curve),
    CompareMLP: (run.compare_mlp, report.compare_mlp),
}


def measure(part: Part, *, from_json: str | Path | None = None) -> dict[str, Any]:
    """Measure ``part`` and return its result. For :class:`PruneSeeds`, ``from_json`` re-renders
    an earlier run's saved rows instead of measuring anything."""
    if isinstance(part, PruneSeeds):
        rows, sweeps = (report.load_prune_seeds(from_json) if from_json is not None
                        else run.prune_seeds(part))
        return report.prune_seeds(part, rows, sweeps)
    if from_json is not None:
        raise ValueError("from_json re-renders prune-seeds only")
    measure_rows, report_rows = _PARTS[type(part)]
    return report_rows(part, measure_rows(part))
