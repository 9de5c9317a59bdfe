"""Fused Pattention: Θ in few passes over the scores, and a backward that stores almost nothing.

The reference path (:func:`tokenformer.nn.theta.theta` under autograd) runs Θ as 4–6 separate
elementwise kernels and autograd keeps 4–5 tensors of shape [L, n] alive for the backward (the
scores, the norm quotient, the GELU input and output, plus their bf16 casts under autocast). On a
CPU these passes are memory-bound, so they cost as much as a good part of the two matmuls.

:class:`PattentionFunction` computes the same function with an analytic backward:

* forward: ``S = X·Kᵀ`` → per-row factor ``c`` (from a norm of S or of GELU(S)) → Θ → ``Y = Θ·V``,
  updating S in place where possible; it saves X, K, V, one [L, n] tensor per variant (two for
  the variants whose Θ is expensive to recompute) and one float32 number per row.
* backward: ``G = dY·Vᵀ``, then ``M = dS / c`` from the closed-form derivative of each Θ variant,
  then ``dX = c ⊙ (M·K)``, ``dK = Mᵀ·(c ⊙ X)``, ``dV = Θᵀ·dY``. Folding the per-row factor ``c``
  into the [L, d] operands instead of the [L, n] gradient saves a pass over the scores.

The closed forms of each Θ (forward, and the backward's M and per-row factor c) are its row of
:data:`tokenformer.nn.theta.THETAS` (:class:`tokenformer.nn.theta.FusedTheta`, the derivatives
in that module's docstring); this module holds what they share: the matmuls, autocast, the
Function. A Θ without closed forms is not run here (``select_impl`` gives it the reference path).

Under CPU/GPU autocast the matmuls run in the autocast dtype, exactly as for the reference; Θ is
computed from the low-precision scores with float32 norms and stored in the autocast dtype, which
is what the next matmul consumes anyway. Everything is plain torch ops without data-dependent
Python control flow, so ``torch.compile`` traces the function (and inductor fuses the passes).

``kernel=True`` (``impl="kernel"``) keeps the matmuls and hands everything done to the [L, n]
scores to the C++ kernel of :mod:`tokenformer.nn.kernels.cpu_theta` (l2_norm_gelu on the CPU):
one pass per direction, and a backward that turns (dΘ, S) into (Θ, dS) in place instead of
allocating.
"""

from __future__ import annotations

import contextlib

import torch

from ..theta import THETAS
from . import cpu_theta


def no_autocast(x: torch.Tensor) -> tuple[torch.dtype, contextlib.AbstractContextManager]:
    """The dtype autocast would run a matmul on ``x`` in, and a context that turns autocast off
    (we cast once ourselves; autocast would re-cast every op). Without autocast: ``x.dtype`` and
    a no-op context, because entering ``torch.autocast`` costs microseconds that add up when
    decoding one token through dozens of Pattentions."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return torch.get_autocast_dtype(device), torch.autocast(device, enabled=False)
    return x.dtype, contextlib.nullcontext()


def _forward(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm: str, scale: float,
             eps: float, kernel: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Y and what the backward needs (what the Θ's :class:`tokenformer.nn.theta.FusedTheta`
    saves). Runs with autocast off, on inputs already in the compute dtype
    (:func:`fused_pattention` casts them). ``kernel``: Θ from the C++ kernel
    (:mod:`tokenformer.nn.kernels.cpu_theta`), which saves only S and r."""
    s = torch.matmul(x, key.t())
    if kernel:
        theta, r = cpu_theta.theta_forward(s, scale, eps)
        return torch.matmul(theta, value), (s, r)
    closed = THETAS[norm].fused
    if closed is None:  # select_impl never picks this path for it: a direct call
        raise ValueError(f"Θ {norm!r} has no fused closed forms; its reference formula runs "
                         f"under autograd (impl='reference')")
    theta, saved = closed.forward(s, scale, eps)
    return torch.matmul(theta, value), saved


def _kernel_backward(gy: torch.Tensor, vc: torch.Tensor, saved: list[torch.Tensor],
                     scale: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, None]:
    """(dV, dS, None) by the C++ kernel, which turns (dΘ, S) into (Θ, dS) in place."""
    s, r = saved
    theta, m = cpu_theta.theta_backward(torch.matmul(gy, vc.t()), s, r, scale, eps)
    return torch.matmul(theta.transpose(-1, -2), gy), m, None


class PattentionFunction(torch.autograd.Function):
    """``Y = Θ(X·Kᵀ)·V`` for 2-D ``X`` with a memory-saving analytic backward (module docstring).
    X, K and V share one dtype and autocast is off (:func:`fused_pattention` arranges both); the
    backward may run under autocast (the trainer's ``loss.backward()`` does) and turns it off."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm: str,
                scale: float, eps: float, kernel: bool = False) -> torch.Tensor:
        y, saved = _forward(x, key, value, norm, scale, eps, kernel)
        ctx.save_for_backward(x, key, value, *saved)
        ctx.norm, ctx.scale, ctx.eps, ctx.kernel = norm, scale, eps, kernel
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        scale, eps = ctx.scale, ctx.eps
        xc, kc, vc, *saved = ctx.saved_tensors
        with no_autocast(xc)[1]:
            gy = grad_y.to(xc.dtype)
            # c: the per-row factor folded into the [L, d] side (None: already applied)
            if ctx.kernel:  # one pass turns (dΘ, S) into (Θ, dS) in place
                grad_v, m, c = _kernel_backward(gy, vc, saved, scale, eps)
            else:
                grad_v, m, c = THETAS[ctx.norm].fused.backward(gy, vc, tuple(saved), scale, eps)
            xs = xc if c is None else xc * c.to(xc.dtype)
            grad_k = torch.matmul(m.transpose(-1, -2), xs)
            grad_x = torch.matmul(m, kc)
            if c is not None:
                grad_x = grad_x.mul_(c.to(grad_x.dtype))
        return grad_x, grad_k, grad_v, None, None, None, None


def fused_pattention(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm: str,
                     scale: float, eps: float = 0.0, kernel: bool = False) -> torch.Tensor:
    """``Θ(x·keyᵀ)·value`` for ``x`` of shape [..., d_in] through :class:`PattentionFunction`.
    ``kernel=True``: Θ from the C++ CPU kernel where it applies (:func:`cpu_theta.supports`:
    ``l2_norm_gelu`` on the CPU in float32/bf16/fp16), the PyTorch passes elsewhere."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    dtype, autocast_off = no_autocast(x2)
    # Cast to the compute dtype here, as autograd ops of their own, rather than inside the
    # Function: the casts' backward (to the float32 leaves) then runs after the Function's
    # backward has released its [L, n] tensors, instead of adding float32 gradients on top of
    # them at the memory peak. Autocast is turned off once, here, for everything inside.
    x2, key, value = x2.to(dtype), key.to(dtype), value.to(dtype)
    kernel = kernel and cpu_theta.supports(x2.device, x2.dtype, norm)
    with autocast_off:
        if torch.is_grad_enabled() and (x2.requires_grad or key.requires_grad
                                        or value.requires_grad):
            y = PattentionFunction.apply(x2, key, value, norm, scale, eps, kernel)
        else:  # inference: skip the autograd.Function machinery (it matters when decoding)
            y = _forward(x2, key, value, norm, scale, eps, kernel)[0]
    return y.view(*shape[:-1], y.shape[-1])
