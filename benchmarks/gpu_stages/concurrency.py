"""Stage ``concurrency``: how to fill one GPU with the frontier's small runs (issue 35: processes
or CUDA graphs of the training step, "measure which"). The ``--frontier-preset``'s largest
TokenFormer run (benchmarks/frontier_probe.py: ``fit`` at the preset's batch and precision) k
times at once, eager for k = 1, 8, 4, 2, and with CUDA graphs of the step (``torch.compile(mode=
"reduce-overhead")``, what ``scale --compile reduce-overhead`` trains with) for k = 8, 1, 4, in
that order (the deciding ones first); the k runs' timed steps are released together (a barrier).
Reports ms per step, the steps/s of all k runs and, for gpu-code, the whole preset's time each
configuration predicts: its measured eager ``--jobs 8`` time scaled by the throughputs.

That measured time (``GPU_CODE_EAGER8_MIN``) came from the 118 run records of the one gpu-code
lease, which were lost before they were committed (docs/results/frontier-gpu.md): the number is
kept as that page reports it and cannot be recomputed from the repository. Not part of the lease.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import log
from frontier_probe import sizes as probe_sizes

from .base import ROOT, StageContext, subprocess_env

PROBE = ROOT / "benchmarks" / "frontier_probe.py"
# (mode, runs at once): eager at 1, 8, 4, 2 processes, the step as CUDA graphs at 8, 1, 4; the
# deciding ones first (the stage stops starting configurations when its minutes are spent)
CONCURRENCY_PLAN = (("eager", 1), ("eager", 8), ("graphs", 8), ("graphs", 1), ("eager", 4),
                    ("eager", 2), ("graphs", 4))
# gpu-code's whole run with --jobs 8 eager, measured on an H200 (docs/results/frontier-gpu.md:
# benchmarks/frontier_steps.py --preset gpu-code --jobs 8 --measured on the lease's run records,
# which were lost before they were committed: this number cannot be recomputed)
GPU_CODE_EAGER8_MIN = 20.8
CONCURRENCY_SMOKE = (("eager", 1), ("eager", 2))


def probe_runs(mode: str, jobs: int, size: str, device: torch.device, args: Any,
               limit: float) -> list[dict[str, Any]]:
    """``jobs`` processes of benchmarks/frontier_probe.py at once, their timed steps released
    together (a barrier folder); each one's JSON line (or an ``error``)."""
    with tempfile.TemporaryDirectory() as barrier:
        command = [sys.executable, str(PROBE), "--preset", args.frontier_preset,
                   "--family", "tokenformer", "--size", size, "--mode", mode,
                   "--device", device.type, "--barrier", barrier,
                   "--warmup", str(2 if args.smoke else 5), "--steps", str(2 if args.smoke else 30),
                   *(["--smoke"] if args.smoke else [])]
        procs = [subprocess.Popen(command, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(jobs)]
        deadline = time.monotonic() + limit
        while len(list(Path(barrier).glob("ready-*"))) < jobs and time.monotonic() < deadline \
                and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        (Path(barrier) / "go").touch()  # all ready (or one died, or out of time): release
        rows = []
        for proc in procs:
            try:
                stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            line = next((s for s in reversed(stdout.splitlines()) if s.startswith("{")), None)
            rows.append(json.loads(line) if proc.returncode == 0 and line else
                        {"error": (stderr.strip().splitlines() or ["killed"])[-1][:300]})
    return rows


def predict_gpu_code(rows: list[dict[str, Any]]) -> bool:
    """Add to each row the whole gpu-code preset's minutes at its throughput: the measured eager
    ``--jobs 8`` time × (eager × 8 steps/s) / (the row's steps/s). False without an eager × 8
    row to scale from."""
    eager8 = next((r["steps_per_s"] for r in rows if (r["mode"], r["jobs"]) == ("eager", 8)),
                  None)
    if not eager8:
        return False
    for r in rows:
        r["gpu_code_min"] = GPU_CODE_EAGER8_MIN * eager8 / r["steps_per_s"]
    return True


def concurrency_stage(ctx: StageContext) -> dict[str, Any]:
    """The frontier preset's largest TokenFormer run, k at once: which of more processes and CUDA
    graphs of the step gets the most steps out of one GPU (issue 35)."""
    args, device = ctx.args, ctx.device
    # the TokenFormer sizes of --frontier-preset, smallest first, as the probe builds them
    configs = list(probe_sizes(args.frontier_preset, "tokenformer", args.smoke))
    size = configs[0] if args.smoke else configs[-1]  # smoke: the smallest, for a CPU
    plan = CONCURRENCY_SMOKE if args.smoke else CONCURRENCY_PLAN
    stop = min(time.monotonic() + 60 * args.concurrency_minutes, ctx.deadline)
    rows, notes, base = [], [], None
    for mode, jobs in plan:
        left = stop - time.monotonic()
        if left < 30:
            notes.append(f"stopped before {mode} × {jobs}: the stage's "
                         f"{args.concurrency_minutes:g} min were spent")
            break
        log(f"concurrency: {size} {mode} × {jobs}")
        runs = probe_runs(mode, jobs, size, device, args, left)
        good = [r for r in runs if "ms_per_step" in r]
        if len(good) < jobs:
            notes += [f"{mode} × {jobs}: {r['error']}" for r in runs if "error" in r][:2]
        if not good:
            continue
        ms = statistics.median(r["ms_per_step"] for r in good)
        steps_per_s = 1000 * len(good) / ms
        base = base or (steps_per_s if (mode, jobs) == plan[0] else None)
        rows.append({"size": size, "mode": mode, "jobs": jobs, "ms_per_step": ms,
                     "steps_per_s": steps_per_s,
                     "vs_one_eager": steps_per_s / base if base else float("nan"),
                     "first_step_s": max(r["first_step_s"] for r in good)})
    if args.frontier_preset == "gpu-code" and predict_gpu_code(rows):
        notes.append(f"gpu-code min: the whole gpu-code preset at that mode and --jobs, "
                     f"predicted as its {GPU_CODE_EAGER8_MIN:g} min measured eager with --jobs 8 "
                     f"× (eager × 8 steps/s here) / (this row's steps/s), plus each worker's "
                     f"compiles (first step s, once per size a worker trains) for graphs; "
                     f"≤ 8 min: run it with --frontier-compile reduce-overhead into a fresh "
                     f"--frontier-dir (docs/results/frontier-gpu.md)")
    notes.append("ms/step: the median over the k runs of each run's median timed step, the k "
                 "runs' timed steps released together; steps/s: all k runs together "
                 "(k × 1000 / ms). graphs: inductor with CUDA graphs (what "
                 "torch.compile(mode=\"reduce-overhead\") sets), compiled during the warm-up "
                 "(first step s)")
    return {"title": "frontier runs sharing one GPU", "ok": bool(rows), "rows": rows,
            "notes": notes,
            "columns": [("size", "size", "{}"), ("mode", "mode", "{}"),
                        ("jobs", "runs at once", "{}"),
                        ("ms_per_step", "ms/step", "{:.1f}"),
                        ("steps_per_s", "steps/s (all runs)", "{:.1f}"),
                        ("vs_one_eager", "× one eager run", "{:.2f}"),
                        ("first_step_s", "first step s", "{:.1f}"),
                        ("gpu_code_min", "gpu-code min", "{:.1f}")]}
