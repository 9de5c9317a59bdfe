"""Offline lm-evaluation-harness tasks (YAML + builders), found via ``TaskManager(include_path=)``.

See :mod:`tokenformer.eval.tasks.kjv`; run with
``tokenformer eval MODEL --tasks kjv_lastword,kjv_choice``.
"""
