"""torchrun on CPU: DDP and FSDP2 give the single-process per-step losses; DCP checkpoints load
in one process."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerLM
from tokenformer.io.metrics import read_metrics
from tokenformer.training.config import load_config
from tokenformer.training.distributed import load_sharded_model
from tokenformer.training.lm import train

STEPS = 5


def common(dataset_dir: Path) -> list[str]:
    return ["--config", "tiny", "--data", str(dataset_dir), "--steps", str(STEPS),
            "--batch-size", "8", "--eval-interval", "0", "--eval-batches", "1",
            "--checkpoint-interval", "2", "--samples", "0", "--threads", "1", "--no-progress"]


# DDP also grows the model mid-run (random new tokens and noise on the old ones: every rank must
# draw the same; frozen old tokens: every rank restores the same rows).
GROWTH = {"ddp": ["3:qkv=2x,ffn=2x,layers=3,recipe=paper,freeze_old=forever,noise_old=0.01"],
          "fsdp": []}


def single(dataset_dir: Path, out: Path, grow_at: list[str]) -> list[dict]:
    """The reference: one process, the same global batch, in this process."""
    cfg = load_config("tiny", {"data": str(dataset_dir), "out": str(out), "steps": STEPS,
                               "batch_size": 8, "eval_interval": 0, "eval_batches": 1,
                               "samples": 0, "threads": 1, "grow_at": grow_at})
    return train(cfg, progress=False, print_fn=lambda s: None).records


def torchrun(args: list[str]) -> subprocess.CompletedProcess:
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun not available")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tokenformer", "train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_data_parallel_matches_single_process(strategy, dataset_dir, tmp_path):
    out = tmp_path / strategy
    grow = [a for spec in GROWTH[strategy] for a in ("--grow-at", spec)]
    # grad_accum 2 on each rank also exercises the skipped gradient syncs
    result = torchrun([*common(dataset_dir), "--out", str(out), "--strategy", strategy,
                       "--grad-accum", "2", *grow])
    errors = [line for line in result.stderr.splitlines() if "rror" in line and "W" != line[:1]]
    assert result.returncode == 0, "\n".join(errors[-20:]) or result.stderr[-3000:]
    reference = single(dataset_dir, tmp_path / "single", GROWTH[strategy])
    records = read_metrics(out)
    losses = [r["loss"] for r in records if r["type"] == "train"]
    assert len(losses) == STEPS
    assert losses == pytest.approx([r["loss"] for r in reference if r["type"] == "train"],
                                   abs=1e-5)
    # evaluations (including those around the growth) do not depend on the world size
    evals = [r.get("val_loss") or r["after"]["val_loss"] for r in records if r["type"] != "train"]
    assert evals == pytest.approx([r.get("val_loss") or r["after"]["val_loss"]
                                   for r in reference if r["type"] != "train"], abs=1e-5)
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_cpu_run_on_a_machine_with_cuda_stays_on_the_cpu(strategy, monkeypatch, tmp_path):
    """A CPU run on a GPU machine (or --device cpu for a debug run) keeps every shard and
    gradient on the CPU: the wrapper takes its device from the run, not from the machine. CUDA is
    made to look present the two ways torch asks (torch 2.13's fully_shard default mesh reads
    torch._C._get_accelerator(); earlier releases torch.cuda.is_available()); the old code then
    built a cuda mesh and failed."""
    import torch.distributed as dist

    from tokenformer.io.process_group import World
    from tokenformer.training.config import TrainConfig
    from tokenformer.training.execution import Execution
    from tokenformer.training.loop import fit

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    config = TokenFormerLM.config_class.from_name("tiny")
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=16, warmup_steps=1, eval_interval=0,
                      samples=0, lr=3e-3, strategy=strategy)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    plain = fit(TokenFormerLM(config), batch_fn, dataclasses.replace(cfg, strategy="auto"),
                execution=Execution(device=cpu), progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        wrapped = fit(TokenFormerLM(config), batch_fn, cfg,
                      execution=Execution(world=World(strategy=strategy), device=cpu),
                      progress=False)
        devices = {(p.full_tensor() if hasattr(p, "full_tensor") else p).device.type
                   for p in wrapped.model.parameters()}
    finally:
        dist.destroy_process_group()
    assert devices == {"cpu"}
    assert wrapped.losses == pytest.approx(plain.losses, rel=1e-5)
