"""Frontier chains with old-token options (issue 24): ``RECIPE:freeze_old=..,noise_old=..``, the
default arms unchanged, and a chain whose old tokens stay frozen across its saved states."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenformer.errors import ConfigError
from tokenformer.experiments.frontier import plan as plan_
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier.plan import PRESETS, chain_spec, get_preset


def test_chain_specs_and_the_unchanged_default_arms():
    # the arms every preset has run so far (their names, hence their saved results, stay valid)
    assert PRESETS["full"].chains == ("exact", "paper", "official", "exact-anneal")
    assert chain_spec("official") == ("official", {})
    assert chain_spec("exact-anneal:freeze_old=forever,noise_old=1e-3") == (
        "exact-anneal", {"freeze_old": "forever", "noise_old": 0.001})
    preset = get_preset("quick", chains=("official-init:freeze_old=200",))
    arms = {r.arm for r in plan_.plan(preset, 256)}
    assert "chain-official-init:freeze_old=200" in arms


@pytest.mark.parametrize("chain, message", [
    ("official-released", "restarts the LR schedule"),
    ("exact:freeze_old=soon", "freeze_old='soon' must be a number of steps or forever"),
    ("exact:lr=1e-3", "is malformed"),
    ("exactly", "unknown chain 'exactly'"),
])
def test_bad_chains_are_refused(chain, message):
    with pytest.raises(ConfigError, match=message):
        get_preset("quick", chains=(chain,))


def test_a_chain_with_frozen_old_tokens_keeps_them_across_its_states(dataset_dir, tmp_path,
                                                                     monkeypatch):
    gpu = PRESETS["full"]
    preset = dataclasses.replace(
        gpu, name="frozen", hidden_size=16, num_layers=1, num_heads=2, base_tokens=(8, 8, 16),
        num_sizes=2, seq_len=16, batch_size=2, seeds=1, families=("tokenformer",),
        chains=("exact:freeze_old=forever,noise_old=0.05",), widenings=(),
        growth_fractions=(0.5,), min_steps=4, sweep_steps=4, warmup_steps=1, anneal_steps=1,
        eval_batches=1, num_budgets=2, lr_grid=(1e-3, 2e-3, 4e-3, 8e-3), max_extensions=0)
    per_step = plan_.chain_stages(preset, plan_.model_configs(preset, "tokenformer", 256))[
        0].flops_per_step
    preset = dataclasses.replace(preset, max_budget=16 * per_step)
    states, real = [], run_._checkpoint

    def keep(path, state):
        if path.name.startswith("chain-"):  # the model's tensors as they are now
            states.append({"frozen_rows": state.get("frozen_rows"),
                           "model": {k: v.clone() for k, v in state["model"].items()}})
        real(path, state)

    monkeypatch.setattr(run_, "_checkpoint", keep)
    results = run_.run_frontier(preset, data=dataset_dir, out=tmp_path / "out",
                                print_fn=lambda line: None, plots=False)
    assert "chain-exact:freeze_old=forever,noise_old=0.05/seed0" in results["runs"]
    grown = [s for s in states if s.get("frozen_rows")]
    assert len(grown) >= 2, "the chain saved fewer than two states after its growth"
    rows = grown[0]["frozen_rows"]["rows"]
    assert grown[0]["frozen_rows"]["until"] is None and rows
    for name, n in rows.items():  # bitwise the same rows in every later state
        first = grown[0]["model"][name][:n]
        assert all(torch.equal(s["model"][name][:n], first) for s in grown[1:]), name
        assert not torch.equal(grown[-1]["model"][name][n:], grown[0]["model"][name][n:])
