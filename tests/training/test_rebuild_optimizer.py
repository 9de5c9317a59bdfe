"""``rebuild_optimizer``: the one way an AdamW is rebuilt from saved group names and state (resume,
``--init-from``, ``tokenformer grow``, the frontier's states)."""

from __future__ import annotations

import copy

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.errors import CheckpointError
from tokenformer.models.baselines import TransformerConfig, TransformerLM
from tokenformer.training.config import TrainConfig
from tokenformer.training.optim import group_names, make_optimizer, rebuild_optimizer


def trained() -> tuple[TokenFormerLM, torch.optim.AdamW, TrainConfig]:
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig(vocab_size=64, hidden_size=16, num_layers=1,
                                            num_heads=2, qkv_tokens=8, proj_tokens=8,
                                            ffn_tokens=16, max_seq_len=8, eos_token_id=None))
    cfg = TrainConfig(lr=2e-3, weight_decay=0.05, beta2=0.99)
    optimizer = make_optimizer(model, cfg)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer, cfg


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [optimizer.state[p][k] for g in optimizer.param_groups for p in g["params"]
            for k in ("exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("with_cfg", [True, False])
def test_a_rebuilt_optimizer_holds_the_saved_groups_and_moments(with_cfg):
    model, optimizer, cfg = trained()
    rebuilt = rebuild_optimizer(model, group_names(model, optimizer), optimizer.state_dict(),
                                "opt.safetensors", cfg if with_cfg else None)
    assert group_names(model, rebuilt) == group_names(model, optimizer)
    assert [g["weight_decay"] for g in rebuilt.param_groups] == [0.05, 0.0]
    assert [g["betas"] for g in rebuilt.param_groups] == [(0.9, 0.99)] * 2
    assert all(torch.equal(a, b) for a, b in zip(moments(rebuilt), moments(optimizer),
                                                 strict=True))


def test_a_saved_state_that_does_not_fit_is_one_line_naming_the_file():
    model, optimizer, cfg = trained()
    names = group_names(model, optimizer)
    with pytest.raises(CheckpointError, match=r"^opt\.safetensors names parameter 'nope'"):
        rebuild_optimizer(model, [[*names[0], "nope"], names[1]], optimizer.state_dict(),
                          "opt.safetensors")
    state = optimizer.state_dict()
    first = state["param_groups"][0]["params"][0]
    state["state"][first]["exp_avg"] = torch.zeros(3)  # a moment of another shape
    with pytest.raises(CheckpointError, match=r"^opt\.safetensors does not match the model: "
                                              r"its exp_avg of shape \(3,\)"):
        rebuild_optimizer(model, names, state, "opt.safetensors", cfg)


@pytest.mark.parametrize("with_cfg", [True, False])
def test_a_state_saved_by_another_implementation_is_rebuilt_with_this_devices(with_cfg):
    """A state saved by a fused AdamW (as on a GPU) rebuilds into this device's implementation,
    on the CPU torch's default (torch would keep the saved one), as every AdamW made here for
    TokenFormer and the baselines; with the moments and step count, it steps on as the fused
    optimizer does, to fp32 rounding."""
    model, _, cfg = trained()
    baseline = TransformerLM(TransformerConfig(arch="transformer++", hidden_size=16,
                                               num_layers=1, num_heads=2, intermediate_size=8,
                                               max_seq_len=8))
    for made in (make_optimizer(model, cfg), make_optimizer(baseline, cfg)):
        assert {(g["foreach"], g["fused"]) for g in made.param_groups} == {(None, None)}
    fused = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))

    def step(opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step(fused)
    saved = copy.deepcopy(fused.state_dict())  # as read from a file: no tensor shared
    names = [[n for n, _ in model.named_parameters()]]
    if with_cfg:  # a run's two groups, from one group's state: regroup the saved state
        names = [[n for n, p in model.named_parameters() if p.ndim >= 2],
                 [n for n, p in model.named_parameters() if p.ndim < 2]]
        order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
        saved = {"state": saved["state"],
                 "param_groups": [{**saved["param_groups"][0],
                                   "params": [order[n] for n in group]} for group in names]}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rebuilt = rebuild_optimizer(model, names, saved, "opt.safetensors",
                                cfg if with_cfg else None)
    assert {(g["foreach"], g["fused"]) for g in rebuilt.param_groups} == {(None, None)}
    assert all(float(rebuilt.state[p]["step"]) == 1.0 for p in model.parameters())
    step(fused)  # the fused optimizer's own next step, from the same weights
    after_fused = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
    step(rebuilt)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), after_fused[n], rtol=1e-5, atol=1e-7, msg=n)
