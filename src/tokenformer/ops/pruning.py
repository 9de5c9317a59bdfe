"""Pruning: shrink a TokenFormer by removing parameter tokens, the inverse of
:func:`~tokenformer.ops.growth.grow`.

Each Pattention keeps its ``n_new`` most important tokens (in their original order) and drops the
rest; every layer of a kind (Q/K/V, proj, FFN) ends with the same count, the config's. Importance
(``by``), per token j of one Pattention, over the rows x of a calibration batch:

``contribution`` (default)
    mean_x |Θ(x·Kᵀ)_j| · ‖v_j‖: the average size of the token's term Θ_j·v_j in the output, the
    quantity whose removal the output feels.
``mass``
    mean_x |Θ(x·Kᵀ)_j|: how much weight the token receives, whatever its value.
``value``
    ‖v_j‖ (needs no calibration data).
``newest``
    the highest indices go first: undoes growth, which appends tokens (``grow`` then
    ``prune(by="newest")`` to the old counts with ``scale="hold"`` restores the model exactly for
    the ``exact`` recipe's L2/L1 variants).

Θ's factor (``scale``): ``hold`` keeps the layer's factor (what undoes exact growth); ``follow``
resets it to the default for the new n (√n or n); ``renorm`` multiplies it by the mean over the
calibration rows of (Θ's normaliser over the kept tokens) / (over all tokens), so the kept tokens'
pre-activations keep their average size when the dropped scores leave the norm. Held and renormed
factors are written to ``config.*_scale`` so save/load reproduces them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GrowthError
from ..nn.pattention import KINDS, Pattention, default_scale, pattention_kind, theta
from ..nn.theta import theta_variant
from .growth import rebuild, refuse_product_ffn, size_request

PRUNE_BY: tuple[str, ...] = ("contribution", "mass", "value", "newest")
SCALES: tuple[str, ...] = ("hold", "follow", "renorm")


def prune_size(spec: int | str | None, current: int, what: str) -> int:
    """The new count for ``what``: ``None`` keeps ``current``; an int or "384" is absolute;
    "0.5x" multiplies ``current`` (rounded to a whole number). Never larger, at least 1."""
    if spec is None:
        return current
    request = size_request(spec, current)
    if request is None:
        raise GrowthError(f"{what}: malformed size {spec!r}; give a count like 192 or a "
                          f"multiplier like '0.5x'")
    new = round(request)
    if not 1 <= new <= current:
        raise GrowthError(f"{what}: cannot prune from {current} to {new}; pruning keeps between "
                          f"1 and {current} tokens (grow adds tokens)")
    return new


def prune_sizes(config: Any, qkv: int | str | None = None, proj: int | str | None = None,
                ffn: int | str | None = None) -> dict[str, int]:
    """The new token count per kind (``qkv``/``proj``/``ffn``, as :func:`prune`), every request
    refused here, from the config alone (before any calibration data is loaded): a model without
    Pattention tokens, a size out of range, a product-key FFN resized."""
    if not hasattr(config, "qkv_tokens"):
        arch = getattr(config, "arch", type(config).__name__)
        raise GrowthError(f"prune removes Pattention parameter tokens; a {arch} model has none")
    sizes = {kind: prune_size(spec, getattr(config, f"{kind}_tokens"), f"{kind} tokens")
             for kind, spec in zip(KINDS, (qkv, proj, ffn), strict=True)}
    refuse_product_ffn(config, sizes["ffn"], "prune")
    return sizes


def needs_calibration(by: str, scale: str, importance: object = None) -> bool:
    """Whether :func:`prune` needs calibration input ids: importance by ``contribution``/``mass``
    (unless a custom ``importance`` replaces it), or ``scale="renorm"``."""
    return (importance is None and by in ("contribution", "mass")) or scale == "renorm"


def _normaliser(scores: torch.Tensor, norm: str) -> torch.Tensor:
    """Θ's per-row normaliser of ``scores`` [rows, m] (what :func:`theta` divides by): its
    ``normaliser`` in :data:`tokenformer.nn.theta.THETAS`; ones for a Θ without one (plain
    ``gelu``): pruning then changes no kept token's weight."""
    normaliser = theta_variant(norm).normaliser
    if normaliser is None:
        return torch.ones(scores.shape[:-1], dtype=scores.dtype, device=scores.device)
    return normaliser(scores)


@torch.no_grad()
def calibrate(model: nn.Module, input_ids: torch.Tensor, keep_scores: bool = False
              ) -> dict[str, dict[str, Any]]:
    """Run ``input_ids`` [B, T] through ``model`` and return, per Pattention name, the mean
    |Θ| per token (``mass``, [n]) and, with ``keep_scores`` (for ``scale="renorm"``; rows × n
    floats per Pattention), the calibration rows' scores (``scores``, float32)."""
    stats: dict[str, dict[str, Any]] = {}
    hooks = []
    for name, module in model.named_modules():
        if not isinstance(module, Pattention):
            continue

        def hook(m: Pattention, args: tuple, _out: Any, name: str = name) -> None:
            x = args[0].detach().float().reshape(-1, m.in_features)
            scores = F.linear(x, m.key_param_tokens.detach().float())
            stats[name] = {"mass": theta(scores, m.norm, m.scale, m.eps).abs().mean(dim=0),
                           "scores": scores if keep_scores else None}

        hooks.append(module.register_forward_hook(hook))
    try:
        model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return stats


def token_importance(module: Pattention, by: str, stats: dict[str, Any] | None) -> torch.Tensor:
    """Importance [n] of each token of ``module`` (higher = kept first); module docstring."""
    n = module.num_tokens
    if by == "newest":
        return -torch.arange(n, dtype=torch.float32)
    value_norm = module.value_param_tokens.detach().float().norm(dim=1)
    if by == "value":
        return value_norm
    if stats is None:
        raise GrowthError(f"prune by={by!r} needs calibration input ids")
    return stats["mass"] * value_norm if by == "contribution" else stats["mass"]


def prune(model: nn.Module, *, qkv: int | str | None = None, proj: int | str | None = None,
          ffn: int | str | None = None, by: str = "contribution",
          calibration: torch.Tensor | None = None, scale: str = "hold",
          importance: Callable[[str, Pattention], torch.Tensor] | None = None) -> nn.Module:
    """Return a smaller copy of ``model`` (same class) with fewer parameter tokens.

    ``qkv``/``proj``/``ffn``: new token count of those Pattentions, absolute or a multiplier
    (``"0.5x"``). ``by`` scores the tokens (module docstring; ``contribution``/``mass`` and
    ``scale="renorm"`` need ``calibration``, input ids [B, T]); ``importance(name, module)``
    overrides it with any per-token score (e.g. a first-order loss change). ``scale``: ``hold``,
    ``follow`` or ``renorm``. The input model is not modified.
    """
    if by not in PRUNE_BY:
        raise GrowthError(f"unknown importance {by!r}; choose one of {', '.join(PRUNE_BY)}")
    if scale not in SCALES:
        raise GrowthError(f"unknown scale rule {scale!r}; choose one of {', '.join(SCALES)}")
    config = model.config
    sizes = prune_sizes(config, qkv, proj, ffn)
    needs_data = needs_calibration(by, scale, importance)
    if needs_data and calibration is None:
        raise GrowthError(f"prune by={by!r} with scale={scale!r} needs calibration input ids")
    stats = calibrate(model, calibration, keep_scores=scale == "renorm") if needs_data else {}

    kept: dict[str, torch.Tensor] = {}
    ratios: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for name, module in model.named_modules():
        if not isinstance(module, Pattention):
            continue
        kind = pattention_kind(name)
        n_new = sizes[kind]
        score = (importance(name, module) if importance is not None
                 else token_importance(module, by, stats.get(name)))
        index = torch.topk(score.float(), n_new).indices.sort().values  # original order
        kept[name] = index
        if scale == "renorm" and n_new < module.num_tokens:
            scores = stats[name]["scores"]
            ratio = (_normaliser(scores[:, index.to(scores.device)], module.norm)
                     / _normaliser(scores, module.norm))
            ratios[kind].append(float(ratio.mean()))

    changes: dict[str, object] = {}
    for kind, n_new in sizes.items():
        n_old = getattr(config, f"{kind}_tokens")
        if n_new == n_old:
            continue
        changes[f"{kind}_tokens"] = n_new
        old_scale = config.theta_scale(kind)
        new_scale = {"hold": old_scale, "follow": None,
                     "renorm": old_scale * _mean(ratios[kind])}[scale]
        if new_scale is not None and new_scale == default_scale(config.norm, n_new):
            new_scale = None  # the default for the new n: keep the config free of it
        changes[f"{kind}_scale"] = new_scale
    new_config = dataclasses.replace(config, **changes)

    def tokens_for(name: str, _new: Pattention, old: Pattention
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        index = kept[name].to(old.key_param_tokens.device)
        return (old.key_param_tokens.detach()[index].clone(),
                old.value_param_tokens.detach()[index].clone())

    return rebuild(model, new_config, tokens_for, desc="prune").model


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 1.0
