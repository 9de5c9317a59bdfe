"""Growth and resume you can trust (issue 36): a resumed run keeps the growth history and plan it
recorded (never a growth applied twice, never one recorded that did not happen), a growth at a
checkpoint's step is logged once, and the growth noise is named when the loss diverges."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main as cli
from tokenformer.errors import DivergedError
from tokenformer.io.checkpoint import write_manifest
from tokenformer.io.metrics import read_metrics
from tokenformer.io.run_folders import step_dir
from tokenformer.io.training_state import STATE_NAME, read_state
from tokenformer.training.config import TrainConfig
from tokenformer.training.loop import RunState, fit

GROWTH = "6:qkv=2x,proj=2x,ffn=2x"


def run_args(dataset_dir: Path, *extra: str) -> list[str]:
    return ["--data", str(dataset_dir), "--eval-interval", "0", "--threads", "1",
            "--samples", "0", "--eval-batches", "1", "--no-progress", *extra]


@pytest.fixture(scope="module")
def grown_run(tmp_path_factory, dataset_dir) -> Path:
    """tiny, 12 steps, one growth at step 6 (32 → 64 qkv tokens), a checkpoint every 2 steps."""
    run = tmp_path_factory.mktemp("grown") / "R"
    assert cli(["train", "--config", "tiny", "--steps", "12", "--checkpoint-interval", "2",
                "--keep-last", "10", "--out", str(run), "--grow-at", GROWTH,
                *run_args(dataset_dir)]) == 0
    return run


def cut_back(run: Path, tmp_path: Path, step: int) -> Path:
    """A copy of ``run`` as if it had been killed after the checkpoint of ``step``."""
    copy = tmp_path / "R"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "final")
    for later in range(step + 2, 12, 2):  # the last step's checkpoint is final
        shutil.rmtree(step_dir(copy, later))
    return copy


def snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize(("given", "step"), [
    (["10:qkv=2x,proj=2x,ffn=2x"], "step 6"),  # the replay: qkv 32 → 64 → 128
    (["6:ffn=2x"], "step 6"),  # would record a growth that never happened
    (["10:qkv=48"], "step 6"),  # failed at step 10, "cannot shrink", and the plan was saved
    ([GROWTH, "10:qkv=2x"], "step 10"),  # a new growth after the resumed step
    ([], None),  # --grow-at given without the recorded growth (the config's own: kept)
])
def test_a_resume_that_changes_the_growth_plan_is_refused(grown_run, tmp_path, capsys,
                                                          dataset_dir, given, step):
    run = cut_back(grown_run, tmp_path, 8)
    before = snapshot(run)
    if not given:  # no --grow-at at all: the recorded plan applies, once
        assert cli(["train", "--resume", str(run), "--no-progress"]) == 0
        final = TokenFormerLM.load(run / "final")
        assert final.config.qkv_tokens == 64  # 32 grown once, not twice
        assert json.loads((run / "config.json").read_text())["grow_at"] == [GROWTH]
        return
    capsys.readouterr()
    args = [a for spec in given for a in ("--grow-at", spec)]
    assert cli(["train", "--resume", str(run), *args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "--grow-at" in lines[0] and step in lines[0], lines[0]
    assert snapshot(run) == before  # the saved plan and the checkpoints are untouched


def test_a_resume_giving_the_recorded_plan_respelled_grows_once(grown_run, tmp_path,
                                                                 dataset_dir):
    run = cut_back(grown_run, tmp_path, 8)
    assert cli(["train", "--resume", str(run), "--grow-at", " 6: ffn=2x, proj=2x,qkv=2x ",
                "--no-progress"]) == 0
    final = TokenFormerLM.load(run / "final")
    reference = TokenFormerLM.load(grown_run / "final")
    assert final.config.qkv_tokens == reference.config.qkv_tokens == 64
    assert all(torch.equal(a, b) for a, b in zip(final.parameters(), reference.parameters(),
                                                 strict=True))


@pytest.mark.parametrize("step", [6, 4])
def test_one_grow_record_after_resuming_at_or_before_the_growth_step(grown_run, tmp_path, step):
    """The checkpoint of step 6 is taken before the growth at step 6 (which runs after 6
    steps): the resumed run grows again, and its record must replace the first one's."""
    run = cut_back(grown_run, tmp_path, step)
    # what the killed run had logged: the growth at 6 and the steps after it
    shutil.copy(grown_run / "metrics.jsonl", run / "metrics.jsonl")
    assert cli(["train", "--resume", str(run), "--no-progress"]) == 0
    grows = [r for r in read_metrics(run) if r["type"] == "grow"]
    assert [g["step"] for g in grows] == [6]
    assert [r["step"] for r in read_metrics(run) if r["type"] == "train"] == list(range(1, 13))
    # and the checkpoint of step 6 does not claim the growth it has not applied yet
    assert read_state(step_dir(grown_run, 6))["growth"] == []
    assert read_state(step_dir(grown_run, 8))["growth"] == [GROWTH]


def test_a_checkpoint_that_disagrees_with_the_saved_plan_is_refused(grown_run, tmp_path,
                                                                   capsys):
    """What an earlier version's double growth left behind: checkpoints of a run grown at step 6
    whose saved config plans another growth. The checkpoint's history wins: refused, one line."""
    run = cut_back(grown_run, tmp_path, 8)
    config = json.loads((run / "config.json").read_text())
    config["grow_at"] = ["10:qkv=2x"]
    (run / "config.json").write_text(json.dumps(config))
    assert cli(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--grow-at" in err and "step 8" in err, err


def test_a_malformed_growth_history_is_one_line(grown_run, tmp_path, capsys):
    run = cut_back(grown_run, tmp_path, 8)
    state = read_state(step_dir(run, 8))
    state["growth"] = "abc"
    (step_dir(run, 8) / STATE_NAME).write_text(json.dumps(state))
    write_manifest(step_dir(run, 8))  # a state file that is whole, only wrong
    assert cli(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "growth is 'abc'" in err, err


def test_fit_resumed_with_another_plan_is_refused(grown_run, tmp_path):
    """The Python API's backstop: fit(resume_from=...) compares the checkpoint's history."""
    from tokenformer.errors import ConfigError

    run = cut_back(grown_run, tmp_path, 8)
    cfg = TrainConfig.from_dict({**json.loads((run / "config.json").read_text()),
                                 "grow_at": ["10:qkv=2x"]})
    model = TokenFormerLM(TokenFormerLM.load(step_dir(run, 8)).config)
    with pytest.raises(ConfigError, match="step 8"):
        fit(model, lambda step: {}, cfg, start=RunState(resume_from=step_dir(run, 8)),
            progress=False)


def test_divergence_after_a_noisy_growth_names_the_noise():
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig(
        vocab_size=61, hidden_size=16, num_layers=1, num_heads=2, qkv_tokens=8, proj_tokens=8,
        ffn_tokens=16, max_seq_len=16, eos_token_id=None))

    def batches(step: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 61, (4, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    # width_noise 1e30: finite weights (no refusal at the growth), then a non-finite loss
    cfg = TrainConfig(steps=4, lr=1e-3, min_lr=1e-4, warmup_steps=0, eval_interval=0,
                      samples=0, grow_at=["2:hidden=2x,width_noise=1e30"])
    with pytest.raises(DivergedError, match=r"growth at step 2.*width_noise=1e\+30") as info:
        fit(model, batches, cfg, progress=False)
    assert "\n" not in str(info.value)


def test_a_plan_of_absurd_depth_is_refused_at_once():
    """--grow-at 6:layers=200000 ran > 60 s (the placement planned in O(N²)) before its memory
    check; now the plan is arithmetic and the memory check refuses it, naming the flag."""
    import time

    from tokenformer.errors import ConfigError
    from tokenformer.training.growth_events import check_growth_plan, growth_events, parse_grow_at

    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"--grow-at '6:layers=20000000' \(step 6.*GiB"):
        check_growth_plan(TokenFormerConfig.from_name("tiny"),
                          growth_events([parse_grow_at("6:layers=20000000")]))
    assert time.perf_counter() - started < 5


def test_a_fresh_plan_that_shrinks_is_refused_before_the_first_step(tmp_path, capsys,
                                                                   dataset_dir):
    """The second growth applies to the model the first one made (64 qkv tokens): refused
    before anything is written, naming the flag, the spec and its step."""
    out = tmp_path / "run"
    assert cli(["train", "--config", "tiny", "--steps", "12", "--out", str(out), "--grow-at",
                "6:qkv=2x", "--grow-at", "10:qkv=48", *run_args(dataset_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    assert "--grow-at '10:qkv=48' (step 10" in err and "cannot shrink from 64 to 48" in err, err
    assert not out.exists()
