"""The v3 frontier's growing arms (issue 25): the per-stage LR schedule is piecewise what the
plan says (hand-computed values), half-depth / half-width stages take the nearest swept size's
LR, and a tiny run of every new arm kind — official-released (fresh optimizer, warmup restart),
G_stack for both families, HyperCloning for Transformer++, the final-size LR policy — trains
into the planned final size with the planned LRs."""

from __future__ import annotations

import dataclasses

import pytest
from test_frontier import assert_plan_refused  # rootdir-relative, as test_frontier_old_tokens

from tokenformer.experiments.frontier import configs as configs_
from tokenformer.experiments.frontier import one_run as one_run_
from tokenformer.experiments.frontier import presets as presets_
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier import schedule as schedule_
from tokenformer.experiments.frontier import state as state_
from tokenformer.experiments.frontier.plan import plan
from tokenformer.experiments.frontier.presets import PRESETS, get_preset
from tokenformer.training.schedule import lr_at

# the full preset's TokenFormer chain on a hand-made envelope S0, S0, S0, S1, S1, S2
ENVELOPE = dict(enumerate(["S0", "S0", "S0", "S1", "S1", "S2"]))
CHOSEN = {"tokenformer-S0": 8e-3, "tokenformer-S1": 4e-3, "tokenformer-S2": 2e-3,
          "tokenformer-S3": 1e-3}


def _chain(arm: str) -> schedule_.Run:
    preset = presets_.FULL_V3
    sizes = {f: presets_.family_sizes(preset, f) for f in preset.families}  # T++ has no S0
    runs = plan(preset, 256, envelopes={f: {j: z if z in sizes[f] else sizes[f][0]
                                            for j, z in ENVELOPE.items()}
                                        for f in preset.families})
    return next(r for r in runs if r.arm == arm and r.seed == 0)


def test_per_stage_lr_schedule_is_piecewise_the_plans():
    """Per-stage: S0's stable steps at 8e-3, S1's at 4e-3, S2's at 2e-3 (the peak moves at once
    at each growth step); the warmup ramps to S0's peak; every branch cools the size it reached
    down to 0.1 × that size's peak. Final-size: 2e-3 everywhere."""
    preset = presets_.FULL_V3
    run = _chain("chain-paper")
    assert [s.size for s in run.stages] == ["S0", "S1", "S2"]
    lrs = schedule_.stage_lrs(run, CHOSEN)
    assert lrs == (8e-3, 4e-3, 2e-3)
    g1, g2 = run.stages[1].start, run.stages[2].start
    longest = max(b.steps for b in run.branches)

    def lr(step, steps=longest):
        return lr_at(step, schedule_.run_schedule(run, lrs, steps, preset))

    w = preset.warmup_steps
    assert lr(0) == pytest.approx(8e-3 / w) and lr(w - 1) == pytest.approx(8e-3)
    assert [lr(s) for s in (w, g1 - 1, g1, g2 - 1, g2, run.steps - 1)] == pytest.approx(
        [8e-3, 8e-3, 4e-3, 4e-3, 2e-3, 2e-3])
    for b in run.branches:
        peak = lrs[[s.size for s in run.stages].index(
            schedule_.size_at(run.stages, b.decay_start - 1).size)]
        assert lr(b.decay_start - 1, b.steps) == pytest.approx(peak)
        assert lr(b.steps - 1, b.steps) == pytest.approx(0.1 * peak)  # min_lr_ratio
        halfway = (b.decay_start + b.steps) // 2  # linear in between
        frac = (halfway - b.decay_start + 1) / (b.steps - b.decay_start)
        assert lr(halfway, b.steps) == pytest.approx(peak - frac * 0.9 * peak)
    final = _chain("chain-paper-final-lr")
    assert final.lr_policy == "final-size"
    assert schedule_.stage_lrs(final, CHOSEN) == (2e-3, 2e-3, 2e-3)


def test_official_released_restarts_the_warmup_at_each_growth():
    preset = presets_.FULL_V3
    run = _chain("chain-official-released")
    lrs = schedule_.stage_lrs(run, CHOSEN)
    w, steps = preset.warmup_steps, max(b.steps for b in run.branches)
    for i, stage in enumerate(run.stages[1:], start=1):
        g = stage.start
        schedule = schedule_.run_schedule(run, lrs, steps, preset)
        assert lr_at(g, schedule) == pytest.approx(lrs[i] / w)
        assert lr_at(g + 9, schedule) == pytest.approx(lrs[i] * 10 / w)
        assert lr_at(g + w - 1, schedule) == pytest.approx(lrs[i])
    paper = _chain("chain-paper")  # the same growth without the restart: the peak at once
    g = paper.stages[1].start
    assert lr_at(g, schedule_.run_schedule(paper, lrs, steps, preset)) == pytest.approx(lrs[1])


def test_half_stages_take_the_nearest_swept_sizes_lr():
    """G_stack's half-depth S2 has exactly S1's non-embedding parameters (its blocks are S2's,
    half as many): it trains at S1's LR, then S2's; HyperCloning's half-width Transformer++ S2
    is nearest to Transformer++ S1."""
    stack = _chain("chain-stack")
    assert [s.size for s in stack.stages] == ["S2/half-depth", "S2"]
    assert stack.stages[0].config.num_parameters(non_embedding=True) == configs_.model_configs(
        presets_.FULL_V3, "tokenformer", 256)["S1"].num_parameters(non_embedding=True)
    assert schedule_.stage_lrs(stack, CHOSEN) == (4e-3, 2e-3)
    clone = _chain("widen-duplicate")
    assert [schedule_.stage_lr_key(clone, s) for s in clone.stages] == [
        "transformer++-S1", "transformer++-S2"]
    assert clone.stages[0].config.hidden_size * 2 == clone.stages[1].config.hidden_size


# a two-block tiny preset whose predicted envelopes move in both families (so every arm kind
# is planned): TokenFormer S0 → S2, Transformer++ S1 → S2
V3 = dataclasses.replace(
    presets_.FULL_V3, name="tiny-v3", hidden_size=32, num_layers=2, num_heads=2,
    base_tokens=(16, 16, 64), num_sizes=3, seq_len=32, batch_size=4, max_budget=4.8e9,
    num_budgets=3, warmup_steps=2, min_steps=8, sweep_steps=12, anneal_steps=3, eval_batches=1,
    seeds=1, tuning_seeds=1, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
    families=("tokenformer", "transformer++"),
    recipes=("chain-paper", "chain-official-released", "chain-stack", "widen-stack",
             "widen-duplicate", "chain-paper-final-lr"),
    follow="predicted", tokens_per_parameter=0.5, questions=())


def test_every_new_arm_kind_trains_into_its_planned_size(dataset_dir, tmp_path, monkeypatch):
    saved, real = {}, one_run_.save_state

    def keep(path, state):  # each state: its step, model config and AdamW's step count
        steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
        saved.setdefault(path.name, []).append((state["cursor"], state["config"], steps))
        real(path, state)

    monkeypatch.setattr(one_run_, "save_state", keep)
    results = run_.run_frontier(V3, data=dataset_dir, out=tmp_path / "out",
                                print_fn=lambda line: None, plots=False)
    runs = results["runs"]
    assert {r["arm"] for r in runs.values()} >= set(V3.recipes)
    chosen = {k: s["chosen"] for k, s in results["sweeps"].items()}
    for run in runs.values():
        if run["kind"] == "scratch":
            continue
        stages = run["stages"]
        lrs = [chosen[s["lr_from"]] for s in stages]
        # the LRs the run recorded are the plan's: one per stage, or one for final-size
        assert run["lr"] == (lrs[0] if len(set(lrs)) == 1 else lrs)
        if run["arm"] == "chain-paper-final-lr":
            assert {s["lr_from"] for s in stages} == {run["lr_from"]}
        assert len(stages) >= 2, run["arm"]  # every arm of V3 grows (the envelopes move)
        states = saved[state_._safe(run["id"]) + ".pt"]
        for stage in stages[1:]:  # after each growth the model is the planned size
            # the first state after the growth (the one at its step holds the model before it)
            cursor, config, steps = min((s for s in states if s[0] > stage["start"]),
                                        key=lambda s: s[0])
            # (a grown model keeps its config's name: the rest is the planned size's)
            assert {**config, "name": None} == {**stage["config"], "name": None}
            # official-released restarts AdamW at the growth (its step count starts again);
            # every other arm carries it (the count of every step of the run)
            restarted = run["arm"] == "chain-official-released"
            assert steps == {cursor - stage["start"] if restarted else cursor}, run["arm"]


# v3's gpu-30m as it was (issue 26; replaced by gpu-code in v4): the refusal's test case
GPU_30M = dataclasses.replace(
    presets_.FULL_V3, name="gpu-30m", hidden_size=256, num_layers=4, num_heads=4,
    base_tokens=(128, 128, 512), first_size=0, num_sizes=3, seq_len=512, batch_size=128,
    max_budget=1e15, num_budgets=4, warmup_steps=50, min_steps=120, sweep_steps=150,
    anneal_steps=50, lr_grid=(5e-4, 1e-3, 2e-3, 4e-3), eval_batches=16, dtype="bf16",
    tokens_per_parameter=20.0, recipes=("chain-paper", "chain-gelu"),
    questions=tuple(q for q in presets_.GROWTH_QUESTIONS + presets_.ARCHITECTURE_QUESTIONS
                    + presets_.CONTROL_QUESTIONS if q.id in ("G1", "A1", "A2", "C1", "C2")),
    corpus="synthetic:30000000")


def test_question_whose_arm_never_runs_refused_at_plan_time(capsys, tmp_path, monkeypatch):
    """v3's gpu-30m asked G6 (widen-zero vs Transformer++'s envelope) while its own plan put
    Transformer++ at S1 only, so widen-zero never grew and G6 got no data after the whole run.
    The plan now refuses such a preset in one line, before anything trains; every shipped preset
    plans (and gpu-30m no longer asks G6)."""
    from tokenformer.errors import ConfigError

    v3_gpu = dataclasses.replace(
        GPU_30M, recipes=("chain-paper", "widen-zero", "chain-gelu"),
        questions=(*GPU_30M.questions,
                   next(q for q in presets_.GROWTH_QUESTIONS if q.id == "G6")))
    with pytest.raises(ConfigError, match=r"question G6 needs widen-zero, which preset "
                                          r"'gpu-30m' never runs"):
        plan(v3_gpu, 256)
    assert_plan_refused(monkeypatch, capsys, tmp_path, "gpu-30m", v3_gpu,
                        "error: frontier: question G6 needs widen-zero")


def test_every_preset_runs_the_arms_of_its_questions():
    for name in PRESETS:
        plan(get_preset(name), 256)  # refuses a question whose arm never runs
