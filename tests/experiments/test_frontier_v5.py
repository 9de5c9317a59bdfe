"""The v5 frontier protocol (issue 46; docs/frontier-v5.md): the reuse family (a finished base
grown or trained on for X times its compute, against rivals given the same X), validation on
whole random documents in a tuning and a scoring window, the power printed by --plan, T1 over
post-growth budgets, and the v4 preset kept under ``full-v4`` with its record."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from test_frontier import (  # rootdir-relative, as test_frontier_v4
    fake_result,
    run_with_fake_execute,
)

from tokenformer.data.heldout import kjv_chapters, split_documents, window
from tokenformer.errors import ConfigError, DataError
from tokenformer.experiments.common.stats import paired_power, tost_power
from tokenformer.experiments.frontier import (
    analysis,
    estimates,
    one_run,
    plan_text,
    report_markdown,
)
from tokenformer.experiments.frontier import plan as plan_
from tokenformer.experiments.frontier import presets as presets_
from tokenformer.experiments.frontier import questions as questions_
from tokenformer.experiments.frontier import reuse as reuse_
from tokenformer.experiments.frontier import state as state_
from tokenformer.experiments.frontier.presets import HeldOut, Reuse, get_preset
from tokenformer.experiments.frontier.run import run_frontier
from tokenformer.io.untrusted import safe_torch_load

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------- the plan
def test_full_reuse_levels_cells_and_steps_are_the_documented_ones():
    """docs/frontier-v5.md: the base S0 (12,352 non-embedding parameters, 156,672 training
    FLOPs per token) at k = 40, 126.5, 400 is the budget grid (C(k) by hand); the cells with
    >= 80 steps of every arm are X = 1 at k 40; 0.316, 1 at k 126.5; all three at k 400; the
    base trains 241, 763 and 2,412 steps, the smallest cell 96 steps of S2."""
    preset = get_preset("full")
    assert preset.budgets == pytest.approx([k * 12_352 * 156_672 for k in (40, 126.5, 400)],
                                           rel=1e-3)
    assert reuse_.levels(preset, 256) == {0: 40.0, 1: 126.5, 2: 400.0}
    assert reuse_.cells(preset, 256) == {0: (0,), 1: (0, 1), 2: (0, 1, 2)}
    steps = [reuse_.base_steps(preset, "tokenformer", j, 256) for j in range(3)]
    # C(k) / (FLOPs per token × 2,048 tokens per step), rounded
    assert steps == [round(k * 12_352 / 2_048) for k in (40, 126.5, 400)] == [241, 763, 2412]
    grown = reuse_.continuation_run(preset, "grown", 2, 0, 256)
    assert [b.steps for b in grown.branches] == [96, 305, 965]
    tpp = reuse_.continuation_run(preset, "tpp-grown", 2, 0, 256)
    assert tpp.branches[0].steps == 83 and tpp.stages[0].config.hidden_size == 48
    # each branch's FLOPs are the cell's incremental budget, counted from the continuation
    for run in (grown, tpp):
        for b in run.branches:
            assert abs(b.flops - preset.budgets[b.budget_index]) <= run.stages[0].flops_per_step
    assert grown.data_offset == 2412 and grown.origin_budget == 2


def test_every_question_has_its_arms_on_every_held_out_seed():
    """Every term of every pre-registered question of v5's full and quick presets is an arm of
    the held-out plan (or an envelope whose family runs), on every held-out seed, at every
    budget the question reads; the base runs at every k, R1's size at every cell."""
    for name in ("full", "quick"):
        preset = get_preset(name)
        stages = plan_.stage_plans(preset, 256)
        held = [r for key, runs in stages.items() if key.startswith("held-out") or
                key == "reuse held-out" for r in runs]
        seeds = set(plan_.held_out_seeds(preset))
        cells = reuse_.cells(preset, 256)
        levels = reuse_.levels(preset, 256)
        for q in preset.questions:
            for term in q.terms():
                if term.startswith("envelope:"):
                    assert term.split(":")[1] in preset.families
                    continue
                runs = [r for r in held if r.arm == term]
                assert {r.seed for r in runs} == seeds, (name, q.id, term)
        for seed in seeds:
            base = [r for r in held if r.arm == "tokenformer-S0" and r.seed == seed]
            assert set(levels) <= {b.budget_index for r in base for b in r.branches}
            final = [r for r in held if r.arm == "tokenformer-S2" and r.seed == seed]
            read = {i for ids in cells.values() for i in ids}
            assert read <= {b.budget_index for r in final for b in r.branches}
        for run in stages["reuse held-out"]:
            assert {b.budget_index for b in run.branches} == set(cells[run.origin_budget])
        # tuning: every (arm, k) at every horizon factor on every tuning seed, never held out;
        # none with one factor (quick: the pick is that factor)
        tuning = stages["reuse tuning"]
        assert {r.seed for r in tuning} == (set(plan_.tuning_seeds(preset)) if name == "full"
                                            else set())
        assert len(tuning) == (len(reuse_.arm_levels(preset, 256)) * len(preset.horizon_factors)
                               * preset.tuning_seeds if name == "full" else 0)
        # no run reads the embedded training split (≈ 3.18e6 bytes) more than 4 times
        plan_.check_epochs(preset, [r for runs in stages.values() for r in runs], 3_100_000)


def test_quick_is_a_reuse_mini_family_and_full_keeps_v4_under_its_own_name():
    quick = get_preset("quick")
    assert quick.reuse is not None and len(quick.reuse.tokens_per_parameter) == 1
    assert len(quick.reuse.increments) == 2 and set(quick.reuse.arms) == {"grown", "continued"}
    assert {q.family for q in quick.questions} == {"reuse-R1", "reuse-R3"}
    full = get_preset("full")
    assert {q.family for q in full.questions} == {"reuse-R1", "reuse-R2", "reuse-R3",
                                                  "reuse-R4", "growth", "trend"}
    assert full.seeds == 8 and full.tuning_seeds == 2


def test_v4_preset_keeps_its_committed_record():
    """``full-v4``'s record (what its fingerprint hashes) is exactly the committed v4 run's
    preset: the v5 fields at their defaults are left out, so a v4 folder resumes."""
    committed = json.loads((ROOT / "docs/results/frontier-v4/results.json").read_text())["preset"]
    record = json.loads(json.dumps(presets_.preset_record(get_preset("full-v4"))))
    assert record == committed
    assert not set(presets_.V5_FIELDS) & set(record)
    assert set(presets_.V5_FIELDS) <= set(presets_.preset_record(get_preset("full")))


def test_chain_grid_is_small_times_final_times_growth_time():
    """G1's chain is tuned on small-stage ×{1, 2} × final-stage ×{½, 1, 2} at the rule's growth
    steps, and at half those steps with final ×1 (the trimmed grid): 8 points per tuning seed;
    ×½ moves every growth to half its step."""
    preset = get_preset("full")
    grid = plan_.chain_grid(preset)
    assert {(c.final, c.small, c.growth) for c in grid} == {
        (f, s, 1.0) for f in (0.5, 1.0, 2.0) for s in (1.0, 2.0)} | {
        (1.0, s, 0.5) for s in (1.0, 2.0)}
    assert len(grid) == 8
    chains = [r for r in plan_.plan(preset, 256) if r.kind == "chain"]
    (chain,) = [r for r in chains if r.seed == 0]
    half = plan_.candidate_run(preset, chain, plan_.ChainCandidate(1.0, 2.0, 0.5), 1000)
    assert [s.start for s in half.stages] == [0] + [round(s.start / 2)
                                                    for s in chain.stages[1:]]
    c = plan_.ChainCandidate(0.5, 2.0)
    assert c.lrs((1e-3, 2e-3, 4e-3)) == pytest.approx((2e-3, 4e-3, 2e-3))


def test_plan_prints_reuse_shapes_power_and_validation(capsys):
    from tokenformer.cli import main

    assert main(["scale", "--preset", "full", "--plan"]) == 0
    out = capsys.readouterr().out
    # the documented Pattention shares: S0 (the base) 50 %, S2 (grown) 80 %
    assert "| tokenformer-S0 | 12,352 | 156,672 | 50% |" in out
    assert "| tokenformer-S2 | 49,216 | 391,680 | 80% |" in out
    assert "| 400 | 7.74e+11 | 2,412 | 4,939,776 |" in out
    for arm in ("grown", "continued", "tpp-grown"):
        assert f"| {arm} |" in out
    assert "| reuse-R1 | 6 | ±0.02 | 0.60 | 0.53 |" in out
    assert "| growth | 1 | ±0.02 | 0.90 | 0.92 |" in out
    assert ">= 1,000,000 tokens of whole random documents" in out
    assert main(["scale", "--preset", "quick", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "1 held-out seed, so no question has an interval" in out and "| grown |" in out


@pytest.mark.parametrize("m", [1, 6])
def test_power_against_a_simulation(m):
    """paired_power and tost_power against a Monte Carlo of the paired t-test and TOST (8
    seeds, sd 0.0148, margin 0.02, α/m): an independent count of rejections."""
    rng = np.random.default_rng(0)
    n, sd, margin, alpha, draws = 8, 0.0148, 0.02, 0.05 / m, 40_000

    def rejections(delta: float) -> tuple[float, float]:
        x = rng.normal(delta, sd, size=(draws, n))
        mean, se = x.mean(1), x.std(1, ddof=1) / math.sqrt(n)
        two = np.abs(mean / se) > stats.t.ppf(1 - alpha / 2, n - 1)
        crit = stats.t.ppf(1 - alpha, n - 1)
        tost = (mean - crit * se > -margin) & (mean + crit * se < margin)
        return float(two.mean()), float(tost.mean())

    resolve, _ = rejections(margin)
    _, equivalent = rejections(0.0)
    assert paired_power(margin, sd, n, alpha) == pytest.approx(resolve, abs=0.015)
    assert tost_power(margin, sd, n, alpha=alpha) == pytest.approx(equivalent, abs=0.015)


# ---------------------------------------------------------------------- held-out documents
def test_validation_windows_are_disjoint_random_documents():
    """>= 1e6 bytes of whole chapters drawn at random: the tuning and scoring windows are
    disjoint sets of chapters, each >= half the asked bytes, drawn from across the book (not
    its tail); training holds every other chapter, and each window's bytes are its chapters'
    bytes in draw order."""
    docs = kjv_chapters()
    assert len(docs) == 1189 and docs[0][0] == "1001"
    by_name = {name: text.encode() for name, text in docs}
    ds = split_documents(docs, 1_000_000, 0.5, 0, "kjv")
    held = ds.meta["held_out"]
    tuning, scoring = held["tuning_documents"], held["scoring_documents"]
    assert not set(tuning) & set(scoring)
    for names, which in ((tuning, "tuning"), (scoring, "scoring")):
        part = window(ds, which).val
        expected = b"".join(by_name[x] for x in names)
        assert len(part) >= 500_000 and bytes(part) == expected
    order = [name for name, _ in docs]
    positions = sorted(order.index(x) for x in tuning + scoring)
    assert positions[0] < len(order) // 4 and positions[-1] > 3 * len(order) // 4
    total = sum(len(b) for b in by_name.values())
    assert len(ds.train) == total - len(ds.val)
    kept = [x for x in order if x not in set(tuning + scoring)]
    assert bytes(ds.train[:len(by_name[kept[0]])]) == by_name[kept[0]]
    with pytest.raises(DataError, match="cannot hold out"):
        split_documents(docs[:3], 10**9, 0.5, 0, "kjv")


def test_tuning_seeds_evaluate_on_the_tuning_window_held_out_on_the_scoring_one():
    ctx = state_.Context(get_preset("quick"), None, None, "fp32", "tail", False, None,
                         windows={"tuning": "T", "scoring": "S"})
    run = reuse_.continuation_run(get_preset("quick"), "grown", 1, 1000, 256)
    assert state_.evaluator(ctx, run) == "T"
    assert state_.evaluator(ctx, dataclasses.replace(run, seed=3)) == "S"
    v4 = state_.Context(get_preset("full-v4"), None, None, "fp32", "tail", False, None)
    assert state_.evaluator(v4, run) == "tail"
    # the time estimate counts what is read: full's tuning runs a fixed subset of 64 batches,
    # held-out runs the whole 500,000-token scoring window (245 batches of 2,048 tokens)
    full = get_preset("full")
    held = reuse_.continuation_run(full, "grown", 2, 0, 256)
    assert estimates.eval_batches(full, dataclasses.replace(held, seed=1000)) == 64
    assert estimates.eval_batches(full, held) == math.ceil(500_000 / 2_048) == 245


# --------------------------------------------------------------------------- T1 (v5 reading)
def test_trend_grown_reads_only_the_budgets_after_the_growth():
    """T1 (v5): the chain is S0 at budget 0 and grown after; its per-seed slope is over budgets
    1–3 only (scipy's linregress there), so a pre-growth gap does not make it."""
    budgets = [1e10, 2e10, 4e10, 8e10]
    runs = {}
    for seed, m in {0: -0.02, 1: -0.01, 2: 0.005}.items():
        for arm, kind in (("tokenformer-S1", "scratch"), ("chain-x", "chain")):
            branches = [{"budget_index": j, "loss": 2.0 + (
                (0.5 if j == 0 else m * math.log2(b)) if kind == "chain" else 0.0),
                "flops": b, "tokens": 1, "size": "S0" if j == 0 and kind == "chain" else "S1"}
                for j, b in enumerate(budgets)]
            runs[f"{arm}/{seed}"] = {"arm": arm, "kind": kind, "family": "tokenformer",
                                     "recipe": None, "lr": 1e-3, "seed": seed,
                                     "stages": [{"size": "S0" if kind == "chain" else "S1",
                                                 "start": 0, "parameters": 1,
                                                 "non_embedding_parameters": 1}],
                                     "branches": branches}
    q = dataclasses.replace(questions_.V5_TREND, a="chain-x")
    results = {"runs": runs, "budgets": budgets, "sweeps": {},
               "preset": {"questions": [dataclasses.asdict(q)]}}
    (row,) = analysis.answers(results)
    assert row["budgets_read"] == [1, 2, 3]
    assert row["diffs"] == pytest.approx([-0.02, -0.01, 0.005])


# ------------------------------------------------------------------- the reuse runner, faked
def test_each_x_cell_gets_its_own_tuned_lr(monkeypatch, tmp_path):
    """Fake losses whose best LR factor differs by X cell (×½ at the small cell, ×2 at the
    large one): the tuning picks per cell, the picks at an end factor extend one factor
    beyond (×¼, ×4), and the held-out continuations run one stable run per chosen LR with the
    branches of the cells that chose it, from their own seed's held-out base."""
    preset = tiny_v5(horizon_factors=(0.5, 1.0, 2.0), horizon_extensions=1)
    best = {0: 0.25, 1: 4.0}  # the factor of the sweep's pick each cell prefers

    def loss(run, lrs, j):
        if run.kind == "sweep":
            return (math.log(lrs[0]) - math.log(3e-3)) ** 2
        if run.kind == "reuse":
            return 2.0 + (math.log(lrs[0] / run_lr0(run)) - math.log(best[j])) ** 2
        return 3.0 + 0.01 * ("S0" in run.arm) + (math.log(lrs[0]) - math.log(3e-3)) ** 2

    def run_lr0(run):
        return 3e-3  # every sweep picks 3e-3 (the fake sweep loss)

    results = run_with_fake_execute(
        monkeypatch, preset, lambda ctx, run, lrs: fake_result(run, lrs, loss), tmp_path)
    tuned = results["tuning"]["reuse"]["grown@k4"]
    assert tuned["factors"] == [0.25, 0.5, 1.0, 2.0, 4.0]
    assert {c: tuned["cells"][c]["factor"] for c in ("0", "1")} == pytest.approx(
        {"0": 0.25, "1": 4.0})
    held = [r for r in results["runs"].values() if r["arm"] == "grown@k4"]
    assert {(r["seed"], round(r["lr"], 8), tuple(b["budget_index"] for b in r["branches"]))
            for r in held} == {(s, round(lr, 8), (j,)) for s in (0, 1)
                               for j, lr in ((0, 3e-3 / 4), (1, 3e-3 * 4))}
    for r in held:
        assert r["origin"] == f"tokenformer-S0/seed{r['seed']}" and r["origin_budget"] == 1
    text = "\n".join(report_markdown.tuning_lines(results))
    assert "| grown@k4 | 0.5 | 0.003 (tokenformer-S2) |" in text and "0.00075 (×0.25)" in text


# ------------------------------------------------------------------- the reuse family, trained
def tiny_v5(**overrides) -> presets_.Preset:
    """A v5 preset small enough to train end to end in seconds: sizes S-1…S2 at d 16, one
    tuning and two held-out seeds, the base S0 finished at k = 4 (its compute the largest of
    two budgets ×2 apart), X = ½ and 1, every continuing arm."""
    base = dataclasses.replace(
        get_preset("full"), name="tiny-v5", hidden_size=16, num_layers=1, num_heads=2,
        base_tokens=(4, 4, 16), first_size=-1, num_sizes=4, seq_len=16, batch_size=4,
        num_budgets=2, budget_ratio=2.0, warmup_steps=2, min_steps=6, sweep_steps=8,
        eval_batches=1, seeds=2, tuning_seeds=1, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
        tpp_widths=(12, 24), tpp_heads=2, recipes=(), chain_small_factors=(),
        growth_time_factors=(), horizon_factors=(1.0, 2.0), horizon_extensions=0,
        window_extensions=0, size_window=None, tokens_per_parameter=2.0,
        validation=HeldOut(tokens=1000), reuse=Reuse(tokens_per_parameter=(4.0,),
                                                     increments=(0.5, 1.0)), questions=())
    unit = reuse_.per_parameter(reuse_.base_stage(base, "tokenformer", 256), base)
    base = dataclasses.replace(base, max_budget=4 * unit, questions=questions_.reuse_questions(
        (4.0,), "tokenformer-S2", ("R1", "R3", "R4")))
    return dataclasses.replace(base, **overrides)


@pytest.fixture(scope="module")
def reuse_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("v5") / "tiny"
    torch.set_num_threads(1)
    return out, run_frontier(tiny_v5(), out=out, progress=False, plots=False)


def test_reuse_family_trains_end_to_end(reuse_run):
    """The tiny preset trains every stage for real: the held-out continuations start from
    their own seed's finished base (saved weights), each question is answered at every X cell
    on both held-out seeds, and no reported run is on a tuning seed."""
    out, results = reuse_run
    assert results["protocol"] == "v5"
    assert {r["seed"] for r in results["runs"].values()} == {0, 1}
    continuations = [r for r in results["runs"].values() if r["kind"] == "reuse"]
    assert {r["arm"] for r in continuations} == {"grown@k4", "continued@k4", "tpp-grown@k4"}
    for r in continuations:
        base = results["runs"][r["origin"]]
        assert base["seed"] == r["seed"] and r["origin_budget"] in {
            b["budget_index"] for b in base["branches"]}
        assert (out / "models" / r["origin"].replace("/", "__") / f"b{r['origin_budget']}.pt"
                ).is_file()
    for q in ("R1-k4", "R3-k4", "R4-k4"):
        rows = [a for a in analysis.answers(results) if a["question"]["id"] == q]
        assert [a["budget_index"] for a in rows] == [0, 1] and all(a["n"] == 2 for a in rows)


def test_the_reuse_plot_draws_every_curve_from_the_held_out_runs(reuse_run, tmp_path):
    """reuse.png's data, recomputed from the run records: per level, the grown arm and each
    question's rival at X = its budget over the base's compute, every held-out seed's loss
    (R1: the grown size from scratch at every budget it ran), and the finished bases' losses
    at X = 0 (TokenFormer's S0 and R4's Transformer++ base at the level's budget)."""
    pytest.importorskip("matplotlib")
    from tokenformer.experiments.frontier.plots import make_plots, reuse_series

    _, results = reuse_run
    budgets = results["budgets"]

    def losses(arm: str) -> dict[float, dict[int, float]]:  # arm → X → seed → loss
        out: dict[float, dict[int, float]] = {}
        for r in results["runs"].values():
            if r["arm"] == arm:
                for b in r["branches"]:
                    out.setdefault(budgets[b["budget_index"]] / budgets[1], {})[r["seed"]] = (
                        b["loss"])
        return out

    series = reuse_series(results)
    assert list(series) == [4.0] and series[4.0]["level"] == 1
    curves = series[4.0]["curves"]
    assert set(curves) == {"grown", "R1", "R3", "R4"}
    assert curves["grown"] == losses("grown@k4") and curves["R3"] == losses("continued@k4")
    assert curves["R4"] == losses("tpp-grown@k4") and curves["R1"] == losses("tokenformer-S2")
    assert sorted(curves["grown"]) == [0.5, 1.0]
    for family, key in (("tokenformer", "tokenformer-S0"), ("transformer++", "transformer++-S0")):
        assert series[4.0]["bases"][family] == losses(key)[1.0]
    names = make_plots(results, tmp_path)
    assert "reuse.png" in names
    assert (tmp_path / "reuse.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_continuation_starts_from_its_bases_weights(reuse_run):
    """R3 continues the finished base itself (every tensor equal); the grown base holds the
    base's rows of every Pattention and its new key rows are zero (the paper's recipe)."""
    out, _ = reuse_run
    preset = tiny_v5()
    ctx = state_.context(preset, None, "cpu", None, False, out, None)
    for arm in ("continued", "grown"):
        run = reuse_.continuation_run(preset, arm, 1, 0, 256, origin="tokenformer-S0/seed0")
        saved = safe_torch_load(state_.model_path(ctx, run.origin, 1), foreign=False)["model"]
        model = one_run.continued_base(ctx, run)
        now = model.state_dict()
        for name, tensor in saved.items():
            if arm == "continued" or tensor.shape == now[name].shape:
                assert torch.equal(now[name], tensor), name
            else:  # a grown Pattention: the old tokens first, new keys zero
                rows = tensor.shape[0]
                assert torch.equal(now[name][:rows], tensor), name
                if name.endswith("key_param_tokens"):
                    assert not now[name][rows:].any(), name



def _without_weights(reuse_run, tmp_path, drop: list[str]) -> tuple[Path, dict]:
    """A copy of the tiny run's folder as a fresh machine resumes it from committed records:
    no finished base's weights (``models/``: never committed), no results.json, and the run
    records of ``drop`` (continuations still to train) removed."""
    import shutil

    out, results = reuse_run
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("models", "results.json",
                                                             "report.md", "*.lock"))
    for run_id in drop:
        (copy / "runs" / f"{run_id.replace('/', '__')}.json").unlink()
    return copy, results


def test_a_resumed_folder_without_the_bases_weights_trains_only_the_needed_bases_again(
        reuse_run, tmp_path):
    """gpu-v5's leases commit run records, never the bases' weights (42 MB each): a resumed
    folder trains a base again for the continuations that still need it, and only those
    bases. Training is a pure function of seed and step, so on the CPU the continuation
    trained from the regenerated base equals the first one bit for bit."""
    _, results = reuse_run
    held = next(r for r in results["runs"].values() if r["kind"] == "reuse" and r["seed"] == 1)
    arm_k, tuning = next(iter(results["tuning"]["reuse"].items()))
    tuned_id = reuse_.tuning_id(arm_k, tuning["factors"][0], 1000)
    copy, _ = _without_weights(reuse_run, tmp_path, [held["id"], tuned_id])
    lines: list[str] = []
    torch.set_num_threads(1)
    again = run_frontier(tiny_v5(), out=copy, progress=True, plots=False,
                         print_fn=lines.append)
    assert again["runs"][held["id"]]["branches"] == held["branches"]  # bit for bit
    assert again["tuning"]["reuse"] == results["tuning"]["reuse"]
    regenerated = sorted(p.name for p in (copy / "models").iterdir())
    assert regenerated == sorted({held["origin"].replace("/", "__"),
                                  tuning["bases"][0].replace("/", "__")})
    trained_again = [line for line in lines if "trained again for its weights" in line]
    assert len(trained_again) == 2 and all(
        line.split("loss ")[1].split(",")[0] == line.split("recorded ")[1].split(",")[0]
        for line in trained_again), trained_again


def test_with_workers_the_bases_are_trained_again_in_them_one_seed_at_a_time(
        reuse_run, tmp_path, monkeypatch):
    """With --jobs > 1 the missing bases go to the worker processes as ``again`` items (here an
    in-process stand-in for the pool), one seed at a time: its bases, then its continuations,
    so a lease shorter than the stage still finishes some seeds. The continuations then equal
    the first ones."""
    _, results = reuse_run
    held = [r for r in results["runs"].values() if r["kind"] == "reuse"]
    copy, _ = _without_weights(reuse_run, tmp_path, [r["id"] for r in held])
    items: list[tuple] = []

    class InProcessPool:
        def imap_unordered(self, fn, work):
            for item in work:
                items.append(item)
                yield fn(item)

        def close(self) -> None: ...
        def join(self) -> None: ...
        def terminate(self) -> None: ...

    monkeypatch.setattr(one_run, "worker_pool", lambda jobs: InProcessPool())
    torch.set_num_threads(1)
    again = run_frontier(tiny_v5(), out=copy, progress=False, plots=False, jobs=2)
    # each seed's two bases (TokenFormer's and Transformer++'s, R4's), then its continuations
    order = [(item[3].seed, "base" if len(item) == 6 and item[5] else "run") for item in items]
    expected = [(seed, what) for seed in (0, 1) for what in ("base", "run")]
    assert list(dict.fromkeys(order)) == expected, order
    for seed in (0, 1):
        assert {item[3].id for item in items if len(item) == 6 and item[3].seed == seed} == {
            r["origin"] for r in held if r["seed"] == seed}
        assert len({r["origin"] for r in held if r["seed"] == seed}) == 2
    assert {item[3].id for item in items if len(item) == 5} == {r["id"] for r in held}
    for r in held:
        assert again["runs"][r["id"]]["branches"] == r["branches"]

def test_incremental_compute_to_reach_by_hand():
    """Endpoint (b): budgets 1e10, 2e10, 4e10, the base's level at 4e10, so X = ¼, ½, 1. The
    grown arm at X = ½ has loss 2.0. Seed 0's rival (2.2, 2.1, 1.9) reaches 2.0 halfway (in
    log X) from ½ to 1: X' = √½, ratio √2; seed 1's (2.1, 2.0, 1.8) at ½: ratio 1; the
    interval is over log2 ratios (½, 0). A third seed whose rival never comes down (2.3, 2.2,
    2.1) is a bound ('above') and leaves no interval."""
    budgets = [1e10, 2e10, 4e10]

    def run(arm, seed, losses):
        return {"arm": arm, "kind": "reuse", "family": "tokenformer", "recipe": None,
                "lr": 1e-3, "seed": seed, "stages": [{"size": "S0", "start": 0}],
                "branches": [{"budget_index": j, "loss": x, "flops": budgets[j], "tokens": 1,
                              "size": "S0"} for j, x in losses.items()]}

    rivals = {0: (2.2, 2.1, 1.9), 1: (2.1, 2.0, 1.8), 2: (2.3, 2.2, 2.1)}
    q = {"id": "R3-k1", "family": "reuse-R3", "a": "grown@k1", "b": "continued@k1"}

    def reach(seeds):
        runs = {}
        for s in seeds:
            runs[f"g{s}"] = run("grown@k1", s, {1: 2.0})
            runs[f"c{s}"] = run("continued@k1", s, dict(enumerate(rivals[s])))
        results = {"runs": runs, "budgets": budgets, "preset": {"questions": [q]},
                   "tuning": {"reuse": {"grown@k1": {"level": 2}}}}
        table = analysis.arms(results)
        (row,) = analysis.reuse_reach(results, table, {})
        return row

    row = reach((0, 1))
    assert row["x"] == 0.5
    assert row["per_seed"] == pytest.approx({0: math.sqrt(2), 1: 1.0})
    assert row["ratio"] == pytest.approx(2 ** 0.25)
    ci = stats.t.interval(0.95, 1, loc=0.25, scale=stats.sem([0.5, 0.0]))
    assert (row["low"], row["high"]) == pytest.approx((2 ** ci[0], 2 ** ci[1]))
    row = reach((0, 1, 2))
    assert row["per_seed"][2] == "above" and "ratio" not in row


# ------------------------------------------------------------------------ the GPU preset
GPU_V5_DIR = ROOT / "docs" / "results" / "frontier-gpu-v5"  # where docs/frontier-v5.md says


def test_gpu_v5_is_planned_at_10m_parameters_on_real_text():
    """Issue 46 point 6: d >= 512, a base of >= 10M non-embedding parameters whose FLOPs are
    mostly Pattention, the reuse family first, the installed packages' Python sources (1.17e8
    bytes on the device's image: no run reads its training split more than 4 times)."""
    preset = get_preset("gpu-v5")
    base = reuse_.base_stage(preset, "tokenformer", 256)
    assert preset.hidden_size >= 512 and base.config.num_parameters(non_embedding=True) >= 10e6
    assert preset.corpus.startswith("pysource:") and preset.reuse is not None
    assert {q.family for q in preset.questions} == {"reuse-R1", "reuse-R2", "reuse-R3",
                                                    "reuse-R4"}
    assert reuse_.levels(preset, 256) == {0: 6.32, 1: 20.0}
    stages = plan_.stage_plans(preset, 256)
    plan_.check_epochs(preset, [r for runs in stages.values() for r in runs], 116_000_000)


def test_gpu_v5_bases_grow_and_train_a_step_on_cpu(tmp_path):
    """A few steps on the CPU at the GPU preset's shapes: TokenFormer's base S0 saved as a
    finished base, continued by the grown arm (paper recipe into S2) and Transformer++'s by
    HyperCloning (d 480 → 960), each one AdamW step on a short batch with a finite loss."""
    preset = get_preset("gpu-v5")
    ctx = state_.Context(preset, None, torch.device("cpu"), "fp32", None, False, tmp_path)
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (1, 32))
    for arm, family, width in (("grown", "tokenformer", 512), ("tpp-grown", "transformer++",
                                                                 960)):
        run = reuse_.continuation_run(preset, arm, 0, 0, 256, origin=f"base-{family}")
        base = reuse_.base_stage(preset, family, 256)
        state_.save_model(state_.model_path(ctx, run.origin, 0), family,
                          state_.build_model(family, base.config, 0, ctx.device))
        model = one_run.continued_base(ctx, run)
        assert model.config.hidden_size == width
        assert model.config.num_parameters(non_embedding=True) == run.stages[0].config.\
            num_parameters(non_embedding=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        assert math.isfinite(loss.item())


def test_committed_gpu_v5_runs_match_the_preset():
    """The GPU preset's leases commit their finished runs to docs/results/frontier-gpu-v5 (the
    folder docs/frontier-v5.md names) and each next lease resumes from them: the folder's
    experiment.json must be this preset's (record and fingerprint) and hold finished runs that
    read. No lease has run yet: skipped until the folder is committed."""
    marker = GPU_V5_DIR / "experiment.json"
    if not marker.is_file():
        pytest.skip(f"no gpu-v5 lease committed yet ({GPU_V5_DIR.relative_to(ROOT)} absent)")
    from tokenformer.experiments.common.arms import fingerprint

    saved = json.loads(marker.read_text())
    assert saved["fingerprint"] == fingerprint(saved["settings"])
    assert saved["settings"]["preset"] == json.loads(json.dumps(
        presets_.preset_record(get_preset("gpu-v5"))))
    runs = sorted((GPU_V5_DIR / "runs").glob("*.json"))
    assert runs, "a committed lease with no finished run"
    for path in runs:
        json.loads(path.read_text())  # every committed run record reads


def test_the_size_window_extends_past_a_tuning_optimum_at_its_edge(monkeypatch, tmp_path):
    """Fake losses where S0 is best at every budget: the window (one size around the predicted
    optimum, plus the base and R1's size) has S0 as its smallest size at both budgets, so S-1
    is swept and runs both budgets on the tuning seeds (v5); S0 then has a size on each side
    and stays the envelope, no longer at the grid's edge."""
    preset = tiny_v5(size_window=1, window_extensions=1, horizon_factors=(0.5, 1.0, 2.0),
                     tokens_per_parameter=1.0)  # predicted S1, S2: S-1 outside the window
    assert "S-1" not in plan_.swept_sizes(preset, "tokenformer", 256)
    penalty = {"S-1": 0.05, "S0": 0.0, "S1": 0.02, "S2": 0.04}

    def loss(run, lrs, j):
        shape = (math.log(lrs[-1]) - math.log(3e-3)) ** 2
        return 3.0 + shape + (0.0 if run.kind == "sweep" else penalty.get(run.stages[-1].size,
                                                                            0.0))

    results = run_with_fake_execute(
        monkeypatch, preset, lambda ctx, run, lrs: fake_result(run, lrs, loss), tmp_path)
    tuning = results["tuning"]
    assert tuning["window_added"] == [{"family": "tokenformer", "size": "S-1",
                                       "budget_index": j} for j in (0, 1)]
    assert "tokenformer-S-1" in results["sweeps"]
    assert set(tuning["horizon"]["tokenformer-S-1"]["budgets"]) == {"0", "1"}
    for e in tuning["envelope"]["tokenformer"].values():
        assert e["size"] == "S0" and not e["at_grid_edge"] and "S-1" in e["candidates"]


def test_the_epoch_check_counts_what_a_continuation_read_before_it_started():
    """A continuation reads on from its base's last batch, so its model has read the base's
    steps too: v5's R3 at k = 400, X = 1 has 2,412 + 2,613 steps of 2,048 tokens (1.03e7, hand
    multiplied), 4.1 epochs of a 2.5e6-token split: refused (its own steps alone: 2.1)."""
    preset = get_preset("full")
    r3 = next(r for r in reuse_.held_out_runs(preset, 256, [0]) if r.id == "continued@k400/seed0")
    assert (r3.data_offset, r3.total_steps, preset.tokens_per_step) == (2412, 2613, 2048)
    plan_.check_epochs(preset, [r3], 2_600_000)  # 3.95 epochs: inside the cap
    with pytest.raises(ConfigError, match=r"continued@k400/seed0 would see the training split "
                                          r"4\.1 times"):
        plan_.check_epochs(preset, [r3], 2_500_000)


def test_the_plan_labels_each_stage_by_the_seeds_its_runs_use():
    """The pre-registration says which seeds run each stage, read off the runs themselves: the
    reuse tuning runs on tuning seeds (the table said "held-out", its name not being in a list
    of tuning stages)."""
    text = plan_text.describe(get_preset("full"), 256)
    for stage, seeds in (("sweep", "tuning"), ("reuse tuning", "tuning"),
                         ("reuse held-out", "held-out"), ("held-out chains", "held-out")):
        assert f"| {stage} | {seeds} |" in text, stage


def test_r4_beside_a_transformer_family_is_refused():
    """R4's Transformer++ base is planned under the family's own run ids (transformer++-S0/seed0):
    with Transformer++ also a family, two different runs shared ids (66 horizon runs, 60 ids)."""
    with pytest.raises(ConfigError, match="drop transformer\\+\\+ from families"):
        dataclasses.replace(get_preset("full"), families=("tokenformer", "transformer++")
                            ).validate()
