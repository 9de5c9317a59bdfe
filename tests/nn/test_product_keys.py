"""Product-key Pattention (issue 18 part 2, tokenformer.product_keys)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenformer
from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.errors import ConfigError, GrowthError
from tokenformer.nn.product_keys import ProductKeyPattention, product_top_k


@settings(max_examples=40, deadline=None)
@given(s=st.integers(1, 9), d=st.integers(2, 10), rows=st.integers(1, 6), data=st.data(),
       seed=st.integers(0, 2**16))
def test_selection_equals_brute_force_over_materialised_keys(s, d, rows, data, seed):
    k = data.draw(st.integers(1, s * s))
    g = torch.Generator().manual_seed(seed)
    layer = ProductKeyPattention(d, 3, s * s, k)
    with torch.no_grad():
        for p in (layer.sub_keys_a, layer.sub_keys_b):
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    layer = layer.double()
    x = torch.randn(rows, d, generator=g, dtype=torch.float64)
    scores, index = product_top_k(x, layer.sub_keys_a, layer.sub_keys_b, k)
    keys = torch.cat((layer.sub_keys_a.repeat_interleave(s, 0), layer.sub_keys_b.repeat(s, 1)), 1)
    brute = (x @ keys.t()).topk(k, dim=-1)  # an independent materialisation of K_P
    torch.testing.assert_close(scores.sort(-1).values, brute.values.sort(-1).values)
    assert torch.equal(index.sort(-1).values, brute.indices.sort(-1).values)
    torch.testing.assert_close(layer.keys(), keys)


def _f64_reference(x, a, b, v, k, scale):
    """Brute force in float64: all n scores, top k, l2_norm_gelu over them, weighted value sum."""
    s = a.shape[0]
    keys = torch.cat((a.repeat_interleave(s, 0), b.repeat(s, 1)), 1)
    top = (x @ keys.t()).topk(k, dim=-1)
    w = F.gelu(top.values / top.values.norm(dim=-1, keepdim=True) * scale)
    return (w.unsqueeze(-1) * v[top.indices]).sum(-2)


@pytest.mark.parametrize("k", [1, 4, 9])
def test_forward_and_gradients_match_float64_reference(k):
    torch.manual_seed(0)
    layer = ProductKeyPattention(10, 6, 16, k)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 7, 10, requires_grad=True)
    out = layer(x)
    params = [p.detach().double().requires_grad_() for p in
              (layer.sub_keys_a, layer.sub_keys_b, layer.value_param_tokens)]
    x64 = x.detach().double().requires_grad_()
    ref = _f64_reference(x64.view(-1, 10), *params, k, k ** 0.5).view(2, 7, 6)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    for got, want in zip((x, layer.sub_keys_a, layer.sub_keys_b, layer.value_param_tokens),
                         (x64, *params), strict=True):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-4, atol=1e-5)


def test_growth_keeps_every_old_token():
    torch.manual_seed(0)
    layer = ProductKeyPattention(8, 4, 9, 4)
    big = layer.grown(5, generator=torch.Generator().manual_seed(1))
    assert big.num_tokens == 25 and big.top_k == 4 and big.scale == layer.scale
    old_keys, new_keys = layer.keys(), big.keys()
    for i in range(3):
        for j in range(3):
            assert torch.equal(new_keys[i * 5 + j], old_keys[i * 3 + j])
            assert torch.equal(big.value_param_tokens[i * 5 + j],
                               layer.value_param_tokens[i * 3 + j])
    with pytest.raises(ConfigError):
        layer.grown(2)


def test_lm_with_product_key_ffn_trains():
    torch.manual_seed(0)
    config = TokenFormerConfig.from_name("tiny", ffn_keys="product", ffn_tokens=256,
                                         ffn_product_k=8)
    model = TokenFormerLM(config)
    assert model.num_parameters() == config.num_parameters()
    dense = TokenFormerConfig.from_name("tiny", ffn_tokens=256)
    assert config.projection_flops()[1] < dense.projection_flops()[1] / 3
    ids = torch.randint(0, 64, (4, 32))  # a small vocabulary subset: learnable in a few steps
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_product_config_validation_and_surgery_refusals(tmp_path):
    with pytest.raises(ConfigError, match="square"):
        TokenFormerConfig.from_name("tiny", ffn_keys="product", ffn_tokens=128)
    with pytest.raises(ConfigError, match="ffn_product_k"):
        TokenFormerConfig.from_name("tiny", ffn_keys="product", ffn_tokens=64, ffn_product_k=65)
    with pytest.raises(ConfigError, match="ffn_keys"):
        TokenFormerConfig.from_name("tiny", ffn_keys="sparse")
    model = TokenFormerLM(TokenFormerConfig.from_name("tiny", ffn_keys="product",
                                                      ffn_tokens=64, ffn_product_k=4))
    with pytest.raises(GrowthError, match="product-key"):
        tokenformer.grow(model, ffn="4x")
    with pytest.raises(GrowthError, match="product-key"):
        tokenformer.prune(model, ffn=16, by="value")
    grown = tokenformer.grow(model, qkv="2x")  # the rest of the model still grows
    ids = torch.randint(0, 257, (1, 8))
    torch.testing.assert_close(grown.eval()(ids).logits, model.eval()(ids).logits)
    model.save(tmp_path / "m")
    loaded = TokenFormerLM.load(tmp_path / "m")
    assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def test_autocast_bf16_runs_and_matches_fp32():
    torch.manual_seed(0)
    layer = ProductKeyPattention(16, 8, 64, 4)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(3, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.value_param_tokens.grad.dtype == torch.float32
    torch.testing.assert_close(y.float(), layer(x).detach(), rtol=0.05, atol=0.05)


def test_product_key_model_round_trips_through_hugging_face(tmp_path):
    pytest.importorskip("transformers")
    from tokenformer.hf.modeling import TokenFormerForCausalLM

    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig.from_name("tiny", ffn_keys="product", ffn_tokens=64,
                                                      ffn_product_k=4)).eval()
    TokenFormerForCausalLM.from_core(model).save_pretrained(tmp_path)
    again = TokenFormerForCausalLM.from_pretrained(tmp_path).eval()
    assert again.config.ffn_keys == "product" and again.config.ffn_product_k == 4
    ids = torch.randint(0, 257, (1, 8))
    assert torch.equal(again(ids).logits, model(ids).logits)
