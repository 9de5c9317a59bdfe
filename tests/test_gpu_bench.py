"""benchmarks/gpu.py --smoke on the CPU: every stage but the frontier runs end to end at toy sizes
and writes results.json / results.md with finite numbers, so the script a GPU session runs in a
few 10-minute calls cannot rot unnoticed before then."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["tests", "train", "pattention", "decode"]


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
def test_smoke_run_writes_finite_results(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "gpu"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--device", "cpu",
         "--stage", *STAGES, "--out", str(out), "--frontier-dir", str(tmp_path / "frontier")],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"env", *STAGES}
    assert results["env"]["bf16_matmul_tflops"] > 0 and results["env"]["copy_gbps"] > 0
    for stage in STAGES:
        values = numbers(results[stage]["rows"])
        assert values and all(math.isfinite(v) for v in values), stage
    tests = results["tests"]["runs"][0]
    assert tests["passed"] >= 1 and tests["failed"] == 0
    # 5 models (TokenFormer: default, impl=triton, triton + one Q/K/V GEMM; Transformer++;
    # GPT-NeoX) × (eager, compiled); 4 layers × 2 modes per shape, and 4 Q/K/V variants × 2
    # modes; decode: 2 models × 2 paths (eager, static + compiled) × 2 batch sizes
    assert len(results["train"]["rows"]) == 10
    assert all(0 < r["mfu"] and r["tokens_per_s"] > 0 for r in results["train"]["rows"])
    assert len(results["pattention"]["rows"]) == 16
    layers = {r["layer"] for r in results["pattention"]["rows"]}
    assert {"Pattention triton", "Q/K/V one GEMM, triton"} <= layers
    assert len(results["decode"]["rows"]) == 8
    assert results["decode"]["expected_ratio_weights"] > 0
    text = (out / "results.md").read_text()
    for title in ("device tests", "training speed", "Pattention vs MLP", "decoding"):
        assert f"## GPU: {title}" in text
    assert "| TokenFormer (tiny) | compiled |" in text
    assert "| TokenFormer (tiny), impl=triton, one Q/K/V GEMM | compiled |" in text
    assert (out / "tests.log").read_text().strip()
    # the printed section is the file's (the reply of a device call shows stdout's end)
    assert "## GPU: decoding" in result.stdout


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
    gpu = benchmark("gpu")
    rows = [{"mode": "eager", "jobs": 1, "steps_per_s": 30.0},
            {"mode": "eager", "jobs": 8, "steps_per_s": 50.0},
            {"mode": "graphs", "jobs": 8, "steps_per_s": 125.0}]
    assert gpu.predict_gpu_code(rows)
    assert [r["gpu_code_min"] for r in rows] == pytest.approx(
        [gpu.GPU_CODE_EAGER8_MIN * 50 / 30, gpu.GPU_CODE_EAGER8_MIN, gpu.GPU_CODE_EAGER8_MIN * 0.4])
    assert not gpu.predict_gpu_code([{"mode": "graphs", "jobs": 8, "steps_per_s": 1.0}])
