"""The scaling experiment (``tokenformer scale``): statistics, the plan, cost accounting, MLP
widening, and the whole experiment at toy scale."""

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

from tokenformer.baselines import TransformerConfig, TransformerLM
from tokenformer.config import flops_per_token
from tokenformer.errors import ConfigError
from tokenformer.experiments.common import (
    Arm,
    Curve,
    Event,
    Point,
    crossing,
    paired,
    run_arms,
    spread,
    value_at,
)
from tokenformer.experiments.scale import (
    REFERENCE_THROUGHPUT,
    ScalePreset,
    assemble,
    estimate_seconds,
    get_preset,
    plan,
    report_markdown,
    run_scale,
    widen_mlp,
)

TOY = ScalePreset(name="toy", hidden_size=32, num_layers=2, num_heads=2, base_tokens=(8, 8, 64),
                  seq_len=16, batch_size=2, stage_steps=(3, 2, 2), warmup_steps=2, eval_every=3,
                  eval_batches=1, dense=(0, 1, 2), seeds=2, other_seeds=1, dtype="fp32")


@pytest.fixture
def one_thread():
    # Tiny models on a shared 2-core machine: a second thread only adds contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from tokenformer.data import prepare

    rng = random.Random(0)
    words = ("the lord said unto moses and aaron in the land of egypt this month shall be "
             "unto you the beginning of months it shall be the first month of the year").split()
    text = "\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000))
    root = tmp_path_factory.mktemp("scale")
    (root / "corpus.txt").write_text(text)
    prepare([root / "corpus.txt"], "bytes", root / "data", progress=False)
    return root / "data"


# ------------------------------------------------------------------------------- statistics
def test_crossing_and_value_at_hand_computed():
    xs, ys = [0.0, 10.0, 20.0], [3.0, 2.0, 1.0]
    assert crossing(xs, ys, 1.5) == pytest.approx(15.0)
    assert crossing(xs, ys, 2.0) == pytest.approx(10.0)
    assert crossing(xs, ys, 3.5) == 0.0
    assert crossing(xs, ys, 0.5) is None
    assert value_at(xs, ys, 5.0) == pytest.approx(2.5)
    assert value_at(xs, ys, 25.0) is None
    # a growth step: two points at one x; the curve jumps up and comes back down
    xs, ys = [0.0, 10.0, 10.0, 20.0], [3.0, 2.0, 2.5, 1.0]
    assert crossing(xs, ys, 2.2) == pytest.approx(8.0)  # (0,3)→(10,2) crosses 2.2 at 8
    assert value_at(xs, ys, 10.0) == 2.5  # the grown model's evaluation
    assert value_at(xs, ys, 15.0) == pytest.approx(1.75)


def test_paired_decision_rule():
    a = {0: 1.0, 1: 1.1, 2: 0.9}
    resolved = paired("g", "s", a, {0: 1.1, 1: 1.22, 2: 0.98})  # diffs -0.1, -0.12, -0.08
    assert resolved.mean == pytest.approx(-0.1) and resolved.spread == pytest.approx(0.02)
    assert resolved.winner == "g" and resolved.verdict == "g better"
    noisy = paired("g", "s", a, {0: 1.1, 1: 1.0, 2: 0.95})  # diffs -0.1, +0.1, -0.05
    assert noisy.winner is None and noisy.verdict == "not resolved"
    single = paired("g", "s", {0: 1.0}, {0: 2.0})
    assert single.winner is None and single.verdict == "not resolved (one seed)"
    never = paired("g", "s", {0: math.inf, 1: math.inf}, {0: 3.0, 1: 3.1}, "compute")
    assert never.winner == "s" and never.mean == math.inf
    mixed = paired("g", "s", {0: math.inf, 1: 1.0}, {0: 3.0, 1: 3.1}, "compute")
    assert mixed.winner is None
    s = spread([1.0, 2.0, 3.0])
    assert (s.mean, s.std, s.min, s.max, s.n) == (2.0, 1.0, 1.0, 3.0, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5)), min_size=1, max_size=6))
def test_paired_is_antisymmetric(pairs):
    a = {i: x for i, (x, _) in enumerate(pairs)}
    b = {i: y for i, (_, y) in enumerate(pairs)}
    ab, ba = paired("a", "b", a, b), paired("b", "a", b, a)
    assert ab.mean == pytest.approx(-ba.mean, abs=1e-12)
    assert ab.winner == ba.winner
    if ab.winner is not None:  # a named winner needs two seeds and |mean| above the spread
        assert ab.n >= 2 and abs(ab.mean) > ab.spread


def test_run_arms_shares_per_seed_and_resumes_after_a_crash(tmp_path):
    calls = []

    def recipe(name, crash_at=None):
        def run(seed, shared):
            if (name, seed) == crash_at:
                raise RuntimeError("killed")
            calls.append((name, seed))
            shared.setdefault("base", []).append(name)  # visible to later arms of this seed
            return _toy_curve([(0, 0.0, 3.0), (1, 1.0, 2.0 + seed + len(shared["base"]))])
        return run

    def arms(crash_at=None):
        return [Arm("a", recipe("a", crash_at)), Arm("b", recipe("b", crash_at), seeds=1),
                Arm("c", recipe("c", crash_at))]

    partial = tmp_path / "partial.json"
    with pytest.raises(RuntimeError):
        run_arms(arms(crash_at=("c", 1)), [0, 1], partial=partial, settings={"x": 1},
                 progress=False)
    assert calls == [("a", 0), ("b", 0), ("c", 0), ("a", 1)]  # seed-major; b runs one seed
    calls.clear()
    done = run_arms(arms(), [0, 1], partial=partial, settings={"x": 1}, progress=False)
    assert calls == [("c", 1)]  # only what the crash lost
    assert {n: sorted(r) for n, r in done.items()} == {"a": [0, 1], "b": [0], "c": [0, 1]}
    assert done["c"][0].final.loss == 2.0 + 0 + 3  # third arm of seed 0 saw two before it
    calls.clear()
    run_arms(arms(), [0, 1], partial=partial, settings={"x": 2}, progress=False)
    assert len(calls) == 5  # other settings: nothing is reused


# ---------------------------------------------------------------------------------- the plan
def test_full_plan_has_every_arm_of_the_issue_and_matched_costs():
    preset = get_preset("full")
    arms = {a.name: a for a in plan(preset, vocab_size=257)}
    grown = {f"grow-{r}-{o}-{s}" for r in ("paper", "official", "exact")
             for o in ("carry", "reset") for s in ("wsd", "restart")}
    expected = {"scratch-S", "scratch-M", "scratch-L", "small-longer", "scratch-L-matched",
                *grown, *(f"{a}-{s}" for a in ("transformer", "transformer++") for s in "SML"),
                "transformer-widen-zero", "transformer-widen-net2net"}
    assert set(arms) == expected
    deciding = {n for n, a in arms.items() if a.deciding}
    assert deciding == {"scratch-L", "small-longer", "scratch-L-matched",
                        "grow-paper-carry-wsd", "grow-official-carry-wsd", "grow-exact-carry-wsd"}
    tps = preset.tokens_per_step
    chain = arms["grow-exact-carry-wsd"]
    sizes = [s.config.num_parameters(non_embedding=True) for s in chain.stages]
    assert [round(b / a, 2) for a, b in itertools.pairwise(sizes)] == [3.0, 3.0]
    assert {s.config.hidden_size for s in chain.stages} == {preset.hidden_size}
    total = sum(chain.stage_flops(tps))
    for name in ("small-longer", "scratch-L-matched"):  # equal compute, up to one step
        (stage,) = arms[name].stages
        assert abs(stage.flops_per_token * stage.steps * tps - total) <= \
            stage.flops_per_token * tps / 2
    for arch in ("transformer", "transformer++"):  # matched in parameters and FLOPs per token
        for tf_stage, size in zip(chain.stages, "SML", strict=True):
            base = arms[f"{arch}-{size}"].stages[0]
            assert base.config.num_parameters(non_embedding=True) == pytest.approx(
                tf_stage.config.num_parameters(non_embedding=True), rel=0.01)
            assert base.flops_per_token == pytest.approx(tf_stage.flops_per_token, rel=0.02)


def test_presets_fit_their_time_budgets_at_the_reference_throughput():
    for name, minutes, seeds in (("quick", 15, 1), ("full", 120, 3)):
        preset = get_preset(name)
        assert preset.seeds == seeds
        arms = plan(preset, 257)
        rates = {f"{a.family}-{s.size}": REFERENCE_THROUGHPUT["bf16"][s.size]
                 for a in arms for s in a.stages}
        # evaluation and start-up: at most 10 % on top of training
        assert 1.1 * estimate_seconds(arms, preset, preset.seeds, rates) <= minutes * 60


# -------------------------------------------------------------------------- MLP widening
@pytest.mark.parametrize("arch,how", [("transformer", "zero"), ("transformer", "net2net"),
                                      ("transformer++", "net2net")])
def test_widen_mlp_preserves_function_and_carries_adam(arch, how, one_thread):
    torch.manual_seed(0)
    config = TransformerConfig(arch=arch, vocab_size=64, hidden_size=16, num_layers=2,
                               num_heads=2, intermediate_size=12, max_seq_len=16)
    model = TransformerLM(config).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    gen = torch.Generator().manual_seed(1)
    big, big_opt = widen_mlp(model, opt, 30, how, generator=gen)
    assert big.config.intermediate_size == 30 and model.config.intermediate_size == 12
    with torch.no_grad():
        torch.testing.assert_close(big(ids).logits, model(ids).logits, rtol=0, atol=1e-10)
    up_old, up_new = model.layers[0].mlp.up.weight, big.layers[0].mlp.up.weight
    state = big_opt.state[up_new]
    torch.testing.assert_close(state["exp_avg"][:12], opt.state[up_old]["exp_avg"])
    assert state["exp_avg"][12:].abs().sum() == 0 and state["step"] == opt.state[up_old]["step"]
    mlp = big.layers[0].mlp
    before_up, before_down = mlp.up.weight.detach().clone(), mlp.down.weight.detach().clone()
    copies = {j: next(i for i in range(12) if torch.equal(before_up[j], before_up[i]))
              for j in range(12, 30)} if how == "net2net" else {}
    for _ in range(2):  # new units train (with zero outgoing weights, those move first)
        big(ids, labels=ids).loss.backward()
        big_opt.step()
        big_opt.zero_grad()
    assert (mlp.up.weight[12:] != before_up[12:]).any(dim=1).all()
    assert (mlp.down.weight[:, 12:] != before_down[:, 12:]).any(dim=0).all()
    for j, i in copies.items():  # a copy and its source diverge: their outgoing shares differ
        assert not torch.equal(mlp.up.weight[j], mlp.up.weight[i])


# ------------------------------------------------------------------------------ cost + report
def _toy_curve(points: list[tuple[int, float, float]], events: list[int] = (),
               stage_of=lambda step: 0) -> Curve:
    return Curve([Point(s, s * 10, f, 1.0 * s, loss, loss / math.log(2), stage_of(s))
                  for s, f, loss in points],
                 [Event(e, e * 10, next(f for s, f, _ in points if s == e), 1.0 * e, "S→L")
                  for e in events])


def test_summary_on_synthetic_curves():
    """Compute to target, the marginal view and the verdict, against hand-computed values."""
    preset = ScalePreset(name="synthetic", stage_steps=(4, 4, 4), warmup_steps=1, seeds=3,
                         dense=(0, 1), arms=("scratch-L", "small-longer", "scratch-L-matched",
                                             "grow-exact-carry-wsd"))
    plans = plan(preset, 257)
    curves = {}
    for seed, eps in enumerate((0.0, 0.01, -0.01)):
        curves.setdefault("scratch-L", {})[seed] = _toy_curve(
            [(0, 0.0, 3 + eps), (6, 10.0, 2 + eps), (12, 20.0, 1 + eps)])
        grown = [(0, 0.0, 3 + eps), (4, 4.0, 1.5 + eps), (4, 4.0, 1.6 + eps),
                 (12, 8.0, 0.5 + eps)]
        curves.setdefault("grow-exact-carry-wsd", {})[seed] = Curve(
            [Point(s, s, f, s, y, y, int(i >= 2)) for i, (s, f, y) in enumerate(grown)],
            [Event(4, 4, 4.0, 4.0, "S→L")])
        curves.setdefault("small-longer", {})[seed] = _toy_curve(
            [(0, 0.0, 3 + eps), (12, 8.0, 0.8 + 2 * eps)])
        curves.setdefault("scratch-L-matched", {})[seed] = _toy_curve(
            [(0, 0.0, 3 + eps), (12, 8.0, 1.4 + eps)])
    results = assemble(preset, plans, curves, command="test", seeds=[0, 1, 2], device="cpu",
                       precision="fp32", data={"name": "synthetic", "train_tokens": 1,
                                               "bytes_per_token": 1.0}, wall_clock=0.0)
    s = results["summary"]
    assert s["target"] == pytest.approx(1.0)
    # seed 0: (4, 1.6) → (8, 0.5) crosses 1.0 at 4 + 4·0.6/1.1; marginal: minus the 4 before growth
    grown = s["arms"]["grow-exact-carry-wsd"]
    assert grown["flops_to_target"][0] == pytest.approx(4 + 4 * 0.6 / 1.1)
    assert grown["marginal_flops_to_target"][0] == pytest.approx(4 * 0.6 / 1.1)
    assert s["arms"]["scratch-L"]["flops_to_target"][0] == pytest.approx(20.0)
    assert s["arms"]["scratch-L-matched"]["flops_to_target"][0] is None
    by = {(c["a"], c["b"], c["metric"]): c for c in s["comparisons"]}
    assert by[("grow-exact-carry-wsd", "small-longer", "loss")]["winner"] == "grow-exact-carry-wsd"
    assert by[("grow-exact-carry-wsd", "scratch-L-matched", "loss")]["winner"] == \
        "grow-exact-carry-wsd"
    assert s["verdict"][0].startswith("**Does any growth recipe beat training the small model "
                                      "longer at equal total compute? Yes**")
    assert "## Compute to reach scratch-L's final loss (1.0000)" in report_markdown(results, [])
    rows = s["transient"]["grow-exact-carry-wsd"]
    assert rows[0]["before"] == pytest.approx(1.5) and rows[0]["after"]["0"] == pytest.approx(1.6)
    assert rows[0]["after"]["1"] is None  # no evaluation one step after growth in this curve


# ----------------------------------------------------------------------- the whole experiment
def _numbers(results: dict) -> dict:
    """Everything except wall-clock, timing and machine facts: what must reproduce exactly."""
    out = {}
    for name, arm in results["arms"].items():
        out[name] = {s: [(p["step"], p["tokens"], p["flops"], p["loss"], p["bpb"], p["stage"])
                         for p in run["points"]] for s, run in arm["runs"].items()}
    return out


def test_toy_experiment_end_to_end(toy_data, tmp_path, one_thread):
    """Every arm at toy scale: report structure, FLOPs = analytic count × tokens, reproducible."""
    results = run_scale(TOY, data=toy_data, out=tmp_path / "a", progress=False,
                        print_fn=lambda *_: None)
    names = [a.name for a in plan(TOY, 257)]
    assert list(results["arms"]) == names and len(names) == 25
    report = (tmp_path / "a" / "report.md").read_text()
    for heading in ("## Verdict", "## Arms", "## Compute to reach scratch-L's final loss",
                    "## Paired comparisons", "## Right after growth", "## Method"):
        assert heading in report
    assert "beat training the small model longer" in report
    assert "Wall-clock of the whole run" in report and not results["resumed"]
    resumed = report_markdown({**results, "resumed": True}, [])
    assert "Wall-clock of this invocation" in resumed and "whole run" not in resumed
    for name in names:
        assert f"| {name} " in report
    saved = json.loads((tmp_path / "a" / "results.json").read_text())
    assert saved["schema"] == "tokenformer-scale/1" and list(saved["arms"]) == names
    assert not (tmp_path / "a" / ".partial.json").exists()
    pytest.importorskip("matplotlib")
    for png in ("headline.png", "loss_vs_flops.png", "bpb_vs_flops.png", "loss_vs_wall.png",
                "bpb_vs_wall.png", "transient.png"):
        assert (tmp_path / "a" / png).read_bytes()[:4] == b"\x89PNG"

    tokens_per_step = TOY.batch_size * TOY.seq_len
    for name, arm in results["arms"].items():
        assert set(arm["runs"]) == ({"0", "1"} if arm["deciding"] else {"0"})
        stage_fpt = [flops_per_token(p.config, TOY.seq_len, training=True)["total"]
                     for p in next(a for a in plan(TOY, 257) if a.name == name).stages]
        bounds = [0]
        for st_ in arm["stages"]:
            bounds.append(bounds[-1] + st_["steps"])
        for run in arm["runs"].values():
            for p in run["points"]:
                # steps trained at each size before this point, × tokens per step × FLOPs/token
                trained = [max(0, min(p["step"], hi) - lo)
                           for lo, hi in itertools.pairwise(bounds)]
                expected = sum(n * tokens_per_step * f
                               for n, f in zip(trained, stage_fpt, strict=True))
                assert p["flops"] == pytest.approx(expected, rel=1e-12)
                assert p["tokens"] == p["step"] * tokens_per_step
            assert run["points"][-1]["step"] == arm["steps"]
            if arm["kind"] == "grown":  # dense evaluations right after each growth
                steps = {(p["step"], p["stage"]) for p in run["points"]}
                for k, e in enumerate(run["events"], start=1):
                    assert {(e["step"], k - 1), (e["step"], k), (e["step"] + 1, k),
                            (e["step"] + 2, k)} <= steps
    exact = results["summary"]["transient"]["grow-exact-carry-wsd"]
    for row in exact:  # function-preserving growth: the loss does not move at the growth step
        assert row["after"]["0"] == pytest.approx(row["before"], abs=1e-4)

    # the same seed again (a subset of the arms, run in another order): identical numbers
    subset = ("transformer-widen-net2net", "grow-official-reset-restart", "small-longer")
    again = run_scale(dataclasses.replace(TOY, arms=subset, seeds=1),
                      data=toy_data, out=tmp_path / "b", progress=False, print_fn=lambda *_: None,
                      plots=False)
    first, second = _numbers(results), _numbers(again)
    for name in subset:
        assert second[name]["0"] == first[name]["0"]


def test_cli_plan_and_errors(toy_data, capsys):
    from tokenformer.cli import main

    assert main(["scale", "--plan", "--preset", "quick", "--data", str(toy_data)]) == 0
    out = capsys.readouterr().out
    assert "grow-exact-carry-wsd *" in out and "estimated training time" in out
    assert main(["scale", "--plan", "--steps", "10,x,3", "--data", str(toy_data)]) == 2
    assert "error: --steps expects comma-separated integers" in capsys.readouterr().err
    assert main(["scale", "--plan", "--arms", "grow-nothing", "--data", str(toy_data)]) == 2
    assert "unknown arm(s) grow-nothing" in capsys.readouterr().err


def test_new_row_moments_reach_the_grown_arms(toy_data, tmp_path, one_thread, capsys):
    """``--new-row-moments mean`` changes the carried arms' training after growth (and only
    after it), keeps exact growth function-preserving, and is refused with a bad value."""
    from tokenformer.cli import main

    runs = {}
    for moments in ("zero", "mean"):
        preset = dataclasses.replace(TOY, arms=("grow-exact-carry-wsd",), seeds=1,
                                     new_row_moments=moments)
        results = run_scale(preset, data=toy_data, out=tmp_path / moments, progress=False,
                            print_fn=lambda *_: None, plots=False)
        runs[moments] = results["arms"]["grow-exact-carry-wsd"]["runs"]["0"]["points"]
    first_growth = TOY.stage_steps[0]
    before = {m: [p["loss"] for p in points if p["step"] <= first_growth and p["stage"] == 0]
              for m, points in runs.items()}
    assert before["zero"] == before["mean"] and before["zero"]
    assert runs["zero"][-1]["loss"] != runs["mean"][-1]["loss"]
    for stage in (1, 2):  # +0 after each growth: the loss just before it, in both variants
        for points in runs.values():
            at = [p for p in points if p["step"] == sum(TOY.stage_steps[:stage])]
            assert [p["stage"] for p in at] == [stage - 1, stage]  # before, then +0
            assert at[1]["loss"] == pytest.approx(at[0]["loss"], abs=1e-4)
    with pytest.raises(SystemExit) as exc:  # argparse rejects the value: one line, exit 2
        main(["scale", "--plan", "--new-row-moments", "old", "--data", str(toy_data)])
    assert exc.value.code == 2 and "--new-row-moments" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="new_row_moments"):
        get_preset("quick", new_row_moments="old")
