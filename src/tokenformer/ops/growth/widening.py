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
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ...errors import GrowthError
from ...registry import TEXT_RULE, Registry, function_rule
from .surgery import Growth

# One MLP's new units: widen(old mlp, new mlp, generator, init_std) fills the new MLP's weights
# (old units first in every widened dimension, the function kept); the rest is shared.
UnitsFn = Callable[[nn.Module, nn.Module, "torch.Generator | None", float], None]


@dataclass(frozen=True)
class Widening:
    """One way to widen a Transformer baseline's MLP to any width: ``units`` fills each MLP;
    ``what`` says what it does (``grow --widen``'s help)."""

    name: str
    units: UnitsFn
    what: str


def _incoming(old: nn.Module, new: nn.Module) -> list[tuple[nn.Linear, nn.Linear]]:
    """The (old, new) Linears that produce the units (up, and gate when gated)."""
    pairs = [(old.up, new.up)]
    if old.gate is not None:
        pairs.append((old.gate, new.gate))
    return pairs


def zero_units(old: nn.Module, new: nn.Module, generator: torch.Generator | None,
               init_std: float) -> None:
    """New units with random incoming weights (the model's init) and zero outgoing weights."""
    units, width = old.up.out_features, new.up.out_features
    for o, n in _incoming(old, new):
        fresh = torch.randn(width - units, o.in_features, generator=generator).to(o.weight)
        n.weight.copy_(torch.cat([o.weight, fresh * init_std]))
        if o.bias is not None:
            n.bias.copy_(torch.cat([o.bias, o.bias.new_zeros(width - units)]))
    down = old.down.weight
    new.down.weight.copy_(torch.cat([down, down.new_zeros(down.shape[0], width - units)], dim=1))


def net2net_units(old: nn.Module, new: nn.Module, generator: torch.Generator | None,
                  init_std: float) -> None:
    """Each new unit copies the incoming weights (and bias) of a random old unit; the outgoing
    weights of a unit and its copies are split between them in random shares summing to one
    (equal ±10 %), so the sum is unchanged while the copies see different gradients."""
    units, width = old.up.out_features, new.up.out_features
    src = torch.cat([torch.arange(units),
                     torch.randint(0, units, (width - units,), generator=generator)])
    for o, n in _incoming(old, new):
        n.weight.copy_(o.weight[src])
        if o.bias is not None:
            n.bias.copy_(o.bias[src])
    # float64, so that the shares of one unit sum to 1 to the model's precision
    share = 1 + 0.1 * (2 * torch.rand(width, generator=generator, dtype=torch.float64) - 1)
    share = share / share.new_zeros(units).index_add_(0, src, share)[src]
    new.down.weight.copy_(old.down.weight[:, src] * share.to(old.down.weight))


# A Transformer baseline's MLP growth (ffn=), by widen=: "duplicate" copies every unit a whole
# number of times (HyperCloning, tokenformer.ops.cloning: the rule hidden= follows too); the
# others are the table's function-preserving widenings to any width, the MLP alone (the
# frontier's widening arms).
DUPLICATE = "duplicate"

# The MLP widenings, name → Widening (grow's widen=, beside its "duplicate"): a new one is one
# units function and one line here, or, from outside the package, register_widening.
WIDENINGS: dict[str, Widening] = {w.name: w for w in (
    Widening("zero", zero_units, "new units with zero outgoing weights (any width)"),
    Widening("net2net", net2net_units,
             "new units copy random old ones, outgoing weights split (Net2Net; any width)"),
)}
_REGISTRY = Registry("MLP widening", WIDENINGS, Widening, GrowthError, fields={
    "units": function_rule("(old mlp, new mlp, generator, init_std) -> None, filling the new "
                           "MLP's weights"),
    "what": TEXT_RULE,
}, built_in=tuple(WIDENINGS), reserved={DUPLICATE: "grow's widening by duplication"},
    article="an")


def register_widening(widening: Widening) -> Widening:
    """Add ``widening`` to :data:`WIDENINGS`: ``grow(widen=name)``, ``--grow-at ...,widen=name``
    and ``tokenformer grow --widen name`` accept it from then on; returns it. GrowthError,
    naming the problem, for a name that is taken (``duplicate`` included) or no name
    (:data:`tokenformer.registry.NAME_TEXT`), units that are no function or an empty ``what``.
    :func:`unregister_widening` takes it out again."""
    _REGISTRY.add(widening.name if isinstance(widening, Widening) else None, widening)
    return widening


def unregister_widening(name: str) -> None:
    """Remove the widening ``name`` (registered by :func:`register_widening`)."""
    _REGISTRY.remove(name)


def mlp_widening(model: nn.Module, width: int, how: str, generator: torch.Generator | None
                 ) -> Growth:
    """Every MLP of a Transformer baseline widened to ``width`` units by the widening ``how``
    (:data:`WIDENINGS`), preserving its function; ``width`` and ``how`` were checked by
    :func:`~tokenformer.ops.growth.plan.plan_growth`. Old units come first in every widened
    dimension, so an optimizer state tensor carries over into the leading corner of a zero
    tensor of the new shape (the :class:`Growth`'s ``carry``)."""
    config = model.config
    param = next(model.parameters())
    new = type(model)(dataclasses.replace(config, intermediate_size=width)).to(param)
    new.load_state_dict({k: v for k, v in model.state_dict().items()
                         if "mlp." not in k}, strict=False)
    with torch.no_grad():
        for block, grown in zip(model.layers, new.layers, strict=True):
            WIDENINGS[how].units(block.mlp, grown.mlp, generator, config.init_std)
            if block.mlp.down.bias is not None:
                grown.mlp.down.bias.copy_(block.mlp.down.bias)
    params = dict(new.named_parameters())

    def carry(name: str, key: str, value: torch.Tensor) -> torch.Tensor:
        grown = value.new_zeros(params[name].shape)
        grown[tuple(slice(0, n) for n in value.shape)] = value
        return grown

    return Growth(new, {name: name for name in params}, set(), carry)
