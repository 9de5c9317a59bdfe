"""Stage ``frontier``: ``tokenformer scale --preset PRESET --device cuda --jobs N --out
--frontier-dir`` for at most ``--frontier-minutes`` (and the stage's deadline), then SIGINT:
every finished run is on disk and a second call continues (the frontier resumes from its folder,
which travels with the working tree once committed). ``--frontier-compile MODE`` adds ``--compile
MODE`` (reduce-overhead: every step as CUDA graphs), a different experiment than the eager one:
give it a fresh ``--frontier-dir``. The folder is packed into ``frontier.tar.gz`` under ``--out``
(without the in-progress state when that would not fit a device call's 16 MiB per file, and
never with the finished bases' weights under ``models/``: 42 MB each at ``gpu-v5``'s size, too
large to return or to commit; a continuation whose base's weights a fresh machine lacks trains
the base again first, experiments/frontier/one_run.ready_bases)."""

from __future__ import annotations

import math
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from common import log

from .base import ROOT, StageContext, run_logged, subprocess_env

FRONTIER_TAR, FRONTIER_LOG = "frontier.tar.gz", "frontier.log"
MAX_RETURNED_FILE = 16 << 20  # a device call brings back files up to 16 MiB
STOP_S = 75  # kept after the SIGINT: the runs' orderly stop (≤ 60 s), packing, --plan
MIN_S = 30  # a frontier call shorter than this finishes nothing


def frontier_stage(ctx: StageContext) -> dict[str, Any]:
    args, device, out = ctx.args, ctx.device, ctx.out
    folder = Path(args.frontier_dir).resolve()
    command = [sys.executable, "-m", "tokenformer", "scale", "--preset", args.frontier_preset]
    if args.smoke:
        command.append("--plan")
    else:
        command += ["--device", device.type, "--out", str(folder), "--no-progress",
                    "--jobs", str(args.frontier_jobs)]
        if args.frontier_compile != "off":
            command += ["--compile", args.frontier_compile]
    if args.frontier_data:
        command += ["--data", str(Path(args.frontier_data).resolve())]
    log_path = out / FRONTIER_LOG  # not inside the folder: scale refuses files it did not write
    limit = min(60 * args.frontier_minutes, ctx.left() - STOP_S)
    if limit < MIN_S and not args.smoke:
        return {"title": "frontier", "ok": False, "rows": [], "columns": [],
                "notes": [f"not started: {max(0.0, limit):.0f} s left of the stage's time, "
                          f"< {MIN_S} s"]}
    log(f"frontier: {shlex.join(command[1:])} (at most {limit / 60:.1f} min)")
    start = time.perf_counter()
    # stopped, the finished runs are kept and a rerun resumes
    returncode, stopped = run_logged(command, log_path, None if math.isinf(limit) else limit,
                                     grace=60)
    seconds = time.perf_counter() - start
    text = log_path.read_text()
    total = (planned_runs(args, timeout=min(300, max(1, ctx.left() - 10))) if not args.smoke
             else _planned_runs(text))
    done = len(list((folder / "runs").glob("*.json")))
    finished = (folder / "results.json").is_file()
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    row = {"preset": args.frontier_preset, "runs_done": done, "runs_total": total,
           "finished": finished, "stopped_at_limit": stopped, "returncode": returncode,
           "seconds": seconds}
    notes = [f"Command: `{' '.join(['tokenformer', *command[3:]])}`; folder {folder} "
             f"(packed into {FRONTIER_TAR}); rerun the same call to continue."]
    if not stopped:  # (stopped at the limit, it says "error: interrupted")
        notes += [f"the frontier stopped: {line}" for line in errors[-1:]]
    if folder.is_dir():
        row["packed_state"] = pack(folder, out / FRONTIER_TAR)
        row["archive_mib"] = (out / FRONTIER_TAR).stat().st_size / 2**20
    return {"title": "frontier", "rows": [row], "notes": notes, "log_tail": text[-4000:],
            "columns": [("preset", "preset", "{}"), ("runs_done", "runs done", "{}"),
                        ("runs_total", "runs planned (--plan)", "{}"),
                        ("finished", "finished", "{}"),
                        ("stopped_at_limit", "stopped at the limit", "{}"),
                        ("seconds", "s", "{:.0f}")]}


def planned_runs(args: Any, timeout: float = 300) -> int | None:
    """How many runs ``scale --plan`` predicts for the frontier stage's preset (None when it
    cannot say): every stage of a v4 plan, whose measured envelope can still move the held-out
    runs a little; ``scale``'s own header line counts only the sweeps and the held-out runs."""
    command = [sys.executable, "-m", "tokenformer", "scale", "--preset", args.frontier_preset,
               "--plan"]
    if args.frontier_data:
        command += ["--data", str(Path(args.frontier_data).resolve())]
    try:
        done = subprocess.run(command, cwd=ROOT, env=subprocess_env(), capture_output=True,
                              text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return _planned_runs(done.stdout) if done.returncode == 0 else None


def _planned_runs(plan_text: str) -> int | None:
    """The run count of a ``scale --plan`` text: its stage table's runs column (v4), else its
    header's sweep and final/held-out counts (v3 presets have no stage table)."""
    stages = re.findall(r"^\| (?:sweep|horizon|chain tuning|held-out[^|]*|reuse[^|]*) \| [^|]* \| "
                        r"(\d+) \|",
                        plan_text, re.M)
    if stages:
        return sum(map(int, stages))
    header = re.search(r"(\d+) LR-sweep runs[^,]*, (\d+) (?:final|held-out) runs", plan_text)
    return int(header[1]) + int(header[2]) if header else None


def pack(folder: Path, archive: Path) -> bool:
    """``folder`` as a .tar.gz under the 16 MiB a device call returns; the in-progress state
    (state/*.pt, needed to resume a half-trained run on a fresh machine) only if it fits; never
    the finished bases' weights (``models/``: trained again when needed). Returns whether the
    state is in it."""
    def write(with_state: bool) -> None:
        with tarfile.open(archive, "w:gz") as tar:
            for path in sorted(folder.rglob("*")):
                relative = path.relative_to(folder)
                if path.is_file() and relative.name != ".tokenformer.lock" and (
                        relative.parts[0] != "models") and (
                        with_state or relative.parts[0] != "state"):
                    tar.add(path, arcname=str(Path(folder.name) / relative))

    write(with_state=True)
    if archive.stat().st_size <= MAX_RETURNED_FILE:
        return True
    write(with_state=False)
    return False
