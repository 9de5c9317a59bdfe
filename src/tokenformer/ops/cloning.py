"""Width growth by duplication (HyperCloning, Samragh et al. 2024, arXiv 2409.12903): a language
model whose hidden size d becomes r·d (r a whole number) and computes exactly the same function.

Every tensor axis of width d (or, for the Transformer baselines, of MLP width f) is tiled r times,
in one of two modes:

``copy``
    the axis is *produced* into the widened stream: the r copies are equal, [t, t, …]. The
    embedding columns (so the residual stream is [x, x, …]), every Pattention value
    (V [n, d] → [V, V]), a Linear's output rows, block norm weights and biases.
``split``
    the axis is *summed against* the widened stream: the copies are t/r each, [t/r, t/r, …], so
    the sum over the r copies of an input that is itself [x, x, …] is the old sum. Every Pattention
    key (scores x'·K'ᵀ = x·Kᵀ, so Θ, n and Θ's factor are unchanged), a Linear's input columns,
    the untied head's columns, and the final norm's weight and bias when the head is tied (then
    the head reads [y/r, …] against the embedding [E, E, …] and the logits are y·Eᵀ).

Why the rest is exact: LayerNorm and RMSNorm of [x, x, …] have the mean and variance (mean
square) of x, ε included, so their output is [n, n, …]; heads keep their size (d/H) and their
number grows to r·H: head j of the widened model reads columns [j·hd, (j+1)·hd) of [q, q, …],
which is old head j mod H, so rotary, the attention pattern and the output [a, a, …] are copies.

Gradients of the widened model (the optimizer moments follow them): with θ' = tile(θ)·α (α = r⁻ˢ
for s split axes) and the function L'(tile(θ)·α) = L(θ) for every θ, differentiating gives
Σ_copies G'·α = G, and the r^t copies (t tiled axes) of an element are interchangeable, so each
gets G' = G / (α·r^t) = G / r^c, c the number of *copy* axes. A key (one split axis) gets the
old gradient G; a value or an embedding (one copy axis) G/r; a Linear d → d (copy out, split in)
G/r; the tied final norm (split) G. :func:`moment_scale` carries AdamW's moments accordingly
(``exp_avg`` · r⁻ᶜ, ``exp_avg_sq`` · r⁻²ᶜ), so the first steps after growth see the statistics
of the gradients they actually get. Adam's step m/√v is invariant to that scale, so a split
tensor (value t/r) takes the old step at 1/r of its size: in function space it moves r× as far as
the small model would (μP's reason for a 1/width learning rate on hidden matrices).

Copies receive identical gradients, so without help they stay copies for ever. ``noise`` (std
relative to each tensor's RMS) is added to every split tensor as r draws centred to sum to zero
across the copies (the HyperCloning release adds +N, −N to pairs of input-column blocks, with
SNR 10 dB, i.e. std ≈ 0.32): because the copies' inputs are equal, the sum is unchanged and the
function is still exact, while the copies' gradients with respect to the stream now differ.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import GrowthError
from ..models.lm import LayerNorm, TokenFormerLM
from ..nn.pattention import Pattention
from ..nn.product_keys import ProductKeyPattention

COPY, SPLIT = "copy", "split"


@dataclass(frozen=True)
class Axis:
    """One widened axis of a tensor: its dimension, the size it has (``"d"``, the hidden size, or
    ``"f"``, a baseline's MLP width) and how it is tiled (``copy`` or ``split``)."""

    dim: int
    size: str
    mode: str


def width_axes(model: nn.Module) -> dict[str, tuple[Axis, ...]]:
    """For every parameter of a :class:`~tokenformer.TokenFormerLM` or a Transformer baseline,
    its widened axes (none for a tensor whose shape does not involve d or f). Anything else,
    or a product-key FFN, is refused: no duplication rule is known for it."""
    if not isinstance(model, TokenFormerLM):
        raise GrowthError(f"width growth duplicates the units of a language model "
                          f"(TokenFormerLM or a Transformer baseline), not a "
                          f"{type(model).__name__}")
    d_in, d_out = (Axis(1, "d", SPLIT),), (Axis(0, "d", COPY),)
    tied = model.lm_head is None
    axes: dict[str, tuple[Axis, ...]] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, ProductKeyPattention):
            raise GrowthError(product_key_refusal("widen"))
        if isinstance(module, Pattention):
            axes[f"{prefix}key_param_tokens"] = (Axis(1, "d", SPLIT),)
            axes[f"{prefix}value_param_tokens"] = (Axis(1, "d", COPY),)
        elif isinstance(module, nn.Embedding):
            axes[f"{prefix}weight"] = (Axis(1, "d", COPY),)
        elif isinstance(module, nn.Linear):
            if name == "lm_head":
                out, into = (), d_in
            elif name.endswith("mlp.up") or name.endswith("mlp.gate"):
                out, into = (Axis(0, "f", COPY),), d_in
            elif name.endswith("mlp.down"):
                out, into = d_out, (Axis(1, "f", SPLIT),)
            else:  # attention Q, K, V, proj: d → d
                out, into = d_out, d_in
            axes[f"{prefix}weight"] = (*out, *into)
            if module.bias is not None:
                axes[f"{prefix}bias"] = tuple(dataclasses.replace(a, dim=0) for a in out)
        elif isinstance(module, (LayerNorm, nn.RMSNorm)):
            # The final norm feeds the head: halved when the head is the embedding [E, E].
            mode = SPLIT if name == "final_norm" and tied else COPY
            for leaf in ("weight", "bias"):
                if getattr(module, leaf, None) is not None:
                    axes[f"{prefix}{leaf}"] = (Axis(0, "d", mode),)
    missing = [n for n, _ in model.named_parameters() if n not in axes]
    if missing:
        raise GrowthError(f"cannot widen {type(model).__name__}: no duplication rule for "
                          f"parameter {missing[0]!r}")
    return axes


def product_key_refusal(what: str) -> str:
    return (f"cannot {what} a model with a product-key FFN: its sub-keys split the hidden size "
            f"into two halves, and a duplicated stream [x, x] does not split into the old halves; "
            f"grow its ffn tokens by sub-keys instead (docs/sparse.md)")


def widened_config(config: Any, r: int, heads: int | None = None, r_ffn: int = 1) -> Any:
    """The config of the model widened by ``r`` (hidden size and heads; head size kept) and, for a
    baseline, with ``r_ffn`` times the MLP width. ``heads``, when given, must be r·H."""
    new_heads = r * config.num_heads
    if heads is not None and heads != new_heads:
        raise GrowthError(
            f"heads={heads}: width growth copies whole heads, keeping the head size "
            f"{config.head_dim} (rotary and attention scale unchanged), so hidden "
            f"{r * config.hidden_size} has {new_heads} heads; a different head size is not "
            f"function-preserving")
    changes: dict[str, Any] = {"hidden_size": r * config.hidden_size, "num_heads": new_heads}
    if r_ffn != 1:
        changes["intermediate_size"] = r_ffn * config.intermediate_size
    return dataclasses.replace(config, **changes)


def widen_tensor(old: torch.Tensor, axes: tuple[Axis, ...], factors: dict[str, int],
                 noise: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """``old`` tiled along ``axes`` (copy: [t, t, …]; split: [t/r, t/r, …]), with zero-sum noise
    of std ``noise``·RMS across the copies of every split axis."""
    out = old.detach()
    for axis in axes:
        r = factors[axis.size]
        if r > 1:
            out = torch.cat([out] * r, dim=axis.dim)  # a new tensor
            if axis.mode == SPLIT:
                out = out / r
    if out.data_ptr() == old.data_ptr():  # nothing widened: never hand back the old storage
        out = out.clone()
    for axis in axes:
        r = factors[axis.size]
        if axis.mode == SPLIT and r > 1 and noise > 0:
            out += _zero_sum_noise(out, axis.dim, r, noise, generator)
    return out


def _zero_sum_noise(t: torch.Tensor, dim: int, r: int, std: float,
                    generator: torch.Generator | None) -> torch.Tensor:
    """N(0, (std·rms(t))²) noise shaped like ``t``, centred over the r blocks of ``dim`` (and
    rescaled by √(r/(r−1)) to keep its std), drawn in float64 on the CPU."""
    rms = float(t.double().pow(2).mean().sqrt())
    shape = list(t.shape)
    shape[dim: dim + 1] = [r, shape[dim] // r]
    draw = torch.empty(shape, dtype=torch.float64).normal_(0.0, std * rms, generator=generator)
    draw = (draw - draw.mean(dim=dim, keepdim=True)) * math.sqrt(r / (r - 1))
    return draw.reshape(t.shape).to(t)


def moment_scale(axes: tuple[Axis, ...], factors: dict[str, int]) -> float:
    """β with G' = β·tile(G) for a parameter widened along ``axes``: r⁻¹ per copy axis (module
    docstring). First moments scale by β, second moments by β²."""
    return 1.0 / math.prod(factors[a.size] for a in axes if a.mode == COPY)


def carry_moment(axes: tuple[Axis, ...], factors: dict[str, int]
                 ) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """How an optimizer state tensor shaped like the parameter widens: tiled like the gradient
    (copies, never divided), times β, or β² for a second moment (a state key containing "sq":
    Adam's ``exp_avg_sq``, ``max_exp_avg_sq``)."""
    beta = moment_scale(axes, factors)
    copies = tuple(dataclasses.replace(a, mode=COPY) for a in axes)

    def carry(key: str, value: torch.Tensor) -> torch.Tensor:
        power = 2 if "sq" in key else 1
        return widen_tensor(value, copies, factors) * beta ** power

    return carry
