"""Parameter tokens as experts (``tokenformer sparse-study``, docs/sparse.md): top-k and pruning.

What top-k Pattention and pruning parameter tokens cost in quality, against pruning a matched
Transformer++'s MLP neurons, on trained models paired by seed. Data flows one way: :mod:`.plan`
(the grids, arms and questions; one settings class per part) → :mod:`.run` (trains and measures,
rows only; :mod:`.mlp` prunes the baseline) → :mod:`.report` (intervals, paired tests, the
markdown sections and plots). The speed of top-k and product keys is measured apart, by
``benchmarks/sparse.py``.
"""

from .plan import CompareMLP, PruneCurve, PruneSeeds, Quality, TrainArms
from .report import plot, plot_seeds, save_json, section
from .study import Part, measure

# What the CLI (and a user's script) calls; the modules behind it are internal (pyproject.toml's
# contract "the CLI imports each experiment through its package").
__all__ = ["CompareMLP", "Part", "PruneCurve", "PruneSeeds", "Quality", "TrainArms", "measure",
           "plot", "plot_seeds", "save_json", "section"]
