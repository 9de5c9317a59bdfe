"""Timing helpers shared by the speed benchmarks (fused.py, compile.py, decode.py).

This machine is shared: other jobs come and go, so wall-clock times of one side can be hit by a
burst the other side never saw. Candidates are therefore run interleaved (round-robin, order
rotated each round) and the *minimum* over rounds is reported next to the median: the minimum is
the least-disturbed run and the one that ratios should use.

``--cpu-time`` (see :func:`add_clock_args`) goes further: one intra-op thread and the calling
thread's CPU time instead of wall time, which a busy machine barely perturbs (no time is counted
while the process waits for a core). The results then are single-core costs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

CLOCK: Callable[[], float] = time.perf_counter


def add_clock_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-time", action="store_true",
                        help="one thread, timed by thread CPU time (robust on a busy machine)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def apply_clock_args(args: argparse.Namespace) -> str:
    """Set threads and the clock from the parsed arguments; returns a phrase for the report."""
    global CLOCK
    if args.cpu_time:
        torch.set_num_threads(1)
        CLOCK = time.thread_time
        return "single-thread CPU time (time.thread_time)"
    if args.threads:
        torch.set_num_threads(args.threads)
    return f"wall time, {torch.get_num_threads()} threads"


def interleaved(fns: dict[str, Callable[[], object]], rounds: int, warmup: int = 2
                ) -> dict[str, dict[str, float]]:
    """Seconds per call of each function: ``{name: {"min": s, "median": s}}``."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            start = CLOCK()
            fns[name]()
            elapsed = CLOCK() - start
            if i >= warmup:
                times[name].append(elapsed)
    return {n: {"min": min(t), "median": statistics.median(t)} for n, t in times.items()}


def synchronized(fn: Callable[[], object], device: torch.device | str
                 ) -> Callable[[], object]:
    """``fn`` followed by waiting for the device (CUDA work is asynchronous: without the wait a
    timer would measure the kernel launches only). ``fn`` itself on the CPU."""
    if torch.device(device).type != "cuda":
        return fn

    def run() -> object:
        result = fn()
        torch.cuda.synchronize(device)
        return result
    return run


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return (f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); load average {load_average()}")


def autocast(precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def command_line(argv: list[str] | None = None) -> str:
    """How a benchmark script is invoked, as a reader would retype it (for a section's Command:):
    ``argv`` is [script, *arguments], by default this process's own."""
    script, *rest = sys.argv if argv is None else argv
    return " ".join(["python", f"benchmarks/{os.path.basename(script)}", *rest])


def load_average() -> str:
    return " / ".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def log(message: str) -> None:
    """Progress for the person watching: stderr, so stdout stays the RESULTS.md section."""
    print(message, file=sys.stderr, flush=True)
