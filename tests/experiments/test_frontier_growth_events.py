"""The frontier's chains grow the one way every run grows: each growth is the ``--grow-at`` event
that starts a segment, applied by ``fit`` (issue 32). A state written at a growth point holds
the model before the growth; a state of an earlier version (the model already grown) resumes
without growing twice."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from test_frontier import TINY, _strip_timing  # rootdir-relative, as other test folders do

from tokenformer.experiments.frontier import growing
from tokenformer.experiments.frontier import one_run as one_run_
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier.schedule import Run, Stage
from tokenformer.io.untrusted import safe_torch_load
from tokenformer.models.baselines import TransformerConfig
from tokenformer.models.config import TokenFormerConfig
from tokenformer.ops.growth import grow_with_optimizer
from tokenformer.training.growth_events import parse_grow_at
from tokenformer.training.optim import group_names, rebuild_optimizer

TF = TokenFormerConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, qkv_tokens=8,
                       proj_tokens=8, ffn_tokens=32, max_seq_len=16)
TPP = TransformerConfig(arch="transformer++", vocab_size=64, hidden_size=16, num_layers=2,
                        num_heads=2, intermediate_size=40, max_seq_len=16)


def chain(recipe: str, first: object, grown: object) -> tuple[Run, Stage]:
    stages = (Stage("S0", first, 0, 1.0), Stage("S1", grown, 120, 2.0))
    return Run(f"{recipe}/seed0", recipe, "chain", "tokenformer", 0, stages, (), 1e-3, "x",
               recipe=recipe), stages[1]


@pytest.mark.parametrize("recipe, first, grown, spec", [
    ("chain-paper", TF, dataclasses.replace(TF, qkv_tokens=16, proj_tokens=16, ffn_tokens=64),
     "120:qkv=16,proj=16,ffn=64,strategy=paper"),
    ("chain-exact-frozen", TF, dataclasses.replace(TF, ffn_tokens=64),
     "120:qkv=8,proj=8,ffn=64,strategy=exact,freeze_old=forever"),
    ("chain-exact-noised", TF, dataclasses.replace(TF, ffn_tokens=64),
     "120:qkv=8,proj=8,ffn=64,strategy=exact,noise_old=0.01"),
    ("chain-stack", dataclasses.replace(TF, num_layers=1), TF, "120:layers=2,how=stack"),
    ("widen-net2net", TPP, dataclasses.replace(TPP, intermediate_size=64),
     "120:ffn=64,widen=net2net"),
    ("widen-duplicate", dataclasses.replace(TPP, hidden_size=8, num_heads=1,
                                            intermediate_size=20), TPP,
     "120:hidden=16,heads=2,width_noise=0.32,ffn=40"),
])
def test_each_arm_grows_by_the_event_of_the_spec_a_user_would_write(recipe, first, grown, spec):
    """The frontier passes the event itself to fit (issue 44: no spec formatted to be parsed
    again); its spec, what records and messages show, is the text the frontier has always
    written, and that text parses to the same growth."""
    run, stage = chain(recipe, first, grown)
    event = growing.grow_at(run, stage, first)
    assert event.spec == spec
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strategy=: the old key, in the frontier's records
        parsed = parse_grow_at(spec)  # a spec tokenformer train --grow-at takes
    assert (event.step, event.kwargs, event.lr, event.lr_ramp) == (
        parsed.step, parsed.kwargs, parsed.lr, parsed.lr_ramp)


def test_growth_settings_follow_the_recipe():
    preset = dataclasses.replace(TINY, new_row_moments="mean", anneal_steps=7)
    settings = {r: growing.growth_settings(preset, chain(r, TF, TF)[0], grows=True)
                for r in ("chain-exact-anneal", "chain-paper", "widen-zero")}
    assert settings == {
        "chain-exact-anneal": {"growth_optimizer": "carry-mean", "anneal_steps": 7},
        "chain-paper": {"growth_optimizer": "carry-mean", "anneal_steps": 0},
        # an MLP widening starts new units' moments at zero (its only form)
        "widen-zero": {"growth_optimizer": "carry", "anneal_steps": 0}}
    # a segment without a growth starts no anneal (the one in force is passed on)
    assert growing.growth_settings(preset, chain("chain-exact-anneal", TF, TF)[0],
                                   grows=False)["anneal_steps"] == 0


def test_a_state_of_an_earlier_version_resumes_without_growing_twice(dataset_dir, tmp_path,
                                                                     monkeypatch):
    """Before this version a state at a growth point held the grown model; rewritten so, the
    run resumes to the same results as a run never stopped (the growth is not applied again)."""
    preset = dataclasses.replace(TINY, seeds=1, recipes=("chain-exact",), questions=())
    quiet = dict(data=dataset_dir, print_fn=lambda line: None, plots=False)
    reference = _strip_timing(json.loads(json.dumps(run_.run_frontier(
        preset, out=tmp_path / "whole", **quiet))))
    (run_id, run), = [(k, r) for k, r in reference["runs"].items() if r["arm"] == "chain-exact"]
    growth_step = run["stages"][1]["start"]
    real = one_run_.save_state

    def killed(path, state):
        real(path, state)
        if path.name.startswith("chain-exact") and state["cursor"] == growth_step:
            raise KeyboardInterrupt("killed")

    out = tmp_path / "killed"
    monkeypatch.setattr(one_run_, "save_state", killed)
    with pytest.raises(KeyboardInterrupt):
        run_.run_frontier(preset, out=out, **quiet)
    (path,) = (out / "state").glob("chain-exact*.pt")
    state = safe_torch_load(path, foreign=False)
    # the state as an earlier version wrote it: the model grown by the same event
    model = one_run_.build_model("tokenformer", TokenFormerConfig(**state["config"]), 0, "cpu")
    model.load_state_dict(state["model"])
    optimizer = rebuild_optimizer(model, state["param_groups"], state["optimizer"], str(path))
    stage = run["stages"][1]["config"]
    grown, optimizer = grow_with_optimizer(
        model, optimizer, new_row_moments=preset.new_row_moments,
        generator=torch.Generator().manual_seed(run["seed"] * 1_000_003 + growth_step),
        qkv=stage["qkv_tokens"], proj=stage["proj_tokens"], ffn=stage["ffn_tokens"],
        recipe="exact")
    state.update(model=grown.state_dict(), optimizer=optimizer.state_dict(),
                 param_groups=group_names(grown, optimizer),
                 config=dataclasses.asdict(grown.config))
    torch.save(state, path)
    monkeypatch.setattr(one_run_, "save_state", real)
    grew = []
    real_grow_at = one_run_.grow_at
    monkeypatch.setattr(one_run_, "grow_at", lambda *a: grew.append(a[1].start) or
                        real_grow_at(*a))
    resumed = _strip_timing(json.loads(json.dumps(run_.run_frontier(preset, out=out, **quiet))))
    assert growth_step not in grew  # not grown again
    # the same run, but for the diagnosis of the growth at the killed point (an earlier
    # version's state carried it half done; the one written here has none)
    later = [d for d in reference["runs"][run_id]["growth_diagnostics"] if d["step"] > growth_step]
    assert later and resumed["runs"][run_id].pop("growth_diagnostics") == later
    assert resumed["runs"][run_id] == {k: v for k, v in reference["runs"][run_id].items()
                                       if k != "growth_diagnostics"}
