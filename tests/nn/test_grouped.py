"""One GEMM for Q, K and V (tokenformer.nn.grouped): the same function as the separate layers,
checked against them and against float64; fallbacks where grouping would change the function."""

from __future__ import annotations

import math

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.nn.grouped import groupable, grouped_attend, set_grouped_qkv
from tokenformer.nn.pattention import THETA_VARIANTS, Pattention, theta


def layers(sizes: list[int], d_in: int = 24, d_out: int = 20, dtype=torch.float32, **kw):
    g = torch.Generator().manual_seed(len(sizes) + sum(sizes))
    out = []
    for n in sizes:
        p = Pattention(d_in, d_out, n, dtype=dtype, **kw)
        with torch.no_grad():
            p.key_param_tokens.copy_(torch.randn(n, d_in, generator=g) / math.sqrt(d_in))
            p.value_param_tokens.copy_(torch.randn(n, d_out, generator=g) / math.sqrt(n))
        out.append(p)
    return out


def outputs_and_grads(fn, x, ps):
    x = x.clone().requires_grad_()
    ys = fn(x)
    loss = sum((y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum()
               for y in ys)
    params = [t for p in ps for t in (p.key_param_tokens, p.value_param_tokens)]
    return [y.detach() for y in ys], torch.autograd.grad(loss, [x, *params])


@pytest.mark.parametrize("sizes", [[40, 40, 40], [40, 56, 72]], ids=["equal-n", "grown-n"])
@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_grouped_equals_separate_and_float64(norm, sizes):
    """fp32 grouped == separate within fp32 rounding (normwise), and as close to the float64
    formula as the separate layers are; equal n (one batched value product) and different n per
    projection (per segment). eps > 0 and a zero input row (its scores are all zero) included."""
    ps = layers(sizes, norm=norm, eps=1e-3, impl="fused")
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(3))
    x[0, 2] = 0.0
    assert groupable(ps)
    grouped = outputs_and_grads(lambda x: grouped_attend(x, ps), x, ps)
    separate = outputs_and_grads(lambda x: [p(x) for p in ps], x, ps)

    def formula(x):
        return [theta(x @ p.key_param_tokens.double().t(), norm, p.scale, p.eps)
                @ p.value_param_tokens.double() for p in ps]

    truth = outputs_and_grads(formula, x.double(), ps)
    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for a, b, t in zip([*grouped[0], *grouped[1]], [*separate[0], *separate[1]],
                       [*truth[0], *truth[1]], strict=True):
        assert rel(a, b) < 1e-5
        assert rel(a, t) <= max(4 * rel(b, t), 1e-6), (rel(a, t), rel(b, t))


def test_grouped_lm_equals_separate_and_checkpoint_layout_unchanged():
    """A tiny LM with the one-GEMM Q/K/V: logits and every gradient as the separate layers',
    and the state dict (names, shapes: the official layout) unchanged."""
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name("tiny", theta_eps=1e-6)
    model = TokenFormerLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    keys = {k: v.shape for k, v in model.state_dict().items()}

    def run(on: bool):
        set_grouped_qkv(model, on)
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    sep, grp = run(False), run(True)
    assert all(block.attention.grouped_qkv for block in model.layers)
    torch.testing.assert_close(grp[0], sep[0], rtol=1e-5, atol=1e-5)
    for name, grad in sep[1].items():
        torch.testing.assert_close(grp[1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert {k: v.shape for k, v in model.state_dict().items()} == keys


def test_grouped_inference_matches_separate():
    """No autograd (the C++ kernel's Θ where it applies) gives the separate layers' outputs."""
    ps = layers([32, 32, 32])
    x = torch.randn(5, 24)
    with torch.no_grad():
        for a, b in zip(grouped_attend(x, ps), [p(x) for p in ps], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_not_groupable_falls_back_to_the_layers():
    """Top-k, mixed impls, hooks or a subclass (adapters, PEFT parametrizations) run the
    layers one by one: bit for bit the separate result."""
    x = torch.randn(3, 24)
    cases = {"top-k": layers([40, 40, 40], top_k=8),
             "mixed impl": [*layers([40, 40]), *layers([40], impl="reference")],
             "subclass": [*layers([40, 40]), type("Sub", (Pattention,), {})(24, 20, 40)]}
    hooked = layers([40, 40, 40])
    hooked[1].register_forward_hook(lambda m, i, o: o * 2)
    cases["hook"] = hooked
    for name, ps in cases.items():
        assert not groupable(ps), name
        with torch.no_grad():
            for a, b in zip(grouped_attend(x, ps), [p(x) for p in ps], strict=True):
                assert torch.equal(a, b), name
