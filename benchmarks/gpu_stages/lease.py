"""``--lease``: every measurement a GPU lease is for, in one command of at most ``--budget-s``
(default 570 s: 9.5 of a device call's 10 minutes), in this order (issue 43):

1. ``env``: the environment (GPU, driver, CUDA, torch, triton, transformers, Python, CPUs; the
   bf16 matmul rate and the copy bandwidth), once;
2. ``tests``: ``tests/test_device.py --device cuda -k "triton or grouped or static or
   compiled"``;
3. ``train``: compiled training, interleaved in one run: Transformer++ (separate and fused
   projections), TokenFormer default, Triton Θ, Triton Θ + one Q/K/V GEMM; the "assuming every
   input is mutated" count and a profile of one step per model;
4. ``decode``: batch 1 and 32, ours eager and static + compiled, HF eager and static; tokens/s,
   ms per step, kernels per token, share of the bandwidth bound;
5. ``pattention``: Pattention (fused, triton) vs the faster of the eager and compiled MLP at
   768 × 3072 and 1536 × 6144;
6. ``frontier``: in the time left, ``--frontier-preset`` into ``--frontier-dir`` (resumable).

Each stage is ``benchmarks/gpu.py --stage NAME`` in a process group of its own, with a time
limit: the stage's own cap, cut so that the stages after it keep their minimum (but never below
its own: earlier stages come first). The stage knows its limit (``--deadline``, the wall-clock
time it ends: its imports count too) and saves what it has measured as it goes; at the limit it
gets SIGINT (it then writes what it had), 20 s later SIGKILL. A stage that fails, hangs or is
cut off loses only itself. After each stage ``results.json`` and ``results.md`` are rewritten
(each stage merges its entry; this process adds its own record, ``lease``, and the entry of a
stage that wrote none), every stage's output is appended to ``lease.log``, and the stage's
section is printed.
Under ``--out``: at most the eight files a device call returns (results.json, results.md,
lease.log, tests.log, frontier.log, frontier.tar.gz).

On CUDA the stages run with ``TOKENFORMER_KERNELS=0``: the C++ Θ kernel serves CPU tensors only,
and its ≈ 15 s build would be spent for nothing. ``--smoke`` (toy sizes on a shared CPU, where
every process start costs seconds) triples the caps, minimums and budget.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import command_line, log

from .base import ROOT, stop_at, subprocess_env
from .frontier import MIN_S as FRONTIER_MIN_S
from .frontier import STOP_S as FRONTIER_STOP_S
from .results import load_results, section, write_results

LEASE_BUDGET_S = 570.0
GRACE_S = 20.0  # from SIGINT to SIGKILL
LEASE_LOG = "lease.log"
LEASE_TESTS = "triton or grouped or static or compiled"
LEASE_MODELS = ("transformer++", "transformer++-fused", "tokenformer", "tokenformer-triton",
                "tokenformer-triton-qkv")
MAX_FILES = 8  # a device call returns at most 8 files from $OUT
SMOKE_SLACK = 3.0  # --smoke: caps, minimums and budget × this (a shared CPU, not a lent GPU)


@dataclass(frozen=True)
class LeaseStage:
    name: str  # the results.json entry the stage writes
    cap_s: float  # at most this long
    min_s: float  # not started with less; the stages before it leave it this much
    command: Callable[[float], list[str]]  # its command line, given its limit in seconds


def lease_plan(args: argparse.Namespace, device: torch.device, out: Path) -> list[LeaseStage]:
    """The stages of a lease, their caps and minimums (seconds; from the first H200 run's stage
    times: tests 66 s for the whole file, a compiled TokenFormer-150M 66 s, decoding 53 s
    eager-only, Pattention 71 s; the compiles now run at once in worker processes)."""
    script = str(ROOT / "benchmarks" / "gpu.py")
    common = ["--out", str(out), "--device", device.type, "--workers", args.workers,
              *(["--smoke"] if args.smoke else [])]

    def stage(name: str, *extra: str, reuse: bool = True) -> Callable[[float], list[str]]:
        return lambda limit: [sys.executable, script, "--stage", name, *common,
                              *(["--reuse-env"] if reuse else []),
                              "--deadline", f"{time.time() + limit:.1f}", *extra]

    def frontier(limit: float) -> list[str]:
        return [*stage("frontier", "--frontier-minutes", f"{limit / 60:.2f}",
                       "--frontier-preset", args.frontier_preset, "--frontier-dir",
                       args.frontier_dir, "--frontier-jobs", str(args.frontier_jobs),
                       "--frontier-compile", args.frontier_compile,
                       *(["--frontier-data", args.frontier_data] if args.frontier_data else []))(
                           limit)]

    plan = [
        LeaseStage("env", 60, 15, stage("env", reuse=False)),
        LeaseStage("tests", 120, 40, stage("tests", "--no-cpu-tests", *(
            () if args.smoke else ("--tests-keyword", LEASE_TESTS)))),  # smoke: Sizes' filter
        LeaseStage("train", 210, 120, stage("train", "--modes", "compiled",
                                            "--train-models", *LEASE_MODELS)),
        LeaseStage("decode", 170, 90, stage("decode")),
        LeaseStage("pattention", 90, 45, stage("pattention", "--pattention-impls", "fused",
                                               "triton", "--no-qkv")),
        LeaseStage("frontier", float("inf"),
                   10 if args.smoke else FRONTIER_STOP_S + FRONTIER_MIN_S, frontier),
    ]
    return [dataclasses.replace(s, cap_s=SMOKE_SLACK * s.cap_s, min_s=SMOKE_SLACK * s.min_s)
            for s in plan] if args.smoke else plan


def run_lease(args: argparse.Namespace, device: torch.device, out: Path, started: float) -> int:
    """The lease (module docstring); ``started``: the process's ``time.monotonic()`` at start
    (its imports count against the budget). 0 when every stage ended ``ok``."""
    extra = {"TOKENFORMER_KERNELS": os.environ.get("TOKENFORMER_KERNELS", "0")} \
        if device.type == "cuda" else {}
    budget = args.budget_s * (SMOKE_SLACK if args.smoke else 1) - (time.monotonic() - started)
    record = run_stages(lease_plan(args, device, out), out, budget, subprocess_env(**extra))
    return 0 if all(row["status"] == "ok" for row in record["rows"]) else 1


def run_stages(stages: list[LeaseStage], out: Path, budget_s: float, env: dict[str, str]
               ) -> dict[str, Any]:
    """Run ``stages`` in order within ``budget_s`` (module docstring); returns the ``lease``
    record (one row per stage: its limit, seconds, return code and status)."""
    start = time.monotonic()
    record: dict[str, Any] = {
        "title": "lease", "command": command_line(), "budget_s": budget_s, "rows": [],
        "notes": [f"Each stage a process of its own with a time limit (its cap, cut so that the "
                  f"later stages keep their minimum, never below its own), SIGINT at the limit, "
                  f"SIGKILL {GRACE_S:.0f} s later; budget {budget_s:.0f} s in all."],
        "columns": [("stage", "stage", "{}"), ("limit_s", "limit s", "{:.0f}"),
                    ("seconds", "s", "{:.0f}"), ("cpu_s", "CPU s", "{:.0f}"),
                    ("returncode", "exit", "{}"),
                    ("status", "status", "{}")]}
    log_path = out / LEASE_LOG
    for i, stage in enumerate(stages):
        # its cap, less what the later stages need, but never below its own minimum: the
        # stages come in the order of their priority; the grace after SIGINT is the budget's too
        room = budget_s - (time.monotonic() - start) - GRACE_S
        limit = min(stage.cap_s, room,
                    max(stage.min_s, room - sum(s.min_s for s in stages[i + 1:])))
        row = {"stage": stage.name, "limit_s": max(0.0, limit)}
        if limit < stage.min_s:
            row.update(status="skipped", seconds=0.0)
            entry = {"title": stage.name, "ok": False, "rows": [], "columns": [],
                     "notes": [f"skipped: {max(0.0, limit):.0f} s left for it of the lease's "
                               f"budget, < its minimum {stage.min_s:.0f} s"]}
        else:
            command = stage.command(limit)
            log(f"lease: {stage.name} (at most {limit:.0f} s)")
            offset = log_path.stat().st_size if log_path.exists() else 0
            returncode, timed_out, seconds, cpu = run_stage(command, limit, log_path, env)
            entry = load_results(out).get(stage.name)
            row.update(seconds=seconds, cpu_s=cpu, returncode=returncode,
                       status="timed out" if timed_out else "ok" if returncode == 0 and entry
                       else "failed")
            entry = stage_entry(stage.name, entry, row, command, log_path, offset)
        results = load_results(out)
        if stage.name != "env" or row["status"] != "ok":
            results[stage.name] = entry
        record["rows"].append(row)
        record.update(seconds=time.monotonic() - start,
                      device=results.get("env", {}).get("summary", "?"),
                      written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        results["lease"] = record
        write_results(out, results)
        print(section(results[stage.name], profiles=False) if "title" in results.get(
            stage.name, {}) else f"{stage.name}: {row['status']}", flush=True)
    files = [p.name for p in out.rglob("*") if p.is_file()]
    if len(files) > MAX_FILES:
        record["notes"].append(f"{len(files)} files under --out, more than the {MAX_FILES} a "
                               f"device call returns: {', '.join(sorted(files))}")
    results = load_results(out)
    results["lease"] = record
    write_results(out, results)
    print(summary(results), flush=True)
    return record


def stage_entry(name: str, entry: dict[str, Any] | None, row: dict[str, Any],
                command: list[str], log_path: Path, offset: int) -> dict[str, Any]:
    """The stage's results.json entry as the lease records it: its own (a partial one when it
    was stopped), or one made here from its log's tail when it wrote none."""
    if entry is None:
        with log_path.open("rb") as f:
            f.seek(offset)
            tail = f.read().decode(errors="replace").strip().splitlines()[-15:]
        entry = {"title": name, "rows": [], "columns": [], "command": shlex.join(command[1:]),
                 "written": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "notes": [f"wrote no result (exit {row['returncode']}); the end of its log:",
                           *(f"`{line[:300]}`" for line in tail)]}
    if row["status"] != "ok":
        entry = {**entry, "ok": False, "timed_out": row["status"] == "timed out"}
    if row["status"] == "timed out":
        entry["notes"] = [*entry.get("notes", []), f"stopped at its {row['limit_s']:.0f} s limit:"
                          f" the rows are those it had finished"]
    return entry


def run_stage(command: list[str], limit: float, log_path: Path, env: dict[str, str]
              ) -> tuple[int | None, bool, float, float]:
    """``command`` in a process group of its own, its output appended to ``log_path``; SIGINT to
    the group at ``limit`` seconds, SIGKILL ``GRACE_S`` later. Returns (exit code, whether it was
    stopped at the limit, seconds, CPU seconds of the stage and the processes it waited for)."""
    start = time.monotonic()
    cpu = _children_cpu()
    with log_path.open("a") as f:
        f.write(f"\n=== {time.strftime('%H:%M:%S')} {shlex.join(command[1:])} "
                f"(limit {limit:.0f} s)\n")
        f.flush()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                process_group=0, preexec_fn=_default_sigint)
        try:
            timed_out = stop_at(proc, limit, GRACE_S, send=lambda sig: os.killpg(proc.pid, sig))
        finally:  # the stage's own children (workers, pytest, scale's runs) end with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, timed_out, time.monotonic() - start, _children_cpu() - cpu


def _default_sigint() -> None:
    """In the stage's process before it starts: SIGINT back to its default, so that Python turns
    the limit's SIGINT into KeyboardInterrupt (gpu.py's stages then save what they have). A shell
    without job control starts a background job (``cmd &``) with SIGINT ignored, and a stage
    would inherit that and run on until the SIGKILL 20 s later. The one place this is ensured."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children and theirs."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def summary(results: dict[str, Any]) -> str:
    """The lease's table and every stage's goal lines: the end of stdout, which a device call's
    reply shows."""
    goals = [f"* {stage}: {note}" for stage in ("train", "pattention", "decode")
             for note in results.get(stage, {}).get("notes", [])
             if "goal" in note or "fastest" in note]
    return section(results["lease"]) + ("\n" + "\n".join(goals) + "\n" if goals else "")
