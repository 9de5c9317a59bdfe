"""Run every benchmark and rewrite benchmarks/RESULTS.md from their outputs.

Convention: each script in ``SCRIPTS`` prints its own markdown section (starting with a ``## ``
heading) to stdout. This file writes a machine-info header, then each script's sections in the
order below. Sections already in RESULTS.md whose heading no script produced in this run (numbers
an engineer measured by hand, or a script that failed) are kept; every section keeps its place in
the file and new headings are appended, so nothing is lost until its script joins the list.

    python benchmarks/run_all.py                     # everything (long: tens of minutes)
    python benchmarks/run_all.py --only fused decode # a subset, others' sections are kept
    python benchmarks/run_all.py --list              # the names and the command each one runs

To add a benchmark: make it print one ``## <area>`` section and add a line to ``SCRIPTS``.
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import sys
import time
from pathlib import Path

from tokenformer.io.files import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"

# name -> (script, arguments). --cpu-time: single-thread CPU time, robust on a shared machine.
# data_pipeline, hf_eval, grow and vit_digits time the wall clock (grow adds process CPU time):
# run them on a quiet machine.
SCRIPTS: dict[str, tuple[str, list[str]]] = {
    "pattention": ("pattention.py", ["--threads", "1", "--clock", "cpu", "--reps", "7"]),
    "fused": ("fused.py", ["--cpu-time"]),
    "compile": ("compile.py", ["--cpu-time"]),
    "decode": ("decode.py", ["--cpu-time"]),
    "inference": ("inference.py", ["--cpu-time"]),
    "train_throughput": ("train_throughput.py", ["--cpu-time"]),
    "training_step": ("training_step.py", ["--cpu-time"]),
    "theta_passes": ("theta_passes.py", ["--cpu-time"]),
    "attention": ("attention.py", ["--cpu-time"]),
    "data_pipeline": ("data_pipeline.py", []),
    "hf_eval": ("hf_eval.py", ["--tokens", "16384", "--new-tokens", "96", "--repeats", "2",
                               "--threads", "1"]),
    "grow": ("grow.py", ["--repeats", "5"]),
    "vit_digits": ("vit_digits.py", ["--seeds", "0", "1", "2", "3"]),
}

HEADING = re.compile(r"^## .*$", re.MULTILINE)


def split_sections(text: str) -> dict[str, str]:
    """``{heading line: section text}`` for every ``## `` section of ``text``."""
    starts = [m.start() for m in HEADING.finditer(text)]
    sections = {}
    for start, end in zip(starts, [*starts[1:], len(text)], strict=True):
        body = text[start:end].strip() + "\n"
        sections[body.splitlines()[0].strip()] = body
    return sections


def machine_info() -> str:
    lscpu = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        keep = ("Model name", "CPU(s):", "Thread(s) per core", "L2 cache", "L3 cache")
        lscpu = "; ".join(" ".join(line.split()) for line in out.splitlines()
                          if line.startswith(keep))
        flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
        lscpu += f"; ISA: {', '.join(isa) or 'baseline'}"
    except (OSError, subprocess.CalledProcessError):
        pass
    import platform

    return (f"Machine: {machine()}  \n{lscpu}  \nPython {platform.python_version()}, "
            f"{platform.platform()}; written {datetime.datetime.now():%Y-%m-%d %H:%M}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(SCRIPTS), default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per script")
    args = parser.parse_args(argv)
    if args.list:
        for name, (script, extra) in SCRIPTS.items():
            print(f"{name}: {command_line([script, *extra])}")
        return 0

    new: dict[str, str] = {}
    failed = []
    for name in args.only or list(SCRIPTS):
        script, extra = SCRIPTS[name]
        print(f"[run_all] {name}: {command_line([script, *extra])}", flush=True)
        start = time.perf_counter()
        try:
            proc = subprocess.run([sys.executable, str(HERE / script), *extra],
                                  capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            failed.append(f"{name} (timed out after {args.timeout:.0f} s)")
            continue
        produced = split_sections(proc.stdout)
        if proc.returncode != 0 or not produced:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            failed.append(f"{name} (exit {proc.returncode}: {tail})")
            continue
        new.update(produced)
        print(f"[run_all] {name}: {len(produced)} section(s) in "
              f"{time.perf_counter() - start:.0f} s", flush=True)

    # Read as late as possible: others append their hand-measured sections while this runs.
    old = split_sections(RESULTS.read_text()) if RESULTS.exists() else {}
    kept = [h for h in old if h not in new]
    # Sections keep their place in the file; headings new to it go at the end.
    body = [new.get(h, old[h]) for h in old] + [s for h, s in new.items() if h not in old]
    parts = ["# Benchmark results\n",
             "Written by `python benchmarks/run_all.py`; each section names the command that "
             "produced it. Sections no script in run_all produces yet were measured by hand and "
             "are kept as they were.\n",
             machine_info() + "\n", *body]
    atomic_write_text(RESULTS, "\n".join(parts))
    print(f"[run_all] wrote {RESULTS} ({len(new)} new, {len(kept)} kept section(s))")
    for f in failed:
        print(f"[run_all] FAILED: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
