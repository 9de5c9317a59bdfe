"""Pruning a Transformer baseline's MLP neurons (weight magnitude or activation): the control.

What the sparse study sets against pruning TokenFormer parameter tokens (:func:`tokenformer.prune`)
at the same fractions.
"""

from __future__ import annotations

import dataclasses

import torch


@torch.no_grad()
def mlp_activations(model: torch.nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per block, the mean |h_i| over the rows of ``ids`` of each MLP hidden unit h (the input
    of ``down``: act(gate)·up for SwiGLU)."""
    out: list[torch.Tensor] = [None] * len(model.layers)
    hooks = [block.mlp.down.register_forward_hook(
        lambda _m, args, _o, i=i: out.__setitem__(i, args[0].detach().float().abs()
                                                 .reshape(-1, args[0].shape[-1]).mean(0)))
        for i, block in enumerate(model.layers)]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out


@torch.no_grad()
def prune_mlp(model: torch.nn.Module, width: int, by: str = "magnitude",
              calibration: torch.Tensor | None = None) -> torch.nn.Module:
    """A Transformer baseline with every MLP cut to its ``width`` most important neurons.
    ``magnitude``: neuron i scores ‖up_i‖·‖down_:,i‖ (× ‖gate_i‖ for SwiGLU), the usual weight
    criterion; ``activation``: mean_x |h_i(x)| · ‖down_:,i‖ over ``calibration`` ids, the
    average size of the neuron's output term (the analogue of TokenFormer's ``contribution``)."""
    new = type(model)(dataclasses.replace(model.config, intermediate_size=width))
    state = model.state_dict()
    acts = mlp_activations(model, calibration) if by == "activation" else None
    for i, block in enumerate(model.layers):
        mlp, p = block.mlp, f"layers.{i}.mlp."
        if by == "activation":
            score = acts[i] * mlp.down.weight.norm(dim=0)
        else:
            score = mlp.up.weight.norm(dim=1) * mlp.down.weight.norm(dim=0)
            if mlp.gate is not None:
                score = score * mlp.gate.weight.norm(dim=1)
        keep = score.topk(width).indices.sort().values
        for name in ("up", "gate"):
            for leaf in ("weight", "bias"):
                if f"{p}{name}.{leaf}" in state:
                    state[f"{p}{name}.{leaf}"] = state[f"{p}{name}.{leaf}"][keep]
        state[f"{p}down.weight"] = state[f"{p}down.weight"][:, keep]
    new.load_state_dict(state, strict=True)
    return new.eval()
