"""The trainer: schedule, config loading, errors, growth in a run, checkpoints, SIGKILL + resume."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM, flops_per_token
from tokenformer.cli import main as cli
from tokenformer.errors import ConfigError
from tokenformer.io.checkpoint import verify_checkpoint
from tokenformer.io.metrics import read_metrics
from tokenformer.io.training_state import load_optimizer_state
from tokenformer.training.config import TrainConfig, load_config
from tokenformer.training.growth_events import parse_grow_at
from tokenformer.training.lm import train
from tokenformer.training.loop import FitResult, RunState, fit
from tokenformer.training.optim import make_optimizer
from tokenformer.training.schedule import LrSchedule, lr_at

FAST = {"threads": 1, "samples": 0, "eval_batches": 2}


def cfg_for(dataset_dir: Path, out: Path, **overrides) -> TrainConfig:
    return load_config("tiny", {"data": str(dataset_dir), "out": str(out), **FAST, **overrides})


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"]


# ------------------------------------------------------------------------------- schedule
def test_lr_schedules_by_hand():
    cfg = TrainConfig(steps=11, warmup_steps=2, lr=1.0, min_lr=0.1).lr_schedule()
    # warmup: (s+1)/2; cosine over steps 2..10 (8 intervals) from 1.0 to 0.1
    assert [lr_at(s, cfg) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, cfg) == pytest.approx(1.0)
    assert lr_at(6, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_at(10, cfg) == pytest.approx(0.1)
    wsd = TrainConfig(steps=10, warmup_steps=2, lr=1.0, min_lr=0.0, schedule="wsd",
                      decay_fraction=0.4).lr_schedule()
    # stable 2..5, linear decay over the last 4 steps: 0.75, 0.5, 0.25, 0
    assert [lr_at(s, wsd) for s in range(10)] == pytest.approx(
        [0.5, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0])
    const = TrainConfig(steps=10, warmup_steps=0, lr=0.3, schedule="constant").lr_schedule()
    assert {lr_at(s, const) for s in range(10)} == {0.3}


def test_lr_restart_at_growth():
    cfg = TrainConfig(steps=20, warmup_steps=2, lr=1.0, min_lr=0.0, grow_at=["10:ffn=2x"],
                      growth_lr="restart").lr_schedule()
    # stage 1: steps 0..9 end at min_lr; stage 2 warms up again from step 10
    assert lr_at(9, cfg) == pytest.approx(0.0)
    assert [lr_at(s, cfg) for s in (10, 11)] == [0.5, 1.0]
    assert lr_at(19, cfg) == pytest.approx(0.0)
    cont = TrainConfig(steps=20, warmup_steps=2, lr=1.0, min_lr=0.0, grow_at=["10:ffn=2x"])
    assert lr_at(10, cont.lr_schedule()) == pytest.approx(lr_at(10, TrainConfig(
        steps=20, warmup_steps=2, lr=1.0, min_lr=0.0).lr_schedule()))


# ------------------------------------------------------------------------------- config
def test_config_loading_and_overrides():
    by_name, by_path = load_config("demo"), load_config("configs/demo.yaml")
    assert by_name == by_path
    cfg = load_config("tiny", {"lr": "3e-4", "model.ffn_tokens": "96", "eval_at": "3,5",
                               "compile": "false", "model.qkv_scale": "null"})
    assert cfg.lr == 3e-4 and cfg.model == {"preset": "tiny", "ffn_tokens": 96,
                                            "qkv_scale": None}
    assert cfg.eval_at == [3, 5] and cfg.compile is False


@pytest.mark.parametrize("overrides, message", [
    ({"learning_rate": 1}, "unknown config key"),
    ({"lr": "fast"}, "lr must be a number"),
    ({"steps": "0"}, "steps must be > 0"),
    ({"schedule": "linear"}, "schedule must be one of"),
    ({"model.ffn_units": 3}, "unknown model key"),
    ({"optim.lr": 3}, "unknown config key"),
    ({"grow_at": ["10"]}, "malformed"),
    ({"grow_at": ["10:ffn=2y"]}, "positive integer or a multiplier"),
    ({"grow_at": ["10:width=2x"]}, "malformed"),
    ({"grow_at": ["500:ffn=2x"]}, "must be in 1..19"),
    ({"batch_size": 6, "grad_accum": 4}, "not divisible"),
])
def test_bad_config_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides)


def test_parse_grow_at():
    event = parse_grow_at("100:qkv=2x,proj=128,ffn=1.5x,layers=4,recipe=paper")
    assert event.step == 100
    assert event.kwargs == {"qkv": "2x", "proj": 128, "ffn": "1.5x", "layers": 4,
                            "recipe": "paper"}


@pytest.mark.parametrize("args, message", [
    (["--config", "tiny", "--lr", "x"], "lr must be a number"),
    (["--config", "tiny", "--grow-at", "5:qkv"], "malformed"),
    (["--config", "nope"], "not found"),
    (["--config", "tiny", "--model.preset", "huge"], "unknown model preset"),
    (["--config", "tiny", "--seq-len", "100000"], "fewer than one sequence"),
    (["--config", "tiny", "--model.vocab_size", "100"], "257-token vocabulary"),
])
def test_cli_errors_leave_no_output(tmp_path, dataset_dir, capsys, args, message):
    out = tmp_path / "run"
    code = cli(["train", *args, "--data", str(dataset_dir), "--out", str(out), "--threads", "1",
                "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1
    assert message in err
    assert not out.exists()


def test_bad_data_leaves_no_output(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text("{not json")
    for data in (tmp_path / "missing", broken):
        code = cli(["train", "--config", "tiny", "--data", str(data), "--out",
                    str(tmp_path / "run"), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and "error: " in err and len(err.strip().splitlines()) == 1
        assert not (tmp_path / "run").exists()


def test_refuses_to_overwrite_a_run(tmp_path, dataset_dir):
    cfg = cfg_for(dataset_dir, tmp_path / "run", steps=2)
    train(cfg, progress=False, print_fn=lambda s: None)
    with pytest.raises(ConfigError, match="already holds a run"):
        train(cfg, progress=False, print_fn=lambda s: None)


def test_weight_decay_groups():
    model = TokenFormerLM(TokenFormerConfig.from_name("tiny", block_norm="both"))
    opt = make_optimizer(model, TrainConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in opt.param_groups[0]["params"]}
    no_decay = {names[id(p)] for p in opt.param_groups[1]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0
    assert "layers.0.attention.query.key_param_tokens" in decay
    assert "layers.0.mlp.value_param_tokens" in decay and "word_embeddings.weight" in decay
    assert no_decay == {n for n in names.values() if "norm" in n}


# ------------------------------------------------------------------------------- the loop
def test_train_end_to_end(tmp_path, dataset_dir):
    out = tmp_path / "run"
    lines = []
    cfg = cfg_for(dataset_dir, out, steps=12, checkpoint_interval=4, keep_last=1,
                  eval_interval=6, samples=1, sample_tokens=8)
    result = train(cfg, progress=False, print_fn=lines.append)
    assert isinstance(result, FitResult) and result.step == 12 and len(result.losses) == 12
    assert result.losses[-1] < result.losses[0]
    # one FLOPs accounting: analytic training FLOPs/token × tokens
    per_token = flops_per_token(result.model.config, cfg.seq_len, training=True)["total"]
    assert result.tokens == 12 * cfg.batch_size * cfg.seq_len
    assert result.flops == pytest.approx(per_token * result.tokens)
    evals = [r for r in read_metrics(out) if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [6, 12]
    e = evals[-1]
    assert e["val_ppl"] == pytest.approx(math.exp(e["val_loss"]))
    meta = json.loads((dataset_dir / "meta.json").read_text())
    bpt = meta["val_bytes"] / meta["val_tokens"]
    assert e["val_bpb"] == pytest.approx(e["val_loss"] / math.log(2) / bpt)
    text = "\n".join(lines)
    assert "unigram entropy" in text and "--- sample 1 ---" in text and "done: 12 steps" in text
    # keep_last=1: only the newest periodic checkpoint (8) besides final (12)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000008"]
    final = out / "final"
    loaded = TokenFormerLM.load(final)
    for a, b in zip(loaded.parameters(), result.model.parameters(), strict=True):
        assert torch.equal(a, b)
    state = load_optimizer_state(final)
    assert len(state["param_groups"]) == 2 and state["state"]
    assert verify_checkpoint(final)
    assert json.loads((final / "trainer_state.json").read_text())["step"] == 12
    assert json.loads((out / "config.json").read_text())["steps"] == 12
    assert (final / "tokenizer_bytes.json").is_file()


def test_growth_inside_a_run(tmp_path, dataset_dir):
    pytest.importorskip("tokenformer.ops.growth")
    out = tmp_path / "run"
    cfg = cfg_for(dataset_dir, out, steps=8, eval_interval=0,
                  grow_at=["4:qkv=2x,proj=2x,ffn=2x,layers=3,recipe=exact"],
                  growth_lr="restart", warmup_steps=2, eval_after_growth=[1])
    result = train(cfg, progress=False, print_fn=lambda s: None)
    records = read_metrics(out)
    grow = next(r for r in records if r["type"] == "grow")
    assert grow["step"] == 4
    assert grow["after"]["val_loss"] == pytest.approx(grow["before"]["val_loss"], abs=1e-5)
    small = TokenFormerConfig.from_name("tiny", max_seq_len=cfg.seq_len)
    big = result.model.config
    assert (big.qkv_tokens, big.ffn_tokens, big.num_layers) == (64, 256, 3)
    assert grow["params_before"] == small.num_parameters()
    assert grow["params_after"] == big.num_parameters() > small.num_parameters()
    # FLOPs accounting switches at the growth step
    tokens = cfg.batch_size * cfg.seq_len
    train_records = [r for r in records if r["type"] == "train"]
    per_step = [b["flops"] - a["flops"] for a, b in itertools.pairwise(train_records)]
    assert per_step[2] == pytest.approx(flops_per_token(small, 64, True)["total"] * tokens)
    assert per_step[3] == pytest.approx(flops_per_token(big, 64, True)["total"] * tokens)
    # restart: the LR warms up again at the growth step
    assert train_records[4]["lr"] == pytest.approx(cfg.lr / 2)
    assert [r["step"] for r in records if r["type"] == "eval"] == [5, 8]
    assert TokenFormerLM.load(out / "final").config.num_layers == 3
    # a growth that does not preserve the function shows it in the post-growth evaluation
    paper = cfg_for(dataset_dir, tmp_path / "paper", steps=6, eval_interval=0,
                    grow_at=["4:ffn=4x,recipe=paper"])
    result = train(paper, progress=False, print_fn=lambda s: None)
    grow = next(r for r in result.records if r["type"] == "grow")
    assert abs(grow["after"]["val_loss"] - grow["before"]["val_loss"]) > 1e-3


def test_grad_accumulation_and_activation_checkpointing_match(tmp_path, dataset_dir):
    base = cfg_for(dataset_dir, tmp_path / "a", steps=3, eval_interval=0)
    ref = train(base, progress=False, print_fn=lambda s: None).losses
    accum = cfg_for(dataset_dir, tmp_path / "b", steps=3, eval_interval=0, grad_accum=4)
    assert train(accum, progress=False, print_fn=lambda s: None).losses == pytest.approx(
        ref, abs=1e-5)
    ac = cfg_for(dataset_dir, tmp_path / "c", steps=3, eval_interval=0,
                 activation_checkpointing=True)
    assert train(ac, progress=False, print_fn=lambda s: None).losses == pytest.approx(
        ref, abs=1e-6)
    # The C++ Θ kernel reuses the saved scores in its backward: recomputed under checkpointing.
    kernel = cfg_for(dataset_dir, tmp_path / "k", steps=3, eval_interval=0,
                     activation_checkpointing=True, pattention_impl="kernel")
    result = train(kernel, progress=False, print_fn=lambda s: None)
    assert all(m.impl == "kernel" for m in result.model.modules() if hasattr(m, "impl"))
    assert result.losses == pytest.approx(ref, abs=1e-5)
    bf16 = cfg_for(dataset_dir, tmp_path / "d", steps=3, eval_interval=0, precision="bf16")
    got = train(bf16, progress=False, print_fn=lambda s: None).losses
    assert got == pytest.approx(ref, abs=0.05) and got != ref


def test_baseline_arch_trains(tmp_path, dataset_dir):
    from tokenformer.models.baselines import TransformerLM, load_model_dir

    cfg = cfg_for(dataset_dir, tmp_path / "run", steps=3, eval_interval=0, arch="transformer++")
    result = train(cfg, progress=False, print_fn=lambda s: None)
    assert isinstance(result.model, TransformerLM)
    assert result.flops == pytest.approx(
        flops_per_token(result.model.config, 64, True)["total"] * result.tokens)
    assert type(load_model_dir(tmp_path / "run" / "final")) is TransformerLM


def test_fit_is_task_agnostic():
    """A classifier batch without input_ids, with its own FLOPs count."""

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                                           torch.nn.Linear(8, 3))

        def forward(self, x, labels):
            loss = torch.nn.functional.cross_entropy(self.net(x), labels)
            return type("Out", (), {"loss": loss})()

    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 4, generator=g)
        return {"x": x, "labels": (x[:, 0] > 0).long() + (x[:, 1] > 0).long()}

    torch.manual_seed(0)
    cfg = TrainConfig(steps=30, lr=0.05, warmup_steps=0, eval_interval=10)
    result = fit(Classifier(), batch_fn, cfg, flops_fn=lambda m, b: 6.0 * 67 * 16,
                 eval_fn=lambda m: {"n": 1.0}, progress=False)
    assert result.tokens == 30 * 16 and result.flops == 30 * 6.0 * 67 * 16
    assert result.losses[-1] < result.losses[0]
    assert [r["step"] for r in result.evals] == [10, 20, 30]


def test_plot(tmp_path, dataset_dir, monkeypatch):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    train(cfg_for(dataset_dir, run, steps=2, eval_interval=1), progress=False,
          print_fn=lambda s: None)
    png = tmp_path / "curves.png"
    assert cli(["plot", str(run), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="pip install"):
        from tokenformer.training.plot import plot_runs

        plot_runs([run], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------- resume
def _train_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenformer", "train", *args]


def test_sigkill_and_resume_is_bit_identical(tmp_path, dataset_dir):
    args = ["--config", "tiny", "--data", str(dataset_dir), "--steps", "24",
            "--checkpoint-interval", "4", "--keep-last", "2", "--eval-interval", "8",
            "--threads", "1", "--samples", "0", "--eval-batches", "2", "--no-progress",
            "--grow-at", "12:ffn=2x,recipe=exact"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, killed = tmp_path / "full", tmp_path / "killed"
    # the uninterrupted reference runs in this process (same threads: same arithmetic)
    assert cli(["train", *args, "--out", str(full)]) == 0

    proc = subprocess.Popen(_train_cmd(*args, "--out", str(killed)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"type": "train"') >= 17:
            break
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "final").exists()
    assert len(losses(killed)) >= 17

    resumed = subprocess.run(_train_cmd("--resume", str(killed), "--no-progress"), env=env,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert losses(killed) == losses(full)  # exact equality, every step
    evals = [[r["val_loss"] for r in read_metrics(d) if r["type"] == "eval"]
             for d in (full, killed)]
    assert evals[0] == evals[1]
    a, b = TokenFormerLM.load(full / "final"), TokenFormerLM.load(killed / "final")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_tensorboard_missing_is_a_clear_error(tmp_path, dataset_dir):
    try:
        import torch.utils.tensorboard  # noqa: F401

        pytest.skip("tensorboard is installed")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="pip install"):
        train(cfg_for(dataset_dir, tmp_path / "run", tensorboard=True), progress=False)
    assert not (tmp_path / "run").exists()


def test_train_grow_cli_then_init_from(tmp_path, dataset_dir):
    pytest.importorskip("tokenformer.ops.growth")
    train(cfg_for(dataset_dir, tmp_path / "a", steps=4, eval_interval=0), progress=False,
          print_fn=lambda s: None)
    grown = tmp_path / "grown"
    assert cli(["grow", str(tmp_path / "a" / "final"), "--ffn", "2x", "--out", str(grown)]) == 0
    result = train(cfg_for(dataset_dir, tmp_path / "b", steps=2, eval_interval=0,
                           init_from=str(grown)), progress=False, print_fn=lambda s: None)
    assert result.model.config.ffn_tokens == 256
    steps = {int(s["step"]) for s in result.optimizer.state.values()}
    assert steps == {6}  # 4 steps before growth (moments carried by the grow CLI) + 2
    with pytest.raises(ConfigError, match="arch"):
        train(cfg_for(dataset_dir, tmp_path / "c", steps=2, init_from=str(grown),
                      arch="transformer"), progress=False)
    assert not (tmp_path / "c").exists()


def test_fit_raises_diverged_error_at_the_first_non_finite_loss():
    """A model whose loss is inf from step 3 on: fit stops there with DivergedError (what the
    experiments catch to record a diverged run), after emitting that step's record."""
    from tokenformer.errors import DivergedError

    class Exploding(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))

        def forward(self, x, step):
            loss = (self.w * x).pow(2).mean()
            return type("Out", (), {"loss": loss * math.inf if step >= 3 else loss})()

    records = []
    cfg = TrainConfig(steps=10, lr=0.01, warmup_steps=0, eval_interval=100)
    with pytest.raises(DivergedError, match="the training loss became inf at step 3"):
        fit(Exploding(), lambda step: {"x": torch.ones(4), "step": step + 1}, cfg,
            flops_fn=lambda m, b: 1.0, callbacks=[lambda r, m: records.append(r)],
            progress=False)
    assert [r["step"] for r in records if r["type"] == "train"] == [1, 2, 3]


def test_fit_schedule_replaces_the_configs():
    """``schedule`` sets every step's learning rate (the frontier's runs span several fit calls):
    an LR of 0 leaves the weights untouched even under weight decay, and each step's record
    holds the value that schedule gives it, not cfg's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, labels):
            loss = ((self.inner(x).squeeze(-1) - labels) ** 2).mean()
            return type("Out", (), {"loss": loss})()

    def batch_fn(step):
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(8, 3, generator=g), "labels": torch.randn(8, generator=g)}

    wrapped, seen = Wrapped(), []
    before = [p.detach().clone() for p in model.parameters()]
    cfg = TrainConfig(steps=6, lr=0.1, warmup_steps=0, weight_decay=0.1)
    zero = LrSchedule(0.0, 0.0, 6, 0, "constant")
    fit(wrapped, batch_fn, cfg, progress=False, start=RunState(schedule=zero),
        flops_fn=lambda m, b: 1.0,
        callbacks=[lambda r, m: seen.append(r["lr"]) if r["type"] == "train" else None])
    assert seen == [0.0] * 6
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    seen.clear()
    ramp = LrSchedule(6e-3, 0.0, 6, 6, "constant")  # a warmup over all 6 steps: 1e-3 * (s + 1)
    fit(wrapped, batch_fn, cfg, progress=False, start=RunState(schedule=ramp),
        flops_fn=lambda m, b: 1.0,
        callbacks=[lambda r, m: seen.append(r["lr"]) if r["type"] == "train" else None])
    assert seen == pytest.approx([1e-3 * (s + 1) for s in range(6)])
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
