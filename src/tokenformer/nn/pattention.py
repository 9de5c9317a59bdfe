"""Pattention: a token-parameter attention layer that replaces ``nn.Linear``.

``Pattention(X) = Θ(X · K_Pᵀ) · V_P`` where the ``n`` rows of ``K_P`` [n, d_in] and ``V_P``
[n, d_out] are learnable *parameter tokens* and Θ is a modified softmax acting on each row of
scores (over the n parameter tokens). The variants (``norm``: ``l2_norm_gelu``, the official
default, ``gelu_l2_norm``, ``gelu_l1_norm``, ``softmax``, and ``gelu``, the MLP control) and
everything the package knows about each are one table, :data:`tokenformer.nn.theta.THETAS`;
this module re-exports :func:`theta`, :func:`check_theta`, :func:`default_scale`,
:func:`key_init_std` and :data:`THETA_VARIANTS` from there.

``scale`` is part of the layer's state rather than recomputed from ``n`` on every call: growth
(:mod:`tokenformer.ops.growth`) appends tokens and may hold ``scale`` at its pre-growth value,
which is what makes function-preserving growth possible.

``top_k`` (default ``None``: dense) reads each parameter token as an expert: scores and Θ are
computed over all n tokens exactly as in the dense layer, then each input row keeps only its k
largest-|Θ| weights and reads only those k rows of V_P (docs/sparse.md). |Θ|, not Θ: GELU's
outputs can be negative (down to −0.17) and a token's contribution to the output is Θ_j·v_j, whose
size is |Θ_j|·‖v_j‖; ranking by signed Θ would drop a −0.17 weight before a +0.01 one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .kernels.dispatch import DEFAULT_IMPL, IMPLS, check_impl, choose_impl, select_impl
from .theta import THETA_VARIANTS as THETA_VARIANTS  # re-exported: callers import them here
from .theta import check_theta, default_scale
from .theta import key_init_std as key_init_std
from .theta import theta as theta

# The values of a Pattention's ``impl``: "reference": theta() (nn/theta.py) under plain autograd,
# the ground truth; "fused": one custom autograd Function (tokenformer.nn.kernels.fused);
# "kernel": that Function with Θ from the C++ CPU kernel; "triton": Θ from the Triton kernels
# (CUDA; opt-in, unmeasured); "auto" (default): the C++ kernel where it applies, else fused when
# training and reference otherwise; "torch": auto without the kernel, what the documented
# experiments ran with. Which backend each runs for a call is its rule in
# tokenformer.nn.kernels.dispatch.IMPLS, applied by select_impl alone. docs/performance.md.
PATTENTION_IMPLS: tuple[str, ...] = tuple(IMPLS)

# The one map from a TokenFormer block's Pattentions (their names in the block, which are the
# official checkpoints' names too) to the kind whose token count, Θ factor and top-k the config
# holds (``qkv_tokens``, ``proj_scale``, ``ffn_top_k``...). Growth, pruning, adapters, top-k, the
# experiments and the PEFT targets all read the names and kinds from here.
KINDS: tuple[str, ...] = ("qkv", "proj", "ffn")
BLOCK_PATTENTIONS: dict[str, str] = {
    "attention.query": "qkv", "attention.key": "qkv", "attention.value": "qkv",
    "attention.proj": "proj", "mlp": "ffn"}


TopK = int | float | None
# Rows × k × d_out elements up to which the sparse path gathers each row's own k value rows (the
# decode case: one row per call reads k·d_out of V instead of n·d_out); above it, the rows' k
# weights are scattered into a dense Θ and multiplied by all of V (prefill: the union of the rows'
# selections covers nearly all of V anyway, and one GEMM beats a [rows, k, d_out] gather).
GATHER_ELEMENTS = 1 << 20


def resolve_top_k(spec: TopK, num_tokens: int) -> int | None:
    """The k of a ``top_k`` spec for a layer of ``num_tokens`` tokens: ``None`` (dense) stays
    ``None``; an int is a count (capped at n); a float in (0, 1] a fraction of n (at least 1)."""
    check_top_k(spec)
    if spec is None:
        return None
    if isinstance(spec, float):
        return max(1, min(num_tokens, round(spec * num_tokens)))
    return min(int(spec), num_tokens)


def check_top_k(spec: object, what: str = "top_k") -> None:
    if spec is None:
        return
    if isinstance(spec, bool) or not isinstance(spec, (int, float)):
        raise ConfigError(f"{what} must be a token count, a fraction in (0, 1] or null, "
                          f"got {spec!r}")
    if isinstance(spec, float) and not 0.0 < spec <= 1.0:
        raise ConfigError(f"{what}: a fraction must be in (0, 1], got {spec!r}")
    if isinstance(spec, int) and spec < 1:
        raise ConfigError(f"{what}: a count must be >= 1, got {spec!r}")


def top_k_pattention(value: torch.Tensor, theta_: torch.Tensor, k: int) -> torch.Tensor:
    """Θ·V with only each row's ``k`` largest-|Θ| entries of ``theta_`` [..., n] kept. Gathers
    the k value rows per row (decoding) or multiplies a masked dense Θ (many rows); autograd
    flows through both (gradients reach the kept weights and value rows only)."""
    index = theta_.abs().topk(k, dim=-1, sorted=False).indices
    weights = theta_.gather(-1, index)
    rows = weights.numel() // k
    if rows * k * value.shape[1] <= GATHER_ELEMENTS:
        picked = value[index.reshape(rows, k)]  # [rows, k, d_out]: only these rows of V are read
        out = torch.bmm(weights.reshape(rows, 1, k), picked)
        return out.view(*theta_.shape[:-1], value.shape[1])
    return torch.matmul(torch.zeros_like(theta_).scatter(-1, index, weights), value)


def set_pattention_impl(module: nn.Module, impl: str) -> None:
    """Switch every Pattention inside ``module`` (e.g. a whole model) to ``impl``."""
    check_impl(impl)  # also where there is no Pattention
    for m in module.modules():
        if isinstance(m, Pattention):
            m.impl = impl


def set_pattention_top_k(model: nn.Module, *, qkv: TopK = None, proj: TopK = None,
                         ffn: TopK = None) -> None:
    """Set the inference top-k of a TokenFormer's Pattentions by kind (None: dense), and record
    it in ``model.config`` (``qkv_top_k``/``proj_top_k``/``ffn_top_k``) when the config has those
    fields, so ``save``/HF conversion carry it. A count or a fraction of each layer's n."""
    specs = dict(zip(KINDS, (qkv, proj, ffn), strict=True))
    for kind, spec in specs.items():
        check_top_k(spec, f"{kind} top_k")
    config = getattr(model, "config", None)
    for kind, spec in specs.items():
        if config is not None and hasattr(config, f"{kind}_top_k"):
            setattr(config, f"{kind}_top_k", spec)
    for name, m in model.named_modules():
        if isinstance(m, Pattention):
            m.top_k = specs[pattention_kind(name)]


def parse_top_k(spec: TopK | str | dict[str, TopK]) -> dict[str, TopK]:
    """A top-k request for every kind: one value for all (``0.25``, ``64``, ``"0.25"``), a dict
    ``{"ffn": 0.25}``, or a string ``"ffn=0.25,qkv=64"`` (kinds left out stay dense)."""
    def number(text: str) -> TopK:
        text = text.strip()
        try:
            return int(text) if text.isdecimal() else float(text)
        except ValueError:
            raise ConfigError(f"top-k tokens: {text!r} is not a count or a fraction") from None

    if isinstance(spec, str):
        if "=" not in spec:
            spec = number(spec)
        else:
            pairs = [part.split("=", 1) for part in spec.split(",") if part.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ConfigError(f"top-k tokens: malformed {spec!r}; use e.g. 'ffn=0.25,qkv=64'")
            spec = {kind.strip(): number(value) for kind, value in pairs}
    if not isinstance(spec, dict):
        spec = dict.fromkeys(KINDS, spec)
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise ConfigError(f"top-k tokens: unknown kind(s) {', '.join(unknown)}; use "
                          f"{', '.join(KINDS)}")
    out = {kind: spec.get(kind) for kind in KINDS}
    for kind, value in out.items():
        check_top_k(value, f"{kind} top-k tokens")
    return out


def top_k_request(model: nn.Module, spec: TopK | str | dict[str, TopK]) -> dict[str, TopK]:
    """``spec`` parsed (:func:`parse_top_k`) for ``model``, which must have parameter tokens to
    select: a Transformer baseline has none (its projections and MLP are Linear layers), and a
    top-k that changed nothing there was ignored in silence."""
    request = parse_top_k(spec)
    if not any(isinstance(m, Pattention) for m in model.modules()):
        arch = getattr(getattr(model, "config", None), "arch", None)
        what = f"a Transformer baseline ({arch})" if arch else f"a {type(model).__name__}"
        raise ConfigError(f"top-k tokens: {what} has no parameter tokens to select (its "
                          f"projections and MLP are Linear layers); top-k tokens sparsifies a "
                          f"TokenFormer's Pattentions: leave it out")
    return request


@contextlib.contextmanager
def top_k_tokens(model: nn.Module, spec: TopK | str | dict[str, TopK] | None
                 ) -> Iterator[None]:
    """Run a block with :func:`set_pattention_top_k` applied (``spec`` as :func:`parse_top_k`),
    then restore every Pattention's and the config's previous setting. ``None``: no change."""
    if spec is None:
        yield
        return
    request = top_k_request(model, spec)
    config = getattr(model, "config", None)
    saved_config = {kind: getattr(config, f"{kind}_top_k") for kind in request
                    if hasattr(config, f"{kind}_top_k")}
    saved = {m: m.top_k for m in model.modules() if isinstance(m, Pattention)}
    set_pattention_top_k(model, **request)
    try:
        yield
    finally:
        for m, value in saved.items():
            m.top_k = value
        for kind, value in saved_config.items():
            setattr(config, f"{kind}_top_k", value)


def pattention_kind(name: str) -> str:
    """"qkv", "proj" or "ffn" for a Pattention's qualified name in a TokenFormer (the config
    holds one token count, Θ factor and top-k per kind), by :data:`BLOCK_PATTENTIONS`."""
    for suffix, kind in BLOCK_PATTENTIONS.items():
        if name == suffix or name.endswith("." + suffix):
            return kind
    raise ConfigError(f"{name!r} is not a Q/K/V, proj or FFN Pattention of a TokenFormer")


def kind_names(kind: str) -> tuple[str, ...]:
    """The names (relative to a block) of a block's Pattentions of ``kind``."""
    return tuple(name for name, k in BLOCK_PATTENTIONS.items() if k == kind)



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
        impl: str = DEFAULT_IMPL,
        top_k: TopK = None,
    ) -> None:
        super().__init__()
        check_theta(norm)
        self.impl = impl
        check_top_k(top_k)
        for name, value in (("in_features", in_features), ("out_features", out_features),
                            ("num_tokens", num_tokens)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"Pattention {name} must be a positive integer, got {value!r}")
        self.in_features = in_features
        self.out_features = out_features
        self.norm = norm
        self.scale = float(scale) if scale is not None else default_scale(norm, num_tokens)
        self.eps = float(eps)
        self.top_k = top_k  # a count or fraction (resolved against n at each call: survives growth)
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

    @property
    def impl(self) -> str:
        """Which implementation computes this layer (:data:`PATTENTION_IMPLS`); setting it checks
        the name and readies the backend it names (:func:`choose_impl`), wherever it is set."""
        return self._impl

    @impl.setter
    def impl(self, impl: str) -> None:
        self._impl = choose_impl(impl)

    def attend(self, x: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """This layer's Pattention (Θ, scale, eps, impl, top_k) over the tokens ``key``/``value``
        (its own parameters, or more appended: adapters), by the backend select_impl picks."""
        training = torch.is_grad_enabled() and (x.requires_grad or key.requires_grad
                                                or value.requires_grad)  # autograd records it
        backend = select_impl(self.impl, x.device, x.dtype, self.norm, training=training)
        k = None if self.top_k is None else resolve_top_k(self.top_k, key.shape[0])
        if k is not None and k < key.shape[0]:  # Θ over all n scores, then each row's k largest
            return top_k_pattention(value, backend.theta(F.linear(x, key), self, training), k)
        return backend.pattention(x, key, value, self, training)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"num_tokens={self.num_tokens}, norm={self.norm!r}, scale={self.scale:.6g}"
                + (f", top_k={self.top_k!r}" if self.top_k is not None else ""))
