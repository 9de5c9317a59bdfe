"""What a growth inside a run can ask for (issue 24): frozen or noised old tokens, the recipes
``official-init``/``official-released``, the peak learning rate of the next stage, and the
``--grow-at`` keys that carry them, through ``fit``, ``train`` and a kill and resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main as cli
from tokenformer.errors import ConfigError, GrowthError
from tokenformer.io.metrics import read_metrics
from tokenformer.io.run_folders import step_dir
from tokenformer.io.training_state import read_state
from tokenformer.ops.growth import grow_with_optimizer, old_tokens
from tokenformer.training import growth as growth_in_run
from tokenformer.training.config import TrainConfig, load_config
from tokenformer.training.freezing import FrozenRows
from tokenformer.training.growth import growth_plan
from tokenformer.training.growth_events import (
    check_growth_plan,
    growth_events,
    parse_grow_at,
)
from tokenformer.training.lm import train
from tokenformer.training.loop import RunState, fit
from tokenformer.training.schedule import lr_at

VOCAB = 61


def tiny_lm(seed: int = 0) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=2, qkv_tokens=8,
        proj_tokens=8, ffn_tokens=16, max_seq_len=16, eos_token_id=None))


def batches(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def quiet(**overrides) -> TrainConfig:
    return TrainConfig(**{"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 0, "eval_interval": 0,
                          "weight_decay": 0.1, "samples": 0, **overrides})


def rows_of(model: torch.nn.Module, rows: dict[str, int], old: bool) -> dict[str, torch.Tensor]:
    """The old (first n) or new rows of each tensor in ``rows``, copied."""
    params = dict(model.named_parameters())
    return {name: (params[name][:n] if old else params[name][n:]).detach().clone()
            for name, n in rows.items()}


# ------------------------------------------------------------------------------ frozen old tokens
def test_frozen_old_tokens_and_their_moments_are_bitwise_unchanged_while_new_ones_move():
    small = tiny_lm()
    cfg = quiet(steps=3)
    warm = fit(small, batches, cfg, progress=False)  # non-zero moments to carry
    grown, optimizer = grow_with_optimizer(warm.model, warm.optimizer, qkv="2x", ffn="2x",
                                           freeze_old=3, generator=torch.Generator())
    freeze = FrozenRows.after_growth(grown, 3)
    assert freeze.until == 6 and freeze.rows == old_tokens(grown).rows
    old_w, new_w = rows_of(grown, freeze.rows, True), rows_of(grown, freeze.rows, False)
    params = dict(grown.named_parameters())
    old_m = {(n, k): optimizer.state[params[n]][k][:r].clone() for n, r in freeze.rows.items()
             for k in ("exp_avg", "exp_avg_sq")}
    assert any(m.any() for m in old_m.values())  # carried moments: AdamW would move the rows
    other = {n: p.detach().clone() for n, p in grown.named_parameters() if n not in freeze.rows}

    result = fit(grown, batches, quiet(steps=6),
                 start=RunState(step=3, optimizer=optimizer, freeze=freeze),
                 progress=False)  # three steps, all frozen
    assert result.model is grown and result.optimizer is optimizer
    for name, n in freeze.rows.items():
        assert torch.equal(params[name][:n], old_w[name]), name  # bitwise, weight decay on
        if new_w[name].numel():  # proj did not grow: all its tokens are old
            assert not torch.equal(params[name][n:], new_w[name]), name  # the new rows train
        for key in ("exp_avg", "exp_avg_sq"):  # no moments accumulated or decayed
            assert torch.equal(optimizer.state[params[name]][key][:n], old_m[name, key])
    assert all(not torch.equal(p, other[n]) for n, p in grown.named_parameters()
               if n not in freeze.rows)  # the embedding and the final norm train

    fit(grown, batches, quiet(steps=7), start=RunState(step=6, optimizer=optimizer, freeze=freeze),
        progress=False)  # step 6: the freeze is over
    assert all(not torch.equal(params[n][:r], old_w[n]) for n, r in freeze.rows.items())


def test_freeze_forever_inside_a_run_and_what_it_records():
    snapshots = {}

    def watch(record, model):
        if record["type"] == "grow":
            rows = old_tokens(model).rows
            snapshots["rows"], snapshots["old"] = rows, rows_of(model, rows, True)
            snapshots["new"] = rows_of(model, rows, False)
            assert record["frozen_until"] == "forever"

    cfg = quiet(steps=6, grow_at=["2:proj=2x,ffn=24,layers=2,freeze_old=forever"])
    result = fit(tiny_lm(), batches, cfg, callbacks=[watch], progress=False)
    rows = snapshots["rows"]
    assert set(rows) == {f"layers.0.{m}.{leaf}" for m in ("attention.query", "attention.key",
                                                          "attention.value", "attention.proj",
                                                          "mlp")
                         for leaf in ("key_param_tokens", "value_param_tokens")}
    now_old, now_new = rows_of(result.model, rows, True), rows_of(result.model, rows, False)
    assert all(torch.equal(now_old[n], snapshots["old"][n]) for n in rows)
    assert all(not torch.equal(now_new[n], snapshots["new"][n]) for n in rows if rows[n] <
               dict(result.model.named_parameters())[n].shape[0])
    # the inserted block is new: it trains whole
    assert not any(name.startswith("layers.1.") for name in rows)


def test_a_freeze_may_not_outlast_the_next_growth_unless_that_one_freezes_longer():
    """The plan is checked where it runs (growth_plan: fit's and train's start)."""
    with pytest.raises(ConfigError, match="outlasts the growth at step 8"):
        growth_plan(quiet(steps=20, grow_at=["5:ffn=2x,freeze_old=4", "8:ffn=2x"]))
    growth_plan(quiet(steps=20, grow_at=["5:ffn=2x,freeze_old=3", "8:ffn=2x"]))  # ends at 8
    growth_plan(quiet(steps=20, grow_at=["5:ffn=2x,freeze_old=forever",
                                         "8:ffn=2x,freeze_old=forever"]))
    # the run-wide setting applies to every growth that does not set its own
    with pytest.raises(ConfigError, match="outlasts"):  # 8 turns it off: 5's would outlast it
        growth_plan(quiet(steps=20, grow_at=["5:ffn=2x", "8:ffn=2x,freeze_old=0"],
                          growth_freeze_old="forever"))
    cfg = quiet(steps=20, grow_at=["5:ffn=2x", "8:ffn=2x,noise_old=0"], growth_freeze_old="12",
                growth_noise_old=0.01)
    first, second = growth_plan(cfg)
    assert first.kwargs == {"ffn": "2x", "freeze_old": 12, "noise_old": 0.01}
    assert second.kwargs == {"ffn": "2x", "freeze_old": 12, "noise_old": 0.0}


# ------------------------------------------------------------------------------ recipes
def test_official_released_resets_the_optimizer_and_restarts_warmup_and_decay():
    cfg = quiet(steps=10, warmup_steps=2, schedule="wsd", decay_fraction=0.25,
                grow_at=["6:ffn=2x,recipe=official-released"])
    result = fit(tiny_lm(), batches, cfg, progress=False)
    lrs = [r["lr"] for r in result.records if r["type"] == "train"]
    # stage 1 (steps 0-5): warmup 2, decay over round(0.25*6) = 2 steps; stage 2 (steps 6-9):
    # warmup 2 again, decay over round(0.25*4) = 1 step, ending at min_lr
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-2, 1e-2, 5.5e-3, 1e-3, 5e-3, 1e-2, 1e-2, 1e-3])
    # a fresh AdamW at step 6: four steps since (a carried one would count ten)
    assert {float(s["step"]) for s in result.optimizer.state.values()} == {4.0}
    carried = fit(tiny_lm(), batches, quiet(steps=10, grow_at=["6:ffn=2x,recipe=official-init"]),
                  progress=False)
    assert {float(s["step"]) for s in carried.optimizer.state.values()} == {10.0}


def test_official_is_still_official_init_with_a_note(tmp_path, dataset_dir):
    def run(name, recipe):
        lines = []
        cfg = load_config("tiny", {"data": str(dataset_dir), "out": str(tmp_path / name),
                                   "threads": 1, "samples": 0, "eval_batches": 1, "steps": 4,
                                   "eval_interval": 0,
                                   "grow_at": [f"2:ffn=2x,recipe={recipe}"]})
        return train(cfg, progress=False, print_fn=lines.append).losses, lines

    old, old_lines = run("old", "official")
    new, new_lines = run("new", "official-init")
    assert old == new
    notes = [line for line in old_lines if line.startswith("note: ")]
    assert len(notes) == 1 and "'official-init'" in notes[0]
    assert not any(line.startswith("note: ") for line in new_lines)


# ------------------------------------------------------------------------------ per-stage LR
def test_per_stage_peak_lr_is_piecewise_what_the_plan_says():
    cfg = TrainConfig(steps=20, warmup_steps=2, lr=1.0, min_lr=0.1, schedule="wsd",
                      decay_fraction=0.2, grow_at=[
                          "5:ffn=2x,lr=0.5",                      # a jump
                          "10:ffn=2x,lr=0.8,lr_ramp=4",           # a ramp 0.5 -> 0.8 over 4
                          "15:ffn=2x,recipe=official-released,lr=0.3"])  # restart at 0.3
    # by hand: [0, 15) is one WSD run of 15 steps (warmup 2, decay over the last 3, from 12),
    # [15, 20) another of 5 (warmup 2, decay over the last 1). Peaks: 1 until 5, 0.5 until 10,
    # 0.575, 0.65, 0.725, 0.8 on 10..13, 0.3 from 15.
    expected = [0.5, 1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5, 0.5, 0.575, 0.65,
                0.725 - (0.725 - 0.1) / 3, 0.8 - 2 * (0.8 - 0.1) / 3, 0.1,
                0.15, 0.3, 0.3, 0.3, 0.1]
    assert [lr_at(s, cfg.lr_schedule()) for s in range(20)] == pytest.approx(expected)
    # growth_lr: restart restarts at every growth, whatever the recipe
    restart = TrainConfig(steps=20, warmup_steps=2, lr=1.0, min_lr=0.1, schedule="constant",
                          growth_lr="restart", grow_at=["5:ffn=2x,lr=0.5"])
    assert [lr_at(s, restart.lr_schedule()) for s in (4, 5, 6, 19)] == [1.0, 0.25, 0.5, 0.5]


def test_a_stage_lr_below_min_lr_is_refused():
    with pytest.raises(ConfigError, match="below min_lr"):
        TrainConfig(steps=20, lr=1e-3, min_lr=1e-4, grow_at=["5:ffn=2x,lr=5e-5"])


# ------------------------------------------------------------------------------ --grow-at grammar
def test_grow_at_keys():
    event = parse_grow_at("100:hidden=2x,heads=8,layers=2x,how=stack,recipe=official-released,"
                          "freeze_old=forever,noise_old=1e-2,lr=3e-4,lr_ramp=50")
    assert event.kwargs == {"hidden": "2x", "heads": 8, "layers": "2x", "how": "stack",
                            "recipe": "official-released", "freeze_old": "forever",
                            "noise_old": 0.01}
    assert (event.lr, event.lr_ramp, event.note) == (3e-4, 50, "")
    assert event.lr_stage.restart and event.lr_stage.lr == 3e-4 and event.lr_stage.ramp == 50
    old = parse_grow_at("7:ffn=2x,recipe=official")
    assert old.kwargs["recipe"] == "official-init" and "'official-init'" in old.note
    assert not old.lr_stage.restart and old.lr_stage.lr is None


@pytest.mark.parametrize("spec, message", [
    ("10:ffn=2x,lr=0", "lr='0' must be a number > 0"),
    ("10:ffn=2x,lr=fast", "lr='fast' must be a number > 0"),
    ("10:ffn=2x,lr_ramp=5", "lr_ramp needs lr="),
    ("10:ffn=2x,lr=1e-3,lr_ramp=-1", "lr_ramp='-1' must be a number of steps"),
    ("10:ffn=2x,freeze_old=soon", "freeze_old='soon' must be a number of steps or forever"),
    ("10:ffn=2x,noise_old=-1", "noise_old='-1' must be a number >= 0"),
    ("10:ffn=2x,recipe=exact,strategy=paper", "name the same thing"),
    ("10:ffn=2x,recipe=official-releasd", "unknown recipe 'official-releasd'"),
    ("10:hidden=0.5x", "would shrink the model"),
    ("10:how=Stack!", "must be a word"),
    ("10:ffn=2x,width=2x", "malformed"),
])
def test_bad_grow_at_is_one_error_line_and_nothing_written(tmp_path, dataset_dir, capsys, spec,
                                                          message):
    out = tmp_path / "run"
    code = cli(["train", "--config", "tiny", "--data", str(dataset_dir), "--out", str(out),
                "--threads", "1", "--no-progress", "--grow-at", spec])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1
    assert message in err
    assert not out.exists()


def test_width_and_depth_arguments_reach_grow(monkeypatch):
    """hidden=, heads=, layers=, how= go to grow_with_optimizer as given (the operators are
    ops.growth's; here a stand-in that records its arguments and grows nothing)."""
    seen = []

    def fake(model, optimizer, **kwargs):
        seen.append(kwargs)
        return model, optimizer

    monkeypatch.setattr(growth_in_run, "grow_with_optimizer", fake)
    cfg = quiet(steps=3, grow_at=["1:hidden=2x,heads=4,layers=2x,how=stack,recipe=exact"])
    fit(tiny_lm(), batches, cfg, progress=False)
    assert len(seen) == 1
    assert {k: seen[0][k] for k in ("hidden", "heads", "layers", "how", "recipe")} == {
        "hidden": "2x", "heads": 4, "layers": "2x", "how": "stack", "recipe": "exact"}


def test_width_and_stacking_run_inside_fit_and_preserve_what_they_claim():
    """The real operators inside a run: at the growth step the width-doubled model gives the
    logits the small one gave (exact duplication, float32 rounding), stacking doubles the blocks,
    and training goes on with optimizer state of the new shapes."""
    captured = {}
    real = growth_in_run.grow_with_optimizer

    def spy(model, optimizer, **kwargs):
        ids = batches(0)["input_ids"]
        with torch.no_grad():
            captured["before"] = model.eval()(ids).logits.clone()
        grown, opt = real(model, optimizer, **kwargs)
        with torch.no_grad():
            captured["after"] = grown.eval()(ids).logits.clone()
        grown.train()
        captured["model"], captured["optimizer"] = grown, opt
        return grown, opt

    growth_in_run.grow_with_optimizer, saved = spy, growth_in_run.grow_with_optimizer
    try:
        cfg = quiet(steps=4, grow_at=["2:hidden=2x,layers=2x,how=stack,recipe=exact"])
        result = fit(tiny_lm(), batches, cfg, progress=False)
    finally:
        growth_in_run.grow_with_optimizer = saved
    grown = captured["model"]
    assert grown.config.hidden_size == 32 and grown.config.num_layers == 2
    assert grown.config.num_heads == 4  # head size kept
    # stacking changes the function; width alone would not: check width separately below
    assert result.step == 4
    for group in captured["optimizer"].param_groups:
        for param in group["params"]:
            state = captured["optimizer"].state.get(param, {})
            if "exp_avg" in state:
                assert state["exp_avg"].shape == param.shape
    small = tiny_lm()
    width_only = real(small, torch.optim.AdamW(small.parameters()), hidden="2x")[0]
    ids = batches(0)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(width_only.eval()(ids).logits, small(ids).logits,
                                   rtol=1e-4, atol=1e-5)


def test_old_token_options_with_stacking_or_width_are_refused_before_the_first_step():
    """train() checks the plan before its first step (check_growth_plan); grow() itself refuses
    the same request too, for Python callers."""
    for spec in ("1:layers=2x,how=stack,freeze_old=5", "1:hidden=2x,noise_old=0.1"):
        with pytest.raises(ConfigError, match="freeze_old and noise_old"):
            check_growth_plan(tiny_lm().config, growth_events([parse_grow_at(spec)]))
        with pytest.raises(GrowthError, match="freeze_old and noise_old"):
            fit(tiny_lm(), batches, quiet(steps=3, grow_at=[spec]), progress=False)


# ------------------------------------------------------------------------------ kill and resume
def kill_and_resume(args: list[str], tmp_path, kill_after: int):
    """Train ``args`` uninterrupted into ``full``, and again into ``killed`` killed with SIGKILL
    after ``kill_after`` train records then resumed; assert both runs' losses, LRs and final
    weights are identical. Returns (full, killed, final model)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert cli(["train", *args, "--out", str(full)]) == 0  # the uninterrupted reference

    proc = subprocess.Popen([sys.executable, "-m", "tokenformer", "train", *args, "--out",
                             str(killed)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"type": "train"') >= kill_after:
            break
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "final").exists()

    resumed = subprocess.run([sys.executable, "-m", "tokenformer", "train", "--resume",
                              str(killed), "--no-progress"], env=env, capture_output=True,
                             text=True)
    assert resumed.returncode == 0, resumed.stderr

    def train_records(run):
        return [(r["step"], r["loss"], r["lr"]) for r in read_metrics(run) if r["type"] == "train"]

    assert train_records(killed) == train_records(full)  # exact equality, every step
    a, b = TokenFormerLM.load(full / "final"), TokenFormerLM.load(killed / "final")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    return full, killed, a


def test_killed_inside_a_freeze_resumes_bit_for_bit(tmp_path, dataset_dir):
    args = ["--config", "tiny", "--data", str(dataset_dir), "--steps", "12",
            "--checkpoint-interval", "2", "--eval-interval", "0", "--threads", "1",
            "--samples", "0", "--eval-batches", "1", "--no-progress", "--schedule", "wsd",
            "--grow-at", "5:ffn=2x,qkv=2x,recipe=official-released,freeze_old=6,"
                         "noise_old=0.05,lr=2e-3,lr_ramp=3"]
    # the old tokens are frozen for steps 5..10: die after a checkpoint inside that window
    full, _, a = kill_and_resume(args, tmp_path, kill_after=8)
    inside = read_state(step_dir(full, 10))["frozen_rows"]
    small = TokenFormerConfig.from_name("tiny")
    counts = {"query": small.qkv_tokens, "key": small.qkv_tokens, "value": small.qkv_tokens,
              "proj": small.proj_tokens, "mlp": small.ffn_tokens}
    assert inside["until"] == 11 and inside["rows"] == {
        name: counts[name.split(".")[-2]] for name, _ in a.named_parameters()
        if name.endswith("_param_tokens")}
    assert "frozen_rows" not in read_state(full / "final")


def test_killed_after_a_width_and_stacking_growth_resumes_bit_for_bit(tmp_path, dataset_dir):
    """Width duplication and depth stacking inside a run: a kill after the growth resumes from a
    checkpoint of the grown model (and its tiled optimizer state) to the same losses."""
    args = ["--config", "tiny", "--data", str(dataset_dir), "--steps", "10",
            "--checkpoint-interval", "2", "--eval-interval", "0", "--threads", "1",
            "--samples", "0", "--eval-batches", "1", "--no-progress", "--schedule", "wsd",
            "--grow-at", "3:hidden=2x,layers=2x,how=stack,width_noise=0.01,lr=2e-3"]
    _, _, grown = kill_and_resume(args, tmp_path, kill_after=7)
    small = TokenFormerConfig.from_name("tiny")
    assert grown.config.hidden_size == 2 * small.hidden_size
    assert grown.config.num_layers == 2 * small.num_layers
