"""Θ's factor annealed after an exact growth (``anneal_steps``, ``--anneal-steps``): the factor of a
step, when ``fit`` sets it, the config's checks, and a resume inside the anneal bit for bit."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM, load_model
from tokenformer.cli import main as cli
from tokenformer.errors import CheckpointError, ConfigError
from tokenformer.io.run_folders import step_dir
from tokenformer.io.training_state import read_state
from tokenformer.models.baselines import model_class
from tokenformer.ops.growth import Recipe, register_recipe, unregister_recipe
from tokenformer.ops.growth.tokens import exact_tokens
from tokenformer.training.anneal import Anneal, is_exact
from tokenformer.training.config import TrainConfig
from tokenformer.training.growth import growth_plan
from tokenformer.training.growth_events import parse_grow_at
from tokenformer.training.loop import fit


def small_config(**overrides) -> TokenFormerConfig:
    return TokenFormerConfig(**{"vocab_size": 64, "hidden_size": 16, "num_layers": 1,
                                "num_heads": 2, "qkv_tokens": 8, "proj_tokens": 8,
                                "ffn_tokens": 32, "max_seq_len": 8, "eos_token_id": None,
                                **overrides})


# --------------------------------------------------------------------------- the factor
def test_theta_anneal_moves_linearly_to_sqrt_n_and_the_config_with_it():
    model = model_class("tokenformer")(small_config(qkv_scale=2.0, proj_scale=2.0,
                                                    ffn_scale=4.0))
    anneal = Anneal(100, {"qkv": 2.0, "proj": 2.0, "ffn": 4.0},
                    {"qkv": math.sqrt(8), "proj": math.sqrt(8), "ffn": math.sqrt(32)}, 100)
    anneal.apply(model, 125)  # a quarter of the way
    p = model.pattentions()
    assert p["layers.0.attention.query"].scale == pytest.approx(2 + 0.25 * (math.sqrt(8) - 2))
    assert p["layers.0.mlp"].scale == pytest.approx(4 + 0.25 * (math.sqrt(32) - 4))
    assert model.config.ffn_scale == pytest.approx(4 + 0.25 * (math.sqrt(32) - 4))  # in force
    anneal.apply(model, 250)
    assert p["layers.0.mlp"].scale == pytest.approx(math.sqrt(32))
    assert model.config.ffn_scale is None and model.config.theta_scale("ffn") == pytest.approx(
        math.sqrt(32))


@pytest.mark.parametrize(("step", "expected"), [
    (7, {"qkv": 2.0, "proj": 3.0, "ffn": 4.0}),  # before the growth: held
    (10, {"qkv": 2.0, "proj": 3.0, "ffn": 4.0}),  # the growth step: held
    (14, {"qkv": 3.0, "proj": 2.0, "ffn": 6.0}),  # midway: held + ½·(target − held)
    (16, {"qkv": 3.5, "proj": 1.5, "ffn": 7.0}),  # three quarters
    (18, {"qkv": 4.0, "proj": 1.0, "ffn": 8.0}),  # the end: the target
    (50, {"qkv": 4.0, "proj": 1.0, "ffn": 8.0}),  # and after it
])
def test_the_factor_of_a_step_is_held_plus_its_fraction_of_the_way(step, expected):
    anneal = Anneal(10, {"qkv": 2.0, "proj": 3.0, "ffn": 4.0},
                    {"qkv": 4.0, "proj": 1.0, "ffn": 8.0}, 8)
    assert {k: anneal.factor(k, step) for k in expected} == expected


def test_at_the_end_the_factor_is_sqrt_n_itself_which_the_null_config_stands_for():
    """0.7 + (√8 − 0.7) rounds to √8 + 4e-16: the factor at the end is the target itself, so
    the Pattentions compute what a model built from the released config (``qkv_scale`` None,
    √8) does, and a folder saved as the anneal ends loads as the same function."""
    model = model_class("tokenformer")(small_config(qkv_scale=0.7))
    anneal = Anneal(0, {"qkv": 0.7, "proj": math.sqrt(8), "ffn": math.sqrt(32)},
                    {"qkv": math.sqrt(8), "proj": math.sqrt(8), "ffn": math.sqrt(32)}, 4)
    anneal.apply(model, 4)
    assert model.pattentions()["layers.0.attention.query"].scale == math.sqrt(8)
    assert model.config.qkv_scale is None and model.config.theta_scale("qkv") == math.sqrt(8)


def test_after_an_exact_growth_it_runs_from_the_held_factor_to_sqrt_n():
    config = small_config(qkv_tokens=16, qkv_scale=math.sqrt(8), ffn_scale=5.0)
    anneal = Anneal.after_growth(config, 40, 20)
    assert anneal.step == 40 and anneal.steps == 20
    assert anneal.held == {"qkv": math.sqrt(8), "proj": math.sqrt(8), "ffn": 5.0}
    assert anneal.target == {"qkv": 4.0, "proj": math.sqrt(8), "ffn": math.sqrt(32)}


def test_a_saved_anneal_round_trips_and_a_malformed_one_is_one_line():
    anneal = Anneal(3, {"qkv": 1.0, "proj": 2.0, "ffn": 3.0},
                    {"qkv": 2.0, "proj": 2.0, "ffn": 4.0}, 5)
    assert Anneal.from_state(json.loads(json.dumps(anneal.to_state())), 5, "x") == anneal
    with pytest.raises(CheckpointError, match=r"^state\.json: anneal is malformed") as err:
        Anneal.from_state({"step": 3, "held": {"qkv": 1.0}, "target": {}}, 5, "state.json")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="anneal_steps"):
        Anneal.from_state(anneal.to_state(), 0, "state.json")


def test_fit_sets_each_steps_factor_after_an_exact_growth():
    """The factor each optimizer step trains with (what a callback sees after the step): √8
    before the growth at step 2, then held √8 moving to √16 = 4 over 4 steps, then 4."""
    torch.manual_seed(0)
    model = TokenFormerLM(small_config())
    cfg = TrainConfig(model={"preset": "tiny"}, seq_len=8, batch_size=2, steps=8,
                      warmup_steps=1, eval_interval=0, samples=0, device="cpu",
                      grow_at=["2:qkv=2x,recipe=exact"], anneal_steps=4)
    seen: list[float] = []

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    def watch(record, current) -> None:
        if record["type"] == "train":
            seen.append(current.pattentions()["layers.0.attention.query"].scale)

    result = fit(model, batch_fn, cfg, callbacks=[watch], progress=False)
    held, target = math.sqrt(8), 4.0
    assert seen[:2] == [held, held]  # before the growth: √n of 8 tokens
    assert seen[2:] == [held + f * (target - held) for f in (0.0, 0.25, 0.5, 0.75, 1.0, 1.0)]
    assert result.model.config.qkv_scale is None  # the config follows n again


@pytest.mark.parametrize("steps", [7, 10])  # final/ inside the anneal; the anneal ends with it
def test_a_model_folder_saved_inside_the_anneal_is_the_function_that_trained(tmp_path, steps):
    """An exact growth at step 2 (8 → 16 qkv tokens) annealed over 8 steps, a checkpoint every
    2: each model folder (checkpoints 4, 6, 8, ``final/``, and the returned model saved)
    loads with ``load_model`` as the live model was when it was saved (the logits its
    evaluation then computed), its config holding the factor of the anneal at that step,
    √8 + (step − 2)/8·(4 − √8), and None (√16 = 4) from step 10 on."""
    torch.manual_seed(0)
    cfg = TrainConfig(model={"preset": "tiny"}, seq_len=8, batch_size=2, steps=steps,
                      warmup_steps=1, eval_interval=2, checkpoint_interval=2, keep_last=10,
                      samples=0, device="cpu", grow_at=["2:qkv=2x,recipe=exact"],
                      anneal_steps=8)
    probe = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(99))
    evaluated: list[torch.Tensor] = []
    live: dict[int, torch.Tensor] = {}

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    def eval_fn(model) -> dict[str, float]:
        evaluated.append(model(input_ids=probe).logits)
        return {"val_loss": 0.0}

    def watch(record, current) -> None:
        if record["type"] == "eval":
            live[record["step"]] = evaluated[-1]

    result = fit(TokenFormerLM(small_config()), batch_fn, cfg, eval_fn=eval_fn,
                 callbacks=[watch], out_dir=tmp_path / "R", progress=False)
    result.model.save(tmp_path / "returned")
    folders = {**{s: step_dir(tmp_path / "R", s) for s in range(4, steps, 2)},
               steps: tmp_path / "R" / "final"}
    for step, folder in [*folders.items(), (steps, tmp_path / "returned")]:
        factor = math.sqrt(8) + (step - 2) / 8 * (4 - math.sqrt(8)) if step < 10 else None
        assert json.loads((folder / "config.json").read_text())["qkv_scale"] == (
            pytest.approx(factor) if factor is not None else None), folder
        with torch.no_grad():
            logits = load_model(folder).eval()(input_ids=probe).logits
        torch.testing.assert_close(logits, live[step], msg=f"{folder}")


# ------------------------------------------------------------------------ config and CLI
def test_train_help_lists_anneal_steps(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["train", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--anneal-steps" in out and "exact growth" in out


def error_line(capsys, argv: list[str]) -> str:
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(("value", "grow", "says"), [
    ("-1", "4:qkv=2x", "anneal_steps must be >= 0, got -1"),
    ("abc", "4:qkv=2x", "anneal_steps must be an integer, got 'abc'"),
    ("1.5", "4:qkv=2x", "anneal_steps must be an integer, got '1.5'"),
    ("5", None, "this run has none"),  # no growth to anneal after
    ("5", "4:qkv=2x,recipe=paper", "this run has none"),  # paper's factor follows n already
])
def test_bad_anneal_steps_are_refused_in_one_line(capsys, tmp_path, value, grow, says):
    argv = ["train", "--config", "tiny", "--out", tmp_path / "new", "--anneal-steps", value,
            *(["--grow-at", grow] if grow else [])]
    assert says in error_line(capsys, argv)
    assert not (tmp_path / "new").exists()


def test_a_growth_inside_an_anneal_is_refused():
    with pytest.raises(ConfigError, match=r"comes 3 steps after the exact growth") as err:
        growth_plan(TrainConfig(steps=20, grow_at=["4:qkv=2x", "7:ffn=2x"], anneal_steps=5))
    assert "\n" not in str(err.value)
    growth_plan(TrainConfig(steps=20, grow_at=["4:qkv=2x", "9:ffn=2x"], anneal_steps=5))  # fine
    with pytest.raises(ConfigError, match="arch transformer"):
        growth_plan(TrainConfig(arch="transformer", steps=20, grow_at=["4:layers=2x"],
                                anneal_steps=5))


# ------------------------------------------------------------------------------ resume
GROWTH = "4:qkv=2x,proj=2x,ffn=2x,recipe=exact"


def run_args(dataset_dir: Path, *extra: str) -> list[str]:
    return ["--data", str(dataset_dir), "--eval-interval", "0", "--threads", "1",
            "--samples", "0", "--eval-batches", "1", "--no-progress", "--steps", "12",
            "--checkpoint-interval", "2", "--keep-last", "10", "--grow-at", GROWTH, *extra]


@pytest.fixture(scope="module")
def annealed_run(tmp_path_factory, dataset_dir) -> Path:
    """tiny, 12 steps, an exact growth at step 4 (32 → 64 qkv tokens) annealed over 6 steps
    (until step 10), a checkpoint every 2 steps."""
    run = tmp_path_factory.mktemp("annealed") / "R"
    assert cli(["train", "--config", "tiny", "--out", str(run),
                *run_args(dataset_dir, "--anneal-steps", "6")]) == 0
    return run


def weights(path: Path) -> dict[str, torch.Tensor]:
    return TokenFormerLM.load(path).state_dict()


@pytest.mark.parametrize("step", [4, 6, 8])
def test_a_resume_inside_the_anneal_equals_the_uninterrupted_run(annealed_run, tmp_path, step):
    """Killed after the checkpoint of ``step`` (4: before the growth; 6, 8: inside the anneal),
    then resumed: the final weights are the uninterrupted run's, bit for bit."""
    run = tmp_path / "R"
    shutil.copytree(annealed_run, run)
    shutil.rmtree(run / "final")
    for later in range(step + 2, 12, 2):
        shutil.rmtree(step_dir(run, later))
    assert cli(["train", "--resume", str(run), "--no-progress"]) == 0
    final, reference = weights(run / "final"), weights(annealed_run / "final")
    assert final.keys() == reference.keys()
    assert all(torch.equal(final[k], reference[k]) for k in reference)


def test_the_anneal_is_saved_and_changes_the_training(annealed_run, tmp_path, dataset_dir):
    """Inside the anneal the checkpoint holds it and its config the factor in force (a third
    of the way from √32 to 8 at step 6); after it the config follows n (None); and the run
    differs from the same run held (no anneal)."""
    mid = read_state(step_dir(annealed_run, 6))["anneal"]
    assert mid["step"] == 4 and mid["held"]["qkv"] == math.sqrt(32) and mid["target"]["qkv"] == 8
    assert json.loads((step_dir(annealed_run, 6) / "config.json").read_text())["qkv_scale"] == \
        pytest.approx(math.sqrt(32) + (8 - math.sqrt(32)) / 3)
    assert TokenFormerLM.load(annealed_run / "final").config.qkv_scale is None
    held = tmp_path / "held"
    assert cli(["train", "--config", "tiny", "--out", str(held), *run_args(dataset_dir)]) == 0
    assert TokenFormerLM.load(held / "final").config.qkv_scale == math.sqrt(32)
    a, b = weights(annealed_run / "final"), weights(held / "final")
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_other_anneal_steps_is_refused(annealed_run, tmp_path, capsys):
    run = tmp_path / "R"
    shutil.copytree(annealed_run, run)
    shutil.rmtree(run / "final")
    capsys.readouterr()
    line = error_line(capsys, ["train", "--resume", run, "--anneal-steps", "3",
                               "--no-progress"])
    assert "--anneal-steps" in line and "recorded 6" in line, line


def test_a_registered_exact_recipe_is_exact_for_the_anneal():
    """is_exact asks the recipe table, as the schedule does (it compared the name "exact")."""
    register_recipe(Recipe("exact-too", exact_tokens, exact=True))
    try:
        assert is_exact(parse_grow_at("4:ffn=2x,recipe=exact-too"))
        assert is_exact(parse_grow_at("4:ffn=2x")) and not is_exact(
            parse_grow_at("4:ffn=2x,recipe=paper"))
    finally:
        unregister_recipe("exact-too")
