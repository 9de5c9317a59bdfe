"""The loss-vs-compute frontier (``tokenformer scale``): the plan's schedule family and sizes, LR
selection, FLOP accounting against torch's counter, the statistics against scipy, resume after
a kill, and a tiny end-to-end run that writes the report and plots."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer.errors import ConfigError
from tokenformer.experiments.common import Arm, Curve, Point, run_arms
from tokenformer.experiments.common.stats import describe, format_p, paired, spread, t_interval
from tokenformer.experiments.frontier import plan as plan_
from tokenformer.experiments.frontier import report
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier.plan import PRESETS, decay_start, get_preset, plan
from tokenformer.models.baselines import matched_config, model_class
from tokenformer.models.config import (
    SOFTMAX_FLOPS_PER_SCORE,
    THETA_FLOPS_PER_SCORE,
    TokenFormerConfig,
    flops_per_token,
)

KJV_TRAIN_TOKENS = 4_000_000  # below the embedded corpus' training split (a safe lower bound)

TINY = dataclasses.replace(
    PRESETS["full"], name="tiny", hidden_size=32, num_layers=1, num_heads=2,
    base_tokens=(16, 16, 64), num_sizes=3, seq_len=32, batch_size=4, max_budget=1.2e9,
    num_budgets=3, warmup_steps=2, min_steps=8, sweep_steps=12, anneal_steps=3,
    eval_batches=1, seeds=2, growth_fractions=(0.25, 0.5), lr_grid=(1e-3, 3e-3, 1e-2, 3e-2))


# ---------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("name", ["quick", "full", "sparse", "gpu", "tiny"])
def test_every_run_of_every_preset_uses_one_wsd_family(name):
    preset = TINY if name == "tiny" else get_preset(name)
    runs = plan(preset, 256) + plan_.sweep_plan(preset, 256)
    assert runs
    for run in runs:
        assert run.schedule == plan_.SCHEDULE_FAMILY == "wsd"
        for b in run.branches:
            # the cooldown is the last decay_fraction of the branch, after the same warmup
            assert b.decay_start == decay_start(b.steps, preset)
            assert b.steps - b.decay_start == max(1, round(preset.decay_fraction * b.steps))
            assert b.decay_start >= preset.warmup_steps
            # the runner's segments reproduce that WSD schedule step for step
            lr, w = 1e-3, preset.warmup_steps
            assert run_.wsd_lr(w - 1, b.steps, lr, preset) == lr  # warmup ends at the peak
            for step in (w, (w + b.decay_start) // 2, b.decay_start - 1):  # stable
                assert run_.wsd_lr(step, b.steps, lr, preset) == lr
            assert run_.wsd_lr(b.decay_start, b.steps, lr, preset) < lr  # the cooldown
            assert run_.wsd_lr(b.steps - 1, b.steps, lr, preset) == pytest.approx(
                lr * preset.min_lr_ratio)
        # growth happens only in the stable phase of the run (before the last branch point)
        assert all(s.start < run.steps for s in run.stages[1:])


def test_full_preset_sizes_budgets_seeds_and_corpus_repeats():
    preset = get_preset("full")
    runs = plan(preset, 256, KJV_TRAIN_TOKENS)  # raises if any run repeats the corpus > 4×
    budgets = preset.budgets
    assert math.log10(budgets[-1] / budgets[0]) >= 1.5
    assert all(b / a == pytest.approx(preset.budget_ratio) for a, b in itertools.pairwise(budgets))
    arms = {r.arm for r in runs}
    tf = sorted(a for a in arms if a.startswith("tokenformer-"))
    tpp = sorted(a for a in arms if a.startswith("transformer++-"))
    assert len(tf) >= 4 and [a.split("-")[-1] for a in tf] == [a.split("-")[-1] for a in tpp]
    assert {"chain-paper", "chain-official", "chain-exact", "chain-exact-anneal",
            "widen-zero", "widen-net2net"} <= arms
    for arm in arms:  # every arm the verdict reads has >= 3 seeds
        assert len({r.seed for r in runs if r.arm == arm}) >= 3
    # the chain ends at its final size's LR and grows at the stated FLOP fractions
    chain = next(r for r in runs if r.arm == "chain-exact")
    assert chain.lr_from == f"tokenformer-{chain.stages[-1].size}"
    for stage, fraction in zip(chain.stages[1:], preset.growth_fractions, strict=True):
        assert plan_.flops_at(chain.stages, stage.start) == pytest.approx(
            fraction * preset.max_budget, rel=0.01)
    # every branch ends within one step of its budget
    for run in runs:
        for b in run.branches:
            assert abs(b.flops - b.budget) <= run.stages[-1].flops_per_step
    with pytest.raises(ConfigError, match="times"):
        plan(dataclasses.replace(preset, max_budget=preset.max_budget * 4), 256, KJV_TRAIN_TOKENS)


def test_matched_transformer_sizes_track_tokenformer_parameters():
    preset = get_preset("full")
    tf = plan_.model_configs(preset, "tokenformer", 256)
    tpp = plan_.model_configs(preset, "transformer++", 256)
    for a, b in zip(tf, tpp, strict=True):
        ratio = b.num_parameters(non_embedding=True) / a.num_parameters(non_embedding=True)
        assert abs(ratio - 1) < 0.01


# ------------------------------------------------------------------------------- LR selection
@pytest.mark.parametrize("optimum,chosen,added,edge", [
    (3e-3, 4e-3, [], False),  # inside the grid: the argmin (closest in log), nothing added
    (3e-2, 3.2e-2, [1.6e-2, 3.2e-2], True),  # beyond the top: extended twice, still at the edge
    (1.5e-2, 1.6e-2, [1.6e-2, 3.2e-2], False),  # beyond the top: extended until inside
    (6e-4, 5e-4, [5e-4, 2.5e-4], False),  # below: one step down is still the edge, two inside
])
def test_chosen_lr_is_the_sweeps_argmin_and_edges_extend(monkeypatch, optimum, chosen, added,
                                                          edge):
    preset = dataclasses.replace(TINY, lr_grid=(1e-3, 2e-3, 4e-3, 8e-3), families=("tokenformer",),
                                 num_sizes=2, growth_fractions=(0.5,), max_extensions=2)
    seen = []

    def fake_execute(ctx, run, lr):
        seen.append(lr)
        return {"branches": [{"loss": (math.log(lr) - math.log(optimum)) ** 2}]}

    monkeypatch.setattr(run_, "execute", fake_execute)
    ctx = run_.Context(preset, None, None, "fp32", None, False, None)
    sweeps = run_.run_sweeps(ctx, 256)
    s = sweeps["tokenformer-S1"]
    losses = {p["lr"]: p["loss"] for p in s["points"]}
    assert s["chosen"] == min(losses, key=losses.get)  # the argmin of what was run
    assert s["chosen"] == pytest.approx(chosen)
    assert s["added"] == pytest.approx(added)
    assert s["at_edge"] is edge
    assert len(s["points"]) >= 4


# ----------------------------------------------------------------------------- FLOP accounting
def _counted(model, ids, backward):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(input_ids=ids, labels=ids)
        if backward:
            out.loss.backward()
    return counter.get_total_flops() / ids.numel()


@pytest.mark.parametrize("arch", ["tokenformer", "transformer++"])
def test_flops_match_torch_flop_counter_on_matmuls(arch):
    """torch's counter sees the matmuls (Pattention / Linear, the head) but not CPU attention:
    the analytic count must equal it once the stated elementwise and attention terms are taken
    out, and training must cost exactly 3× the forward pass."""
    T, d, L, H, V = 16, 32, 2, 2, 200
    tf = TokenFormerConfig(vocab_size=V, hidden_size=d, num_layers=L, num_heads=H, qkv_tokens=16,
                           proj_tokens=24, ffn_tokens=64, max_seq_len=T, eos_token_id=None)
    config = tf if arch == "tokenformer" else matched_config(tf, arch)
    torch.manual_seed(0)
    model = model_class(arch)(config)
    ids = torch.randint(0, V, (3, T))
    forward, training = _counted(model, ids, False), _counted(model, ids, True)
    # independent expectation from the weight shapes: 2 FLOPs per multiply-add
    if arch == "tokenformer":
        per_layer = sum(2 * p.num_tokens * (p.in_features + p.out_features)
                        for name, p in model.pattentions().items() if name.startswith("layers.0."))
    else:
        per_layer = sum(2 * m.in_features * m.out_features
                        for m in model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    head = 2 * config.padded_vocab_size * d
    assert forward == L * per_layer + head
    assert training == 3 * forward
    # the analytic count = these matmuls + the stated convention for the rest
    parts = flops_per_token(config, T)
    token_attention = 2 * 2 * T * d  # Q·Kᵀ and A·V over the full context, all heads
    softmax = SOFTMAX_FLOPS_PER_SCORE * T * H
    rotary = 3 * 2 * config.rotary_dim * H
    norms = 2 * 5 * d
    if arch == "tokenformer":
        n = 3 * tf.qkv_tokens + tf.proj_tokens + tf.ffn_tokens
        elementwise = THETA_FLOPS_PER_SCORE[tf.norm] * n
    else:
        elementwise = sum(parts[k] for k in ("attention_pattentions", "ffn")) - per_layer
    assert parts["total"] == pytest.approx(
        forward + L * (token_attention + softmax + rotary + norms + elementwise) + 5 * d)
    assert flops_per_token(config, T, training=True)["total"] == 3 * parts["total"]


# -------------------------------------------------------------------------------- statistics
def test_t_interval_against_scipy_and_by_hand():
    from scipy import stats

    diffs = [-0.1, -0.12, -0.08]  # mean -0.1, sample sd 0.02
    ci = t_interval(diffs)
    # by hand: t_{0.975, 2} = 4.302653 (t table), se = 0.02 / √3 = 0.0115470
    half = 4.302653 * 0.02 / math.sqrt(3)
    assert ci.mean == pytest.approx(-0.1)
    assert (ci.low, ci.high) == pytest.approx((-0.1 - half, -0.1 + half), abs=1e-6)
    low, high = stats.t.interval(0.95, 2, loc=-0.1, scale=stats.sem(diffs))
    assert (ci.low, ci.high) == pytest.approx((low, high), rel=1e-12)
    assert ci.p_value == pytest.approx(stats.ttest_1samp(diffs, 0).pvalue, rel=1e-12)
    assert ci.excludes_zero


def test_paired_decision_rule_is_the_interval():
    a = {0: 1.0, 1: 1.1, 2: 0.9}
    resolved = paired("g", "s", a, {0: 1.1, 1: 1.22, 2: 0.98})  # diffs -0.1, -0.12, -0.08
    assert resolved.winner == "g" and resolved.verdict == "g better"
    assert resolved.ci_high < 0 and resolved.p_value < 0.05
    # |mean| > sd (the old rule) but the interval includes 0: t = 0.1 / (0.07 / √3) = 2.47
    old_rule = paired("g", "s", {0: 0.0, 1: 0.0, 2: 0.0}, {0: 0.03, 1: 0.1, 2: 0.17})
    assert abs(old_rule.mean) > old_rule.spread and old_rule.winner is None
    assert old_rule.verdict == "not resolved"
    assert old_rule.p_value == pytest.approx(0.1318, abs=1e-3)
    single = paired("g", "s", {0: 1.0}, {0: 2.0})
    assert single.winner is None and single.verdict == "not resolved (one seed)"
    never = paired("g", "s", {0: math.inf, 1: math.inf}, {0: 3.0, 1: 3.1}, "compute")
    assert never.winner is None and never.mean == math.inf
    both = paired("g", "s", {0: math.inf, 1: 1.0, 2: 1.1}, {0: math.inf, 1: 1.2, 2: 1.3})
    assert both.diffs == pytest.approx([0.0, -0.2, -0.2])  # both failed at seed 0: a tie there
    one_nan = paired("g", "s", {0: math.nan, 1: 1.0, 2: 1.1}, {0: 3.0, 1: 3.1, 2: 3.2})
    assert one_nan.winner is None and math.isnan(one_nan.mean)  # not a tie at seed 0
    s = spread([1.0, 2.0, 3.0])
    assert (s.mean, s.std, s.min, s.max, s.n) == (2.0, 1.0, 1.0, 3.0, 3)


def test_p_values_and_differences_read_as_text():
    assert format_p(0.1234) == "p = 0.123" and format_p(0.0004) == "p < 0.001"
    assert format_p(math.nan) == "p —" and format_p(None) == "p —"
    c = {"n": 3, "mean": -0.1, "ci_low": -0.15, "ci_high": -0.05, "p_value": 0.0004}
    assert describe(c) == "-0.1000 [-0.1500, -0.0500], p < 0.001"
    assert describe(c, digits=1, scale=100, unit=" pt") == "-10.0 pt [-15.0, -5.0], p < 0.001"
    assert describe({**c, "n": 1, "ci_low": math.nan}) == "-0.1000"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=1, max_size=6))
def test_paired_is_antisymmetric_and_resolved_means_interval_excludes_zero(pairs):
    a = {i: x for i, (x, _) in enumerate(pairs)}
    b = {i: y for i, (_, y) in enumerate(pairs)}
    ab, ba = paired("a", "b", a, b), paired("b", "a", b, a)
    assert ab.mean == pytest.approx(-ba.mean, abs=1e-12)
    assert ab.winner == ba.winner
    if ab.winner is not None:
        assert ab.n >= 2 and (ab.ci_low > 0 or ab.ci_high < 0) and ab.p_value < 0.05


# ------------------------------------------------------------------------- generic machinery
def test_crossing_log_hand_computed():
    # log-FLOP interpolation of the frontier: halfway between 1e10 and 1e12 in log is 1e11
    assert report._crossing_log([1e10, 1e12], [3.0, 2.0], 2.5) == pytest.approx(1e11)
    assert report._crossing_log([1e10, 1e12], [3.0, 2.0], 1.5) is None  # never gets there
    assert report._crossing_log([1e10, 1e12], [3.0, 2.0], 3.5) is None  # already below it


def test_compute_to_reach_by_hand():
    """Envelope 3.0 → 2.0 nats from 1e10 to 1e12 FLOPs (every seed); the chain ends at 2.5, 2.4
    and 2.6 with 1e12 FLOPs: the envelope gets there at 1e11, 10^11.2 and 10^10.8 FLOPs, i.e.
    ln ratios ln 0.1 + (0, +0.2, −0.2)·ln 10: geometric mean ×0.1, t interval on the logs."""
    env = {0: {"flops": dict.fromkeys(range(3), 1e10), "loss": dict.fromkeys(range(3), 3.0),
               "mean": 3.0},
           1: {"flops": dict.fromkeys(range(3), 1e12), "loss": dict.fromkeys(range(3), 2.0),
               "mean": 2.0}}
    arm = {"budgets": {1: {0: (2.5, 1e12, 0), 1: (2.4, 1e12, 0), 2: (2.6, 1e12, 0)}}}
    r = report.compute_to_reach(arm, env)
    assert r["per_seed"][1] == pytest.approx(10 ** 11.2 / 1e12)
    assert r["ratio"] == pytest.approx(0.1)
    half = 4.302653 * 0.2 * math.log(10) / math.sqrt(3)  # sd of the logs = 0.2 · ln 10
    assert (r["low"], r["high"]) == pytest.approx((0.1 * math.exp(-half),
                                                   0.1 * math.exp(half)), rel=1e-5)
    assert r["ratio_of_means"] == pytest.approx(0.1)
    below = report.compute_to_reach({"budgets": {1: {0: (1.9, 1e12, 0)}}}, env)
    assert below["more_than"] == pytest.approx(1.0) and "ratio" not in below


def test_chain_is_compared_with_scratch_at_the_size_it_has_reached():
    """Hand-made results: a chain S1 → S2 (grown before budget 1) and scratch S1, S2. At budget
    0 the chain is still S1: no same-size comparison; at budget 1 it is compared with scratch S2
    (per-seed differences −0.10, −0.12, −0.08: mean −0.10, t interval excludes 0)."""
    def run(arm, kind, seed, sizes, losses):
        return {"arm": arm, "kind": kind, "family": "tokenformer", "recipe": None, "lr": 1e-3,
                "seed": seed, "stages": [{"size": "S1", "parameters": 1,
                                          "non_embedding_parameters": 1}],
                "branches": [{"budget_index": j, "loss": x, "flops": 1e10 * (j + 1),
                              "tokens": 1, "size": z}
                             for j, (z, x) in enumerate(zip(sizes, losses, strict=True))]}
    runs = {}
    for seed, d in enumerate((-0.10, -0.12, -0.08)):
        runs[f"s1/{seed}"] = run("tokenformer-S1", "scratch", seed, ["S1", "S1"], [3.0, 2.9])
        runs[f"s2/{seed}"] = run("tokenformer-S2", "scratch", seed, ["S2", "S2"], [3.2, 2.5])
        runs[f"c/{seed}"] = run("chain-paper", "chain", seed, ["S1", "S2"], [3.1, 2.5 + d])
    results = {"runs": runs, "budgets": [1e10, 2e10], "sweeps": {}}
    comps = [c for c in report.summarize(results)["comparisons"]
             if c["question"] == "chain vs same size from scratch"]
    assert [(c["budget_index"], c["b"]) for c in comps] == [(1, "tokenformer-S2")]
    assert comps[0]["mean"] == pytest.approx(-0.10)
    assert comps[0]["winner"] == "chain-paper" and comps[0]["ci_high"] < 0
    env = [c for c in report.summarize(results)["comparisons"]
           if c["question"] == "chain vs envelope"]
    assert env[0]["b"] == "tokenformer envelope (S1)" and env[0]["mean"] == pytest.approx(0.1)


def test_run_arms_resumes_after_a_crash(tmp_path):
    calls = []

    def recipe(name, crash_at=None):
        def run(seed, shared):
            if (name, seed) == crash_at:
                raise RuntimeError("killed")
            calls.append((name, seed))
            return Curve([Point(1, 10, 1.0, 1.0, 2.0 + seed, 3.0)])
        return run

    def arms(crash_at=None):
        return [Arm("a", recipe("a", crash_at)), Arm("b", recipe("b", crash_at), seeds=1)]

    partial = tmp_path / "partial.json"
    with pytest.raises(RuntimeError):
        run_arms(arms(crash_at=("a", 1)), [0, 1], partial=partial, settings={"x": 1},
                 progress=False)
    calls.clear()
    done = run_arms(arms(), [0, 1], partial=partial, settings={"x": 1}, progress=False)
    assert calls == [("a", 1)] and sorted(done["a"]) == [0, 1]


# ------------------------------------------------------------------------------ Θ annealing
def test_theta_anneal_moves_linearly_to_sqrt_n_then_releases_the_config():
    tf = TokenFormerConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2,
                           qkv_tokens=8, proj_tokens=8, ffn_tokens=32, max_seq_len=8,
                           eos_token_id=None, qkv_scale=2.0, proj_scale=2.0, ffn_scale=4.0)
    model = model_class("tokenformer")(tf)
    anneal = {"step": 100, "held": {"qkv": 2.0, "proj": 2.0, "ffn": 4.0},
              "target": {"qkv": math.sqrt(8), "proj": math.sqrt(8), "ffn": math.sqrt(32)}}
    run_._apply_anneal(model, anneal, 125, 100)  # a quarter of the way
    p = model.pattentions()
    assert p["layers.0.attention.query"].scale == pytest.approx(2 + 0.25 * (math.sqrt(8) - 2))
    assert p["layers.0.mlp"].scale == pytest.approx(4 + 0.25 * (math.sqrt(32) - 4))
    assert model.config.ffn_scale == 4.0  # still held in the config during the anneal
    run_._apply_anneal(model, anneal, 250, 100)
    assert p["layers.0.mlp"].scale == pytest.approx(math.sqrt(32))
    assert model.config.ffn_scale is None and model.config.theta_scale("ffn") == pytest.approx(
        math.sqrt(32))


# ------------------------------------------------------------------ end to end, resume, CLI
def _strip_timing(results):
    out = dict(results)
    out.pop("timing")
    return out


@pytest.fixture(scope="module")
def tiny_run(dataset_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier") / "full"
    lines = []
    results = run_.run_frontier(TINY, data=dataset_dir, out=out, print_fn=lines.append)
    return out, results, lines


def test_tiny_end_to_end_writes_report_plots_and_results(tiny_run):
    out, _, lines = tiny_run
    saved = json.loads((out / "results.json").read_text())
    assert saved["schema"] == run_.SCHEMA and saved["machine"]["cpu"]
    assert saved["pattention_impl"].startswith("auto")
    # one progress line per run (sweeps and finals), whatever stderr is
    assert sum(line.startswith("scale: [") for line in lines) == len(plan_.sweep_plan(
        TINY, 256)) + sum(len(s["added"]) for s in saved["sweeps"].values()) + len(saved["runs"])
    for run in saved["runs"].values():  # every final run used its sweep's choice
        assert run["lr"] == saved["sweeps"][run["lr_from"]]["chosen"]
        assert [b["budget_index"] for b in run["branches"]] == sorted(
            b["budget_index"] for b in run["branches"])
    text = (out / "report.md").read_text()
    assert "## Verdict" in text and "## LR sweeps" in text and "95 %" in text
    assert (out / "frontier.png").stat().st_size > 0 and (out / "lr_sweeps.png").stat().st_size
    summary = report.summarize(saved)
    # the envelope at each budget is the scratch size with the lowest mean loss there
    table = report.arms(saved)
    for j, e in report.envelope(saved, "tokenformer").items():
        means = {a: sum(x[0] for x in v["budgets"][j].values()) / len(v["budgets"][j])
                 for a, v in table.items() if v["kind"] == "scratch"
                 and v["family"] == "tokenformer" and j in v["budgets"]}
        assert e["arm"] == min(means, key=means.get)
    assert any(c["question"] == "chain vs envelope" for c in summary["comparisons"])


def test_resume_after_a_kill_gives_the_same_results(tiny_run, dataset_dir, tmp_path,
                                                    monkeypatch):
    reference = _strip_timing(json.loads((tiny_run[0] / "results.json").read_text()))
    out = tmp_path / "killed"
    real = run_._checkpoint

    def killed(where, nth):
        """Save, then die: the nth checkpoint of a run whose id contains ``where``."""
        seen = []

        def checkpoint(path, state):
            real(path, state)
            if where in path.name:
                seen.append(path)
                if len(seen) == nth:
                    raise KeyboardInterrupt("killed")
        return checkpoint

    quiet = dict(data=dataset_dir, out=out, print_fn=lambda line: None)
    # killed inside an LR-sweep run, then inside a chain after its first growth; then finished
    monkeypatch.setattr(run_, "_checkpoint", killed("sweep__tokenformer-S2", 1))
    with pytest.raises(KeyboardInterrupt):
        run_.run_frontier(TINY, **quiet)
    assert list((out / "state").glob("*.pt"))  # the run in progress left its state
    monkeypatch.setattr(run_, "_checkpoint", killed("chain-exact-anneal__seed1", 2))
    with pytest.raises(KeyboardInterrupt):
        run_.run_frontier(TINY, **quiet)
    assert (out / "state" / "chain-exact-anneal__seed1.pt").is_file()
    monkeypatch.setattr(run_, "_checkpoint", real)
    resumed = run_.run_frontier(TINY, **quiet)
    assert resumed["timing"]["resumed"]
    assert _strip_timing(json.loads((out / "results.json").read_text())) == reference
    assert not list((out / "state").glob("*.pt"))  # finished runs leave no state behind


def test_another_experiment_in_the_same_out_is_refused(tiny_run, dataset_dir):
    other = dataclasses.replace(TINY, seeds=1)
    with pytest.raises(ConfigError, match="another experiment"):
        run_.run_frontier(other, data=dataset_dir, out=tiny_run[0], print_fn=lambda line: None)


def test_gpu_preset_runs_a_few_steps_on_cpu(dataset_dir, tmp_path):
    gpu = get_preset("gpu")
    small = dataclasses.replace(gpu, seq_len=32, batch_size=2, num_sizes=2, seeds=1,
                                families=("tokenformer",), chains=("exact",), widenings=(),
                                growth_fractions=(0.5,), min_steps=4, sweep_steps=6,
                                warmup_steps=2, anneal_steps=1, eval_batches=1, num_budgets=2,
                                dtype="fp32")
    per_step = plan_.chain_stages(small, plan_.model_configs(small, "tokenformer", 256))[
        0].flops_per_step
    small = dataclasses.replace(small, max_budget=12 * per_step)
    results = run_.run_frontier(small, data=dataset_dir, out=tmp_path / "gpu",
                                print_fn=lambda line: None, plots=False)
    assert {r["arm"] for r in results["runs"].values()} == {"tokenformer-S1", "tokenformer-S2",
                                                            "chain-exact"}
    assert results["preset"]["hidden_size"] == 256 and (tmp_path / "gpu" / "report.md").is_file()
    assert gpu.expected_hours


def test_cli_scale_errors_are_one_line(capsys, dataset_dir, tmp_path):
    from tokenformer.cli import main

    # the quick preset would repeat this 180 k-token corpus > 4 times: refused before any file
    out = tmp_path / "never"
    assert main(["scale", "--preset", "quick", "--data", str(dataset_dir), "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: frontier: ") and "(> 4)" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_cli_plan_prints_every_arm_and_trains_nothing(capsys, tmp_path, monkeypatch):
    from tokenformer.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["scale", "--preset", "full", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "schedule wsd for all" in out and "48 final runs" in out
    for arm in ("tokenformer-S5", "transformer++-S1", "chain-exact-anneal", "widen-net2net"):
        assert f"| {arm} | 3 |" in out
    assert not list(tmp_path.iterdir())


def test_random_seed_of_module_is_untouched():
    random.seed(0)  # the plan is pure data: building it draws nothing from any RNG
    state = torch.random.get_rng_state()
    plan(get_preset("full"), 256)
    assert torch.equal(state, torch.random.get_rng_state()) and random.random() == pytest.approx(
        0.8444218515250481)
