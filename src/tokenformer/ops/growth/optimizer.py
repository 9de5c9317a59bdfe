"""The optimizer across a growth: an optimizer of the same class over the grown model, its
param groups and per-parameter state carried over (or fresh); the one place an optimizer is
carried to another model (:func:`copy_optimizer`: to a same-shaped copy)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ...errors import GrowthError
from .surgery import Growth
from .tokens import with_rows

NEW_ROW_MOMENTS: tuple[str, ...] = ("zero", "mean")


def carry_optimizer(old_model: nn.Module, optimizer: torch.optim.Optimizer, growth: Growth,
                    reset: bool, copy: bool = True, new_row_moments: str = "zero"
                    ) -> torch.optim.Optimizer:
    """``optimizer`` (of ``old_model``) rebuilt over ``growth.model``; the rules are in
    :func:`~tokenformer.ops.growth.grow_with_optimizer`'s docstring."""
    old_names = {id(p): n for n, p in old_model.named_parameters()}
    group_of: dict[str, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in old_names:
                raise GrowthError("the optimizer holds a parameter that is not in the model; "
                                  "pass the optimizer that trains this model")
            group_of[old_names[id(p)]] = g
    new_params = dict(growth.model.named_parameters())
    members: list[list[str]] = [[] for _ in optimizer.param_groups]
    for name in new_params:
        old = growth.source[name]
        if old in group_of:  # parameters the old optimizer did not train stay out of it
            members[group_of[old]].append(name)
    groups = []
    for group, names in zip(optimizer.param_groups, members, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        if "param_names" in hyper:
            hyper["param_names"] = list(names)
        groups.append({**hyper, "params": [new_params[n] for n in names]})
    # The optimizer's own constructor arguments (its defaults may hold more keys than it takes).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    new_opt = type(optimizer)(groups, **kwargs)
    if reset:
        return new_opt
    old_params = dict(old_model.named_parameters())
    for name, names_param in new_params.items():
        old_param = old_params.get(growth.source[name])
        if old_param is None or old_param not in optimizer.state:
            continue
        is_new = name in growth.inserted
        state = {}
        for key, value in optimizer.state[old_param].items():
            if torch.is_tensor(value) and value.shape == old_param.shape and growth.carry:
                state[key] = growth.carry(name, key, value)
            elif torch.is_tensor(value) and value.shape == old_param.shape:
                state[key] = (torch.zeros_like(names_param, dtype=value.dtype) if is_new
                              else with_rows(value, names_param.shape[0], copy))
                if (new_row_moments == "mean" and key == "exp_avg_sq" and not is_new
                        and names_param.shape[0] > value.shape[0]):
                    state[key][value.shape[0]:] = value.mean(dim=0, keepdim=True)
            else:
                state[key] = value.clone() if torch.is_tensor(value) else value
        new_opt.state[names_param] = state
    return new_opt


def copy_optimizer(old_model: nn.Module, optimizer: torch.optim.Optimizer, new_model: nn.Module
                   ) -> torch.optim.Optimizer:
    """An independent copy of ``optimizer`` over ``new_model``, a same-shaped copy of
    ``old_model`` (e.g. ``copy.deepcopy``): the frontier's cooldown branches. The carry of a
    growth that grows nothing."""
    params = [name for name, _ in new_model.named_parameters()]
    return carry_optimizer(old_model, optimizer, Growth(new_model, {n: n for n in params}, set()),
                           reset=False, copy=True)
