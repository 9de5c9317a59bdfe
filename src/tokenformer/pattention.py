"""Pattention: a token-parameter attention layer that replaces ``nn.Linear``.

``Pattention(X) = Θ(X · K_Pᵀ) · V_P`` where the ``n`` rows of ``K_P`` [n, d_in] and ``V_P``
[n, d_out] are learnable *parameter tokens* and Θ is a modified softmax acting on each row of
scores (over the n parameter tokens). The variants follow the official code exactly:

=================  ==========================================  =====================
name               Θ(a) for one row a ∈ Rⁿ                      default ``scale`` s
=================  ==========================================  =====================
``l2_norm_gelu``   GELU(a / ‖a‖₂ · s)          (official default)  √n
``gelu_l2_norm``   GELU(a) / ‖GELU(a)‖₂ · s                        √n
``gelu_l1_norm``   GELU(a) / ‖GELU(a)‖₁ · s    (paper ablation)    n
``softmax``        exp(a) / ‖exp(a)‖₁ · s      (softmax × n)        n
=================  ==========================================  =====================

``scale`` is part of the layer's state rather than recomputed from ``n`` on every call: growth
(:mod:`tokenformer.grow`) appends tokens and may hold ``scale`` at its pre-growth value, which is
what makes function-preserving growth possible.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .errors import ConfigError
from .fused import fused_pattention

THETA_VARIANTS: tuple[str, ...] = ("l2_norm_gelu", "gelu_l2_norm", "gelu_l1_norm", "softmax")
# "fused": tokenformer.fused (one custom autograd Function, analytic backward, few passes over the
# scores); "reference": theta() below under plain autograd, the ground truth the fused path is
# tested against. "kernel": the fused path with Θ from the C++ CPU kernel (tokenformer.kernels;
# built once per machine, needs a compiler; where it does not apply or cannot be built: "fused",
# after one warning). "auto" (default): the kernel wherever it applies and is available
# (l2_norm_gelu on the CPU in fp32/bf16/fp16), training and inference; elsewhere fused when
# autograd records the call (less time and half the activation memory) and reference otherwise
# (at the few rows per call of decoding the Function's per-call overhead outweighs its one saved
# pass). "torch": that last rule alone (auto without the kernel; auto before the kernel was the
# default), what the documented experiments ran with, so they can be rerun bit for bit.
# docs/performance.md.
PATTENTION_IMPLS: tuple[str, ...] = ("auto", "fused", "reference", "kernel", "torch")


def default_scale(norm: str, num_tokens: int) -> float:
    """Θ's factor in the official code: √n for the L2 variants, n for the L1 ones."""
    check_theta(norm)
    return float(num_tokens) if norm in ("softmax", "gelu_l1_norm") else math.sqrt(num_tokens)


def check_theta(norm: str) -> None:
    if norm not in THETA_VARIANTS:
        raise ConfigError(f"unknown Θ variant {norm!r}; choose one of {', '.join(THETA_VARIANTS)}")


def theta(scores: torch.Tensor, norm: str, scale: float, eps: float = 0.0) -> torch.Tensor:
    """Apply Θ row-wise over the last dimension of ``scores``.

    With ``eps == 0`` the arithmetic is the official one (an all-zero row gives NaN, exactly like
    the released code; an ``exp`` overflow in ``softmax`` is not guarded either). ``eps > 0`` adds
    ``eps`` to the norm, which makes all-zero rows map to GELU(0) = 0.
    """
    if norm == "l2_norm_gelu":
        norm_ = torch.linalg.vector_norm(scores, dim=-1, keepdim=True)
        return F.gelu(scores / (norm_ + eps) * scale)
    if norm == "gelu_l2_norm":
        act = F.gelu(scores)
        return act / (torch.linalg.vector_norm(act, dim=-1, keepdim=True) + eps) * scale
    if norm == "gelu_l1_norm":
        act = F.gelu(scores)
        return act / (torch.linalg.vector_norm(act, ord=1, dim=-1, keepdim=True) + eps) * scale
    if norm == "softmax":
        act = torch.exp(scores)
        return act / (act.sum(dim=-1, keepdim=True) + eps) * scale
    check_theta(norm)
    raise AssertionError("unreachable")


def _reference(x: torch.Tensor, key: torch.Tensor, value: torch.Tensor, norm: str, scale: float,
               eps: float) -> torch.Tensor:
    return torch.matmul(theta(torch.matmul(x, key.t()), norm, scale, eps), value)


def check_impl(impl: str) -> None:
    if impl not in PATTENTION_IMPLS:
        raise ConfigError(f"unknown Pattention impl {impl!r}; choose one of "
                          f"{', '.join(PATTENTION_IMPLS)}")


def set_pattention_impl(module: nn.Module, impl: str) -> None:
    """Switch every Pattention inside ``module`` (e.g. a whole model) to ``impl``."""
    check_impl(impl)
    for m in module.modules():
        if isinstance(m, Pattention):
            m.impl = impl


class Pattention(nn.Module):
    """Input tokens attend over ``num_tokens`` learnable key/value parameter tokens.

    Drop-in for ``nn.Linear(in_features, out_features, bias=False)``: maps ``[..., in_features]``
    to ``[..., out_features]``. Parameter names are the official ones, so official checkpoints
    convert by renaming module prefixes only.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_tokens: int,
        norm: str = "l2_norm_gelu",
        *,
        scale: float | None = None,
        eps: float = 0.0,
        key_init_std: float = 0.02,
        value_init_std: float = 0.02,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        check_theta(norm)
        check_impl(impl)
        for name, value in (("in_features", in_features), ("out_features", out_features),
                            ("num_tokens", num_tokens)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"Pattention {name} must be a positive integer, got {value!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.norm = norm
        self.scale = float(scale) if scale is not None else default_scale(norm, num_tokens)
        self.eps = float(eps)
        self.impl = impl
        self.key_init_std = key_init_std
        self.value_init_std = value_init_std
        factory = {"device": device, "dtype": dtype}
        self.key_param_tokens = nn.Parameter(torch.empty(num_tokens, in_features, **factory))
        self.value_param_tokens = nn.Parameter(torch.empty(num_tokens, out_features, **factory))
        self.reset_parameters()

    @property
    def num_tokens(self) -> int:
        return self.key_param_tokens.shape[0]

    def reset_parameters(self) -> None:
        nn.init.normal_(self.key_param_tokens, std=self.key_init_std)
        nn.init.normal_(self.value_param_tokens, std=self.value_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(x, self.key_param_tokens, self.value_param_tokens)

    def attend(self, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This layer's Pattention (Θ, scale, eps, impl) over the tokens ``key``/``value``: its
        own parameters, or those with more tokens appended (token adapters)."""
        impl = self.impl
        if impl == "reference":
            return _reference(x, key, value, self.norm, self.scale, self.eps)
        records = torch.is_grad_enabled() and (x.requires_grad or key.requires_grad
                                               or value.requires_grad)
        kernel = (kernels.usable(x, self.norm) if impl == "auto"  # silent fallback
                  else impl == "kernel" and kernels.supports(x, self.norm))  # warns once
        if kernel and not records and not torch.is_autocast_enabled(x.device.type):
            # Inference (decoding: one row per call): as few Python steps as possible.
            scores = F.linear(x, key)
            theta_ = kernels.theta_forward(scores.view(-1, scores.shape[-1]), self.scale,
                                           self.eps)[0]
            return torch.matmul(theta_.view(scores.shape), self._inference_value(value))
        if kernel or records or impl in ("fused", "kernel"):
            return fused_pattention(x, key, value, self.norm, self.scale, self.eps,
                                    kernel=kernel)
        if impl == "auto":  # "torch" keeps the layout too: it reproduces the old results exactly
            value = self._inference_value(value)
        return _reference(x, key, value, self.norm, self.scale, self.eps)

    def _inference_value(self, value: torch.Tensor) -> torch.Tensor:
        """V for a matmul autograd does not record. In bf16/fp16, the CPU's matrix-vector
        kernels are 1.3–1.5x faster for Θ·V when V [n, d_out] is stored column by column (Vᵀ
        contiguous, nn.Linear's layout; docs/performance.md, "Inference"): the first such call
        changes the parameter's memory layout to that, in place. Same values, shape and size;
        fp32 (where it makes no difference), training and tokens that are not this layer's own
        parameter are left alone."""
        if (value is self.value_param_tokens and value.dtype in (torch.bfloat16, torch.float16)
                and value.device.type == "cpu" and value.dim() == 2 and min(value.shape) > 1
                and value.stride(1) == 1
                and not torch.compiler.is_compiling()):
            with torch.inference_mode(False), torch.no_grad():
                value.data = value.t().contiguous().t()
        return value

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"num_tokens={self.num_tokens}, norm={self.norm!r}, scale={self.scale:.6g}")
