"""``scale --jobs N`` workers never outlive their parent (issue 36): after a ``kill -9`` of the
parent, which holds the run-folder lock, its workers die at once and write nothing (the old
workers trained on for ≈ 25 s and wrote runs/*.json beside a rerun)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc to find the workers")


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_scale_workers_die_with_their_parent_and_write_nothing(tmp_path):
    out = tmp_path / "S1"
    workers: list[int] = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-m", "tokenformer", "scale", "--preset", "quick",
                               "--jobs", "2", "--out", str(out), "--no-progress"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and parent.poll() is None:
            # the pool's two workers (a resource tracker may be a third child)
            workers = [p for p in children(parent.pid)
                       if "multiprocessing" in Path(f"/proc/{p}/cmdline").read_text()
                       and "resource_tracker" not in Path(f"/proc/{p}/cmdline").read_text()]
            if len(workers) >= 2:
                break
            time.sleep(0.05)
        assert len(workers) >= 2, "the workers did not start"
        time.sleep(1.0)  # training, mid-run
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        written = set((out / "runs").glob("*.json")) if (out / "runs").exists() else set()
        deadline = time.time() + 5
        while time.time() < deadline and any(alive(w) for w in workers):
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), "a worker outlived its parent"
        time.sleep(1.0)
        after = set((out / "runs").glob("*.json")) if (out / "runs").exists() else set()
        assert after == written  # nothing written once the lock was gone
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for worker in workers:  # what a failure left behind
            if alive(worker):
                os.kill(worker, signal.SIGKILL)


def test_a_worker_whose_parent_is_gone_writes_nothing(tmp_path):
    """Where the kernel's signal is unavailable (or arrived late), the check before every write
    stops the worker: simulated by a parent pid that is not this process's parent."""
    target = tmp_path / "written"
    code = (f"from tokenformer.io import workers\n"
            f"workers._parent = 1 if workers.os.getppid() != 1 else 2\n"
            f"workers.check_parent()\n"
            f"open({str(target)!r}, 'w').close()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and not target.exists(), done.stderr
    ok = subprocess.run([sys.executable, "-c", code.replace(
        "workers._parent = 1 if workers.os.getppid() != 1 else 2",
        "workers._parent = workers.os.getppid()")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and target.exists(), ok.stderr
