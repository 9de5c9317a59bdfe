"""The loss-vs-compute frontier experiment behind ``tokenformer scale`` (issue 15).

Data flows one way: :mod:`.plan` (presets → runs, pure data) → :mod:`.run` (trains them,
resumable, writes ``results.json``) → :mod:`.report` (``results.json`` → ``report.md`` + plots,
the verdict's prose).
"""
