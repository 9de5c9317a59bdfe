"""One GEMM for several Pattentions of the same input (an attention block's Q, K and V).

``X·[K_q; K_k; K_v]ᵀ`` in one matmul, Θ normalised per segment (each projection's n scores of
a row are normalised on their own, exactly as in the separate layers), and one grouped value
product: a batched matmul over the stacked [3, n, d_out] values when the n are equal, one
matmul per segment when they differ (after pruning or uneven growth). The same function as the
separate layers; the parameters stay in their layers (the concatenation is made at run time, so
checkpoints, growth, the official layout and adapters see nothing new).

It applies only where it computes exactly what the layers would (:func:`groupable`): plain
:class:`Pattention` layers (no adapters, no parametrizations such as PEFT's, no hooks), dense
(no top-k), of one input width and ``impl``; anything else runs the layers one by one. Θ
(variant, factor, eps) may differ per layer: then, as when the n differ, each segment gets its
own. Θ comes from the Triton op where :func:`select_impl` picks ``triton`` (equal segments are
rows of the scores viewed as [rows·3, n], so one launch does all three), else from
:func:`tokenformer.nn.theta.theta` under autograd; so on a CPU it trades the C++ kernel's
one-pass Θ for one GEMM (docs/performance.md, "One GEMM for Q, K and V": opt-in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .kernels.dispatch import select_impl
from .kernels.fused import no_autocast
from .pattention import Pattention, theta_by_backend


def groupable(layers: Sequence[nn.Module]) -> bool:
    """Whether :func:`grouped_attend` computes ``[layer(x) for layer in layers]`` in one GEMM."""
    # exactly Pattention: subclasses (adapters, parametrizations) compute something else
    if not layers or not all(type(m) is Pattention for m in layers):
        return False
    first = layers[0]
    same = all((m.in_features, m.impl) == (first.in_features, first.impl) for m in layers)
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in layers)
    return same and not hooked and all(m.top_k is None for m in layers)


def grouped_attend(x: torch.Tensor, layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``, with one GEMM for the scores where :func:`groupable`
    says it is the same function (module docstring), else layer by layer."""
    if not groupable(layers):
        return [layer(x) for layer in layers]
    first = layers[0]
    keys = [m.key_param_tokens for m in layers]
    values = [m.value_param_tokens for m in layers]
    records = torch.is_grad_enabled() and (x.requires_grad or any(
        p.requires_grad for p in (*keys, *values)))
    backend = select_impl(first.impl, x.device, x.dtype, first.norm, training=records)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    dtype, autocast_off = no_autocast(x2)
    sizes = [k.shape[0] for k in keys]
    with autocast_off:
        x2 = x2.to(dtype)
        scores = torch.matmul(x2, torch.cat(keys).to(dtype).t())  # [rows, Σn]: one GEMM
        rows = scores.shape[0]
        equal = len({(m.num_tokens, m.out_features, m.norm, m.scale, m.eps)
                     for m in layers}) == 1
        if equal:  # each row's segments are rows of [rows·3, n]: Θ per segment in one call
            n = sizes[0]
            flat = scores.view(rows * len(layers), n)
            theta_ = theta_by_backend(flat, backend, records, first.norm, first.scale,
                                      first.eps)
            grouped = theta_.view(rows, len(layers), n).transpose(0, 1)  # [3, rows, n]
            outs = torch.bmm(grouped, torch.stack(values).to(dtype)).unbind(0)
        else:
            outs = []
            for m, segment, value in zip(layers, scores.split(sizes, dim=-1), values,
                                         strict=True):
                theta_ = theta_by_backend(segment, backend, records, m.norm, m.scale, m.eps)
                outs.append(torch.matmul(theta_, value.to(dtype)))
    return [y.reshape(*shape[:-1], y.shape[-1]) for y in outs]


def set_grouped_qkv(model: nn.Module, enabled: bool) -> None:
    """Turn the one-GEMM Q/K/V (:func:`grouped_attend`) on or off in every attention block of
    ``model`` (the modules with a ``grouped_qkv`` switch); off by default."""
    for m in model.modules():
        if hasattr(m, "grouped_qkv"):
            m.grouped_qkv = bool(enabled)
