"""torchrun on CPU: DDP and FSDP2 give the single-process per-step losses; DCP checkpoints load
in one process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerLM
from tokenformer.checkpoint import read_metrics
from tokenformer.distributed import load_sharded_model
from tokenformer.train import load_config, train

STEPS = 5


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    from tokenformer.data import kjv_text, prepare

    root = tmp_path_factory.mktemp("data")
    (root / "text.txt").write_text(kjv_text()[:100_000])
    prepare(root / "text.txt", "bytes", root / "ds", val_fraction=0.1, progress=False)
    return root / "ds"


def common(dataset_dir: Path) -> list[str]:
    return ["--config", "tiny", "--data", str(dataset_dir), "--steps", str(STEPS),
            "--batch-size", "8", "--eval-interval", "0", "--eval-batches", "1",
            "--checkpoint-interval", "2", "--samples", "0", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def single(dataset_dir, tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("single") / "run"
    cfg = load_config("tiny", {"data": str(dataset_dir), "out": str(out), "steps": STEPS,
                               "batch_size": 8, "eval_interval": 0, "eval_batches": 1,
                               "samples": 0, "threads": 1})
    return train(cfg, progress=False, print_fn=lambda s: None).losses


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun not available")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tokenformer", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_data_parallel_matches_single_process(strategy, single, dataset_dir, tmp_path):
    out = tmp_path / strategy
    # grad_accum 2 on each rank also exercises the skipped gradient syncs
    result = torchrun([*common(dataset_dir), "--out", str(out), "--strategy", strategy,
                       "--grad-accum", "2"])
    errors = [line for line in result.stderr.splitlines() if "rror" in line and "W" != line[:1]]
    assert result.returncode == 0, "\n".join(errors[-20:]) or result.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(out) if r["type"] == "train"]
    assert len(losses) == STEPS
    assert losses == pytest.approx(single, abs=1e-5)
    final = TokenFormerLM.load(out / "final")  # FSDP's final checkpoint is consolidated too
    if strategy == "fsdp":
        assert (out / "final" / "sharded").is_dir()
        periodic = out / "checkpoints" / "step-000004"
        assert not (periodic / "model.safetensors").exists()
        model = load_sharded_model(periodic)  # one process, no process group
        assert isinstance(model, TokenFormerLM)
        reloaded = load_sharded_model(out / "final")
        for a, b in zip(final.parameters(), reloaded.parameters(), strict=True):
            assert torch.equal(a, b)
        assert any(not torch.equal(a, b) for a, b in zip(model.parameters(),
                                                         final.parameters(), strict=True))
        # resume the sharded step-4 checkpoint under torchrun: step 5 again, bit for bit
        shutil.rmtree(out / "final")
        resumed = torchrun(["--resume", str(out), "--no-progress"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert [r["loss"] for r in read_metrics(out) if r["type"] == "train"] == losses
        again = TokenFormerLM.load(out / "final")
        for a, b in zip(final.parameters(), again.parameters(), strict=True):
            assert torch.equal(a, b)
