"""Configuration as data (issue 44): a TrainConfig checks its own fields and calls none of its
consumers (the growth plan and the anneal are checked where they run, before anything is
written); a run's growths are parsed once, into GrowthEvent objects that code (the frontier)
may hand over as objects, the spec text kept for records; the learning rate is a function of the
step and one small frozen record, LrSchedule, whatever plans it (a TrainConfig, the frontier),
with the post-growth warmup rules of training/schedule.py."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.errors import ConfigError
from tokenformer.training import growth_events as growth_events_
from tokenformer.training.config import TrainConfig
from tokenformer.training.execution import Execution
from tokenformer.training.growth import growth_plan
from tokenformer.training.growth_events import GrowthEvent, parse_grow_at
from tokenformer.training.loop import RunState, fit
from tokenformer.training.schedule import LrSchedule, LrStage, lr_at

SPEC = "3:ffn=2x,recipe=paper,lr=5e-4"


def quiet(**overrides) -> TrainConfig:
    return TrainConfig(**{"seq_len": 8, "batch_size": 2, "steps": 5, "warmup_steps": 1,
                          "eval_interval": 0, "samples": 0, "device": "cpu", **overrides})


def tiny_lm() -> TokenFormerLM:
    torch.manual_seed(0)
    return TokenFormerLM(TokenFormerConfig(vocab_size=32, hidden_size=16, num_layers=1,
                                           num_heads=2, qkv_tokens=8, proj_tokens=8,
                                           ffn_tokens=16, max_seq_len=8))


def batches(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids}


def test_a_spec_is_parsed_once_per_run_and_recorded_as_given(monkeypatch):
    parsed = []
    real = growth_events_.parse_grow_at
    monkeypatch.setattr(growth_events_, "parse_grow_at",
                        lambda spec, **kw: parsed.append(spec) or real(spec, **kw))
    monkeypatch.setattr("tokenformer.training.config.parse_grow_at",
                        growth_events_.parse_grow_at)
    cfg = quiet(grow_at=[SPEC], growth_noise_old=0.01)
    assert parsed == [SPEC]
    (event,) = cfg.grow_at
    assert isinstance(event, GrowthEvent) and event.spec == SPEC
    assert event.kwargs == {"ffn": "2x", "recipe": "paper"}  # the run-wide noise is the run's
    assert growth_plan(cfg)[0].kwargs == {"ffn": "2x", "recipe": "paper", "noise_old": 0.01}
    assert cfg.grow_at[0].kwargs == {"ffn": "2x", "recipe": "paper"}  # left as it was
    assert json.loads(json.dumps(cfg.to_dict()))["grow_at"] == [SPEC]  # the record: the text
    result = fit(tiny_lm(), batches, cfg, progress=False)
    assert parsed == [SPEC]  # fit, its events and its schedule parse nothing again
    (grew,) = [r for r in result.records if r["type"] == "grow"]
    assert grew["spec"] == SPEC and result.model.config.ffn_tokens == 32


def test_an_event_given_as_an_object_is_the_growth_its_spec_would_be():
    """What the frontier does: the event, built in code, is the run's growth; no text is
    formatted to be parsed again."""
    given = GrowthEvent(3, {"ffn": "2x", "recipe": "paper"}, "3:ffn=2x,recipe=paper")
    by_object = fit(tiny_lm(), batches, quiet(grow_at=[given]), progress=False)
    by_text = fit(tiny_lm(), batches, quiet(grow_at=[given.spec]), progress=False)
    assert by_object.losses == by_text.losses
    assert quiet(grow_at=[given]).grow_at == [given]


def test_lr_at_takes_a_schedule_record_not_a_config():
    """A TrainConfig's schedule is a record of its own fields; lr_at reads nothing else (by hand:
    warmup 1, cosine from 1e-3 to 1e-4 over steps 1..4, the peak 5e-4 from step 3 on)."""
    cfg = quiet(lr=1e-3, min_lr=1e-4, grow_at=[SPEC])
    schedule = cfg.lr_schedule()
    assert schedule == LrSchedule(1e-3, 1e-4, 5, 1, "cosine", 0.2, (LrStage(3, False, 5e-4),))
    cosine = [1e-4 + 0.5 * (1 + math.cos(math.pi * (s - 1) / 3)) * (peak - 1e-4)
              for s, peak in ((1, 1e-3), (2, 1e-3), (3, 5e-4), (4, 5e-4))]
    assert [lr_at(s, schedule) for s in range(5)] == pytest.approx([1e-3, *cosine])


def test_the_post_growth_warmup_rules_of_one_schedule():
    """A restart either starts the schedule again (warmup and a new decay: the released code,
    a TrainConfig's) or ramps the schedule up again, its decay kept (the frontier's WSD family).
    By hand: 20 steps, warmup 4, WSD decaying over the last 4 to 0.1; a restart at step 10."""
    common = dict(peak=1.0, min_lr=0.1, steps=20, warmup_steps=4, shape="wsd",
                  decay_fraction=0.2, stages=(LrStage(10, restart=True),))
    anew = LrSchedule(**common)  # [0, 10) and [10, 20): 10 steps each, warmup 4, decay over 2
    assert [lr_at(s, anew) for s in range(8, 20)] == pytest.approx(
        [0.55, 0.1, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 0.55, 0.1])
    kept = LrSchedule(**common, restarts="warmup")  # the run's decay (from 16) times the ramp
    assert [lr_at(s, kept) for s in range(8, 20)] == pytest.approx(
        [1.0, 1.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0 - 0.9 / 4, 1.0 - 0.9 / 2,
         1.0 - 0.9 * 3 / 4, 0.1])
    ratio = LrSchedule(**{**common, "stages": (LrStage(10, lr=0.5),)}, min_ratio=0.1)
    assert lr_at(19, ratio) == pytest.approx(0.05)  # the floor follows the peak in force


def test_a_spec_parsed_from_a_record_keeps_its_text():
    event = parse_grow_at("4:ffn=2x,recipe=official", recorded=True)
    assert event.spec == "4:ffn=2x,recipe=official" and event.kwargs["recipe"] == "official-init"


def test_a_config_checks_its_own_fields_and_the_plan_is_checked_where_it_runs(tmp_path):
    """An anneal with no exact growth to follow, or a freeze outlasting the next growth, is a
    plan the anneal and growth logic refuse: at fit's start, before the run folder is touched;
    the config itself holds only fields of the right types and ranges."""
    for cfg in (quiet(anneal_steps=3),
                quiet(steps=20, grow_at=["5:ffn=2x,freeze_old=4", "8:ffn=2x"])):
        with pytest.raises(ConfigError, match=r"anneal_steps 3 anneals|outlasts") as err:
            fit(tiny_lm(), batches, cfg, out_dir=tmp_path / "run", progress=False)
        assert "\n" not in str(err.value) and not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"the step must be in 1\.\.4"):  # its own fields
        quiet(grow_at=["5:ffn=2x"])
    with pytest.raises(ConfigError, match=r"growth_freeze_old.*must be a number of steps"):
        quiet(growth_freeze_old="soon")


def test_fit_takes_its_run_state_and_execution_as_records():
    """fit took 18 parameters (the run state, the device and the process group one by one, and
    _fit repeated them); now at most 10: where the call starts is a RunState, where it computes
    an Execution. A RunState cannot both resume a checkpoint and carry an optimizer."""
    assert len(inspect.signature(fit).parameters) <= 10
    assert {"start", "execution"} <= set(inspect.signature(fit).parameters)
    with pytest.raises(ConfigError, match="either an optimizer or resume_from"):
        RunState(optimizer=torch.optim.SGD(tiny_lm().parameters(), lr=0.1), resume_from="x")
    five = quiet(steps=5)
    whole = fit(tiny_lm(), batches, five, progress=False)
    # three steps on the five-step run's schedule, then the rest: the frontier's segments
    first = fit(tiny_lm(), batches, quiet(steps=3), start=RunState(schedule=five.lr_schedule()),
                progress=False)
    rest = fit(first.model, batches, five,
               start=RunState(step=first.step, optimizer=first.optimizer),
               execution=Execution(device="cpu", readback=2), progress=False)
    assert first.losses + rest.losses == whole.losses  # a run continued bit for bit


@pytest.mark.parametrize("given, says", [
    ({"step": 7}, "a step"), ({"step": 7, "anneal": object()}, "a step and an anneal"),
    ({"freeze": object()}, "frozen rows")])
def test_what_a_checkpoint_carries_is_refused_beside_resume_from(given, says):
    """The checkpoint sets the step, frozen rows and anneal itself: one given beside it was
    overwritten in silence (only an optimizer and an anneal were refused)."""
    with pytest.raises(ConfigError, match=f"^pass either {says} or resume_from"):
        RunState(resume_from="x", **given)


@pytest.mark.parametrize("field, value", [("shape", "cosin"), ("restarts", "warmups")])
def test_a_misspelt_schedule_name_is_refused(field, value):
    """A name outside SCHEDULES or RESTARTS ran another schedule in silence (WSD for "cosin",
    no restart for "warmups")."""
    with pytest.raises(ConfigError, match=f"LrSchedule {field}='{value}': choose one of"):
        LrSchedule(peak=1.0, min_lr=0.0, steps=10, warmup_steps=2, **{field: value})
