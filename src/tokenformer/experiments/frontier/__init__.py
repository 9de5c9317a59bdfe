"""The loss-vs-compute frontier experiment behind ``tokenformer scale`` (issue 15).

Data flows one way: :mod:`.plan` (presets → runs, pure data; a family's model configs are
:mod:`.configs`', the chains' stages :mod:`.chains`', the time estimates :mod:`.estimates`', the
plan in words :mod:`.plan_text`'s) → :mod:`.run` (trains them, resumable, writes
``results.json``; one run is :mod:`.one_run`'s, its saved state :mod:`.state`'s, a chain's
growths :mod:`.growing`'s) → :mod:`.report` (``results.json`` → the summary and the verdict's
prose, ``report.md`` (:mod:`.report_markdown`) + plots).
"""

from .plan_text import describe
from .presets import PRESETS, Preset, get_preset
from .run import COMPILE, run_frontier

# What the CLI (and a user's script) calls; the modules behind it are internal (pyproject.toml's
# contract "the CLI imports each experiment through its package").
__all__ = ["COMPILE", "PRESETS", "Preset", "describe", "get_preset", "run_frontier"]
