"""benchmarks/gpu.py on the CPU: ``--lease --smoke`` runs every stage of a lease end to end at
toy sizes (the frontier only plans) and writes results.json / results.md with finite numbers, so
the one command a GPU session runs first cannot rot unnoticed before then; the lease's runner
(time limits, partial results, skipped stages) and its worker pool are tested on their own."""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
def benchmark(name: str) -> types.ModuleType:
    """A script of benchmarks/ imported as a module (they import their neighbours, e.g.
    ``common``, by name)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def numbers(value: object) -> list[float]:
    """Every int and float inside a JSON value (booleans are not numbers here)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return []


@pytest.mark.slow
def test_lease_smoke_runs_every_stage_and_returns_few_files(tmp_path):
    """``--lease --smoke`` on the CPU: every stage of a lease in its own process, in order, each
    writing finite numbers into the one results.json; no more files than a device call returns."""
    pytest.importorskip("transformers")
    out = tmp_path / "lease"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--lease", "--smoke", "--device",
         "cpu", "--out", str(out), "--frontier-dir", str(tmp_path / "frontier")],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    results = json.loads((out / "results.json").read_text())
    stages = ["env", "tests", "train", "decode", "pattention", "frontier"]
    assert [r["stage"] for r in results["lease"]["rows"]] == stages
    assert all(r["status"] == "ok" for r in results["lease"]["rows"])
    assert set(results) == {"lease", *stages}
    env = results["env"]
    assert env["bf16_matmul_tflops"] > 0 and env["copy_gbps"] > 0 and env["cpu_count"] >= 1
    assert env["torch"] and env["python"]
    for stage in ("tests", "train", "decode", "pattention"):
        values = numbers(results[stage]["rows"])
        assert values and all(math.isfinite(v) for v in values), stage
        assert not results[stage].get("partial"), stage
    assert results["tests"]["runs"][0]["passed"] >= 1 and results["tests"]["runs"][0]["failed"] == 0
    train = results["train"]["rows"]
    assert {r["mode"] for r in train} == {"compiled"}  # the lease trains compiled only
    # Transformer++, TokenFormer (default, Triton Θ, + one Q/K/V GEMM), and the fused
    # Transformer++ where this checkout has it
    fused = any("fused projections" in r["model"] for r in train)
    assert len(train) == 4 + fused
    assert fused or any("fused_projections" in n for n in results["train"]["notes"])
    assert all(isinstance(r["mutated"], int) and r["profile_kernels"] > 0 for r in train)
    # Pattention fused and triton, and the MLP, eager and compiled, at the smoke shape: the
    # faster MLP row is the unit of the last column
    layers = results["pattention"]["rows"]
    assert len(layers) == 6
    mlp = min((r for r in layers if r["layer"].startswith("MLP")), key=lambda r: r["ms"])
    assert mlp["vs_faster_mlp"] == pytest.approx(1.0)
    decode = results["decode"]["rows"]
    assert len(decode) == 8  # 2 models × (eager, static + compiled) × 2 batch sizes
    assert all(r["kernels_per_token"] > 0 and 0 < r["of_bound"] for r in decode)
    assert results["frontier"]["rows"][0]["runs_total"] > 0  # smoke: the plan only
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert len(files) <= 8 and {"results.json", "results.md", "lease.log"} <= set(files)
    text = (out / "results.md").read_text()
    for title in ("lease", "device tests", "training speed", "Pattention vs MLP", "decoding",
                  "frontier"):
        assert f"## GPU: {title}" in text
    assert "## GPU: lease" in result.stdout.split("## GPU: frontier")[-1]  # the summary last


def test_train_models_flag_names_the_catalog():
    """--train-models' choices (kept light for the command line) are the train stage's models."""
    base, training = benchmark("gpu_stages.base"), benchmark("gpu_stages.training")
    assert list(training.catalog(base.SMOKE, smoke=True)) == list(base.TRAIN_MODELS)
    lease = benchmark("gpu_stages.lease")
    assert set(lease.LEASE_MODELS) <= set(base.TRAIN_MODELS)


def _stage(name: str, code: str, cap: float = 60.0, minimum: float = 1.0):
    lease = benchmark("gpu_stages.lease")
    return lease.LeaseStage(name, cap, minimum, lambda limit: [sys.executable, "-c", code])


def test_a_stage_past_its_limit_keeps_its_rows_and_the_later_stages_run(tmp_path):
    """The lease's runner: a stage that saved a partial entry and then hangs is stopped at its
    limit and recorded as timed out with its rows; the next stage runs and already finds that
    record in results.json (written after each stage); one that exits with an error and writes
    nothing gets an entry with its log's end; one the budget cannot fit is skipped."""
    out = tmp_path / "out"
    out.mkdir()
    results = out / "results.json"
    write = f"import json, pathlib; p = pathlib.Path({str(results)!r}); "
    hangs = write + ("r = json.loads(p.read_text()) if p.exists() else {}; "
                     "r['tests'] = {'title': 'tests', 'rows': [{'passed': 3}], 'notes': [], "
                     "'partial': True}; p.write_text(json.dumps(r)); import time; time.sleep(60)")
    reads = write + ("r = json.loads(p.read_text()); r['train'] = {'title': 'train', 'rows': "
                     "[{'saw': r['tests'].get('timed_out')}], 'notes': []}; "
                     "p.write_text(json.dumps(r))")
    fails = "import sys; print('the reason it failed'); sys.exit(3)"
    lease = benchmark("gpu_stages.lease")
    stages = [_stage("tests", hangs, cap=2.0), _stage("train", reads),
              _stage("decode", fails), _stage("frontier", "pass", minimum=10_000)]
    # SIGINT ignored here, as in a background job of a shell without job control: the stage
    # still gets it at its limit (it used to inherit the ignore and run until SIGKILL, 20 s on)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        record = lease.run_stages(stages, out, budget_s=300, env=dict(os.environ))
    finally:
        signal.signal(signal.SIGINT, ignored)
    assert [(r["stage"], r["status"]) for r in record["rows"]] == [
        ("tests", "timed out"), ("train", "ok"), ("decode", "failed"), ("frontier", "skipped")]
    assert record["rows"][0]["seconds"] < 20  # stopped at 2 s (SIGINT), not after its sleep
    saved = json.loads(results.read_text())
    assert saved["tests"]["timed_out"] and not saved["tests"]["ok"]
    assert saved["tests"]["rows"] == [{"passed": 3}]
    assert saved["train"]["rows"] == [{"saw": True}]
    assert record["rows"][2]["returncode"] == 3
    assert any("the reason it failed" in n for n in saved["decode"]["notes"])
    assert "skipped" in saved["frontier"]["notes"][0]
    assert "## GPU: lease" in (out / "results.md").read_text()


def test_worker_pool_times_in_processes_and_drops_failed_candidates(monkeypatch):
    """Candidates in spawned processes: one that raises while built and one whose process dies
    are dropped with their errors, the others are called and timed (here the "seconds" a dict
    returns for a key), and a call that raises drops its worker."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the workers import gpu_stages too
    workers = benchmark("gpu_stages.workers")
    specs = {"ok": (dict, {"a": 0.25}), "raises": (int, {"x": 1}), "dies": (os._exit,
                                                                            {"status": 3})}
    with workers.Pool(specs, processes=True) as pool:
        pool.start(deadline=time.monotonic() + 120, label="test")
        assert pool.ready() == ["ok"]
        errors = pool.errors()
        assert "TypeError" in errors["raises"] and "died" in errors["dies"]
        times, failed = workers.interleave(pool, {"k": ("ok", "get", ("a",))}, rounds=3,
                                           warmup=1, deadline=math.inf)
        assert times == {"k": {"min": 0.25, "median": 0.25, "rounds": 3}} and not failed
        with pytest.raises(workers.WorkerError, match="KeyError"):
            pool.call("ok", "pop", "missing")
        assert pool.ready() == [] and pool.workers["ok"].process is None


@pytest.mark.slow
def test_smoke_concurrency_stage_times_runs_released_together(tmp_path):
    """The concurrency stage (issue 35: how many frontier runs one GPU should train at once) on
    the CPU: one run, then two whose timed steps start together, each a real fit step."""
    out = tmp_path / "gpu"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu",
         "--stage", "concurrency", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["concurrency"]["rows"]
    assert [(r["mode"], r["jobs"]) for r in rows] == [("eager", 1), ("eager", 2)]
    for row in rows:
        assert row["ms_per_step"] > 0 and math.isfinite(row["ms_per_step"])
        # steps/s of all runs together is k runs over one run's step time
        assert row["steps_per_s"] == pytest.approx(row["jobs"] * 1000 / row["ms_per_step"])
    assert rows[0]["vs_one_eager"] == pytest.approx(1.0)
    assert "## GPU: frontier runs sharing one GPU" in result.stdout


def test_frontier_steps_estimates_from_a_folders_measured_step_times(tmp_path):
    """benchmarks/frontier_steps.py --measured: each (family, size) costs the median over a
    scale folder's runs of their mean step time there (a chain's family is its recipe's)."""
    runs = tmp_path / "measured" / "runs"
    runs.mkdir(parents=True)
    timings = {  # run id → {size: (steps, seconds)}
        "sweep__tokenformer-S-1__lr0.001__seed1000": {"S-1": (10, 1.0)},  # 0.1 s a step
        "horizon__tokenformer-S-1__x1__seed1000": {"S-1": (10, 3.0)},  # 0.3
        "tokenformer-S-1__seed0": {"S-1": (20, 4.0)},  # 0.2
        "chain-paper__seed0": {"S-1": (10, 9.0), "S0": (5, 2.0)},  # tokenformer: 0.9; 0.4
        # S-1: the median of 0.1, 0.3, 0.2 and 0.9 is 0.25
        "transformer++-S0__seed0": {"S0": (4, 2.0)},  # 0.5
    }
    for run_id, step_time in timings.items():
        (runs / f"{run_id}.json").write_text(json.dumps(
            {"timing": {"step_time": {k: list(v) for k, v in step_time.items()}}}))
    frontier_steps = benchmark("frontier_steps")
    seconds = frontier_steps.measured_seconds(tmp_path / "measured")
    assert seconds == pytest.approx({"tokenformer-S-1": 0.25, "tokenformer-S0": 0.4,
                                     "transformer++-S0": 0.5})
    with pytest.raises(SystemExit, match="no run with step times"):
        frontier_steps.measured_seconds(tmp_path)


def test_concurrency_predicts_gpu_code_from_the_eager_8_row():
    """The concurrency stage scales gpu-code's measured eager --jobs 8 time by each
    configuration's throughput relative to eager × 8 (twice the steps/s: half the minutes)."""
    gpu = benchmark("gpu_stages.concurrency")
    rows = [{"mode": "eager", "jobs": 1, "steps_per_s": 30.0},
            {"mode": "eager", "jobs": 8, "steps_per_s": 50.0},
            {"mode": "graphs", "jobs": 8, "steps_per_s": 125.0}]
    assert gpu.predict_gpu_code(rows)
    assert [r["gpu_code_min"] for r in rows] == pytest.approx(
        [gpu.GPU_CODE_EAGER8_MIN * 50 / 30, gpu.GPU_CODE_EAGER8_MIN, gpu.GPU_CODE_EAGER8_MIN * 0.4])
    assert not gpu.predict_gpu_code([{"mode": "graphs", "jobs": 8, "steps_per_s": 1.0}])


def test_a_lease_packs_run_records_but_never_the_bases_weights(tmp_path):
    """gpu-v5's finished bases (``models/``, 42 MB each) never travel back from a lease: they
    would not fit the 16 MiB a call returns nor belong in git; a resumed folder trains the
    needed bases again (tests/experiments/test_frontier_v5.py). Run records and in-progress
    states do travel."""
    import tarfile

    frontier = benchmark("gpu_stages.frontier")
    folder = tmp_path / "frontier-gpu-v5"
    for name in ("experiment.json", "runs/base__seed0.json", "state/run.pt",
                 "models/tokenformer-S0__seed0/b1.pt"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    assert frontier.pack(folder, tmp_path / "f.tar.gz") is True
    with tarfile.open(tmp_path / "f.tar.gz") as tar:
        names = sorted(tar.getnames())
    assert names == ["frontier-gpu-v5/experiment.json", "frontier-gpu-v5/runs/base__seed0.json",
                     "frontier-gpu-v5/state/run.pt"]


def test_the_planned_run_count_includes_the_reuse_stages():
    """The lease's "runs planned" reads every stage of a v5 plan's table, reuse included."""
    frontier = benchmark("gpu_stages.frontier")
    table = ("| stage | seeds | runs | steps | FLOPs |\n|---|---|---:|---:|---:|\n"
             "| sweep | tuning | 10 | 1 | 1 |\n| horizon | tuning | 20 | 1 | 1 |\n"
             "| held-out from scratch | held-out | 30 | 1 | 1 |\n"
             "| reuse tuning | tuning | 40 | 1 | 1 |\n| reuse held-out | held-out | 50 | 1 | 1 |\n")
    assert frontier._planned_runs(table) == 150
