"""The stages of benchmarks/gpu.py, one module each (the entry point, its flags and the device
calls are in that script's docstring and docs/performance.md, section "GPU").

``base``: shapes (``Sizes``), the stage context, helpers every stage shares; ``environment``;
``device_tests``; ``training``; ``layers`` (Pattention vs MLP); ``decoding``; ``concurrency``;
``frontier``; ``workers`` (candidates built and compiled in parallel processes, timed one at a
time); ``results`` (results.json / results.md); ``cli`` (the per-stage calls); ``lease`` (every
stage in one command of at most 9.5 minutes, each in a process of its own with a time limit).
"""
