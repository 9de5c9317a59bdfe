"""The GPU measurements of the project, every result written as JSON and markdown under ``--out``.

    python benchmarks/gpu.py --lease --out $OUT/lease       # a lease: every stage, ≤ 9.5 min
    python benchmarks/gpu.py --stage train --out $OUT/gpu   # one or more stages in one process
    python benchmarks/gpu.py --lease --smoke --device cpu --out /tmp/gpu   # all, tiny, on a CPU

``--lease`` runs, in this order and each in a process of its own with a time limit, the
environment, the device tests, compiled training, decoding, Pattention vs MLP and, in the time
left, the frontier (benchmarks/gpu_stages/lease.py). ``--stage`` takes one or more of ``env``,
``tests``, ``train``, ``pattention``, ``decode``, ``concurrency``, ``frontier`` or ``all``; each
stage is a module of benchmarks/gpu_stages/ whose docstring says what it measures. Every call
records the environment (versions of torch, CUDA, cuDNN, triton and transformers, the GPU and its
driver, the CPU count, and the bf16 matmul rate and copy bandwidth measured on that device) and
writes ``results.json`` and ``results.md`` under ``--out``, each stage's entry as the stage ends
(and partial entries while it runs).

The device machine (torch + CUDA, triton, transformers, pytest, no package registry) needs
nothing else: the library is imported from this checkout's ``src/``, also by the subprocesses.
``--smoke`` shrinks every shape and step count (and compiles with the ``eager`` backend: dynamo
traces, inductor is skipped), and the frontier only prints its plan, so that every stage runs on
a CPU; tests/test_gpu_bench.py runs ``--lease --smoke``, so the script cannot rot before a GPU
session. docs/performance.md, section "GPU", has the stage table and the next lease's command.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

STARTED = time.monotonic()  # a lease's budget counts the imports below too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's library
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_stages.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(description=__doc__.split("\n\n")[0], started=STARTED))
