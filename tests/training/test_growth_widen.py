"""A Transformer baseline's MLP widening (``widen=zero|net2net``) is a growth like any other: the
same ``grow``/``grow_with_optimizer`` request, the same ``--grow-at`` event in a run (the
frontier's widening arms train through it)."""

from __future__ import annotations

import re

import pytest
import torch

from tokenformer.errors import ConfigError, GrowthError
from tokenformer.models.baselines import TransformerConfig, TransformerLM
from tokenformer.models.config import TokenFormerConfig
from tokenformer.ops.growth import grow, grow_with_optimizer, plan_growth
from tokenformer.training.config import TrainConfig
from tokenformer.training.growth_events import parse_grow_at
from tokenformer.training.loop import fit


def baseline(width: int = 12, arch: str = "transformer++") -> TransformerConfig:
    return TransformerConfig(arch=arch, vocab_size=64, hidden_size=16, num_layers=2,
                             num_heads=2, intermediate_size=width, max_seq_len=16)


def trained(config: TransformerConfig) -> tuple[TransformerLM, torch.optim.AdamW, torch.Tensor]:
    torch.manual_seed(0)
    model = TransformerLM(config).double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt, ids


@pytest.mark.parametrize("how", ["zero", "net2net"])
def test_grow_widens_the_mlp_keeping_the_function_and_old_units(how):
    model, opt, ids = trained(baseline())
    grown, grown_opt = grow_with_optimizer(model, opt, ffn=30, widen=how,
                                           generator=torch.Generator().manual_seed(7))
    assert grown.config.intermediate_size == 30 and model.config.intermediate_size == 12
    with torch.no_grad():  # function preserved (float64)
        torch.testing.assert_close(grown(ids).logits, model(ids).logits, rtol=0, atol=1e-10)
    old_mlp, new_mlp = model.layers[1].mlp, grown.layers[1].mlp
    assert torch.equal(new_mlp.up.weight[:12], old_mlp.up.weight)  # old units first
    if how == "zero":  # new units add nothing: zero outgoing weights
        assert not new_mlp.down.weight[:, 12:].any()
    # grow (no optimizer) draws the same new units from the same generator
    alone = grow(model, ffn=30, widen=how, generator=torch.Generator().manual_seed(7))
    assert torch.equal(alone.layers[1].mlp.up.weight, new_mlp.up.weight)
    # the optimizer over the grown model: down's moments in the leading corner, the rest zero
    moment = grown_opt.state[new_mlp.down.weight]["exp_avg"]
    assert torch.equal(moment[:, :12], opt.state[old_mlp.down.weight]["exp_avg"])
    assert not moment[:, 12:].any()


@pytest.mark.parametrize("arch,how", [("transformer", "zero"), ("transformer", "net2net"),
                                      ("transformer++", "net2net")])
def test_widen_mlp_preserves_function_and_carries_adam(arch, how):
    model, opt, ids = trained(baseline(12, arch))
    gen = torch.Generator().manual_seed(1)
    big, big_opt = grow_with_optimizer(model, opt, ffn=30, widen=how, generator=gen)
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


def test_widen_plans_any_width():
    assert plan_growth(baseline(12), ffn="2.5x", widen="zero").intermediate_size == 30
    assert plan_growth(baseline(12), ffn=13, widen="net2net").intermediate_size == 13


@pytest.mark.parametrize("config, request_, message", [
    (baseline(), {"ffn": 24, "widen": "wide"}, "unknown MLP widening"),
    (baseline(), {"widen": "zero"}, re.escape("the width ffn gives: give it (e.g. ffn=2x)")),
    (baseline(), {"ffn": 24, "hidden": "2x", "widen": "zero"}, "the MLP alone"),
    (baseline(), {"ffn": 24, "layers": 4, "widen": "zero"}, "the MLP alone"),
    (baseline(), {"ffn": 12, "widen": "zero"}, "already has 12 units"),
    (baseline(), {"ffn": 8, "widen": "zero"}, "shrink"),
    (TokenFormerConfig(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, qkv_tokens=8,
                       proj_tokens=8, ffn_tokens=16, max_seq_len=16),
     {"ffn": 32, "widen": "zero"}, "grows by its tokens"),
])
def test_bad_widenings_are_refused_before_any_work(config, request_, message):
    with pytest.raises(GrowthError, match=message):
        plan_growth(config, **request_)


def test_widening_refuses_mean_moments_it_cannot_give():
    model, opt, _ = trained(baseline())
    with pytest.raises(GrowthError, match="moments at zero"):
        grow_with_optimizer(model, opt, ffn=24, widen="zero", new_row_moments="mean")
    # a fresh optimizer has no moments to start: allowed
    grown, _ = grow_with_optimizer(model, opt, ffn=24, widen="zero", new_row_moments="mean",
                                   reset_optimizer=True)
    assert grown.config.intermediate_size == 24


def test_grow_at_parses_widen():
    event = parse_grow_at("5:ffn=30,widen=net2net")
    assert (event.step, event.kwargs) == (5, {"ffn": 30, "widen": "net2net"})
    with pytest.raises(ConfigError, match="unknown widen 'wide'"):
        parse_grow_at("5:ffn=30,widen=wide")


def test_a_run_widens_its_mlp_at_its_grow_at_step_keeping_the_loss():
    torch.manual_seed(0)
    model = TransformerLM(baseline(12))
    ids = torch.randint(0, 64, (4, 16))
    cfg = TrainConfig(arch="transformer++", steps=6, lr=1e-3, warmup_steps=0, batch_size=4,
                      seq_len=16, eval_interval=0, samples=0, device="cpu",
                      grow_at=["3:ffn=20,widen=net2net"])

    def evaluate(m):
        with torch.no_grad():
            return {"val_loss": float(m(ids, labels=ids).loss)}

    result = fit(model, lambda step: {"input_ids": ids, "labels": ids}, cfg, eval_fn=evaluate,
                 progress=False)
    assert result.model.config.intermediate_size == 20
    (record,) = [r for r in result.records if r["type"] == "grow"]
    assert record["step"] == 3 and record["params_after"] > record["params_before"]
    # the widening keeps the function: the loss right before and right after are one number
    assert record["after"]["val_loss"] == pytest.approx(record["before"]["val_loss"], abs=1e-5)


def test_cli_grow_widens_a_baselines_mlp(tmp_path, capsys):
    from tokenformer.cli import main
    from tokenformer.formats.loading import load_model

    torch.manual_seed(0)
    model = TransformerLM(baseline(12))
    model.save(tmp_path / "base")
    assert main(["grow", str(tmp_path / "base"), str(tmp_path / "wide"), "--ffn", "20",
                 "--widen", "net2net", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "mlp 20 by net2net widening" in printed and "mlp 12 -> 20" in printed
    grown = load_model(tmp_path / "wide")
    assert grown.config.intermediate_size == 20
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():  # the function kept (float32 rounding of the split shares)
        torch.testing.assert_close(grown(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    # an unknown widening is refused by the parser, before anything is written
    with pytest.raises(SystemExit) as refused:
        main(["grow", str(tmp_path / "base"), str(tmp_path / "bad"), "--ffn", "20",
              "--widen", "wide"])
    assert refused.value.code == 2 and not (tmp_path / "bad").exists()


def test_a_new_widening_is_one_function_and_one_entry(monkeypatch):
    """The widenings are a table (name → units function): a registered one is a widen= value of
    grow and of --grow-at without any other edit."""
    from tokenformer.ops.growth.widening import WIDENINGS, Widening

    def silent(old, new, generator, init_std):  # new units: zero in and out, so they add nothing
        units = old.up.out_features
        for o, n in [(old.up, new.up)] + ([(old.gate, new.gate)] if old.gate is not None else []):
            n.weight.zero_()
            n.weight[:units] = o.weight
        new.down.weight.zero_()
        new.down.weight[:, :units] = old.down.weight

    monkeypatch.setitem(WIDENINGS, "silent", Widening("silent", silent, "zero new units"))
    assert parse_grow_at("4:ffn=20,widen=silent").kwargs == {"ffn": 20, "widen": "silent"}
    model, _, ids = trained(baseline(12))
    grown = grow(model, ffn=20, widen="silent")
    with torch.no_grad():
        assert torch.equal(grown(ids).logits, model(ids).logits)
    assert not grown.layers[0].mlp.up.weight[12:].any()
