"""The command line of benchmarks/gpu.py: one or more stages in this process (``--stage``), or
the whole lease (``--lease``: every stage in a process of its own, ``lease``)."""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import command_line, log

from tokenformer.training.config import COMPILE_MODES as TORCH_COMPILE_MODES

from .base import (
    COMPILE_MODES,
    FULL,
    ROOT,
    SMOKE,
    STAGES,
    TRAIN_MODELS,
    StageContext,
    free_memory,
)
from .environment import environment
from .lease import LEASE_BUDGET_S, run_lease
from .results import header, load_results, section, write_results
from .workers import compile_backend

# stage → (module, function): imported when the stage runs (a lease runs each stage in a process
# of its own, which then imports only what that stage needs)
STAGE_FUNCTIONS = {"tests": ("device_tests", "tests_stage"), "train": ("training", "train_stage"),
                   "pattention": ("layers", "pattention_stage"),
                   "decode": ("decoding", "decode_stage"),
                   "concurrency": ("concurrency", "concurrency_stage"),
                   "frontier": ("frontier", "frontier_stage")}
PATTENTION_IMPLS = ("fused", "reference", "triton")


def stage_function(stage: str) -> Callable[[StageContext], dict[str, Any]]:
    module, function = STAGE_FUNCTIONS[stage]
    return getattr(importlib.import_module(f"{__package__}.{module}"), function)


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--lease", action="store_true",
                        help="every stage of a GPU lease in one command (≤ --budget-s), each in "
                             "a process of its own with a time limit (docs/performance.md)")
    parser.add_argument("--budget-s", type=float, default=LEASE_BUDGET_S,
                        help="--lease: seconds for all stages together (default 570: 9.5 min)")
    parser.add_argument("--stage", nargs="+", default=["all"],
                        choices=["env", *STAGES, "all"], metavar="STAGE",
                        help="env, tests, train, pattention, decode, concurrency, frontier or all "
                             "(several allowed; env is recorded by every call)")
    parser.add_argument("--out", required=True, help="folder of results.json / results.md")
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"],
                        help="cuda or cpu (default: cuda where available)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes and step counts: every stage on a CPU")
    parser.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help="each stage writes what it has and ends within S seconds")
    parser.add_argument("--deadline", type=float, default=None, metavar="EPOCH",
                        help="as --time-limit, up to this wall-clock time (time.time(); what "
                             "--lease passes: its limits count from the stage's start)")
    parser.add_argument("--reuse-env", action="store_true",
                        help="take the environment from --out's results.json when it was "
                             "measured on this device (a lease measures it once)")
    parser.add_argument("--workers", choices=["auto", "processes", "inline"], default="auto",
                        help="train, pattention, decode: each candidate in a process of its own, "
                             "compiled at once (processes), or all in this one (inline); auto: "
                             "processes on CUDA")
    parser.add_argument("--modes", nargs="+", default=list(COMPILE_MODES),
                        choices=COMPILE_MODES, help="train and pattention: eager, compiled")
    parser.add_argument("--train-models", nargs="+", default=None, choices=TRAIN_MODELS,
                        metavar="MODEL", help=f"train: only these of {', '.join(TRAIN_MODELS)} "
                                              f"(default: all)")
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="train: skip the profile of one step of each model")
    parser.add_argument("--pattention-shapes", nargs="+", default=None, metavar="DxN",
                        help="pattention: these d×n (default 768x3072 1536x6144); Q/K/V at the "
                             "first one's d")
    parser.add_argument("--pattention-impls", nargs="+", default=list(PATTENTION_IMPLS),
                        choices=PATTENTION_IMPLS, help="pattention: the Pattention impls timed")
    parser.add_argument("--no-qkv", dest="qkv", action="store_false",
                        help="pattention: skip the Q/K/V rows")
    parser.add_argument("--tests-keyword", default=None, metavar="EXPR",
                        help="tests: only the tests pytest -k EXPR selects (e.g. "
                             "compiled_training: the compiled fit against eager, both modes)")
    parser.add_argument("--no-cpu-tests", dest="cpu_tests", action="store_false",
                        help="tests: on CUDA, skip the second run of the file on the CPU")
    parser.add_argument("--extra-tests", nargs="*", default=[],
                        help="tests: more test files, run on the CPU (e.g. tests/test_fused.py)")
    parser.add_argument("--frontier-preset", default="gpu-code",
                        help="tokenformer scale --preset (gpu-code: its corpus is built here, no "
                             "--frontier-data)")
    parser.add_argument("--frontier-data", default=None, help="tokenformer scale --data")
    parser.add_argument("--frontier-dir",
                        default=str(ROOT / "docs" / "results" / "frontier-gpu-code"),
                        help="the frontier's folder (a rerun continues from it: commit it "
                             "between leases)")
    parser.add_argument("--frontier-jobs", type=int, default=8,
                        help="tokenformer scale --jobs: small runs leave the GPU idle between "
                             "launches, so several share it")
    parser.add_argument("--frontier-compile", choices=("off", *TORCH_COMPILE_MODES), default="off",
                        help="tokenformer scale --compile: reduce-overhead trains every step as "
                             "CUDA graphs (a new experiment: a fresh --frontier-dir)")
    parser.add_argument("--concurrency-minutes", type=float, default=4.0,
                        help="concurrency: stop starting configurations after this long")
    parser.add_argument("--frontier-minutes", type=float, default=7.5,
                        help="stop the frontier (SIGINT) after this long")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, description: str = "",
         started: float | None = None) -> int:
    """benchmarks/gpu.py (``started``: its ``time.monotonic()`` at start, from which a lease's
    budget counts)."""
    args = parse_args(argv, description)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: CUDA is not available", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.lease:
        return run_lease(args, device, out, time.monotonic() if started is None else started)
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:  # toy shapes gain nothing from threads, and a shared CI machine slows them
        torch.set_num_threads(1)
    stages = [s for s in STAGES if s in args.stage or "all" in args.stage]
    deadline = time.monotonic() + min(args.time_limit or math.inf,
                                      math.inf if args.deadline is None
                                      else args.deadline - time.time())
    results = load_results(out)
    command = command_line()
    log(f"gpu.py: stages {', '.join(['env', *stages])} on {device} → {out}")
    if not (args.reuse_env and results.get("env", {}).get("device") == str(device)):
        results["env"] = environment(device, sizes)
    write_results(out, results)
    print(header(results["env"]), flush=True)
    status = 0
    with compile_backend(sizes.compile_backend):
        for stage in stages:
            start = time.perf_counter()

            def stamped(r: dict[str, Any], **extra: Any) -> dict[str, Any]:
                return {**r, "command": command, "device": results["env"]["summary"],
                        "smoke": args.smoke, "seconds": time.perf_counter() - start,  # noqa: B023
                        "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **extra}

            def save(r: dict[str, Any], stage: str = stage) -> None:
                results[stage] = stamped(r, partial=True)
                write_results(out, results)

            log(f"gpu.py: {stage} ...")
            try:
                ctx = StageContext(device, sizes, args, out, deadline, save)
                r = stage_function(stage)(ctx)
            except KeyboardInterrupt:  # a lease's time limit: keep what the stage had saved
                r = results.get(stage, {}) if results.get(stage, {}).get("partial") else {
                    "title": stage, "rows": [], "columns": [], "notes": []}
                r = {**r, "ok": False, "notes": [*r["notes"], "interrupted (SIGINT, e.g. the "
                     "lease's time limit): the rows are those the stage had finished"]}
                results[stage] = stamped(r, partial=True)
                write_results(out, results)
                log(f"gpu.py: {stage} interrupted")
                return 130
            except Exception as exc:  # one stage's failure must not lose the others' results
                log(f"gpu.py: {stage} FAILED: {type(exc).__name__}: {exc}")
                traceback.print_exc()
                free_memory()
                r = {"title": stage, "ok": False, "rows": [], "columns": [],
                     "notes": [f"FAILED: {type(exc).__name__}: {str(exc).strip()[:500]} "
                               f"(traceback on stderr)"]}
            results[stage] = stamped(r)
            write_results(out, results)
            if not r.get("ok", True):
                status = 1
            log(f"gpu.py: {stage} done in {results[stage]['seconds']:.0f} s")
            # stdout as each stage ends (a call killed at its limit still shows the finished
            # ones); the long profiles only in results.md
            print(section(results[stage], profiles=False), flush=True)
    return status
