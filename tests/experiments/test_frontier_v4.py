"""The v4 frontier protocol (issue 35): tuning seeds choose, held-out seeds score; the horizon
stage's LR and envelope choice; trend questions against scipy; Transformer++ by width; the
plan-time refusal of a question that reads the grid's edge."""

from __future__ import annotations

import dataclasses
import math

import pytest
from scipy import stats
from test_frontier import (  # rootdir-relative, as test_frontier_old_tokens
    assert_plan_refused,
    fake_result,
    run_with_fake_execute,
)

from tokenformer.errors import ConfigError
from tokenformer.experiments.frontier import analysis
from tokenformer.experiments.frontier import chains as chains_
from tokenformer.experiments.frontier import configs as configs_
from tokenformer.experiments.frontier import plan as plan_
from tokenformer.experiments.frontier import presets as presets_
from tokenformer.experiments.frontier import questions as questions_
from tokenformer.experiments.frontier.presets import get_preset


def test_width_scaled_transformer_sizes_halve_into_each_other():
    """S-1…S3 at d 24, 36, 48, 72, 96 with an MLP of exactly 8/3·d; Sk at half width (hidden,
    heads and MLP) is S(k−2), the shape HyperCloning starts from."""
    preset = get_preset("full-v4")
    configs = configs_.model_configs(preset, "transformer++", 256)
    assert [(c.hidden_size, c.num_heads, c.intermediate_size) for c in configs.values()] == [
        (24, 1, 64), (36, 2, 96), (48, 2, 128), (72, 4, 192), (96, 4, 256)]
    for big, small in (("S2", "S0"), ("S3", "S1")):
        b, s = configs[big], configs[small]
        assert (b.hidden_size // 2, b.num_heads // 2, b.intermediate_size // 2) == (
            s.hidden_size, s.num_heads, s.intermediate_size)
    # every budget read has a size on each side of the predicted optimum (window of one)
    for family in preset.families:
        best = chains_.predicted_envelope(preset, family, 256)
        order = list(presets_.family_sizes(preset, family))
        assert all(0 < order.index(z) < len(order) - 1 for z in best.values())


def test_a_question_reading_the_grids_edge_is_refused_in_one_line(capsys, tmp_path,
                                                                  monkeypatch):
    """Without S-1 the full preset's smallest budget has its predicted optimum (S0) at the
    grid's edge, and the trend questions read every budget: refused before anything trains."""
    edge = dataclasses.replace(get_preset("full-v4"), first_size=0, num_sizes=4)
    with pytest.raises(ConfigError, match=r"reads the tokenformer envelope at 3.12e\+11 FLOPs, "
                                          r"where its predicted best size S0 is at the edge"):
        plan_.plan(edge, 256)
    assert_plan_refused(monkeypatch, capsys, tmp_path, "edge", edge, "error: frontier: question ")


def test_trend_question_is_the_t_test_of_per_seed_slopes():
    """Per seed, a − b = c_s + m_s · log2(budget) (+ a bump at one budget); the answer's values
    are the least-squares slopes, its p scipy's one-sample t-test of them."""
    budgets = [1e10, 2e10, 4e10, 8e10]
    slopes = {0: -0.02, 1: -0.03, 2: -0.01, 3: -0.025}
    runs = {}
    for seed, m in slopes.items():
        for arm, kind in (("tokenformer-S1", "scratch"), ("chain-x", "chain")):
            branches = [{"budget_index": j, "loss": 2.0 + (
                m * math.log2(b) + (0.004 if j == 2 and seed == 1 else 0.0)
                if arm == "chain-x" else 0.0), "flops": b, "tokens": 1, "size": "S1"}
                for j, b in enumerate(budgets)]
            runs[f"{arm}/{seed}"] = {"arm": arm, "kind": kind, "family": "tokenformer",
                                     "recipe": None, "lr": 1e-3, "seed": seed,
                                     "stages": [{"size": "S1", "start": 0, "parameters": 1,
                                                 "non_embedding_parameters": 1}],
                                     "branches": branches}
    q = questions_.Question("T1", "slope?", "chain-x", "envelope:tokenformer", "trend",
                            budgets="trend")
    results = {"runs": runs, "budgets": budgets, "sweeps": {},
               "preset": {"questions": [dataclasses.asdict(q)]}}
    (row,) = analysis.answers(results)
    x = [math.log2(b) for b in budgets]
    expected = [slopes[0], stats.linregress(x, [slopes[1] * v + (0.004 if j == 2 else 0)
                                                for j, v in enumerate(x)]).slope,
                slopes[2], slopes[3]]
    assert row["diffs"] == pytest.approx(expected)
    assert row["budgets_read"] == [0, 1, 2, 3] and row["n"] == 4
    assert row["p_value"] == pytest.approx(stats.ttest_1samp(expected, 0.0).pvalue)
    assert row["decision"] == ("resolved" if row["p_value"] < 0.05 else "not resolved")


# a one-family v4 preset: sizes S-1…S2, chains on the predicted envelope
V4 = dataclasses.replace(
    get_preset("full-v4"), name="tiny-v4", hidden_size=32, num_layers=1, num_heads=2,
    base_tokens=(16, 16, 64), num_sizes=4, seq_len=32, batch_size=4, max_budget=1.2e9,
    num_budgets=3, warmup_steps=2, min_steps=8, sweep_steps=12, anneal_steps=3,
    eval_batches=1, seeds=3, tuning_seeds=2, lr_grid=(1e-3, 3e-3, 1e-2, 3e-2),
    families=("tokenformer",), recipes=("chain-paper-final-lr",), questions=(),
    size_window=None, tokens_per_parameter=0.5)


def test_tuning_seeds_choose_and_held_out_seeds_score(monkeypatch, tmp_path):
    """Fake losses: on the TUNING seeds S0 (smallest budget), then S1, at ×2 of the sweep's
    pick are best; on the held-out seeds S2 would be better than S1. The envelope is S1 at
    that LR (chosen on the tuning seeds), valued on the held-out seeds; the held-out runs are
    only the chosen pairs; the chain is tuned on the tuning seeds and runs its held-out seeds
    at the chosen factor."""
    preset = V4
    seen: list[tuple[str, int, tuple[float, ...]]] = []

    def loss(run, lrs, budget_index):
        size = run.stages[-1].size
        tuning = run.seed >= presets_.SWEEP_SEED
        if run.kind == "sweep":
            return (math.log(lrs[0]) - math.log(3e-3)) ** 2  # pick 3e-3
        s0 = -0.1 if budget_index == 0 else 0.1  # S0 best at the smallest budget: a chain
        best = ({"S0": s0, "S1": 0.0, "S2": 0.01} if tuning else
                {"S0": s0, "S1": 0.0, "S2": -0.05})
        base = 3.0 - 0.1 * budget_index + best.get(size, 0.2) + 0.001 * (run.seed % 7)
        return base + (math.log(lrs[-1]) - math.log(6e-3)) ** 2  # best LR 6e-3 = 2 × 3e-3

    def fake_execute(ctx, run, lrs):
        seen.append((run.id, run.seed, tuple(lrs)))
        return fake_result(run, lrs, loss)

    results = run_with_fake_execute(monkeypatch, preset, fake_execute, tmp_path)
    assert results["protocol"] == "v4"
    tuning = results["tuning"]
    assert tuning["seeds"] == [1000, 1001] and tuning["held_out_seeds"] == [0, 1, 2]
    env = tuning["envelope"]["tokenformer"]
    assert [env[j]["size"] for j in sorted(env)] == ["S0", "S1", "S1"]
    for e in env.values():
        if e["size"] == "S1":
            assert e["lr"] == pytest.approx(6e-3)
            assert set(e["tuning_losses"]) == {"1000", "1001"}
    held = {r["seed"] for r in results["runs"].values()}
    assert held == {0, 1, 2}  # no reported run on a tuning seed
    # every held-out from-scratch run is the envelope's (size, LR) at the budgets it chose
    for r in results["runs"].values():
        if r["kind"] != "scratch":
            continue
        for b in r["branches"]:
            e = env[str(b["budget_index"])]
            assert (r["stages"][0]["size"], r["lr"]) == (e["size"], pytest.approx(e["lr"]))
    # the envelope's value is the held-out seeds' loss of the tuning seeds' pick (not S2's)
    summary = analysis.envelope(results, "tokenformer")
    for j, e in summary.items():
        assert e["size"] == env[str(j)]["size"] and set(e["loss"]) == {0, 1, 2}
    # the chain: tuned on the tuning seeds at ×0.5, ×1, ×2 of the final size's LR
    chain = tuning["chains"]["chain-paper-final-lr"]
    assert [p["factor"] for p in chain["points"]] == [0.5, 1.0, 2.0]
    assert all(set(p["losses"]) == {"1000", "1001"} for p in chain["points"])
    # the policy LR is already the fake loss's best (6e-3, the final size's horizon pick), so
    # ×1 wins and every stage runs at 6e-3
    assert chain["factor"] == 1.0
    assert chain["lrs"] == pytest.approx([6e-3] * len(chain["lrs"]))
    held_chain = [lrs for rid, seed, lrs in seen if rid.startswith("chain-paper-final-lr/")]
    assert held_chain and all(lrs == pytest.approx(tuple(chain["lrs"])) for lrs in held_chain)


def test_report_method_names_each_family_for_what_it_is():
    """The v4 full run's report called the plain-GELU control a product-key family (every
    family beyond the dense two was taken for product keys) and said Transformer++ was matched
    in parameters when it is scaled by width: the Method section now says what ran."""
    from tokenformer.experiments.frontier import report_markdown

    base = dataclasses.asdict(get_preset("full-v4"))

    def stage(size, d, mlp, n, **config):
        return {"size": size, "non_embedding_parameters": n,
                "config": {"hidden_size": d, "intermediate_size": mlp, **config}}

    table = {"transformer++-S0": {"kind": "scratch", "family": "transformer++",
                                  "stages": [stage("S0", 36, 96, 31284)]},
             "tokenformer-gelu-S0": {"kind": "scratch", "family": "tokenformer-gelu",
                                     "stages": [stage("S0", 64, None, 24704)]}}
    text = "\n".join(report_markdown.method_lines({"preset": base}, table))
    assert "Product-key" not in text
    assert "Θ = gelu" in text and "Sizes S-1…S3" in text
    assert "by width, MLP = 8/3·d: S0 d 36 MLP 96 (31,284 non-emb. parameters)" in text
    pk = {**base, "families": ["tokenformer", "tokenformer-pk16"], "tpp_widths": None}
    table = {"tokenformer-pk16-S1": {"kind": "scratch", "family": "tokenformer-pk16",
                                     "stages": [stage("S1", 64, None, 100000, ffn_tokens=1600,
                                                      ffn_product_k=32)]}}
    text = "\n".join(report_markdown.method_lines({"preset": pk}, table))
    assert "Product-key families (tokenformer-pk16)" in text and "n = 1,600, k = 32" in text
    assert "matched to each in non-embedding parameters" in text
