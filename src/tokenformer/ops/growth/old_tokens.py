"""The old tokens a growth keeps: which rows of the grown model's parameter tokens existed
before it (:class:`OldTokens`, recorded on the grown model), ``noise_old`` on them, and
``freeze_old`` recorded for the trainer (:mod:`tokenformer.training.freezing`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import GrowthError
from .surgery import Growth

TOKEN_TENSORS = ("key_param_tokens", "value_param_tokens")


@dataclass(frozen=True)
class OldTokens:
    """What a growth kept: the first ``rows[name]`` rows of the grown model's parameter-token
    tensor ``name`` existed before it (same tensor, same rows, same width; not an inserted
    block), and the ``freeze`` asked for: None, a number of steps, or
    :data:`~tokenformer.ops.growth.options.FOREVER`."""

    rows: dict[str, int]
    freeze: int | str | None = None


def old_tokens(model: nn.Module) -> OldTokens | None:
    """The :class:`OldTokens` :func:`~tokenformer.ops.growth.grow` recorded on the model it
    returned (None otherwise)."""
    return getattr(model, "_old_tokens", None)


def record_old_tokens(model: nn.Module, growth: Growth, freeze: int | str | None,
                      noise: float, generator: torch.Generator | None) -> None:
    """Record on the grown model which rows of its parameter tokens ``model`` had (and noise
    them): the rows a growth of tokens or identity blocks kept, for ``freeze_old``/``noise_old``
    (checked by :func:`~.options.freeze_request` and :func:`~.options.noise_level` before the
    growth ran)."""
    old_params = dict(model.named_parameters())
    rows = {}
    for name, param in growth.model.named_parameters():
        old = old_params.get(growth.source.get(name, ""))
        if (name.rpartition(".")[2] in TOKEN_TENSORS and name not in growth.inserted
                and old is not None and old.shape[1:] == param.shape[1:]):
            rows[name] = min(old.shape[0], param.shape[0])
    if (freeze is not None or noise) and not rows:
        raise GrowthError("freeze_old and noise_old act on the parameter tokens a growth keeps; "
                          "this growth keeps none (no token tensor kept its width)")
    if noise:
        _noise_old_rows(growth.model, rows, noise, generator)
    growth.model._old_tokens = OldTokens(rows, freeze)


@torch.no_grad()
def _noise_old_rows(model: nn.Module, rows: dict[str, int], noise: float,
                    generator: torch.Generator | None) -> None:
    """Add N(0, (noise·rms)²) to the old rows of each tensor (rms over those rows). Out of place:
    with ``copy=False`` a tensor that did not grow is the input model's own."""
    params = dict(model.named_parameters())
    for name, n in rows.items():
        param = params[name]
        old = param.detach()[:n]
        rms = float(old.double().pow(2).mean().sqrt())
        if rms == 0:
            continue
        delta = torch.empty(old.shape).normal_(0.0, noise * rms, generator=generator)
        new = param.detach().clone()
        new[:n] += delta.to(new)
        param.data = new
