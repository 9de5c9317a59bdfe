"""Frontier arms with old-token options (issue 24): a :class:`GrowingArm` carries ``freeze_old`` /
``noise_old``, the presets' arms are unchanged, and a chain whose old tokens stay frozen keeps
them bitwise across its saved states."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_frontier import TINY  # rootdir-relative, as the other test folders import helpers

from tokenformer.errors import ConfigError
from tokenformer.experiments.frontier import one_run as one_run_
from tokenformer.experiments.frontier import run as run_
from tokenformer.experiments.frontier.arms import GROWING_ARMS, GrowingArm
from tokenformer.experiments.frontier.presets import PRESETS, get_preset
from tokenformer.training.freezing import FrozenRows


def test_old_token_arms_carry_their_options_and_the_presets_arms_are_unchanged():
    assert GROWING_ARMS["chain-exact-frozen"].freeze_old == "forever"
    assert GROWING_ARMS["chain-exact-noised"].noise_old == 0.01
    for preset in PRESETS.values():  # no preset trains them until a question asks
        assert not any(GROWING_ARMS[arm].freeze_old is not None or GROWING_ARMS[arm].noise_old
                       for arm in preset.recipes)
    chosen = get_preset("quick", recipes=("chain-exact-frozen",), questions=()).recipes
    assert chosen == ("chain-exact-frozen",)


@pytest.mark.parametrize("recipe, message", [
    (GrowingArm("stack-frozen", "tokenformer", "chain", "stack", shape="stack", freeze_old=5),
     "a growth of tokens keeps"),
    (GrowingArm("widen-frozen", "transformer++", "widen", "zero", freeze_old=5),
     "a growth of tokens keeps"),
    (GrowingArm("chain-clone", "tokenformer", "chain", "duplicate", shape="clone"),
     "Transformer\\+\\+ arm here"),
    (GrowingArm("chain-final", "tokenformer", "chain", "paper", lr_policy="final"),
     "LR policy 'final' is not available"),
])
def test_bad_old_token_arms_are_refused(monkeypatch, recipe, message):
    monkeypatch.setitem(GROWING_ARMS, recipe.arm, recipe)
    with pytest.raises(ConfigError, match=message):
        get_preset("full-v4", recipes=(recipe.arm,), questions=())


def test_a_chain_with_frozen_old_tokens_keeps_them_across_its_states(dataset_dir, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setitem(GROWING_ARMS, "chain-frozen-noised", GrowingArm(
        "chain-frozen-noised", "tokenformer", "chain", "exact", freeze_old="forever",
        noise_old=0.05))
    preset = dataclasses.replace(TINY, name="frozen", seeds=1, families=("tokenformer",),
                                 recipes=("chain-frozen-noised",), questions=())
    states, real = [], one_run_.save_state

    def keep(path, state):
        if path.name.startswith("chain-"):  # the model's tensors as they are now
            states.append({"frozen_rows": state.get("frozen_rows"),
                           "model": {k: v.clone() for k, v in state["model"].items()}})
        real(path, state)

    real_fit = one_run_.fit

    def fit(*args, callbacks=(), **kwargs):  # the model right after a growth, as fit grew it
        def at_growth(record, model):
            if record["type"] == "grow":
                freeze = FrozenRows.after_growth(model, record["step"])
                states.append({"frozen_rows": freeze.to_state(), "model": {
                    k: v.detach().clone() for k, v in model.state_dict().items()}})
        return real_fit(*args, callbacks=[*callbacks, at_growth], **kwargs)

    monkeypatch.setattr(one_run_, "save_state", keep)
    monkeypatch.setattr(one_run_, "fit", fit)
    results = run_.run_frontier(preset, data=dataset_dir, out=tmp_path / "out",
                                print_fn=lambda line: None, plots=False)
    assert "chain-frozen-noised/seed0" in results["runs"]
    # the model at the last growth and the states after it (an earlier growth's rows are
    # noised again by the next)
    grown = [s for s in states if s.get("frozen_rows")]
    grown = [s for s in grown if s["frozen_rows"] == grown[-1]["frozen_rows"]]
    assert len(grown) >= 2, "the chain saved fewer than two states after its growth"
    rows = grown[0]["frozen_rows"]["rows"]
    assert grown[0]["frozen_rows"]["until"] is None and rows
    for name, n in rows.items():  # bitwise the same rows in every later state
        first = grown[0]["model"][name][:n]
        assert all(torch.equal(s["model"][name][:n], first) for s in grown[1:]), name
        assert not torch.equal(grown[-1]["model"][name][n:], grown[0]["model"][name][n:])
