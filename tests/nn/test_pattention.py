"""Pattention against hand-written float64 formulas (spec §1), and its invariants."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer import ConfigError, Pattention
from tokenformer.nn.pattention import PATTENTION_IMPLS

VARIANTS = ("l2_norm_gelu", "gelu_l2_norm", "gelu_l1_norm", "softmax", "gelu")
IMPLS = list(PATTENTION_IMPLS)  # every path (the default auto too), each against the formulas


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def theta_reference(a: torch.Tensor, variant: str, scale: float) -> torch.Tensor:
    """Θ written out from spec §1 (plus the paper's L1 ablation), one row at a time."""
    rows = []
    for row in a.reshape(-1, a.shape[-1]):
        if variant == "l2_norm_gelu":
            out = gelu(row / math.sqrt(float((row * row).sum())) * scale)
        elif variant == "gelu_l2_norm":
            g = gelu(row)
            out = g / math.sqrt(float((g * g).sum())) * scale
        elif variant == "gelu_l1_norm":
            g = gelu(row)
            out = g / float(g.abs().sum()) * scale
        elif variant == "gelu":  # the MLP control: no normalisation
            out = gelu(row) * scale
        else:  # softmax × n, no max-subtraction
            e = torch.exp(row)
            out = e / float(e.sum()) * scale
        rows.append(out)
    return torch.stack(rows).reshape(a.shape)


def make(d_in: int, d_out: int, n: int, variant: str, **kwargs) -> Pattention:
    kwargs.setdefault("impl", "auto")
    torch.manual_seed(0)
    layer = Pattention(d_in, d_out, n, variant, dtype=torch.float64, **kwargs)
    with torch.no_grad():  # larger values than the init so that GELU's curvature matters
        layer.key_param_tokens.normal_(0.0, 0.5)
        layer.value_param_tokens.normal_(0.0, 0.5)
    return layer


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_float64_formula(variant: str, impl: str) -> None:
    layer = make(12, 7, 20, variant, impl=impl)
    x = torch.randn(3, 5, 12, dtype=torch.float64)
    default = {"softmax": 20.0, "gelu_l1_norm": 20.0, "gelu": 1.0}.get(variant, math.sqrt(20))
    assert layer.scale == pytest.approx(default)
    scores = x @ layer.key_param_tokens.detach().T
    expected = theta_reference(scores, variant, default) @ layer.value_param_tokens.detach()
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("scale", [1.0, 1.7])
def test_plain_gelu_is_a_gelu_mlp_forward_and_backward_float64(impl: str, scale: float) -> None:
    """Θ = plain GELU (issue 25's control): Y = s·GELU(X·Kᵀ)·V, a two-layer GELU MLP, and its
    gradients written out by hand: with S = X·Kᵀ, G = dY, M = s·GELU'(S)⊙(G·Vᵀ) (GELU'(x) =
    Φ(x) + x·φ(x)): dX = M·K, dK = Mᵀ·X, dV = (s·GELU(S))ᵀ·G. Every impl (the kernel and auto
    fall back to the fused Function: the C++ kernel covers l2_norm_gelu only)."""
    layer = make(12, 7, 20, "gelu", impl=impl, scale=scale if scale != 1.0 else None)
    assert layer.scale == scale
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(3, 5, 7, dtype=torch.float64)
    y = layer(x)
    y.backward(gy)
    k, v = layer.key_param_tokens.detach(), layer.value_param_tokens.detach()
    s = x.detach() @ k.T
    phi = torch.exp(-s * s / 2) / math.sqrt(2 * math.pi)
    big_phi = 0.5 * (1 + torch.erf(s / math.sqrt(2)))
    m = scale * (big_phi + s * phi) * (gy @ v.T)
    torch.testing.assert_close(y.detach(), scale * gelu(s) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, m @ k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.key_param_tokens.grad,
                               m.reshape(-1, 20).T @ x.detach().reshape(-1, 12),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.value_param_tokens.grad,
                               (scale * gelu(s)).reshape(-1, 20).T @ gy.reshape(-1, 7),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_fixed_scale_is_used(variant: str, impl: str) -> None:
    layer = make(6, 5, 9, variant, scale=2.5, impl=impl)
    x = torch.randn(4, 6, dtype=torch.float64)
    scores = x @ layer.key_param_tokens.detach().T
    expected = theta_reference(scores, variant, 2.5) @ layer.value_param_tokens.detach()
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
    # Appending parameter tokens (what growth does) must not move a scale given explicitly.
    with torch.no_grad():
        layer.key_param_tokens = torch.nn.Parameter(torch.cat(
            (layer.key_param_tokens, torch.zeros(3, 6, dtype=torch.float64))))
        layer.value_param_tokens = torch.nn.Parameter(torch.cat(
            (layer.value_param_tokens, torch.zeros(3, 5, dtype=torch.float64))))
    assert layer.num_tokens == 12 and layer.scale == 2.5


def test_zero_keys_preserve_l2_norm_gelu_with_fixed_scale() -> None:
    """The reason scale is state: zero new keys + held scale = the same function (spec §5)."""
    layer = make(6, 5, 9, "l2_norm_gelu")
    x = torch.randn(4, 6, dtype=torch.float64)
    before = layer(x)
    grown = Pattention(6, 5, 13, "l2_norm_gelu", scale=layer.scale, dtype=torch.float64)
    with torch.no_grad():
        grown.key_param_tokens.zero_()
        grown.key_param_tokens[:9] = layer.key_param_tokens
        grown.value_param_tokens[:9] = layer.value_param_tokens
    torch.testing.assert_close(grown(x), before, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_eps(impl: str) -> None:
    layer = make(4, 3, 8, "l2_norm_gelu", impl=impl)
    zero = torch.zeros(1, 4, dtype=torch.float64)
    assert torch.isnan(layer(zero)).all()  # the official arithmetic: 0 / 0
    layer.eps = 1e-6
    assert torch.equal(layer(zero), torch.zeros(1, 3, dtype=torch.float64))
    x = torch.randn(5, 4, dtype=torch.float64)
    a = x @ layer.key_param_tokens.detach().T
    expected = gelu(a / (a.norm(dim=-1, keepdim=True) + 1e-6) * math.sqrt(8))
    torch.testing.assert_close(layer(x), expected @ layer.value_param_tokens.detach(),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients(variant: str, impl: str) -> None:
    layer = make(5, 4, 6, variant, impl=impl)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, k, v: torch.func.functional_call(
            layer, {"key_param_tokens": k, "value_param_tokens": v}, (x,)),
        (x, layer.key_param_tokens, layer.value_param_tokens))


@settings(max_examples=30, deadline=None)
@given(variant=st.sampled_from(VARIANTS), n=st.integers(1, 24), seed=st.integers(0, 2**16),
       impl=st.sampled_from(IMPLS))
def test_permuting_parameter_tokens_keeps_output(variant: str, n: int, seed: int,
                                                 impl: str) -> None:
    torch.manual_seed(seed)
    layer = make(6, 5, n, variant, impl=impl)
    x = torch.randn(3, 6, dtype=torch.float64)
    before = layer(x)
    perm = torch.randperm(n)
    with torch.no_grad():
        layer.key_param_tokens.copy_(layer.key_param_tokens[perm])
        layer.value_param_tokens.copy_(layer.value_param_tokens[perm])
    torch.testing.assert_close(layer(x), before, rtol=1e-10, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(lead=st.lists(st.integers(1, 3), max_size=3), d_in=st.integers(1, 9),
       d_out=st.integers(1, 9), n=st.integers(1, 9),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       impl=st.sampled_from(IMPLS))
def test_shape_and_dtype(lead: list[int], d_in: int, d_out: int, n: int,
                         dtype: torch.dtype, impl: str) -> None:
    layer = Pattention(d_in, d_out, n, dtype=dtype, impl=impl)
    assert layer.key_param_tokens.shape == (n, d_in)
    assert layer.value_param_tokens.shape == (n, d_out)
    y = layer(torch.randn(*lead, d_in, dtype=dtype))
    assert y.shape == (*lead, d_out) and y.dtype == dtype


def test_official_parameter_names_and_init() -> None:
    torch.manual_seed(0)
    layer = Pattention(64, 32, 4000, value_init_std=0.01)
    assert [name for name, _ in layer.named_parameters()] == ["key_param_tokens",
                                                             "value_param_tokens"]
    assert layer.key_param_tokens.std().item() == pytest.approx(0.02, rel=0.02)
    assert layer.value_param_tokens.std().item() == pytest.approx(0.01, rel=0.02)


@pytest.mark.parametrize("args", [(4, 4, 0), (0, 4, 4), (4, -1, 4), (4, 4, 2.5)])
def test_bad_sizes(args: tuple) -> None:
    with pytest.raises(ConfigError):
        Pattention(*args)


def test_unknown_variant() -> None:
    with pytest.raises(ConfigError, match="unknown Θ variant"):
        Pattention(4, 4, 4, "relu")


def test_bf16_inference_stores_values_column_major_without_changing_them() -> None:
    """bf16 inference re-lays V out column by column (the faster matrix-vector layout on the
    CPU): values, shape and results are unchanged, and the layer still trains."""
    torch.manual_seed(0)
    layer = Pattention(16, 8, 24).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    before = layer.value_param_tokens.detach().clone()
    layer.impl = "reference"
    with torch.no_grad():
        expected = layer(x)
    layer.impl = "auto"
    with torch.inference_mode():
        got = layer(x)
    value = layer.value_param_tokens
    assert value.shape == (24, 8) and value.stride() == (1, 24)
    assert torch.equal(value, before)
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-3)
    layer(x).float().sum().backward()  # a normal tensor again, not an inference tensor
    assert value.grad is not None and torch.isfinite(value.grad).all()
