"""The Θ table (tokenformer.nn.theta): docs/architecture.md's "Adding a Θ variant" example, run as
written, against a float64 formula written out here; and the built-in rows against the constants
the package used before the table existed (hand-written, not read back from the table)."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenformer import ConfigError, TokenFormerConfig, TokenFormerLM
from tokenformer.nn.kernels.dispatch import select_impl
from tokenformer.nn.kernels.fused import fused_pattention
from tokenformer.nn.pattention import PATTENTION_IMPLS, Pattention
from tokenformer.nn.theta import (
    THETA_VARIANTS,
    THETAS,
    ThetaVariant,
    register_theta,
    scale_n,
    unregister_theta,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
TOY = "relu_l1_norm"
BUILT_IN = "l2_norm_gelu, gelu_l2_norm, gelu_l1_norm, softmax, gelu"


def doc_example() -> str:
    """The python block of docs/architecture.md's "Adding a Θ variant" section."""
    section = DOC.read_text(encoding="utf-8").split("### Adding a Θ variant", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def example() -> Iterator[dict[str, Any]]:
    """The doc's example run as written (it registers the toy Θ); unregistered afterwards."""
    assert TOY not in THETAS
    namespace: dict[str, Any] = {}
    try:
        exec(compile(doc_example(), str(DOC), "exec"), namespace)
        yield namespace
    finally:
        if TOY in THETAS:
            unregister_theta(TOY)
    assert TOY not in THETAS and tuple(THETAS) == THETA_VARIANTS


def relu_l1_by_hand(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """ReLU(a) / ‖ReLU(a)‖₁ · s, one row at a time in Python floats."""
    rows = []
    for row in scores.reshape(-1, scores.shape[-1]).tolist():
        positive = [max(v, 0.0) for v in row]
        total = math.fsum(positive)
        rows.append([v / total * scale for v in positive])
    return torch.tensor(rows, dtype=torch.float64).reshape(scores.shape)


def test_doc_example_runs_every_impl_through_the_reference_path(example):
    layer = example["layer"].double()
    assert layer.norm == TOY and layer.scale == 256.0  # scale_n: n
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        scores = torch.matmul(x, layer.key_param_tokens.t())
        expected = torch.matmul(relu_l1_by_hand(scores, 256.0), layer.value_param_tokens)
    grads = {}
    for impl in PATTENTION_IMPLS:
        layer.impl = impl
        with torch.no_grad():
            torch.testing.assert_close(layer(x), expected, rtol=1e-10, atol=1e-12)
        layer.zero_grad()
        y = layer(x.requires_grad_())
        assert not any("PattentionFunction" in type(f).__name__
                       for f in (y.grad_fn, *(fn for fn, _ in y.grad_fn.next_functions)) if f)
        y.square().sum().backward()
        grads[impl] = layer.key_param_tokens.grad.clone()
        x = x.detach()
    for impl, grad in grads.items():  # one path for all: identical gradients
        assert torch.isfinite(grad).all() and torch.equal(grad, grads["reference"]), impl


def test_dispatch_falls_back_to_reference_for_a_theta_without_fast_paths(example):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silently: no fast path was asked of it
        for impl in PATTENTION_IMPLS:
            for device in (torch.device("cpu"), torch.device("cuda")):
                for dtype in (torch.float32, torch.bfloat16, torch.float64):
                    for training in (False, True):  # auto's re-lays a bf16 V out at inference
                        assert select_impl(impl, device, dtype, TOY, training=training).name \
                            == ("reference_vt" if impl == "auto" and not training
                                else "reference")
    # Called directly, the fused Function says it has nothing for this Θ.
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="no fused closed forms"):
        fused_pattention(x, torch.randn(8, 64), torch.randn(8, 4), TOY, 8.0)
    # The built-in Θs keep their fast paths (not "reference" for everything).
    assert select_impl("fused", torch.device("cpu"), torch.float32, "l2_norm_gelu",
                       training=False).name == "fused"


def test_a_registered_theta_builds_a_model_and_counts_its_flops(example):
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name("tiny", norm=TOY)
    reference = TokenFormerConfig.from_name("tiny")
    logits = TokenFormerLM(config)(torch.randint(0, config.vocab_size, (2, 8))).logits
    assert torch.isfinite(logits).all()
    # Θ FLOPs per score: 4 (the example's) instead of l2_norm_gelu's 8, on every score
    attention, ffn = config.projection_flops()
    attention_l2, ffn_l2 = reference.projection_flops()
    assert attention_l2 - attention == 4 * (3 * config.qkv_tokens + config.proj_tokens)
    assert ffn_l2 - ffn == 4 * config.ffn_tokens


def test_unregistered_theta_is_refused_with_the_built_in_choices():
    register_theta(TOY, ThetaVariant(lambda s, scale, eps: s, scale_n, 1))
    try:
        assert Pattention(4, 4, 4, norm=TOY).scale == 4.0
    finally:
        unregister_theta(TOY)
    with pytest.raises(ConfigError, match=re.escape(
            f"unknown Θ variant {TOY!r}; choose one of {BUILT_IN}")):
        Pattention(4, 4, 4, norm=TOY)
    with pytest.raises(ConfigError, match=re.escape(
            f"norm must be one of {BUILT_IN}, got {TOY!r}")):
        TokenFormerConfig.from_name("tiny", norm=TOY)
    with pytest.raises(ConfigError, match="built in"):
        unregister_theta("softmax")
    with pytest.raises(ConfigError, match="already registered"):
        register_theta("gelu", THETAS["gelu"])
    with pytest.raises(ConfigError, match="no Θ variant"):
        unregister_theta(TOY)


def _row(**fields: Any) -> ThetaVariant:
    """The plain-GELU row with ``fields`` replaced (built without __post_init__'s rules in the
    way: those concern exact_growth alone)."""
    return ThetaVariant(**{**{f: getattr(THETAS["gelu"], f) for f in (
        "reference", "default_scale", "flops_per_score", "normaliser", "zero_keys_silent",
        "exact_growth", "fan_in_keys", "fused", "cpu_kernel", "triton")}, **fields})


@pytest.mark.parametrize(("name", "variant", "message"), [
    (5, None, "a Θ variant's name must be a non-empty string without spaces, ',' or '=' "
              "(options such as --grow-at write it as key=value), got int 5"),
    ("", None, "a Θ variant's name must be a non-empty string without spaces, ',' or '=' "
               "(options such as --grow-at write it as key=value), got str ''"),
    ("my norm", None, "got str 'my norm'"),
    ("a=b", None, "got str 'a=b'"),
    ("x", "abc", "a Θ variant must be a ThetaVariant, got str 'abc'"),
    ("x", {"reference": "abc"},
     "Θ variant 'x': reference must be a function (scores, scale, eps) -> Θ(scores), got "
     "str 'abc'"),
    ("x", {"default_scale": 2.0}, "Θ variant 'x': default_scale must be a function "
                                  "(num_tokens) -> the factor s, got float 2.0"),
    ("x", {"flops_per_score": 1.5}, "flops_per_score must be a whole number of FLOPs >= 0, "
                                    "got float 1.5"),
    ("x", {"flops_per_score": True}, "flops_per_score must be a whole number of FLOPs >= 0, "
                                     "got bool True"),
    ("x", {"flops_per_score": -1}, "flops_per_score must be a whole number of FLOPs >= 0"),
    ("x", {"normaliser": "sum"}, "normaliser must be a function (scores) -> the per-row "
                                 "normaliser or None, got str 'sum'"),
    ("x", {"fan_in_keys": 1}, "fan_in_keys must be True or False, got int 1"),
    ("x", {"fused": object()}, "fused must be a FusedTheta or None, got object"),
    ("x", {"triton": "0"}, "triton must be the Triton kernels' id of a built-in Θ or None, "
                           "got str '0'"),
])
def test_a_bad_theta_is_refused_when_registered(name, variant, message):
    """Each was accepted (issue 42) and failed at the first forward, or never: the name 5 or '',
    a reference that is a string ("'str' object is not callable" inside a Pattention)."""
    row = _row() if variant is None else _row(**variant) if isinstance(variant, dict) \
        else variant
    try:
        with pytest.raises(ConfigError, match=re.escape(message)):
            register_theta(name, row)
    finally:  # a regression that accepts it must not leave it to the next case
        for added in set(THETAS) - set(THETA_VARIANTS):
            del THETAS[added]


def test_unregistering_an_unknown_theta_names_what_is_registered():
    with pytest.raises(ConfigError, match=re.escape(
            f"no Θ variant named 'nope' is registered (registered: none, besides the built-in "
            f"{BUILT_IN})")):
        unregister_theta("nope")


def test_a_theta_whose_zero_keys_take_weight_must_say_how_exact_growth_duplicates():
    """Zero-key growth is exact only when a zero key is silent: a row claiming both is refused,
    and so is an unknown way; a non-silent Θ that duplicates is accepted."""
    identity = lambda s, scale, eps: s  # noqa: E731
    with pytest.raises(ConfigError, match="needs zero_keys_silent"):
        ThetaVariant(identity, scale_n, 1, zero_keys_silent=False)
    with pytest.raises(ConfigError, match="exact_growth must be one of zero-keys, duplicate"):
        ThetaVariant(identity, scale_n, 1, exact_growth="append")
    row = ThetaVariant(identity, scale_n, 1, zero_keys_silent=False, exact_growth="duplicate")
    assert row.exact_growth == "duplicate"


def test_built_in_rows_hold_the_constants_they_replaced():
    assert THETA_VARIANTS == tuple(BUILT_IN.split(", "))
    scales = {name: THETAS[name].default_scale(49) for name in THETA_VARIANTS}
    assert scales == {"l2_norm_gelu": 7.0, "gelu_l2_norm": 7.0, "gelu_l1_norm": 49.0,
                      "softmax": 49.0, "gelu": 1.0}
    assert {name: v.flops_per_score for name, v in THETAS.items()} == {
        "l2_norm_gelu": 8, "gelu_l2_norm": 8, "gelu_l1_norm": 8, "softmax": 5, "gelu": 4}
    assert [name for name, v in THETAS.items() if v.cpu_kernel] == ["l2_norm_gelu"]
    assert [name for name, v in THETAS.items() if v.fan_in_keys] == ["gelu"]
    assert [name for name, v in THETAS.items() if not v.zero_keys_silent] == ["softmax"]
    assert [name for name, v in THETAS.items() if v.exact_growth == "duplicate"] == ["softmax"]
    assert [name for name, v in THETAS.items() if v.normaliser is None] == ["gelu"]
    # the Triton kernels' NORM constexpr (nn/kernels/triton_theta_jit.py's branches)
    assert {name: v.triton for name, v in THETAS.items()} == {
        "l2_norm_gelu": 0, "gelu_l2_norm": 1, "gelu_l1_norm": 2, "softmax": 3, "gelu": 4}
    assert all(v.fused is not None for v in THETAS.values())
