"""One GEMM for Q, K and V (tokenformer.nn.grouped): the same function as the separate layers,
checked against them and against float64; fallbacks where grouping would change the function."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.nn.grouped import StackedWeights, groupable, grouped_attend, set_grouped_qkv
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
    check_against_separate_and_float64(layers(sizes, norm=norm, eps=1e-3, impl="fused"))


@pytest.mark.parametrize("sizes", [[40, 40, 40], [40, 56, 72]], ids=["equal-n", "grown-n"])
def test_grouped_with_a_theta_per_layer_equals_separate_and_float64(sizes):
    """Each layer its own Θ variant, factor and eps (one segment each, as when the n differ):
    the separate layers' outputs and gradients, as close to float64 as theirs."""
    ps = layers(sizes, impl="fused")
    for p, norm, scale, eps in zip(ps, ("l2_norm_gelu", "softmax", "gelu_l1_norm"),
                                   (5.0, 40.0, 3.0), (1e-4, 1e-3, 1e-2), strict=True):
        p.norm, p.scale, p.eps = norm, scale, eps
    check_against_separate_and_float64(ps)


def check_against_separate_and_float64(ps: list[Pattention]) -> None:
    x = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(3))
    x[0, 2] = 0.0
    assert groupable(ps)
    grouped = outputs_and_grads(lambda x: grouped_attend(x, ps), x, ps)
    separate = outputs_and_grads(lambda x: [p(x) for p in ps], x, ps)

    def formula(x):
        return [theta(x @ p.key_param_tokens.double().t(), p.norm, p.scale, p.eps)
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


@pytest.mark.parametrize("sizes", [[32, 32, 32], [32, 40, 48]], ids=["equal-n", "grown-n"])
def test_grouped_inference_matches_separate(sizes):
    """No autograd (the C++ kernel's Θ where it applies, on each segment's strided rows when the
    n differ) gives the separate layers' outputs."""
    ps = layers(sizes)
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


class OpNames(TorchDispatchMode):
    """The names of the aten ops run under it (``cat``, ``mm``, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def grouped_ops(x: torch.Tensor, ps: list[Pattention], weights: StackedWeights
                ) -> tuple[list[torch.Tensor], list[str]]:
    with OpNames() as ops:
        ys = grouped_attend(x, ps, weights)
    return ys, ops.names


def test_inference_reuses_the_stacked_weights():
    """Calls that autograd does not record concatenate the keys and stack the values once, then
    reuse them (a decoding step reads the weights instead of copying them); a recorded call
    (training) drops them, and the next inference call makes them again."""
    ps, weights = layers([40, 40, 40]), StackedWeights()
    x = torch.randn(5, 24)
    with torch.no_grad():
        first, made = grouped_ops(x, ps, weights)
        again, reused = grouped_ops(x, ps, weights)
    assert {"cat", "stack"} <= set(made)
    assert "cat" not in reused and "stack" not in reused
    for a, b, c in zip(first, again, [p(x) for p in ps], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
    grouped_attend(x.requires_grad_(), ps, weights)
    with torch.no_grad():
        assert "cat" in grouped_ops(x, ps, weights)[1]


def grow_in_place(ps: list[Pattention]) -> None:
    """8 more tokens per layer, new Parameters (random keys: the function changes)."""
    g = torch.Generator().manual_seed(9)
    for p in ps:
        for name in ("key_param_tokens", "value_param_tokens"):
            old = getattr(p, name).detach()
            setattr(p, name, nn.Parameter(torch.cat([old, torch.randn(8, old.shape[1],
                                                                      generator=g) / 5])))


def optimizer_step(ps: list[Pattention], **options) -> None:
    """One AdamW step on a loss through the separate layers (not the grouped call, which would
    drop the cache on its own)."""
    optimizer = torch.optim.AdamW([t for p in ps for t in p.parameters()], lr=0.05, **options)
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(4))
    sum(p(x).square().sum() for p in ps).backward()
    optimizer.step()


def load_other_state(ps: list[Pattention]) -> None:
    for p, other in zip(ps, layers([40, 41, 42]), strict=True):
        p.load_state_dict({k: v[:40] for k, v in other.state_dict().items()})


def edit_in_place(ps: list[Pattention]) -> None:
    with torch.no_grad():
        ps[1].value_param_tokens.mul_(2)


def assign_data(ps: list[Pattention]) -> None:
    ps[2].value_param_tokens.data = ps[2].value_param_tokens.detach() * 2  # a new storage


PARAMETER_CHANGES = {"growth": grow_in_place, "load_state_dict": load_other_state,
                     "optimizer step": optimizer_step,
                     "fused optimizer step": lambda ps: optimizer_step(ps, fused=True),
                     "in-place edit": edit_in_place, "param.data assignment": assign_data}


@pytest.mark.parametrize("change", PARAMETER_CHANGES)
def test_stacked_weights_follow_parameter_changes(change):
    """After growth (new Parameters), ``load_state_dict`` (an in-place copy), an optimizer step
    (foreach AdamW bumps the parameters' versions; fused AdamW does not, and the step count
    catches it), an in-place edit or a ``.data`` assignment, the cached inference path computes
    the changed layers' function: the separate layers' outputs."""
    ps, weights = layers([40, 40, 40]), StackedWeights()
    x = torch.randn(5, 24)
    with torch.no_grad():
        before = grouped_attend(x, ps, weights)
    PARAMETER_CHANGES[change](ps)
    with torch.no_grad():
        after, expected = grouped_attend(x, ps, weights), [p(x) for p in ps]
    assert any(not torch.allclose(a, b) for a, b in zip(after, before, strict=True))
    for a, b in zip(after, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_lm_inference_follows_training():
    """A TokenFormer with the one-GEMM Q/K/V: eval logits equal the separate layers' before and
    after a training step (the blocks' cached weights follow the parameters)."""
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name("tiny", theta_eps=1e-6)
    model = TokenFormerLM(config)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def logits(grouped: bool) -> torch.Tensor:
        set_grouped_qkv(model, grouped)
        with torch.no_grad():
            return model.eval()(ids).logits

    for _ in range(2):
        torch.testing.assert_close(logits(True), logits(False), rtol=1e-5, atol=1e-5)
        logits(True)  # twice: the second reads the cache
        model.train()
        set_grouped_qkv(model, False)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
