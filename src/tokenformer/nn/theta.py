"""Θ, the modified softmax of a Pattention: every variant in one table, :data:`THETAS`.

A Pattention computes ``Θ(X · K_Pᵀ) · V_P`` where Θ acts on each row of scores (over the n
parameter tokens). The variants follow the official code exactly:

=================  ==========================================  =====================
name               Θ(a) for one row a ∈ Rⁿ                      default ``scale`` s
=================  ==========================================  =====================
``l2_norm_gelu``   GELU(a / ‖a‖₂ · s)          (official default)  √n
``gelu_l2_norm``   GELU(a) / ‖GELU(a)‖₂ · s                        √n
``gelu_l1_norm``   GELU(a) / ‖GELU(a)‖₁ · s    (paper ablation)    n
``softmax``        exp(a) / ‖exp(a)‖₁ · s      (softmax × n)        n
``gelu``           GELU(a) · s                 (control: no norm)   1
=================  ==========================================  =====================

``gelu`` is not one of the paper's or the official code's variants: it is the critics' control
(issue 25). With no normalisation a Pattention *is* a two-layer GELU MLP (K the first layer's
weight, V the second's), so a TokenFormer with ``norm="gelu"`` is a Transformer whose every
projection is a GELU MLP of n hidden units; zero new keys give scores 0 and GELU(0) = 0, so
zero-key growth preserves its function exactly whatever the factor. Its ``eps`` is unused (there
is no norm to guard). Its keys need another init (:func:`key_init_std`): fan-in, N(0, 1/d_in).

Each row of :data:`THETAS` is a :class:`ThetaVariant`: the reference formula (the ground truth,
run under plain autograd), the default factor for n tokens, the FLOPs charged per score, and what
else the package asks of a Θ (its normaliser for pruning, whether zero keys are silent, the key
init), plus which fast paths compute it: the fused Function's closed forms (:class:`FusedTheta`,
below), the C++ CPU kernel (``nn/kernels/cpu_theta``, ``l2_norm_gelu`` only) and the Triton
kernels' id (``nn/kernels/triton_theta_jit``). The backends read the table;
:func:`tokenformer.nn.kernels.dispatch.select_impl` runs the reference path for a Θ no fast path
covers. Adding a Θ is one function and one :func:`register_theta` call (docs/architecture.md,
"Adding a Θ variant").

The fused closed forms (row-wise, s = ``scale``, r = the norm, c = s / (r + eps),
k = (r + eps) / (s²·r)); each backward returns (dV, M, c) with dS = c ⊙ M (c None: M is dS):

* ``l2_norm_gelu``: u = c·S, Θ = GELU(u);   M = dU − u·k·(u·dU) with dU = GELU'(u)⊙G
  (because dS = c·dU − c·S·(S·dU)/(r(r+eps)) and S = u/c).
* ``gelu_l2_norm``: a = GELU(S), Θ = c·a;   M = GELU'(S)⊙(G − Θ·k·(Θ·G)).
* ``gelu_l1_norm``: a = GELU(S), Θ = c·a;   M = GELU'(S)⊙(G − sign(Θ)·(Θ·G)/s).
* ``softmax``:      e = exp(S), Θ = c·e;    dS = Θ⊙(G − (Θ·G)/s)   (c is not factored out).
* ``gelu`` (the MLP control, no norm): Θ = s·GELU(S);   dS = s·GELU'(S)⊙G; saves S only, like
  a GELU MLP's backward that recomputes its activation.

Each forward saves one [L, n] tensor (two for the variants whose Θ is expensive to recompute)
and one float32 number per row; the backwards keep at most three [L, n] tensors alive (a GELU
MLP's backward peaks at as many): dV before dΘ, so that a recomputed Θ is used and turned into a
buffer before dΘ is allocated.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..registry import FLAG_RULE, EntryRule, Registry, function_rule, instance_rule

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


def _k(r: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    """k = (r + eps) / (s²·r) per row; a zero row (r = 0, only finite when eps > 0) has u = 0 and
    gets the reference's subgradient 0 for the norm."""
    return torch.where(r > 0, (r + eps) / (scale * scale * r), 0.0)


Saved = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class FusedTheta:
    """Θ's closed forms for the fused Function (:mod:`tokenformer.nn.kernels.fused`).

    ``forward(S, scale, eps) -> (Θ, saved)``: Θ of the 2-D scores S (which it may overwrite) and
    the tensors its backward needs. ``backward(dY, V, saved, scale, eps) -> (dV, M, c)``: the
    value gradient, and dS = c ⊙ M with c a per-row [L, 1] factor (None: M is dS), which the
    Function folds into the [L, d] operands instead of the [L, n] gradient."""

    forward: Callable[[torch.Tensor, float, float], tuple[torch.Tensor, Saved]]
    backward: Callable[[torch.Tensor, torch.Tensor, Saved, float, float],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


# How exact growth keeps a Θ's function: new tokens with zero keys, or every old token duplicated.
EXACT_GROWTHS = ("zero-keys", "duplicate")


@dataclass(frozen=True)
class ThetaVariant:
    """One Θ: what every part of the package needs to know about it.

    * ``reference(scores, scale, eps)``: Θ row-wise over the last dimension (module docstring,
      :func:`theta`); the ground truth every fast path is tested against.
    * ``default_scale(n)``: the factor s for a layer of n tokens (``scale=None``).
    * ``flops_per_score``: the elementwise FLOPs charged per score (one per arithmetic op,
      exp/erf count as one): :func:`tokenformer.models.config.flops_per_token`.
    * ``normaliser(scores)``: the per-row quantity Θ divides by, [rows] (pruning's ``renorm``);
      None: Θ has none, removing tokens changes no kept token's weight.
    * ``zero_keys_silent``: a token with a zero key takes weight 0 and leaves every other
      token's weight unchanged (adapters start silent).
    * ``exact_growth``: how ``exact`` growth keeps the function (:mod:`tokenformer.ops.growth`):
      ``"zero-keys"`` appends tokens with zero keys (needs ``zero_keys_silent``); ``"duplicate"``
      repeats every old token r times, its value split into r zero-sum parts, so n grows by whole
      multiples only (exact when r copies of a token weigh what it weighed: softmax's normaliser
      and numerator are both multiplied by r).
    * ``fan_in_keys``: keys start at N(0, 1/d_in) instead of the config's ``init_std``.
    * ``fused``: the fused Function's closed forms; None: no fast path, the reference runs.
    * ``cpu_kernel``: the C++ CPU kernel computes it (``nn/kernels/csrc/theta_cpu.cpp``).
    * ``triton``: the Triton kernels' id for it (their ``NORM`` constexpr); None: not covered.
    """

    reference: Callable[[torch.Tensor, float, float], torch.Tensor]
    default_scale: Callable[[int], float]
    flops_per_score: int
    normaliser: Callable[[torch.Tensor], torch.Tensor] | None = None
    zero_keys_silent: bool = True
    exact_growth: Literal["zero-keys", "duplicate"] = "zero-keys"
    fan_in_keys: bool = False
    fused: FusedTheta | None = None
    cpu_kernel: bool = False
    triton: int | None = None

    def __post_init__(self) -> None:
        if self.exact_growth not in EXACT_GROWTHS:
            raise ConfigError(f"exact_growth must be one of {', '.join(EXACT_GROWTHS)}, got "
                              f"{self.exact_growth!r}")
        if self.exact_growth == "zero-keys" and not self.zero_keys_silent:
            raise ConfigError("exact_growth='zero-keys' needs zero_keys_silent: a zero-key token "
                              "that takes weight would change the grown model's output")


# ------------------------------------------------------------------------- default factors
def scale_sqrt_n(num_tokens: int) -> float:
    """√n: the L2 variants' factor in the official code."""
    return math.sqrt(num_tokens)


def scale_n(num_tokens: int) -> float:
    """n: the L1 variants' (softmax's too) factor in the official code."""
    return float(num_tokens)


def scale_one(num_tokens: int) -> float:
    """1: an MLP has no factor (and it must not change with n for growth to be exact)."""
    return 1.0


# ------------------------------------------------------------------------- l2_norm_gelu
def _l2_norm_gelu(scores: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    norm_ = torch.linalg.vector_norm(scores, dim=-1, keepdim=True)
    return F.gelu(scores / (norm_ + eps) * scale)


def _l2_norm(scores: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(scores, dim=-1)


def _l2_norm_gelu_fwd(s: torch.Tensor, scale: float, eps: float) -> tuple[torch.Tensor, Saved]:
    r = _wide(torch.linalg.vector_norm(s, dim=-1, keepdim=True))
    u = s.mul_((scale / (r + eps)).to(s.dtype))  # u = c·S in place of S
    # Θ = GELU(u) is one cheap pass: the backward recomputes it
    return F.gelu(u), (u, r)


def _l2_norm_gelu_bwd(gy: torch.Tensor, vc: torch.Tensor, saved: Saved, scale: float,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    u, r = saved
    buffer = F.gelu(u)  # Θ, recomputed
    grad_v = torch.matmul(buffer.transpose(-1, -2), gy)
    g = torch.matmul(gy, vc.t())  # dΘ
    du = _gelu_backward_(g, u, grad_input=g)  # dΘ is not needed again
    dot = _wide(torch.mul(du, u, out=buffer).sum(dim=-1, keepdim=True))
    del buffer
    m = du.addcmul_(u, (-_k(r, scale, eps) * dot).to(u.dtype))
    return grad_v, m, scale / (r + eps)


# ------------------------------------------------------------------------- gelu_l2/l1_norm
def _gelu_l2_norm(scores: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    act = F.gelu(scores)
    return act / (torch.linalg.vector_norm(act, dim=-1, keepdim=True) + eps) * scale


def _gelu_l1_norm(scores: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    act = F.gelu(scores)
    return act / (torch.linalg.vector_norm(act, ord=1, dim=-1, keepdim=True) + eps) * scale


def _gelu_l2(scores: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(F.gelu(scores), dim=-1)


def _gelu_l1(scores: torch.Tensor) -> torch.Tensor:
    return F.gelu(scores).abs().sum(dim=-1)


def _gelu_norm_fwd(order: int, s: torch.Tensor, scale: float, eps: float
                   ) -> tuple[torch.Tensor, Saved]:
    theta_ = F.gelu(s)
    r = _wide(torch.linalg.vector_norm(theta_, ord=order, dim=-1, keepdim=True))
    theta_ = theta_.mul_((scale / (r + eps)).to(theta_.dtype))
    # GELU'(S) needs S; Θ is kept too since it costs two passes to rebuild
    return theta_, (s, r, theta_)


def _gelu_norm_bwd(order: int, gy: torch.Tensor, vc: torch.Tensor, saved: Saved, scale: float,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    s, r, theta_ = saved
    grad_v = torch.matmul(theta_.transpose(-1, -2), gy)
    g = torch.matmul(gy, vc.t())
    dot = _row_dot(theta_, g)
    if order == 2:
        g = g.addcmul_(theta_, (-_k(r, scale, eps) * dot).to(g.dtype))
    else:
        g = g.addcmul_(torch.sign(theta_), (-dot / scale).to(g.dtype))
    m = _gelu_backward_(g, s, grad_input=g)
    return grad_v, m, scale / (r + eps)


# ------------------------------------------------------------------------- softmax
def _softmax(scores: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    act = torch.exp(scores)
    return act / (act.sum(dim=-1, keepdim=True) + eps) * scale


def _exp_sum(scores: torch.Tensor) -> torch.Tensor:
    return torch.exp(scores).sum(dim=-1)


def _softmax_fwd(s: torch.Tensor, scale: float, eps: float) -> tuple[torch.Tensor, Saved]:
    e = s.exp_()
    r = _wide(e.sum(dim=-1, keepdim=True))
    theta_ = e.mul_((scale / (r + eps)).to(e.dtype))
    return theta_, (theta_, r)


def _softmax_bwd(gy: torch.Tensor, vc: torch.Tensor, saved: Saved, scale: float, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    theta_, _ = saved
    grad_v = torch.matmul(theta_.transpose(-1, -2), gy)
    g = torch.matmul(gy, vc.t())
    return grad_v, g.sub_((_row_dot(theta_, g) / scale).to(g.dtype)).mul_(theta_), None


# ------------------------------------------------------------------------- gelu (MLP control)
def _gelu(scores: torch.Tensor, scale: float, eps: float) -> torch.Tensor:
    act = F.gelu(scores)  # no norm (eps unused); the factor 1 costs no pass
    return act if scale == 1.0 else act * scale


def _gelu_fwd(s: torch.Tensor, scale: float, eps: float) -> tuple[torch.Tensor, Saved]:
    theta_ = F.gelu(s)
    if scale != 1.0:
        theta_ = theta_.mul_(scale)
    return theta_, (s,)  # no norm; Θ is one cheap pass: the backward recomputes it


def _gelu_bwd(gy: torch.Tensor, vc: torch.Tensor, saved: Saved, scale: float, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    (s,) = saved
    buffer = F.gelu(s)  # Θ / s, recomputed
    grad_v = torch.matmul(buffer.transpose(-1, -2), gy)
    if scale != 1.0:
        grad_v = grad_v.mul_(scale)
    del buffer
    g = torch.matmul(gy, vc.t())
    m = _gelu_backward_(g, s, grad_input=g)
    if scale != 1.0:
        m = m.mul_(scale)
    return grad_v, m, None


# ------------------------------------------------------------------------- the table
# FLOPs per score: l2_norm_gelu: square+accumulate (2), divide and scale (2), GELU
# x·0.5·(1+erf(x/√2)) (4); gelu (the MLP control): GELU's 4 alone, as baselines charge a GELU
# MLP's activation.
_GELU_L2 = FusedTheta(functools.partial(_gelu_norm_fwd, 2), functools.partial(_gelu_norm_bwd, 2))
_GELU_L1 = FusedTheta(functools.partial(_gelu_norm_fwd, 1), functools.partial(_gelu_norm_bwd, 1))
THETAS: dict[str, ThetaVariant] = {
    "l2_norm_gelu": ThetaVariant(_l2_norm_gelu, scale_sqrt_n, 8, _l2_norm, cpu_kernel=True,
                                 fused=FusedTheta(_l2_norm_gelu_fwd, _l2_norm_gelu_bwd), triton=0),
    "gelu_l2_norm": ThetaVariant(_gelu_l2_norm, scale_sqrt_n, 8, _gelu_l2, fused=_GELU_L2,
                                 triton=1),
    "gelu_l1_norm": ThetaVariant(_gelu_l1_norm, scale_n, 8, _gelu_l1, fused=_GELU_L1, triton=2),
    # exp(x·k) > 0: a new token always takes a share of the normalisation
    "softmax": ThetaVariant(_softmax, scale_n, 5, _exp_sum, zero_keys_silent=False,
                            exact_growth="duplicate",
                            fused=FusedTheta(_softmax_fwd, _softmax_bwd), triton=3),
    "gelu": ThetaVariant(_gelu, scale_one, 4, None, fan_in_keys=True,
                         fused=FusedTheta(_gelu_fwd, _gelu_bwd), triton=4),
}
# The built-in variants (what the tests and experiments iterate over); THETAS also holds any
# registered since.
THETA_VARIANTS: tuple[str, ...] = tuple(THETAS)


# Adding and removing Θs, checked (tokenformer.registry): a row whose reference is a string or
# whose FLOP count is a float is refused when it is registered, not at its first forward.
_REGISTRY = Registry("Θ variant", THETAS, ThetaVariant, ConfigError, fields={
    "reference": function_rule("(scores, scale, eps) -> Θ(scores)"),
    "default_scale": function_rule("(num_tokens) -> the factor s"),
    "flops_per_score": EntryRule(lambda n: isinstance(n, int) and not isinstance(n, bool)
                                 and n >= 0, "a whole number of FLOPs >= 0"),
    "normaliser": function_rule("(scores) -> the per-row normaliser", optional=True),
    "zero_keys_silent": FLAG_RULE,
    "fan_in_keys": FLAG_RULE,
    "fused": instance_rule(FusedTheta, "a FusedTheta", optional=True),
    "cpu_kernel": FLAG_RULE,
    "triton": instance_rule(int, "the Triton kernels' id of a built-in Θ", optional=True),
}, built_in=THETA_VARIANTS)


def register_theta(name: str, variant: ThetaVariant) -> None:
    """Add Θ ``name`` to :data:`THETAS`: layers and configs accept ``norm=name`` from now on.
    ConfigError, naming the problem, for a name that is taken or no name
    (:data:`tokenformer.registry.NAME_TEXT`) and for a row whose fields are not what
    :class:`ThetaVariant` says (a reference that is no function, ...)."""
    _REGISTRY.add(name, variant)


def unregister_theta(name: str) -> None:
    """Remove a Θ added by :func:`register_theta` (the built-in ones stay)."""
    _REGISTRY.remove(name)


def check_theta(norm: str) -> None:
    if norm not in THETAS:
        raise ConfigError(f"unknown Θ variant {norm!r}; choose one of {', '.join(THETAS)}")


def theta_variant(norm: str) -> ThetaVariant:
    """The :data:`THETAS` row of ``norm``; ConfigError naming the choices for an unknown one."""
    check_theta(norm)
    return THETAS[norm]


def default_scale(norm: str, num_tokens: int) -> float:
    """Θ's factor in the official code: √n for the L2 variants, n for the L1 ones; 1 for the
    plain-GELU control (an MLP has none, and it must not change with n for growth to be exact)."""
    return theta_variant(norm).default_scale(num_tokens)


def key_init_std(norm: str, in_features: int, init_std: float) -> float:
    """The std of a layer's initial keys: the config's ``init_std`` (released: 0.02) for the
    normalised Θs, whose output does not depend on the scores' scale; 1/√d_in (fan-in) for plain
    ``gelu``, so that on LayerNorm-ed input its GELU inputs start at unit RMS, as
    ``l2_norm_gelu``'s a/‖a‖·√n do by construction. With 0.02 keys they would start at
    0.02·√d (0.16 at d = 64), where GELU is nearly linear; a 250-step probe (d 64, 2 layers, LR
    4e-3, docs/architecture.md) trains to 1.986 with 0.02 keys and 1.835 with fan-in keys
    (l2_norm_gelu: 2.044), so the control is not handicapped by its init."""
    return 1.0 / math.sqrt(in_features) if theta_variant(norm).fan_in_keys else init_std


def theta(scores: torch.Tensor, norm: str, scale: float, eps: float = 0.0) -> torch.Tensor:
    """Apply Θ row-wise over the last dimension of ``scores``: the table's reference formula.

    With ``eps == 0`` the arithmetic is the official one (an all-zero row gives NaN, exactly like
    the released code; an ``exp`` overflow in ``softmax`` is not guarded either). ``eps > 0`` adds
    ``eps`` to the norm, which makes all-zero rows map to GELU(0) = 0.
    """
    variant = THETAS.get(norm)  # (every call: one lookup, no validation on the way)
    if variant is None:
        check_theta(norm)  # raises, naming the choices
    return variant.reference(scores, scale, eps)
