"""The loss-vs-compute frontier experiment behind ``tokenformer scale`` (issue 15).

Data flows one way: :mod:`.plan` (presets → runs, pure data) → :mod:`.run` (trains them,
resumable, writes ``results.json``; one run is :mod:`.one_run`'s, its saved state
:mod:`.state`'s, a chain's growths :mod:`.growing`'s) → :mod:`.report` (``results.json`` →
``report.md`` + plots, the verdict's prose).
"""
