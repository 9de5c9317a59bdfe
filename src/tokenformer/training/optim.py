"""The optimizer: AdamW over two parameter groups, decayed (>= 2-D: embeddings, parameter tokens,
Linear weights) and not decayed (norms, biases), rebuilt by parameter name on resume."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CheckpointError

if TYPE_CHECKING:
    from .config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float,
                 names: Sequence[Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """AdamW groups: ``decay`` (>= 2-D: embeddings, parameter tokens, Linear weights) and
    ``no_decay`` (norms, biases). ``names`` rebuilds saved groups in their saved order."""
    params = dict(model.named_parameters())
    if names is None:
        decay = [n for n, p in params.items() if p.requires_grad and p.ndim >= 2]
        no_decay = [n for n, p in params.items() if p.requires_grad and p.ndim < 2]
        names = [decay, no_decay]
    if len(names) != 2:
        raise CheckpointError(f"expected 2 optimizer param groups, the checkpoint has "
                              f"{len(names)}")
    missing = [n for group in names for n in group if n not in params]
    if missing:
        raise CheckpointError(f"the optimizer state names parameter {missing[0]!r}, which the "
                              f"model does not have")
    return [{"params": [params[n] for n in names[0]], "weight_decay": weight_decay,
             "name": "decay"},
            {"params": [params[n] for n in names[1]], "weight_decay": 0.0, "name": "no_decay"}]


def make_optimizer(model: nn.Module, cfg: TrainConfig,
                   names: Sequence[Sequence[str]] | None = None) -> torch.optim.AdamW:
    """AdamW with ``cfg``'s betas, eps and weight decay over :func:`param_groups`."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, names), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each param group, in order (what a checkpoint saves to rebuild
    :func:`param_groups` on resume)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]
