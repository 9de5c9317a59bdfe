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
from tokenformer.experiments.frontier import analysis, report, report_markdown
from tokenformer.experiments.frontier import arms as arms_
from tokenformer.experiments.frontier import chains as chains_
from tokenformer.experiments.frontier import configs as configs_
from tokenformer.experiments.frontier import one_run as one_run_
from tokenformer.experiments.frontier import plan as plan_
from tokenformer.experiments.frontier import presets as presets_
from tokenformer.experiments.frontier import questions as questions_
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier import schedule as schedule_
from tokenformer.experiments.frontier import state as state_
from tokenformer.experiments.frontier.plan import plan
from tokenformer.experiments.frontier.presets import PRESETS, get_preset
from tokenformer.experiments.frontier.schedule import decay_start
from tokenformer.models.baselines import matched_config, model_class
from tokenformer.models.config import (
    SOFTMAX_FLOPS_PER_SCORE,
    THETA_FLOPS_PER_SCORE,
    TokenFormerConfig,
    flops_per_token,
)
from tokenformer.training.schedule import lr_at

KJV_TRAIN_TOKENS = 4_000_000  # below the embedded corpus' training split (a safe lower bound)

# S0–S3 (Transformer++ S1–S3: S3 the size above the predicted optimum that the plan-time edge
# check asks for), chains on the predicted envelope (fixed before the run, so the resume test
# can kill one): TokenFormer S0 → S1 → S2, Transformer++ S1 → S2
TINY = dataclasses.replace(
    presets_.FULL_V3, name="tiny", hidden_size=32, num_layers=1, num_heads=2,
    base_tokens=(16, 16, 64), num_sizes=4, seq_len=32, batch_size=4, max_budget=1.2e9,
    num_budgets=3, warmup_steps=2, min_steps=8, sweep_steps=12, anneal_steps=3,
    eval_batches=1, seeds=2, tuning_seeds=1, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
    families=("tokenformer", "transformer++"),
    recipes=("chain-exact", "chain-exact-anneal", "widen-zero"), follow="predicted",
    tokens_per_parameter=0.5, questions=(
        *(q for q in questions_.GROWTH_QUESTIONS if q.id in ("G4", "G6")),
        questions_.versus_envelope("GX", "chain-exact", "tokenformer", "growth"),
        questions_.ARCHITECTURE_QUESTIONS[0]))


# ---------------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("name", [*PRESETS, "tiny"])
def test_every_run_of_every_preset_uses_one_wsd_family(name):
    preset = TINY if name == "tiny" else get_preset(name)
    runs = plan(preset, 256) + plan_.sweep_plan(preset, 256)
    assert runs
    for run in runs:
        assert run.schedule == presets_.SCHEDULE_FAMILY == "wsd"
        for b in run.branches:
            # the cooldown is the last decay_fraction of the branch, after the same warmup
            assert b.decay_start == decay_start(b.steps, preset)
            assert b.steps - b.decay_start == max(1, round(preset.decay_fraction * b.steps))
            assert b.decay_start >= preset.warmup_steps
            # the runner's schedule (one peak here) is that WSD schedule step for step
            lr, w = 1e-3, preset.warmup_steps
            lrs = (lr,) * len(run.stages)
            one = dataclasses.replace(run, recipe=None)  # no restart: the plain WSD shape

            def at(step, b=b, one=one, lrs=lrs):
                return lr_at(step, schedule_.run_schedule(one, lrs, b.steps, preset))

            assert at(w - 1) == lr  # warmup ends at the peak
            for step in (w, (w + b.decay_start) // 2, b.decay_start - 1):  # stable
                assert at(step) == lr
            assert at(b.decay_start) < lr  # the cooldown
            assert at(b.steps - 1) == pytest.approx(lr * preset.min_lr_ratio)
        # growth happens only in the stable phase of the run (before the last branch point)
        assert all(s.start < run.steps for s in run.stages[1:])


def test_full_preset_sizes_budgets_seeds_and_corpus_repeats():
    """v4 (issue 35; replaces v3's version of this test): sizes S-1…S3 in every family
    (Transformer++ by width), 4 budgets ×2 apart over 0.9 decades, >= 8 held-out seeds on
    every arm a question reads, the primary chain at its final size's LR, branches within one
    step of their budgets, and no run reading the corpus more than 4 times."""
    preset = get_preset("full-v4")
    runs = plan(preset, 256, KJV_TRAIN_TOKENS)  # raises if any run repeats the corpus > 4×
    budgets = preset.budgets
    assert len(budgets) == 4 and budgets[-1] == 2.5e12
    assert all(b / a == pytest.approx(preset.budget_ratio) for a, b in itertools.pairwise(budgets))
    for family in preset.families:
        assert presets_.family_sizes(preset, family) == ("S-1", "S0", "S1", "S2", "S3")
    arms = {r.arm for r in runs}
    assert {"chain-paper", "chain-paper-final-lr"} <= arms
    used = {t.split(":", 1)[-1] for q in preset.questions for t in q.terms()}
    for arm in arms:
        if arm in used or any(arm.startswith(f + "-S") for f in used):
            assert len({r.seed for r in runs if r.arm == arm}) >= 8, arm
    assert preset.tuning_seeds >= 2 and preset.horizon_factors == (0.5, 1.0, 2.0)
    chain = next(r for r in runs if r.arm == "chain-paper-final-lr")
    assert chain.lr_policy == "final-size"
    assert chain.lr_from == f"tokenformer-{chain.stages[-1].size}"
    for run in runs:
        for b in run.branches:
            assert abs(b.flops - b.budget) <= run.stages[-1].flops_per_step
    with pytest.raises(ConfigError, match="times"):
        plan(preset, 256, KJV_TRAIN_TOKENS // 8)


def test_matched_transformer_sizes_track_tokenformer_parameters():
    preset = presets_.FULL_V3
    tf = configs_.model_configs(preset, "tokenformer", 256)
    tpp = configs_.model_configs(preset, "transformer++", 256)
    gelu = configs_.model_configs(preset, "tokenformer-gelu", 256)
    assert set(tpp) == set(tf) - {"S0"}
    for size, b in tpp.items():
        ratio = b.num_parameters(non_embedding=True) / tf[size].num_parameters(non_embedding=True)
        assert abs(ratio - 1) < 0.01
    for size, a in tf.items():  # the control: the same tokens, Θ = plain GELU
        assert gelu[size].norm == "gelu" and a.norm == "l2_norm_gelu"
        assert gelu[size].num_parameters() == a.num_parameters()
    # S0 has half S1's tokens, and no Transformer++ block fits in its parameters
    assert (tf["S0"].qkv_tokens, tf["S0"].ffn_tokens) == (12, 48)
    with pytest.raises(ConfigError, match="no matched config"):
        matched_config(tf["S0"], "transformer++")


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
                                 num_sizes=2, recipes=(), questions=(), max_extensions=2)
    seen = []

    def fake_execute(ctx, run, lrs):
        (lr,) = lrs
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
    assert analysis._crossing_log([1e10, 1e12], [3.0, 2.0], 2.5) == pytest.approx(1e11)
    assert analysis._crossing_log([1e10, 1e12], [3.0, 2.0], 1.5) is None  # never gets there
    assert analysis._crossing_log([1e10, 1e12], [3.0, 2.0], 3.5) is None  # already below it


def test_compute_to_reach_by_hand():
    """Envelope 3.0 → 2.0 nats from 1e10 to 1e12 FLOPs (every seed); the chain ends at 2.5, 2.4
    and 2.6 with 1e12 FLOPs: the envelope gets there at 1e11, 10^11.2 and 10^10.8 FLOPs, i.e.
    ln ratios ln 0.1 + (0, +0.2, −0.2)·ln 10: geometric mean ×0.1, t interval on the logs."""
    env = {0: {"flops": dict.fromkeys(range(3), 1e10), "loss": dict.fromkeys(range(3), 3.0),
               "mean": 3.0},
           1: {"flops": dict.fromkeys(range(3), 1e12), "loss": dict.fromkeys(range(3), 2.0),
               "mean": 2.0}}
    arm = {"budgets": {1: {0: (2.5, 1e12, 0), 1: (2.4, 1e12, 0), 2: (2.6, 1e12, 0)}}}
    r = analysis.compute_to_reach(arm, env)
    assert r["per_seed"][1] == pytest.approx(10 ** 11.2 / 1e12)
    assert r["ratio"] == pytest.approx(0.1)
    half = 4.302653 * 0.2 * math.log(10) / math.sqrt(3)  # sd of the logs = 0.2 · ln 10
    assert (r["low"], r["high"]) == pytest.approx((0.1 * math.exp(-half),
                                                   0.1 * math.exp(half)), rel=1e-5)
    assert r["ratio_of_means"] == pytest.approx(0.1)
    below = analysis.compute_to_reach({"budgets": {1: {0: (1.9, 1e12, 0)}}}, env)
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
    for run in saved["runs"].values():  # every stage of every final run: its sweep's choice
        lrs = run["lr"] if isinstance(run["lr"], list) else [run["lr"]] * len(run["stages"])
        assert lrs == [saved["sweeps"][s["lr_from"]]["chosen"] for s in run["stages"]]
        assert all(s["lr_from"] == presets_.size_key(run["family"], s["size"])
                   for s in run["stages"])  # per-stage: each stage at its own size's LR
        assert [b["budget_index"] for b in run["branches"]] == sorted(
            b["budget_index"] for b in run["branches"])
    text = (out / "report.md").read_text()
    # the questions are stated before any result, then answered, then the rest
    heads = [text.index(h) for h in ("## Pre-registered questions", "## Answers",
                                     "## Descriptive reading", "## Envelopes",
                                     "## Chains follow the envelope", "## LR sweeps")]
    assert heads == sorted(heads) and "95 %" in text
    assert [r["question"]["id"] for r in report.summarize(saved)["answers"]] == [
        "G4", "G6", "GX", "A1"]
    chains = text[text.index("## Chains follow the envelope"):text.index("## Every arm")]
    assert chains.count("| yes |") == 3  # each chain ends at the envelope's best size
    assert (out / "frontier.png").stat().st_size > 0 and (out / "lr_sweeps.png").stat().st_size
    summary = report.summarize(saved)
    # the envelope at each budget is the scratch size with the lowest mean loss there
    table = analysis.arms(saved)
    for j, e in analysis.envelope(saved, "tokenformer").items():
        means = {a: sum(x[0] for x in v["budgets"][j].values()) / len(v["budgets"][j])
                 for a, v in table.items() if v["kind"] == "scratch"
                 and v["family"] == "tokenformer" and j in v["budgets"]}
        assert e["arm"] == min(means, key=means.get)
    assert any(c["question"] == "chain vs envelope" for c in summary["comparisons"])


def test_resume_after_a_kill_gives_the_same_results(tiny_run, dataset_dir, tmp_path,
                                                    monkeypatch):
    reference = _strip_timing(json.loads((tiny_run[0] / "results.json").read_text()))
    out = tmp_path / "killed"
    real = one_run_.save_state

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
    monkeypatch.setattr(one_run_, "save_state", killed("sweep__tokenformer-S2", 1))
    with pytest.raises(KeyboardInterrupt):
        run_.run_frontier(TINY, **quiet)
    assert list((out / "state").glob("*.pt"))  # the run in progress left its state
    monkeypatch.setattr(one_run_, "save_state", killed("chain-exact-anneal__seed1", 2))
    with pytest.raises(KeyboardInterrupt):
        run_.run_frontier(TINY, **quiet)
    assert (out / "state" / "chain-exact-anneal__seed1.pt").is_file()
    monkeypatch.setattr(one_run_, "save_state", real)
    resumed = run_.run_frontier(TINY, **quiet)
    assert resumed["timing"]["resumed"]
    assert _strip_timing(json.loads((out / "results.json").read_text())) == reference
    assert not list((out / "state").glob("*.pt"))  # finished runs leave no state behind


def test_two_jobs_write_the_results_of_one(tiny_run, dataset_dir, tmp_path):
    """``jobs=2`` (``scale --jobs 2``): runs train two at a time in worker processes with one
    thread each; results.json equals the sequential one-thread run's up to its timing, and
    every run is announced exactly once."""
    reference = _strip_timing(json.loads((tiny_run[0] / "results.json").read_text()))
    lines: list[str] = []
    run_.run_frontier(TINY, data=dataset_dir, out=tmp_path / "jobs", print_fn=lines.append,
                      plots=False, jobs=2)
    assert _strip_timing(json.loads((tmp_path / "jobs" / "results.json").read_text())) == \
        reference
    ids = [line.split("] ")[1].split(" ")[0] for line in lines if line.startswith("scale: [")]
    assert len(ids) == len(set(ids)) == len(tiny_run[2]) - 2  # all but the first/last line
    assert lines[-2].startswith(f"scale: [{len(ids)}/{len(ids)}]")


def test_another_experiment_in_the_same_out_is_refused(tiny_run, dataset_dir):
    other = dataclasses.replace(TINY, seeds=1)
    with pytest.raises(ConfigError, match=r"another experiment: preset\.seeds is 2 there, 1 in "
                                          r"this call \(--preset, --seeds\); rerun it as it "
                                          r"was started"):
        run_.run_frontier(other, data=dataset_dir, out=tiny_run[0], print_fn=lambda line: None)


@pytest.mark.parametrize("name", ["gpu", "gpu-code"])
def test_gpu_presets_run_a_few_steps_on_cpu(name, dataset_dir, tmp_path, monkeypatch):
    """Both GPU presets at their model widths, a few steps on CPU in fp32; gpu-code (v4: the
    horizon stage, held-out seeds, chain tuning) on its own kind of corpus, the Python sources
    of an installed package (here this package: small; cached under TOKENFORMER_CACHE, never
    downloaded), with its chains following the tuning seeds' envelope."""
    monkeypatch.setenv("TOKENFORMER_CACHE", str(tmp_path / "cache"))
    gpu = get_preset(name)
    small = dataclasses.replace(gpu, seq_len=32, batch_size=2, num_sizes=2, seeds=1,
                                tuning_seeds=1, families=("tokenformer",),
                                recipes=("chain-exact",), questions=gpu.questions[:0],
                                min_steps=4, sweep_steps=6, warmup_steps=2, anneal_steps=1,
                                eval_batches=1, num_budgets=2, dtype="fp32",
                                follow="predicted", tokens_per_parameter=1e-3,
                                corpus="pysource:tokenformer" if gpu.corpus else None)
    configs = configs_.model_configs(small, "tokenformer", 256)
    first = small.sizes[0]
    per_step = configs_.sized_stage(small, first, configs[first], 0).flops_per_step
    small = dataclasses.replace(small, max_budget=12 * per_step)
    data = None if gpu.corpus else dataset_dir
    results = run_.run_frontier(small, data=data, out=tmp_path / "gpu",
                                print_fn=lambda line: None, plots=False)
    arms = {r["arm"] for r in results["runs"].values()}
    held_out = ({presets_.size_key("tokenformer", e["size"])  # v4: the envelope's choices
                 for e in results["tuning"]["envelope"]["tokenformer"].values()}
                if small.horizon_factors else
                {presets_.size_key("tokenformer", z) for z in small.sizes})
    assert held_out and held_out <= arms
    assert results["preset"]["hidden_size"] == gpu.hidden_size >= 256
    assert (tmp_path / "gpu" / "report.md").is_file() and gpu.expected_hours
    if gpu.corpus:
        (package,) = results["data"]["corpus"]["packages"]
        assert package["name"] == "tokenformer" and package["version"]
        assert len(results["data"]["corpus"]["sha256"]) == 64
        assert results["data"]["train_tokens"] >= 0.9 * results["data"]["corpus"]["bytes"]
        assert results["protocol"] == "v4" and results["tuning"]["envelope"]["tokenformer"]
        assert {r["seed"] for r in results["runs"].values()} == {0}  # held-out seeds only


def test_gpu_code_fits_its_corpus_and_the_protocol():
    """gpu-code (v4, replaces gpu-30m): the v4 protocol (questions, 8 held-out and 2 tuning
    seeds, horizon factors) on the Python sources of torch and transformers; no run reads
    more than 4 epochs of a 1e8-byte corpus (its training split >= 95 % of its bytes)."""
    preset = get_preset("gpu-code")
    assert preset.corpus == "pysource:torch,transformers,sympy" and preset.dtype == "bf16"
    assert preset.seeds >= 8 and preset.tuning_seeds >= 2 and preset.horizon_factors
    assert {q.id for q in preset.questions} >= {"G1", "L1", "A1", "T1", "T2"}
    runs = plan(preset, 256, int(0.95 * 1e8))
    assert preset.arm_names() >= {"chain-paper-final-lr", "tokenformer-S0"}
    # every size the plan sweeps is the predicted optimum somewhere or its neighbour
    for family in preset.families:
        best = set(chains_.predicted_envelope(preset, family, 256).values())
        order = list(presets_.family_sizes(preset, family))
        for z in plan_.swept_sizes(preset, family, 256):
            assert any(abs(order.index(z) - order.index(b)) <= 1 for b in best)
    assert runs


def test_cli_scale_errors_are_one_line(capsys, dataset_dir, tmp_path):
    from tokenformer.cli import main

    # v3's quick preset would repeat this 180 k-token corpus > 4 times: refused before any file
    out = tmp_path / "never"
    assert main(["scale", "--preset", "quick-v3", "--data", str(dataset_dir), "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: frontier: ") and "(> 4)" in err and len(err.splitlines()) == 1
    assert not out.exists()
    # --jobs trains each run with one thread: a --threads beyond that is refused up front
    assert main(["scale", "--preset", "quick", "--jobs", "2", "--threads", "2", "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: scale: --jobs") and len(err.splitlines()) == 1
    assert not out.exists()


def test_cli_plan_prints_every_arm_and_trains_nothing(capsys, tmp_path, monkeypatch):
    """v4 (replaces v3's arm count): the plan names tuning vs held-out seeds, each stage's runs
    and FLOPs, and every held-out arm with its seeds and LR sources; nothing is written."""
    from tokenformer.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["scale", "--preset", "full-v4", "--plan"]) == 0
    out = capsys.readouterr().out
    preset = get_preset("full-v4")
    stages = plan_.stage_plans(preset, 256)
    assert "schedule wsd for all" in out
    assert "**tuning seeds** 1000, 1001" in out and "**held-out seeds** 0–7" in out
    for name, seeds in (("sweep", "tuning"), ("horizon", "tuning"), ("chain tuning", "tuning"),
                        ("held-out from scratch", "held-out"), ("held-out chains", "held-out")):
        runs = stages[name]
        assert f"| {name} | {seeds} | {len(runs)} | {sum(r.total_steps for r in runs):,} |" in out
    # 3 families × 3 sizes × 3 LRs × 2 tuning seeds = 90 horizon runs over S-1..S3's windows
    assert len(stages["horizon"]) == 90 and len(stages["chain tuning"]) == 12
    for arm in ("tokenformer-S0", "transformer++-S1", "tokenformer-gelu-S2", "chain-paper",
                "chain-paper-final-lr"):
        assert f"| {arm} | 8 |" in out
    paper = next(x for x in out.splitlines() if x.startswith("| chain-paper | "))
    assert paper.endswith("| tokenformer-S0 → tokenformer-S1 → tokenformer-S2 |")
    final = next(x for x in out.splitlines() if x.startswith("| chain-paper-final-lr | "))
    assert final.endswith("| tokenformer-S2 |")
    assert not list(tmp_path.iterdir())


def test_random_seed_of_module_is_untouched():
    random.seed(0)  # the plan is pure data: building it draws nothing from any RNG
    state = torch.random.get_rng_state()
    plan(get_preset("full"), 256)
    assert torch.equal(state, torch.random.get_rng_state()) and random.random() == pytest.approx(
        0.8444218515250481)


# ------------------------------------------------------- v3 protocol (issue 25): hand-made results
def _scratch_results(preset, best_by_budget, seeds=3, noise=0.004):
    """Hand-made from-scratch results of every family of ``preset``: at budget j the size
    ``best_by_budget[j]`` (clamped to the family's sizes) has the lowest loss and each size step
    away costs 0.05 nats; seeds add ±``noise`` (the same for every size of a seed, so the
    envelope's choice is the intended one)."""
    runs = {}
    for family in preset.families:
        sizes = list(presets_.family_sizes(preset, family))
        for run in plan(preset, 256, kinds=("scratch",)):
            if run.family != family or run.seed >= seeds:
                continue
            size = run.stages[0].size
            branches = []
            for b in run.branches:
                best = best_by_budget[b.budget_index]
                best = best if best in sizes else sizes[0]
                loss = (3.0 - 0.1 * b.budget_index + 0.05 * abs(sizes.index(size)
                                                                 - sizes.index(best))
                        + noise * (run.seed - 1))
                branches.append({"budget_index": b.budget_index, "budget": b.budget,
                                 "steps": b.steps, "flops": b.flops, "tokens": b.steps,
                                 "size": size, "loss": loss})
            runs[run.id] = {**run.describe(), "lr": 1e-3, "branches": branches}
    return {"runs": runs, "budgets": preset.budgets, "sweeps": {}}


ENVELOPE_SHAPES = {  # budget index → best size: moving up, noisy (non-monotone), flat
    "rising": lambda n: {j: f"S{min(j // 2, 3)}" for j in range(n)},
    "noisy": lambda n: {j: ("S2" if j % 2 else "S1") if j < n - 1 else "S2" for j in range(n)},
    "late": lambda n: {j: "S0" if j < n - 1 else "S3" for j in range(n)},
}


@pytest.mark.parametrize("shape", ENVELOPE_SHAPES)
@pytest.mark.parametrize("name", [n for n in PRESETS if PRESETS[n].recipes])
def test_every_chain_ends_at_the_envelopes_best_size(name, shape):
    """Issue 25: in every preset, each chain (planned from the measured envelope of a hand-made
    results fixture) starts at or below the smallest budget's best size, grows only into
    larger sizes, ends at the envelope's best size at its final budget, and every budget it
    reads has its current size trained for >= min_stage_share of that budget's steps."""
    preset = get_preset(name)
    results = _scratch_results(preset, ENVELOPE_SHAPES[shape](preset.num_budgets))
    measured = {f: {j: e["size"] for j, e in analysis.envelope(results, f).items()}
                for f in preset.families}
    chains = plan(preset, 256, envelopes=measured, kinds=("chain", "widen"))
    for run in chains:
        order = list(presets_.family_sizes(preset, run.family))
        env = measured[run.family]
        final = run.branches[-1]
        assert final.budget_index == max(env)  # the chain reads the largest budget
        assert schedule_.size_at(run.stages, final.decay_start - 1).size == env[max(env)]
        recipe = arms_.GROWING_ARMS[run.arm]
        if recipe.shape != "size":  # stack / clone: one growth, from a half copy of the final
            first, last = run.stages
            c, h = last.config, first.config
            half = ({"num_layers": c.num_layers // 2} if recipe.shape == "stack" else
                    {"hidden_size": c.hidden_size // 2, "num_heads": c.num_heads // 2})
            assert dataclasses.asdict(h) == {**dataclasses.asdict(c), **half}
            continue
        assert order.index(run.stages[0].size) <= order.index(env[min(env)])
        assert [order.index(s.size) for s in run.stages] == sorted(
            {order.index(s.size) for s in run.stages})
        for b in run.branches:
            stage = schedule_.size_at(run.stages, b.decay_start - 1)
            assert b.steps - stage.start >= preset.min_stage_share * b.steps
        assert run.lr_from == presets_.size_key(run.family, env[max(env)])
    families = {a: arms_.GROWING_ARMS[a].family for a in preset.recipes}
    expected = {a for a, f in families.items() if len(set(chains_.chain_targets(
        measured[f], presets_.family_sizes(preset, f)).values())) > 1}
    assert {r.arm for r in chains} == expected  # a flat envelope asks for no chain


def test_growth_points_follow_the_rule_by_hand():
    """The full preset's TokenFormer chain on an envelope S0, S0, S0, S1, S1, S2 (budgets
    1.25e11 … 4e12): it grows into S1 at the 5e11 branch's decay start and into S2 at the 2e12
    branch's decay start; both give the new size >= 40 % of the next budget's steps, so no
    growth moves earlier."""
    preset = presets_.FULL_V3
    configs = configs_.model_configs(preset, "tokenformer", 256)
    best = dict(enumerate(["S0", "S0", "S0", "S1", "S1", "S2"]))
    stages = chains_.follow_envelope(preset, configs, best)
    assert [s.size for s in stages] == ["S0", "S1", "S2"]
    s0 = (stages[0],)
    b2 = schedule_.branch_for(s0, 2, preset.budgets[2], preset)  # 5e11 at S0 alone
    assert stages[1].start == b2.decay_start == decay_start(b2.steps, preset)
    b4 = schedule_.branch_for(stages[:2], 4, preset.budgets[4], preset)
    assert stages[2].start == b4.decay_start
    # a non-monotone envelope never asks the chain to shrink: S1, S2, S1, S2 → S1 … S2
    noisy = dict(enumerate(["S1", "S2", "S1", "S2", "S1", "S2"]))
    assert chains_.chain_targets(noisy, tuple(configs)) == dict(enumerate(["S1"] * 5 + ["S2"]))


def test_min_stage_share_moves_a_growth_earlier():
    """Budgets only 1.25× apart: growing right after the previous branch point would leave the
    new size far less than 40 % of the next budget, so the growth moves to the latest step that
    gives it exactly that share (and the budget before it is then not read)."""
    preset = dataclasses.replace(presets_.FULL_V3, budget_ratio=1.25, num_budgets=4)
    configs = configs_.model_configs(preset, "tokenformer", 256)
    stages = chains_.follow_envelope(preset, configs, dict(enumerate(["S1", "S1", "S1", "S2"])))
    b = schedule_.branch_for(stages, 3, preset.budgets[3], preset)
    assert b.steps - stages[1].start >= 0.4 * b.steps
    later = (stages[0], dataclasses.replace(stages[1], start=stages[1].start + 1))
    b_later = schedule_.branch_for(later, 3, preset.budgets[3], preset)
    assert b_later.steps - later[1].start < 0.4 * b_later.steps  # the latest such step
    run = plan_._with_branches(preset, "chain-paper", "chain", "tokenformer", 0, stages,
                               preset.budgets, "tokenformer-S2", "chain-paper")
    assert 2 not in [x.budget_index for x in run.branches]  # S2 too fresh at budget 2


def _with_questions(results, questions):
    return {**results, "preset": {"questions": [dataclasses.asdict(q) for q in questions]}}


def test_report_answers_each_question_with_the_expected_decision(tmp_path):
    """A hand-made fixture of five seeds: a chain 0.05 below the envelope (resolved), one within
    ±0.004 of it (equivalent within ±0.02), and two envelope comparisons of another family whose
    raw p-values (0.031, 0.049) are below 0.05 but not after Holm over that family."""
    Q = questions_.Question
    questions = (
        Q("G1", "below?", "chain-a", "envelope:tokenformer", "growth", margin=0.02,
          margin_why="test"),
        Q("G2", "equal?", "chain-b", "envelope:tokenformer", "growth", margin=0.02,
          margin_why="test"),
        Q("A1", "first", "tokenformer-S2", "tokenformer-S1", "architecture"),
        Q("A2", "second", "tokenformer-S3", "tokenformer-S1", "architecture"),
    )

    def run(arm, kind, seed, losses):
        return {"arm": arm, "kind": kind, "family": "tokenformer", "recipe": None, "lr": 1e-3,
                "seed": seed, "stages": [{"size": arm[-2:], "start": 0, "parameters": 1,
                                          "non_embedding_parameters": 1}],
                "branches": [{"budget_index": 0, "loss": losses, "flops": 1e10, "tokens": 1,
                              "size": arm[-2:] if kind == "scratch" else "S1"}]}
    runs = {}
    env = [2.00, 2.01, 1.99, 2.02, 1.98]
    for seed in range(5):
        runs[f"s1/{seed}"] = run("tokenformer-S1", "scratch", seed, env[seed])
        runs[f"s2/{seed}"] = run("tokenformer-S2", "scratch", seed,
                                 env[seed] + [0.04, 0.02, 0.05, 0.0, 0.03][seed])
        runs[f"s3/{seed}"] = run("tokenformer-S3", "scratch", seed,
                                 env[seed] + [0.04, 0.01, 0.05, 0.0, 0.03][seed])
        runs[f"a/{seed}"] = run("chain-a", "chain", seed,
                                env[seed] - [0.05, 0.06, 0.04, 0.05, 0.05][seed])
        runs[f"b/{seed}"] = run("chain-b", "chain", seed,
                                env[seed] + [0.004, -0.006, 0.0, 0.002, -0.001][seed])
    results = _with_questions({"runs": runs, "budgets": [1e10], "sweeps": {}}, questions)
    rows = {r["question"]["id"]: r for r in report.summarize(results)["answers"]}
    assert rows["G1"]["mean"] == pytest.approx(-0.05) and rows["G1"]["decision"] == "resolved"
    assert rows["G2"]["decision"] == "equivalent within ±0.02"
    # Holm over the family's two tests: G1 first (2·p), then G2 (max of that and its own p)
    assert rows["G1"]["p_holm"] == pytest.approx(2 * rows["G1"]["p_value"])
    assert rows["G2"]["p_holm"] == pytest.approx(max(2 * rows["G1"]["p_value"],
                                                     rows["G2"]["p_value"]))
    assert [round(rows[q]["p_value"], 3) for q in ("A1", "A2")] == [0.031, 0.049]
    assert rows["A1"]["decision"] == rows["A2"]["decision"] == "not resolved"
    text = report_markdown.report_markdown({**results, **_report_frame()},
                                           report.summarize(results), [])
    assert text.index("## Pre-registered questions") < text.index("## Answers") < text.index(
        "## Envelopes")
    line = next(x for x in text.splitlines() if x.startswith("| A2 |"))
    assert "0.049" in line and "0.062" in line and "**not resolved**" in line  # raw, Holm
    line = next(x for x in text.splitlines() if x.startswith("| G2 |"))
    assert "±0.02" in line and "**equivalent within ±0.02**" in line


def _report_frame():
    """The fields report_markdown reads besides the runs (a results.json's frame)."""
    preset = dataclasses.asdict(get_preset("quick"))
    return {"command": "test", "machine": {"cpu": "cpu", "cpus": 2, "torch_threads": 1,
                                           "torch": "x"}, "pattention_impl": "auto",
            "device": "cpu", "dtype": "fp32", "timing": {"wall_clock": 1.0, "resumed": False},
            "data": {"name": "d", "train_tokens": 1}, "sizes": ["S1", "S2", "S3"],
            "preset": {**preset, "questions": preset["questions"]}}


def test_a_question_without_data_is_not_resolved():
    results = _with_questions({"runs": {}, "budgets": [1e10], "sweeps": {}},
                              questions_.GROWTH_QUESTIONS[:1])
    (row,) = analysis.answers(results)
    assert row["decision"] == "not resolved" and row["diffs"] == [] and row["budget"] is None
    assert "no data" in report_markdown.answer_rows([row])[0][3]


def test_cli_plan_lists_the_pre_registered_questions(capsys):
    from tokenformer.cli import main

    assert main(["scale", "--preset", "full", "--plan"]) == 0
    out = capsys.readouterr().out
    questions = get_preset("full").questions
    assert len(questions) >= 8 and {q.family for q in questions} >= {"growth", "trend"}
    for q in questions:
        line = next(x for x in out.splitlines() if x.startswith(f"| {q.id} |"))
        assert q.text in line and q.family in line and q.budgets in line
        assert (q.margin is not None and f"TOST ±{q.margin:g}" in line) == (
            q.margin is not None)
    assert "Holm–Bonferroni within each family" in out and "Margin: 0.02 nats" in out
    assert out.index("Pre-registered questions") < out.index("| arm |")  # before the runs


def test_sweep_seeds_average_and_non_monotone_sweeps_are_flagged(monkeypatch):
    """The LR is the argmin of the mean over sweep seeds; a mean curve with a second dip is
    flagged non-monotone, and seeds whose own argmins differ are named."""
    preset = dataclasses.replace(TINY, lr_grid=(1e-3, 2e-3, 4e-3, 8e-3), families=("tokenformer",),
                                 num_sizes=2, recipes=(), questions=(), tuning_seeds=2)
    table = {1e-3: (2.2, 2.2), 2e-3: (2.0, 2.2), 4e-3: (2.15, 2.15), 8e-3: (2.1, 1.9)}

    def fake_execute(ctx, run, lrs):
        (lr,) = lrs
        return {"branches": [{"loss": table.get(lr, (2.3, 2.3))[run.seed - presets_.SWEEP_SEED]}]}

    monkeypatch.setattr(run_, "execute", fake_execute)
    ctx = run_.Context(preset, None, None, "fp32", None, False, None)
    s = run_.run_sweeps(ctx, 256)["tokenformer-S1"]
    assert s["seeds"] == [presets_.SWEEP_SEED, presets_.SWEEP_SEED + 1]
    # means 2.2, 2.1, 2.15, 2.0: argmin 8e-3 at the edge → extended upward (1.6e-2: 2.3)
    assert s["points"][0]["loss"] == pytest.approx(2.2) and s["chosen"] == pytest.approx(8e-3)
    assert s["unimodal"] is False and s["seed_argmins"] == [2e-3, 8e-3]
    results = {"runs": {}, "budgets": [1.0], "sweeps": {"tokenformer-S1": s}}
    text = " ".join(report.verdict(results, {"comparisons": [], "seeds": [0, 1], "reach": {}}))
    assert "Non-monotone LR sweeps" in text and "Sweep seeds disagree" in text


def test_runner_plans_the_chains_from_the_measured_envelope(monkeypatch, tmp_path):
    """The runner trains every from-scratch run first, reads their envelope, and only then plans
    the chains from it (not from the prediction): here the fake losses make S1 the best size
    up to the last budget and S2 there, so the chain is S1 → S2 whatever was predicted."""
    preset = dataclasses.replace(TINY, families=("tokenformer",), recipes=("chain-paper",),
                                 follow="measured", questions=questions_.GROWTH_QUESTIONS[:1],
                                 seeds=2)
    last = preset.num_budgets - 1

    def fake_execute(ctx, run, lr):
        stages = run.stages
        out = []
        for b in run.branches:
            size = schedule_.size_at(stages, b.decay_start - 1).size
            best = "S2" if b.budget_index == last else "S1"
            out.append({"budget_index": b.budget_index, "budget": b.budget, "steps": b.steps,
                        "decay_start": b.decay_start, "flops": b.flops, "tokens": b.steps,
                        "size": size, "loss": 3.0 - 0.1 * b.budget_index + 0.05 * abs(
                            int(size[1]) - int(best[1])) + 0.001 * run.seed, "bpb": 1.0})
        return {"lr": lr, "branches": out, "timing": {"train_time": 0.0, "step_time": {}}}

    results = run_with_fake_execute(monkeypatch, preset, fake_execute, tmp_path)
    assert results["chain_envelopes"]["tokenformer"] == {str(j): "S2" if j == last else "S1"
                                                         for j in range(preset.num_budgets)}
    chain = results["runs"]["chain-paper/seed0"]
    assert [s["size"] for s in chain["stages"]] == ["S1", "S2"]  # predicted: S0 → S1 → S2
    assert chain["lr_from"] == "tokenformer-S2"


def test_plain_gelu_family_and_its_zero_key_chain_preserve_the_function():
    """The critics' control: tokenformer-gelu's sizes are TokenFormer's with Θ = plain GELU
    (fan-in keys), and the chain-gelu recipe grows S0 → S1 with zero new keys: every logit is
    kept (GELU(0) = 0, nothing depends on n)."""
    from tokenformer.ops.growth import grow_with_optimizer
    from tokenformer.training.config import TrainConfig
    from tokenformer.training.optim import make_optimizer

    preset = presets_.FULL_V3
    configs = configs_.model_configs(preset, "tokenformer-gelu", 256)
    torch.manual_seed(0)
    model = model_class("tokenformer")(configs["S0"])
    keys = model.layers[0].mlp.key_param_tokens
    assert float(keys.detach().std()) == pytest.approx(1 / math.sqrt(preset.hidden_size), rel=0.1)
    optimizer = make_optimizer(model, TrainConfig(steps=1, lr=1e-3))
    recipe = arms_.GROWING_ARMS["chain-gelu"]
    c = configs["S1"]
    grown, _ = grow_with_optimizer(model, optimizer, generator=torch.Generator().manual_seed(0),
                                   qkv=c.qkv_tokens, proj=c.proj_tokens, ffn=c.ffn_tokens,
                                   recipe=recipe.method)
    assert grown.config.ffn_tokens == c.ffn_tokens and recipe.family == "tokenformer-gelu"
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before, after = model(ids).logits, grown(ids).logits
    assert (after - before).abs().max() <= 1e-6 * before.abs().max()


def fake_result(run, lrs, loss) -> dict:
    """What ``execute`` returns for ``run`` trained at ``lrs`` when each branch's loss is
    ``loss(run, lrs, budget_index)`` (a fake training, for the runner's protocol)."""
    return {"lr": state_.lr_record(tuple(lrs)), "timing": {"train_time": 0.0, "step_time": {}},
            "branches": [{"budget_index": b.budget_index, "budget": b.budget,
                          "steps": b.steps, "decay_start": b.decay_start, "flops": b.flops,
                          "tokens": b.steps, "size": run.stages[-1].size,
                          "loss": loss(run, lrs, b.budget_index), "bpb": 1.0}
                         for b in run.branches]}


def run_with_fake_execute(monkeypatch, preset, fake_execute, tmp_path) -> dict:
    """The runner's whole protocol (``run._run``) on a 256-token vocabulary with every training
    run replaced by ``fake_execute(ctx, run, lrs)`` and no report written: its results dict."""
    monkeypatch.setattr(run_, "execute", fake_execute)

    class Data:
        vocab_size = 256

    ctx = run_.Context(preset, Data(), torch.device("cpu"), "fp32", None, False, tmp_path,
                       print_fn=lambda line: None)
    monkeypatch.setattr(run_.report, "write", lambda results, out, plots=True: None)
    return run_._run(ctx, preset, plan(preset, 256), {}, "k", {"train_tokens": 10**9},
                     tmp_path, print_fn=lambda line: None, command=None, plots=False)


def assert_plan_refused(monkeypatch, capsys, tmp_path, name, preset, start) -> None:
    """``tokenformer scale --preset NAME --plan`` of ``preset`` fails with one error line
    starting ``start`` and writes nothing."""
    from tokenformer.cli import main

    monkeypatch.setitem(presets_.PRESETS, name, preset)
    monkeypatch.chdir(tmp_path)
    assert main(["scale", "--preset", name, "--plan"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(start), err
    assert not list(tmp_path.iterdir())
