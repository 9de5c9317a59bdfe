"""Transformer baselines: causality, KV cache, parameter/FLOP counts by hand, matched sizes, MLP
widening."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer import TokenFormerConfig, TokenFormerLM, flops_per_token
from tokenformer.errors import ConfigError
from tokenformer.models.baselines import (
    TransformerConfig,
    TransformerLM,
    build_from_dir_config,
    load_model_dir,
    matched_config,
)

ARCHS = ("transformer", "transformer++")


def tiny(arch: str, **kw) -> TransformerConfig:
    base = dict(arch=arch, vocab_size=257, hidden_size=16, num_layers=2, num_heads=2,
                intermediate_size=32, max_seq_len=32)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.fixture(params=ARCHS)
def model(request) -> TransformerLM:
    torch.manual_seed(0)
    return TransformerLM(tiny(request.param)).eval()


def test_causal(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 257, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = torch.randint(0, 257, (2, 5))
    a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def test_cached_equals_uncached(model):
    torch.manual_seed(2)
    ids = torch.randint(0, 257, (2, 10))
    full = model(ids).logits
    out = model(ids[:, :6], use_cache=True)
    steps = [out.logits]
    for t in range(6, 10):
        out = model(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    greedy_cached = model.generate(ids[:, :4], 8, use_cache=True)
    greedy_plain = model.generate(ids[:, :4], 8, use_cache=False)
    assert torch.equal(greedy_cached, greedy_plain)


def test_structure():
    neox, plus = TransformerLM(tiny("transformer")), TransformerLM(tiny("transformer++"))
    names = dict(plus.named_parameters())
    assert not any(n.endswith("bias") for n in names), "Transformer++ has no biases"
    assert isinstance(plus.layers[0].input_layernorm, torch.nn.RMSNorm)
    assert plus.config.rotary_dim == plus.config.head_dim  # rotary on every dim
    assert neox.layers[0].attention.query.bias is not None
    assert neox.layers[0].input_layernorm.weight is None  # non-parametric, like TokenFormer
    assert neox.final_norm.weight is not None and neox.final_norm.bias is not None
    assert neox.config.rotary_dim == int(neox.config.head_dim * 0.25)
    # Tied output head: no separate output matrix.
    assert not any("lm_head" in n or "output" in n for n, _ in neox.named_parameters())


def test_parameters_and_flops_by_hand():
    # d=16, 1 layer, 2 heads (head_dim 8), MLP 32, vocab 257 → 384 rows, context 4.
    neox = tiny("transformer", num_layers=1, max_seq_len=4)
    # attention 4·(16·16+16) = 1088; MLP 16·32+32 + 32·16+16 = 1072; final LN 32.
    assert neox.num_parameters(non_embedding=True) == 1088 + 1072 + 32
    assert neox.num_parameters() == 2192 + 384 * 16
    assert TransformerLM(neox).num_parameters() == 2192 + 384 * 16
    f = flops_per_token(neox, 4)
    # Linears 2·in·out (+out for the bias); GELU 4/unit; rotary 3·2·(2 dims)·2 heads = 24;
    # attention 2·2·T·d = 256 plus softmax 5·T·heads = 40; two norms 2·5·d = 160.
    assert f["attention_pattentions"] == 4 * (2 * 16 * 16 + 16) == 2112
    assert f["ffn"] == (2 * 16 * 32 + 32) + 4 * 32 + (2 * 32 * 16 + 16) == 2224
    assert f["token_attention"] == 256 + 40 + 24
    assert f["per_layer"] == 2112 + 2224 + 320 + 160
    assert f["head"] == 2 * 384 * 16 + 5 * 16
    assert f["total"] == 4816 + 12368
    assert flops_per_token(neox, 4, training=True)["total"] == 3 * 17184

    plus = tiny("transformer++", num_layers=1, max_seq_len=4)
    # no biases; SwiGLU 3·d·F; RMSNorm weights 2d per block + d final.
    assert plus.num_parameters(non_embedding=True) == 4 * 256 + 3 * 16 * 32 + 32 + 16
    assert TransformerLM(plus).num_parameters(non_embedding=True) == 2608
    f = flops_per_token(plus, 4)
    assert f["ffn"] == 2 * (2 * 16 * 32) + 5 * 32 + 2 * 32 * 16  # gate, up, SiLU·up, down
    assert f["token_attention"] == 256 + 40 + 3 * 2 * 8 * 2  # rotary on all 8 dims


@settings(max_examples=25, deadline=None)
@given(d=st.sampled_from([32, 64, 128, 256]), qkv=st.integers(16, 512),
       ffn_mult=st.integers(2, 8), layers=st.integers(1, 6), arch=st.sampled_from(ARCHS))
def test_matched_config_within_a_few_percent(d, qkv, ffn_mult, layers, arch):
    tf = TokenFormerConfig(vocab_size=257, hidden_size=d, num_layers=layers, num_heads=4,
                           qkv_tokens=max(qkv, d), proj_tokens=max(qkv, d),
                           ffn_tokens=ffn_mult * max(qkv, d), max_seq_len=128)
    base = matched_config(tf, arch)
    target = tf.num_parameters(non_embedding=True)
    assert abs(base.num_parameters(non_embedding=True) - target) / target < 0.02
    tf_flops = flops_per_token(tf, 128)["total"] - flops_per_token(tf, 128)["head"]
    base_flops = flops_per_token(base, 128)["total"] - flops_per_token(base, 128)["head"]
    assert abs(base_flops - tf_flops) / tf_flops < 0.05
    assert (base.hidden_size, base.num_layers, base.num_heads) == (d, layers, 4)


def test_matched_config_impossible():
    tf = TokenFormerConfig(vocab_size=257, hidden_size=64, num_layers=2, num_heads=4,
                           qkv_tokens=4, proj_tokens=4, ffn_tokens=4, max_seq_len=64)
    with pytest.raises(ConfigError, match="no matched config"):
        matched_config(tf, "transformer")


def test_save_load_roundtrip(tmp_path, model):
    model.save(tmp_path)
    loaded = load_model_dir(tmp_path)
    assert type(loaded) is TransformerLM and loaded.config == model.config
    ids = torch.randint(0, 257, (1, 8))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert build_from_dir_config(tmp_path).config == model.config
    TokenFormerLM(TokenFormerConfig.from_name("tiny")).save(tmp_path / "tf")
    assert type(load_model_dir(tmp_path / "tf")) is TokenFormerLM


def test_bad_config():
    with pytest.raises(ConfigError, match="arch"):
        TransformerConfig(arch="mamba")
    with pytest.raises(ConfigError, match="divisible"):
        tiny("transformer", num_heads=3)
