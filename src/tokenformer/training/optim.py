"""The optimizer: AdamW over two parameter groups, decayed (>= 2-D: embeddings, parameter tokens,
Linear weights) and not decayed (norms, biases), rebuilt by parameter name from disk
(:func:`rebuild_optimizer`: a run's checkpoint, ``tokenformer grow``'s input, a frontier state).

Every AdamW made here runs the implementation chosen for its parameters' device
(:func:`implementation`): torch's fused kernel on CUDA, torch's default elsewhere. The choice
belongs to the device, not to the saved state: loading a state keeps it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..io.training_state import apply_optimizer_state

if TYPE_CHECKING:
    from .config import TrainConfig


# AdamW's param-group keys that name an implementation of the same update (the device's choice)
IMPLEMENTATION_KEYS = ("fused", "foreach")


def implementation(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """AdamW's implementation for ``params``, the same for every model: ``fused`` (one kernel
    per device and dtype for the whole update) where they are all floating-point CUDA tensors;
    else torch's default (on the CPU its per-tensor loop). torch's fused CPU kernel measured 3-7x
    faster than that loop, but it is ≈ 1 % of a CPU training step and rounds differently, which
    would end the bit-for-bit reruns of the documented CPU experiments (docs/performance.md,
    "The training step")."""
    params = list(params)
    if params and all(p.device.type == "cuda" and p.is_floating_point() for p in params):
        return {"fused": True}
    return {}


def _keep_implementation(optimizer: torch.optim.Optimizer, state: dict[str, Any]
                         ) -> dict[str, Any]:
    """A ``load_state_dict`` pre-hook: the saved groups take this optimizer's implementation
    (torch would otherwise take the saved one's, chosen for the device it was saved on), so
    torch places each ``step`` counter where that implementation wants it."""
    saved = state.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(optimizer.param_groups):
        return state  # load_state_dict says what is wrong
    groups = [{**group, **{k: own[k] for k in IMPLEMENTATION_KEYS if k in own}}
              for group, own in zip(saved, optimizer.param_groups, strict=True)]
    return {**state, "param_groups": groups}


def adamw(groups: list[dict[str, Any]], **hyper: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(groups, **hyper)`` with :func:`implementation`'s choice, kept when a
    saved state is loaded into it."""
    optimizer = torch.optim.AdamW(groups, **hyper, **implementation(
        p for group in groups for p in group["params"]))
    optimizer.register_load_state_dict_pre_hook(_keep_implementation)
    return optimizer


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
    """AdamW (:func:`adamw`) with ``cfg``'s betas, eps and weight decay over
    :func:`param_groups`."""
    return adamw(param_groups(model, cfg.weight_decay, names), lr=cfg.lr,
                 betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each param group, in order (what a checkpoint saves to rebuild
    :func:`param_groups` on resume)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def rebuild_optimizer(model: nn.Module, names: Sequence[Sequence[str]] | None,
                      state: dict[str, Any], file: str | Path,
                      cfg: TrainConfig | None = None) -> torch.optim.AdamW:
    """The one way an optimizer is rebuilt from disk: AdamW (:func:`adamw`) over ``model``'s
    parameters grouped by the saved parameter ``names`` (one list per param group, in order),
    holding the saved ``state`` (an optimizer state dict) checked against the parameters
    (:func:`tokenformer.io.training_state.apply_optimizer_state`). ``file`` names the saved state in
    errors.

    With ``cfg``: a training run's two groups (:func:`make_optimizer`; ``names`` None: the
    model's own split). Without: any number of groups, every hyper-parameter from ``state``
    (Adam and AdamW share the state format; ``decoupled_weight_decay`` comes from the file too)
    but the implementation, which is this device's (:func:`implementation`).
    """
    if cfg is not None:
        optimizer = make_optimizer(model, cfg, names)
    else:
        if names is None:
            raise ValueError("rebuild_optimizer without cfg needs the saved group names")
        params = dict(model.named_parameters())
        unknown = [n for group in names for n in group if n not in params]
        if unknown:
            raise CheckpointError(f"{file} names parameter {unknown[0]!r}, which the model does "
                                  f"not have")
        optimizer = adamw([{"params": [params[n] for n in group]} for group in names])
    apply_optimizer_state(optimizer, state, file)
    return optimizer
