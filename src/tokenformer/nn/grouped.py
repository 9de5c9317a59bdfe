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
own. Θ comes from the backend :func:`select_impl` picks (its ``theta_segments``, or ``theta``
per segment): the Triton op for ``triton``, else :func:`tokenformer.nn.theta.theta` under
autograd (the C++ kernel's pass at inference); so on a CPU it trades the C++ kernel's one-pass Θ
for one GEMM in training (docs/performance.md, "One GEMM for Q, K and V": opt-in).

**Layout: nothing is copied.** With G segments of equal n the scores are [rows, G·n] (the GEMM's
output) and Θ is handed to the value product segment-major, [G, rows, n]: the Triton op
(:func:`~tokenformer.nn.kernels.triton_theta.theta_segments`) reads a row's segment and writes
that segment's row, and its backward turns dΘ in that layout into dS in the scores' layout; the
PyTorch Θ runs over the [rows, G, n] view of the scores and the value product reads its
transpose, a strided view. The value product (:class:`GroupedValues`) is one batched matmul
forward and, backward, writes each segment's dΘ = dY·Vᵀ straight into its place in Θ's layout.
Autograd alone would copy twice per step: undoing the transpose clones the whole [rows, G·n]
score gradient, and the ``unbind`` of the outputs stacks their G gradients
(tests/test_device.py counts the copies). Unequal segments still concatenate their score
gradients (the ``split``'s backward): one copy of [rows, Σn]; at inference the C++ kernel,
which reads contiguous rows, takes a copy of each segment's scores. Under ``torch.compile`` the
value product's backward stacks its products instead (:func:`_compiled_backward`) and inductor
plans where they go.

**Inference** reuses the concatenated keys and stacked values (:class:`StackedWeights`) instead
of making them at every call (a decoding step would copy 3·n·(d_in + d_out) elements per block).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .kernels.dispatch import select_impl
from .kernels.fused import no_autocast
from .pattention import Pattention


def groupable(layers: Sequence[nn.Module]) -> bool:
    """Whether :func:`grouped_attend` computes ``[layer(x) for layer in layers]`` in one GEMM."""
    # exactly Pattention: subclasses (adapters, parametrizations) compute something else
    if not layers or not all(type(m) is Pattention for m in layers):
        return False
    first = layers[0]
    same = all((m.in_features, m.impl) == (first.in_features, first.impl) for m in layers)
    hooked = any(m._forward_hooks or m._forward_pre_hooks for m in layers)
    return same and not hooked and all(m.top_k is None for m in layers)


def _equal_segments(layers: Sequence[Pattention]) -> bool:
    """Whether the layers' segments are alike (n, d_out and Θ): one Θ call, one batched matmul."""
    return len({(m.num_tokens, m.out_features, m.norm, m.scale, m.eps) for m in layers}) == 1


class GroupedValues(torch.autograd.Function):
    """``[Θ[g]·V[g] for each segment g]`` for Θ [G, rows, n] (rows contiguous, any strides
    otherwise) and V [G, n, d_out]: one batched matmul forward. The backward writes each
    segment's dΘ = dY_g·V_gᵀ into its place in a tensor laid out as Θ is (so Θ's own backward
    gets its layout back) and dV_g = Θ_gᵀ·dY_g into V's: one matmul per segment on the G output
    gradients as they come, where autograd's ``unbind`` would first stack them into a new tensor.
    Θ and V share one dtype and autocast is off, as for the fused Function."""

    @staticmethod
    def forward(ctx, theta: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(theta, values)
        return torch.bmm(theta, values).unbind(0)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        theta, values = ctx.saved_tensors
        want_theta, want_values = ctx.needs_input_grad[:2]
        with no_autocast(theta)[1]:
            grads = [grad.to(theta.dtype) for grad in grads]
            if torch.compiler.is_compiling():  # dynamo traces no out= into a strided slot
                return _compiled_backward(theta, values, grads, want_theta, want_values)
            grad_theta = torch.empty_like(theta) if want_theta else None  # Θ's strides
            grad_values = torch.empty_like(values) if want_values else None
            for g, grad in enumerate(grads):
                if grad_theta is not None:
                    torch.mm(grad, values[g].t(), out=grad_theta[g])
                if grad_values is not None:
                    torch.mm(theta[g].t(), grad, out=grad_values[g])
        return grad_theta, grad_values


def _compiled_backward(theta: torch.Tensor, values: torch.Tensor, grads: list[torch.Tensor],
                       want_theta: bool, want_values: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:class:`GroupedValues`'s backward as torch.compile traces it: the per-segment products
    stacked, dΘ in Θ's layout (segment-major, or the transpose of [rows, G, n]); inductor
    decides where the products are written."""
    grad_theta = grad_values = None
    if want_theta:
        parts = [grad @ values[g].t() for g, grad in enumerate(grads)]
        grad_theta = (torch.stack(parts) if theta.stride(0) >= theta.stride(1)
                      else torch.stack(parts, dim=1).transpose(0, 1))
    if want_values:
        grad_values = torch.stack([theta[g].t() @ grad for g, grad in enumerate(grads)])
    return grad_theta, grad_values


# Optimizer steps taken in this process (every torch.optim optimizer, counted by a global step
# hook registered on first use): a fused optimizer updates parameters without bumping their
# version counters, so the step count is part of what a StackedWeights compares.
_steps = {"count": 0, "hooked": False}


def _optimizer_steps() -> int:
    if not _steps["hooked"]:
        _steps["hooked"] = True

        def count(*_) -> None:
            _steps["count"] += 1

        register_optimizer_step_post_hook(count)
    return _steps["count"]


class StackedWeights:
    """A group's keys concatenated [Σn, d_in] and, for equal segments, its values stacked
    [G, n, d_out], in one compute dtype, made by a call that autograd does not record and reused
    by the next such calls while nothing they were made from changed: the same parameter objects
    (growth makes new ones) with the same version counters (in-place updates bump them:
    ``load_state_dict``, optimizer steps, ``no_grad`` edits), data pointers, shapes, strides,
    dtypes and devices, and no optimizer step since (fused optimizers bump no version). A call
    that autograd records drops it (training holds no second copy of the weights).

    Changes made through ``param.data`` in place are invisible to all of these (PyTorch's version
    counter does not see them either): call :meth:`clear` after such an edit. The cache holds one
    extra copy of the group's keys and values while it is kept."""

    def __init__(self) -> None:
        self._sources: tuple[torch.Tensor, ...] = ()
        self._stamp: tuple = ()
        self._tensors: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def clear(self) -> None:
        """Drop the cached tensors (the next inference call makes them again)."""
        self._sources, self._stamp, self._tensors = (), (), None

    def get(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
            dtype: torch.dtype, stack_values: bool
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(keys concatenated, values stacked or None) in ``dtype``, from the cache when it is
        current (class docstring), else made and kept."""
        sources = (*keys, *values)
        stamp = (dtype, stack_values, _optimizer_steps(),
                 *((t._version, t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
                   for t in sources))
        same = len(sources) == len(self._sources) and all(
            a is b for a, b in zip(sources, self._sources, strict=True))
        if self._tensors is None or not same or stamp != self._stamp:
            self._tensors = stacked(keys, values, dtype, stack_values)
            self._sources, self._stamp = sources, stamp
        return self._tensors


def stacked(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], dtype: torch.dtype,
            stack_values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the keys concatenated [Σn, d_in], the values stacked [G, n, d_out] or None) in
    ``dtype``; under autograd (their gradients are views of the results' gradients)."""
    return (torch.cat(keys).to(dtype),
            torch.stack(values).to(dtype) if stack_values else None)


def grouped_attend(x: torch.Tensor, layers: Sequence[nn.Module],
                   weights: StackedWeights | None = None) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]``, with one GEMM for the scores where :func:`groupable`
    says it is the same function (module docstring), else layer by layer. ``weights``: the
    group's cache of concatenated weights, used by calls that autograd does not record (and
    dropped by those it does); without it each call concatenates them."""
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
    equal = _equal_segments(layers)
    if weights is None or torch.compiler.is_compiling():  # a compiled graph makes its own
        key, value = stacked(keys, values, dtype, equal)
    elif records:
        weights.clear()
        key, value = stacked(keys, values, dtype, equal)
    else:
        key, value = weights.get(keys, values, dtype, equal)
    with autocast_off:
        x2 = x2.to(dtype)
        scores = torch.matmul(x2, key.t())  # [rows, Σn]: one GEMM
        if equal:
            theta_ = backend.theta_segments(scores, len(layers), first, records)
            outs = (GroupedValues.apply(theta_, value) if records
                    else torch.bmm(theta_, value).unbind(0))
        else:
            outs = []
            sizes = [k.shape[0] for k in keys]
            for m, segment, v in zip(layers, scores.split(sizes, dim=-1), values, strict=True):
                theta_ = backend.theta(segment, m, records)
                outs.append(torch.matmul(theta_, v.to(dtype)))
    return [y.reshape(*shape[:-1], y.shape[-1]) for y in outs]


def set_grouped_qkv(model: nn.Module, enabled: bool) -> None:
    """Turn the one-GEMM Q/K/V (:func:`grouped_attend`) on or off in every attention block of
    ``model`` (the modules with a ``grouped_qkv`` switch); off by default."""
    for m in model.modules():
        if hasattr(m, "grouped_qkv"):
            m.grouped_qkv = bool(enabled)
