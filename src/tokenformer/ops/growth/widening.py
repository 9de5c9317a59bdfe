"""Growing a Transformer baseline by widening its MLP (``widen="zero"|"net2net"`` with ``ffn=``),
the function-preserving counterpart of TokenFormer's parameter-token growth for
:mod:`tokenformer.models.baselines`: one stage of :func:`~tokenformer.ops.growth.grow`, its
optimizer carried by :func:`~tokenformer.ops.growth.optimizer.carry_optimizer` like every stage's.

``zero``: new units with the model's init on their incoming weights and zero outgoing weights;
``net2net``: new units copy random old units and the outgoing weights of each unit and its copies
are split between them. Both keep the function exactly; the AdamW state of the old units is
carried, the new units' is zero (as growth does for new parameter tokens).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...errors import GrowthError
from .surgery import Growth

# name → what it does (grow's widen=, beside its "duplicate")
WIDENINGS = {"zero": "new units with zero outgoing weights (any width)",
             "net2net": "new units copy random old ones, outgoing weights split (Net2Net; any "
                        "width)"}


def mlp_widening(model: nn.Module, width: int, how: str, generator: torch.Generator | None
              ) -> Growth:
    """Every MLP of a Transformer baseline widened to ``width`` units, preserving its function.

    ``zero``: new units get random incoming weights (the model's init) and zero outgoing
    weights. ``net2net``: each new unit copies the incoming weights (and bias) of a random old
    unit; the outgoing weights of a unit and its copies are split between them in random
    proportions summing to one (equal shares ±10 %), so the sum is unchanged while the copies see
    different gradients and can diverge. Old units come first in every widened dimension, so an
    optimizer state tensor carries over into the leading corner of a zero tensor of the new
    shape (the :class:`Growth`'s ``carry``).
    """
    config = model.config
    old = config.intermediate_size
    if width <= old:
        raise GrowthError(f"cannot widen an MLP of {old} units to {width}")
    if how not in WIDENINGS:
        raise GrowthError(f"unknown MLP widening {how!r}; choose one of {', '.join(WIDENINGS)}")
    param = next(model.parameters())
    new = type(model)(dataclasses.replace(config, intermediate_size=width)).to(param)
    new.load_state_dict({k: v for k, v in model.state_dict().items()
                         if "mlp." not in k}, strict=False)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(param)

    with torch.no_grad():
        for block, grown in zip(model.layers, new.layers, strict=True):
            incoming = [(block.mlp.up, grown.mlp.up)]
            if block.mlp.gate is not None:
                incoming.append((block.mlp.gate, grown.mlp.gate))
            if how == "zero":
                src = torch.arange(old)
                for o, n in incoming:
                    n.weight.copy_(torch.cat([o.weight, randn(width - old, o.in_features)
                                              * config.init_std]))
                    if o.bias is not None:
                        n.bias.copy_(torch.cat([o.bias, o.bias.new_zeros(width - old)]))
                down = torch.cat([block.mlp.down.weight,
                                  block.mlp.down.weight.new_zeros(config.hidden_size,
                                                                  width - old)], dim=1)
            else:
                src = torch.cat([torch.arange(old),
                                 torch.randint(0, old, (width - old,), generator=generator)])
                for o, n in incoming:
                    n.weight.copy_(o.weight[src])
                    if o.bias is not None:
                        n.bias.copy_(o.bias[src])
                # float64, so that the shares of one unit sum to 1 to the model's precision
                share = 1 + 0.1 * (2 * torch.rand(width, generator=generator,
                                                  dtype=torch.float64) - 1)
                share = share / share.new_zeros(old).index_add_(0, src, share)[src]
                down = block.mlp.down.weight[:, src] * share.to(param)
            grown.mlp.down.weight.copy_(down)
            if block.mlp.down.bias is not None:
                grown.mlp.down.bias.copy_(block.mlp.down.bias)
    params = dict(new.named_parameters())

    def carry(name: str, key: str, value: torch.Tensor) -> torch.Tensor:
        grown = value.new_zeros(params[name].shape)
        grown[tuple(slice(0, n) for n in value.shape)] = value
        return grown

    return Growth(new, {name: name for name in params}, set(), carry)
