"""Stage ``tests``: ``pytest tests/test_device.py --device cuda`` (a ``-k`` expression may narrow
it), then the same file on the CPU under the GPU machine's torch unless ``--no-cpu-tests``, and any
``--extra-tests`` files on the CPU; counts, failures and skip reasons from pytest's JUnit XML,
its console output in ``tests.log``. At the stage's deadline pytest is interrupted (SIGINT) and
what it had run is counted."""

from __future__ import annotations

import shlex
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

from common import log

from .base import StageContext, run_logged

TESTS_LOG = "tests.log"


def run_pytest(device: str, files: list[str], keyword: str | None, log_file: Path,
               timeout: float | None = None) -> dict[str, Any]:
    """One pytest run in a subprocess, its console output appended to ``log_file`` as it runs;
    interrupted after ``timeout`` seconds (it then still writes its JUnit XML)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
                   f"--device={device}", f"--junitxml={junit}", *files,
                   *(["-k", keyword] if keyword else [])]
        log(f"tests: {shlex.join(command[1:])}")
        start = time.perf_counter()
        # interrupted, pytest ends the test in progress and still writes its XML
        returncode, interrupted = run_logged(command, log_file, timeout, grace=20, append=True,
                                             interrupted=True)
        result = count_cases(junit)
        result.update(device=device, files=files, keyword=keyword, returncode=returncode,
                      interrupted=interrupted, seconds=time.perf_counter() - start)
    return result


def count_cases(junit: Path) -> dict[str, Any]:
    """Passed, failed (errors included) and skipped cases of a JUnit XML file (none when it is
    absent): the failures' first lines, the skip reasons counted."""
    cases = ElementTree.parse(junit).getroot().iter("testcase") if junit.is_file() else []
    result: dict[str, Any] = {"passed": 0, "failed": 0, "skipped": 0, "failures": [],
                              "skip_reasons": {}}
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            result["failed"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            result["failures"].append({"test": name,
                                       "message": message[0][:300] if message else ""})
        elif skip is not None:
            result["skipped"] += 1
            reason = skip.get("message", "")
            result["skip_reasons"][reason] = result["skip_reasons"].get(reason, 0) + 1
        else:
            result["passed"] += 1
    return result


def tests_stage(ctx: StageContext) -> dict[str, Any]:
    args, device = ctx.args, ctx.device
    log_file = ctx.out / TESTS_LOG
    log_file.unlink(missing_ok=True)
    keyword = args.tests_keyword or ctx.sizes.tests_filter
    plan = [("cuda" if device.type == "cuda" else "cpu", ["tests/test_device.py"], keyword)]
    if device.type == "cuda" and args.cpu_tests:  # the CPU paths too, under the GPU's torch
        plan.append(("cpu", ["tests/test_device.py", *args.extra_tests], args.tests_keyword))
    elif args.extra_tests:
        plan.append(("cpu", args.extra_tests, None))
    runs: list[dict[str, Any]] = []
    for where, files, expression in plan:
        if ctx.left() < 5:
            break
        runs.append(run_pytest(where, files, expression, log_file, timeout=ctx.timeout(5)))
        ctx.save(summary(runs, len(plan)))
    return summary(runs, len(plan))


def summary(runs: list[dict[str, Any]], planned: int) -> dict[str, Any]:
    """The stage's result from the pytest runs so far (``planned`` in all)."""
    rows = [{"run": f"pytest {' '.join(r['files'])} --device {r['device']}"
                    + (f" -k '{r['keyword']}'" if r["keyword"] else ""),
             "passed": r["passed"], "failed": r["failed"], "skipped": r["skipped"],
             "seconds": r["seconds"]} for r in runs]
    notes = [f"FAILED {f['test']}: {f['message']}" for r in runs for f in r["failures"]]
    notes += [f"skipped ×{n}: {reason}" for r in runs for reason, n in r["skip_reasons"].items()]
    notes += [f"{row['run']}: interrupted at the stage's time limit (the counts are the tests "
              f"it finished)" for r, row in zip(runs, rows, strict=True) if r["interrupted"]]
    if any(r["returncode"] not in (0, 5) and not r["failed"] and not r["interrupted"]
           for r in runs):
        notes.append(f"pytest exited with an error outside the tests: see {TESTS_LOG}")
    if len(runs) < planned:
        notes.append(f"{planned - len(runs)} of {planned} pytest runs not started: no time left")
    ok = len(runs) == planned and all(r["returncode"] in (0, 5) and not r["failed"]
                                      and not r["interrupted"] for r in runs)  # 5: none selected
    return {"title": "device tests", "ok": ok, "runs": runs, "rows": rows, "notes": notes,
            "columns": [("run", "run", "{}"), ("passed", "passed", "{}"),
                        ("failed", "failed", "{}"), ("skipped", "skipped", "{}"),
                        ("seconds", "s", "{:.0f}")]}
