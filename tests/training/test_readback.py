"""Losses read back from the device every few steps (``fit(...,
execution=Execution(readback=k))``): the records, files and divergence of a run are those of
reading every step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.errors import DivergedError
from tokenformer.io.metrics import read_metrics
from tokenformer.io.run_folders import FINAL, step_dir
from tokenformer.io.training_state import read_state
from tokenformer.training.config import TrainConfig
from tokenformer.training.execution import Execution
from tokenformer.training.loop import fit
from tokenformer.training.readback import READBACK_STEPS, readback_steps

TIMING = ("train_time", "elapsed", "tokens_per_s", "flops_per_s")  # measured, not computed


def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in TIMING}


def tiny_lm() -> TokenFormerLM:
    torch.manual_seed(0)
    return TokenFormerLM(TokenFormerConfig.from_name("tiny", vocab_size=64, max_seq_len=16))


def batches(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def held_out(model: torch.nn.Module) -> dict[str, float]:
    with torch.no_grad():
        return {"val_loss": model(**batches(99)).loss.item()}


def quiet(**overrides) -> TrainConfig:
    return TrainConfig(**{"lr": 3e-3, "warmup_steps": 1, "eval_interval": 0, "samples": 0,
                          "grad_clip": 1.0, **overrides})


@pytest.mark.parametrize("readback", [3, 4])
def test_reading_back_every_few_steps_records_what_reading_every_step_does(tmp_path, readback):
    """Seven steps with a growth after step 3, evaluations every 2 and a checkpoint at step 4:
    with the losses read every ``readback`` steps, the records (in their order among the eval
    and grow records), metrics.jsonl, the checkpoints' counters and the trained weights are
    those of reading every step, bit for bit; only the measured times differ."""
    cfg = quiet(steps=7, eval_interval=2, checkpoint_interval=4,
                grow_at=["3:qkv=2x,ffn=2x,recipe=exact"])
    runs = {}
    for k in (1, readback):
        runs[k] = fit(tiny_lm(), batches, cfg, eval_fn=held_out, out_dir=tmp_path / f"k{k}",
                      progress=False, execution=Execution(readback=k))
    every, late = runs[1], runs[readback]
    kinds = [(r["type"], r["step"]) for r in every.records]
    assert kinds[:6] == [("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("grow", 3),
                         ("train", 4)]
    assert [untimed(r) for r in late.records] == [untimed(r) for r in every.records]
    assert all(r["grad_norm"] > 0 for r in late.records if r["type"] == "train")
    assert late.losses == every.losses and len(late.losses) == 7
    assert ([untimed(r) for r in read_metrics(tmp_path / f"k{readback}")]
            == [untimed(r) for r in read_metrics(tmp_path / "k1")])
    for where in (lambda run: step_dir(run, 4), lambda run: run / FINAL):
        saved = [read_state(where(tmp_path / f"k{k}")) for k in (1, readback)]
        assert [{key: s[key] for key in ("step", "tokens", "flops")} for s in saved] == [
            {"step": saved[0]["step"], "tokens": saved[0]["tokens"],
             "flops": saved[0]["flops"]}] * 2
    assert late.train_time > 0 and late.elapsed >= late.train_time
    for (name, a), b in zip(every.model.state_dict().items(), late.model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


class Exploding(TokenFormerLM):
    """The tiny LM whose loss becomes infinite on the batches marked ``blow``."""

    def forward(self, input_ids, labels, blow=False):
        out = super().forward(input_ids, labels=labels)
        if blow:
            out.loss = out.loss * math.inf
        return out


def exploding() -> Exploding:
    torch.manual_seed(0)
    return Exploding(TokenFormerConfig.from_name("tiny", vocab_size=64, max_seq_len=16))


def test_a_divergence_read_back_late_stops_the_run_where_it_happened(tmp_path):
    """The loss is inf from step 3; the losses are read every 4 steps and a checkpoint is due
    every 2. The run stops with the error of step 3 after recording steps 1-3 only; the
    checkpoint of step 2 is written, none after it (step 4 was computed before the read, and
    leaves no trace)."""
    def blows_up(step: int) -> dict:
        return {**batches(step), "blow": step >= 2}

    cfg = quiet(steps=10, checkpoint_interval=2)
    with pytest.raises(DivergedError, match=r"^the training loss became inf at step 3; lower"):
        fit(exploding(), blows_up, cfg, out_dir=tmp_path / "run", progress=False,
            execution=Execution(readback=4))
    records = read_metrics(tmp_path / "run")
    assert [(r["type"], r["step"]) for r in records] == [("train", 1), ("train", 2),
                                                         ("train", 3)]
    assert records[-1]["loss"] == math.inf and math.isfinite(records[1]["loss"])
    assert step_dir(tmp_path / "run", 2).is_dir()
    assert not step_dir(tmp_path / "run", 4).exists() and not (tmp_path / "run" / FINAL).exists()


def test_an_error_keeps_the_records_of_the_steps_done_unless_a_divergence_came_first(tmp_path):
    """A batch that fails at step 4 while steps 1-3 wait to be read: the failure is raised and
    their records are written. Had step 2 diverged, the divergence is what is raised."""
    def fails(step: int, blow_from: int = 99) -> dict:
        if step == 3:
            raise RuntimeError("the data is gone")
        return {**batches(step), "blow": step >= blow_from}

    cfg = quiet(steps=8)
    with pytest.raises(RuntimeError, match="the data is gone"):
        fit(exploding(), fails, cfg, out_dir=tmp_path / "a", progress=False,
            execution=Execution(readback=8))
    assert [r["step"] for r in read_metrics(tmp_path / "a")] == [1, 2, 3]
    with pytest.raises(DivergedError, match="became inf at step 2") as info:
        fit(exploding(), lambda s: fails(s, blow_from=1), cfg, out_dir=tmp_path / "b",
            progress=False, execution=Execution(readback=8))
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert [r["step"] for r in read_metrics(tmp_path / "b")] == [1, 2]


def test_the_read_back_interval_by_device_and_callbacks():
    """Every step on the CPU (the step is finished when it returns) and for callbacks (they see
    the model right after each step); every READBACK_STEPS steps on a GPU; a bad value is one
    error."""
    assert readback_steps(torch.device("cpu"), ()) == 1
    assert readback_steps(torch.device("cuda"), ()) == READBACK_STEPS > 1
    assert readback_steps(torch.device("cuda"), [lambda record, model: None]) == 1
    with pytest.raises(ValueError, match="readback must be a whole number of steps >= 1"):
        fit(tiny_lm(), batches, quiet(steps=1), progress=False, execution=Execution(readback=0))


def test_losses_of_a_run_equal_a_hand_loop(tmp_path: Path):
    """The recorded losses, read every 3 steps, are the losses of the same AdamW steps taken by
    hand (reading each loss at once)."""
    cfg = quiet(steps=5, grad_clip=0.0, schedule="constant", warmup_steps=0)
    result = fit(tiny_lm(), batches, cfg, progress=False, execution=Execution(readback=3))
    model = tiny_lm()
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p.ndim >= 2],
          "weight_decay": cfg.weight_decay},
         {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0}],
        lr=3e-3, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    by_hand = []
    for step in range(5):
        loss = model(**batches(step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        by_hand.append(loss.item())
    assert result.losses == by_hand
    assert [r["grad_norm"] for r in result.records] == [None] * 5
