"""Fused Pattention: Θ in few passes over the scores, and a backward that stores almost nothing.

The reference path (:func:`tokenformer.nn.pattention.theta` under autograd) runs Θ as 4–6 separate
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

Derivatives (row-wise, s = ``scale``, r = the norm, c = s / (r + eps), k = (r + eps) / (s²·r)):

* ``l2_norm_gelu``: u = c·S, Θ = GELU(u);   M = dU − u·k·(u·dU) with dU = GELU'(u)⊙G
  (because dS = c·dU − c·S·(S·dU)/(r(r+eps)) and S = u/c).
* ``gelu_l2_norm``: a = GELU(S), Θ = c·a;   M = GELU'(S)⊙(G − Θ·k·(Θ·G)).
* ``gelu_l1_norm``: a = GELU(S), Θ = c·a;   M = GELU'(S)⊙(G − sign(Θ)·(Θ·G)/s).
* ``softmax``:      e = exp(S), Θ = c·e;    dS = Θ⊙(G − (Θ·G)/s)   (c is not factored out).
* ``gelu`` (the MLP control, no norm): Θ = s·GELU(S);   dS = s·GELU'(S)⊙G; saves S only, like
  a GELU MLP's backward that recomputes its activation.

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
import torch.nn.functional as F

from . import cpu_theta

_gelu_backward_ = torch.ops.aten.gelu_backward.grad_input  # out= variant: may write into grad


# Reductions over the scores run in the scores' dtype (they accumulate in float32 internally
# either way); asking for a float32 result from bf16 input makes torch copy the whole [L, n]
# tensor to float32 first, which costs more than the reduction. The per-row results are widened
# to float32 afterwards, and per-row factors are cast back to the scores' dtype before they touch
# an [L, n] tensor, because mixed-dtype elementwise ops also take a copying slow path.
def _wide(t: torch.Tensor) -> torch.Tensor:
    """A per-row [..., 1] quantity in at least float32."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_j a_ij·b_ij per row, shape [..., 1], in at least float32."""
    return _wide((a * b).sum(dim=-1, keepdim=True))


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
    """Y and what the backward needs: the saved scores, r, Θ. Runs with autocast off, on inputs
    already in the compute dtype (:func:`fused_pattention` casts them). ``kernel``: Θ from the
    C++ kernel (:mod:`tokenformer.nn.kernels.cpu_theta`), which saves only S and r."""
    s = torch.matmul(x, key.t())
    if kernel:
        theta, r = cpu_theta.theta_forward(s, scale, eps)
        return torch.matmul(theta, value), (s, r, theta)
    if norm == "l2_norm_gelu":
        r = _wide(torch.linalg.vector_norm(s, dim=-1, keepdim=True))
        u = s.mul_((scale / (r + eps)).to(s.dtype))  # u = c·S in place of S
        theta = F.gelu(u)
        saved = u  # Θ = GELU(u) is one cheap pass: the backward recomputes it
    elif norm == "gelu":
        theta = F.gelu(s)
        if scale != 1.0:
            theta = theta.mul_(scale)
        r, saved = None, s  # no norm; Θ is one cheap pass: the backward recomputes it
    elif norm == "softmax":
        e = s.exp_()
        r = _wide(e.sum(dim=-1, keepdim=True))
        theta = saved = e.mul_((scale / (r + eps)).to(e.dtype))
    else:  # gelu_l2_norm, gelu_l1_norm
        theta = F.gelu(s)
        r = _wide(torch.linalg.vector_norm(theta, ord=2 if norm == "gelu_l2_norm" else 1,
                                           dim=-1, keepdim=True))
        theta = theta.mul_((scale / (r + eps)).to(theta.dtype))
        saved = s  # GELU'(S) needs S; Θ is kept too since it costs two passes to rebuild
    return torch.matmul(theta, value), (saved, r, theta)


def _k(r: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    """k = (r + eps) / (s²·r) per row; a zero row (r = 0, only finite when eps > 0) has u = 0 and
    gets the reference's subgradient 0 for the norm."""
    return torch.where(r > 0, (r + eps) / (scale * scale * r), 0.0)


class PattentionFunction(torch.autograd.Function):
    """``Y = Θ(X·Kᵀ)·V`` for 2-D ``X`` with a memory-saving analytic backward (module docstring).
    X, K and V share one dtype and autocast is off (:func:`fused_pattention` arranges both); the
    backward may run under autocast (the trainer's ``loss.backward()`` does) and turns it off."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm: str,
                scale: float, eps: float, kernel: bool = False) -> torch.Tensor:
        y, (saved, r, theta) = _forward(x, key, value, norm, scale, eps, kernel)
        if norm in ("gelu_l2_norm", "gelu_l1_norm"):  # (kernel implies l2_norm_gelu)
            ctx.save_for_backward(x, key, value, saved, r, theta)
        else:
            ctx.save_for_backward(x, key, value, saved, r)
        ctx.norm, ctx.scale, ctx.eps, ctx.kernel = norm, scale, eps, kernel
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        norm, scale, eps = ctx.norm, ctx.scale, ctx.eps
        xc, kc, vc, saved, r, *rest = ctx.saved_tensors
        with no_autocast(xc)[1]:
            gy = grad_y.to(xc.dtype)
            c = None  # the per-row factor folded into the [L, d] side (None: already applied)
            # The order keeps at most three [L, n] tensors alive (a GELU MLP's backward peaks at
            # as many): dV before dΘ, so that a recomputed Θ is used and turned into a buffer
            # before dΘ is allocated.
            if ctx.kernel:  # one pass turns (dΘ, S) into (Θ, dS) in place
                theta, m = cpu_theta.theta_backward(torch.matmul(gy, vc.t()), saved, r, scale, eps)
                grad_v = torch.matmul(theta.transpose(-1, -2), gy)
                del theta
            elif norm == "l2_norm_gelu":
                u = saved
                buffer = F.gelu(u)  # Θ, recomputed
                grad_v = torch.matmul(buffer.transpose(-1, -2), gy)
                g = torch.matmul(gy, vc.t())  # dΘ
                du = _gelu_backward_(g, u, grad_input=g)  # dΘ is not needed again
                dot = _wide(torch.mul(du, u, out=buffer).sum(dim=-1, keepdim=True))
                del buffer
                m = du.addcmul_(u, (-_k(r, scale, eps) * dot).to(u.dtype))
                c = scale / (r + eps)
            elif norm == "gelu":
                buffer = F.gelu(saved)  # Θ / s, recomputed
                grad_v = torch.matmul(buffer.transpose(-1, -2), gy)
                if scale != 1.0:
                    grad_v = grad_v.mul_(scale)
                del buffer
                g = torch.matmul(gy, vc.t())
                m = _gelu_backward_(g, saved, grad_input=g)
                if scale != 1.0:
                    m = m.mul_(scale)
            elif norm == "softmax":
                theta = saved
                grad_v = torch.matmul(theta.transpose(-1, -2), gy)
                g = torch.matmul(gy, vc.t())
                m = g.sub_((_row_dot(theta, g) / scale).to(g.dtype)).mul_(theta)
            else:
                s, theta = saved, rest[0]
                grad_v = torch.matmul(theta.transpose(-1, -2), gy)
                g = torch.matmul(gy, vc.t())
                dot = _row_dot(theta, g)
                if norm == "gelu_l2_norm":
                    g = g.addcmul_(theta, (-_k(r, scale, eps) * dot).to(g.dtype))
                else:
                    g = g.addcmul_(torch.sign(theta), (-dot / scale).to(g.dtype))
                m = _gelu_backward_(g, s, grad_input=g)
                c = scale / (r + eps)
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
