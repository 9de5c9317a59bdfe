"""Transformer baselines: causality, KV cache, parameter/FLOP counts by hand, matched sizes, MLP
widening, fused Q/K/V and gate/up projections."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer import TokenFormerConfig, TokenFormerLM, flops_per_token, grow
from tokenformer.cli import main as cli
from tokenformer.errors import ConfigError, GrowthError
from tokenformer.models.baselines import (
    TransformerConfig,
    TransformerLM,
    build_from_dir_config,
    convert_projections,
    load_model_dir,
    matched_config,
)
from tokenformer.training.config import load_config
from tokenformer.training.lm import build_model_config

ARCHS = ("transformer", "transformer++")


def tiny(arch: str, **kw) -> TransformerConfig:
    base = dict(arch=arch, vocab_size=257, hidden_size=16, num_layers=2, num_heads=2,
                intermediate_size=32, max_seq_len=32)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.fixture(params=[(arch, fused) for fused in (False, True) for arch in ARCHS],
                ids=lambda p: p[0] + ("-fused" if p[1] else ""))
def model(request) -> TransformerLM:
    arch, fused = request.param
    torch.manual_seed(0)
    return TransformerLM(tiny(arch, fused_projections=fused)).eval()


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


# ------------------------------------------------------------------ fused Q/K/V and gate/up
def fused_pair(arch: str, dtype: torch.dtype = torch.float64
               ) -> tuple[TransformerLM, TransformerLM]:
    """An unfused baseline with random weights and the fused one holding the same weights."""
    torch.manual_seed(3)
    plain = TransformerLM(tiny(arch, bias=True)).to(dtype)
    with torch.no_grad():  # biases and norm weights too, so that no part is trivially zero
        for p in plain.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    fused = TransformerLM(tiny(arch, bias=True, fused_projections=True)).to(dtype)
    fused.load_state_dict(convert_projections(plain.state_dict(), fused=True), strict=True)
    return plain, fused


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_compute_the_same_logits_and_gradients(arch):
    """A fused model holding an unfused one's weights (float64): the same logits and loss, and
    gradients that are the unfused ones side by side (Q/K/V rows, gate/up rows), to float64
    rounding (one GEMM sums in another order than three)."""
    plain, fused = fused_pair(arch)
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(4))
    outs = [m(ids, labels=ids) for m in (plain, fused)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-12, atol=1e-12)
    for out in outs:
        out.loss.backward()
    want = convert_projections({n: p.grad for n, p in plain.named_parameters()}, fused=True)
    got = {n: p.grad for n, p in fused.named_parameters()}
    assert set(got) == set(want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-11, atol=1e-12, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_are_one_linear_each_with_the_same_counts(arch):
    """``attention.qkv`` [3d, d] replaces query/key/value and (SwiGLU only) ``mlp.gate_up``
    [2f, d] replaces gate/up; the parameters, their count and the FLOPs are the unfused
    model's; the same seed draws the same weights in either layout."""
    config = tiny(arch, bias=arch == "transformer")
    fused_config = dataclasses.replace(config, fused_projections=True)
    torch.manual_seed(5)
    plain = TransformerLM(config)
    torch.manual_seed(5)
    fused = TransformerLM(fused_config)
    shapes = {n: tuple(p.shape) for n, p in fused.named_parameters() if n.startswith("layers.0.")}
    assert shapes["layers.0.attention.qkv.weight"] == (48, 16)
    assert not any(k in n for n in shapes for k in (".query", ".key", ".value"))
    if arch == "transformer++":
        assert shapes["layers.0.mlp.gate_up.weight"] == (64, 16)
        assert not any(n.endswith(("mlp.gate.weight", "mlp.up.weight")) for n in shapes)
    else:  # GELU MLP: nothing to fuse; biases are fused like the weights
        assert shapes["layers.0.mlp.up.weight"] == (32, 16)
        assert shapes["layers.0.attention.qkv.bias"] == (48,)
    count = sum(p.numel() for p in plain.parameters())
    assert sum(p.numel() for p in fused.parameters()) == count == config.num_parameters()
    assert fused_config.num_parameters() == count
    assert flops_per_token(fused_config, 32) == flops_per_token(config, 32)
    want = convert_projections(plain.state_dict(), fused=True)
    assert set(want) == set(fused.state_dict())
    assert all(torch.equal(t, want[n]) for n, t in fused.state_dict().items())
    back = convert_projections(fused.state_dict(), fused=False)
    assert all(torch.equal(t, back[n]) for n, t in plain.state_dict().items())


def test_fused_model_saves_under_its_names_and_loads_back(tmp_path):
    """config.json carries fused_projections; the weights file holds attention.qkv and
    mlp.gate_up, and loads into the fused model (the function unchanged)."""
    _, fused = fused_pair("transformer++", torch.float32)
    fused.save(tmp_path)
    assert TransformerConfig.load(tmp_path / "config.json") == fused.config
    assert fused.config.to_dict()["fused_projections"] is True
    loaded = load_model_dir(tmp_path)
    assert loaded.config.fused_projections
    assert "layers.1.mlp.gate_up.weight" in loaded.state_dict()
    ids = torch.randint(0, 257, (1, 8))
    assert torch.equal(loaded(ids).logits, fused(ids).logits)


def test_a_fused_baseline_refuses_to_grow_in_one_line():
    model = TransformerLM(tiny("transformer++", fused_projections=True))
    for request in ({"ffn": 64}, {"layers": 3}, {"ffn": 40, "widen": "zero"}):
        with pytest.raises(GrowthError, match=r"^a Transformer baseline with "
                                              r"fused_projections cannot grow: .* train it with "
                                              r"fused_projections false"):
            grow(model, **request)


def test_train_sets_fused_projections_from_the_command_line_and_config(capsys):
    """``--baseline.fused_projections`` is a train flag, and the baseline of a config with it
    is the matched one, fused."""
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    assert "--baseline.fused_projections" in capsys.readouterr().out
    cfg = load_config("tiny", {"arch": "transformer++", "baseline.fused_projections": "true"})
    config = build_model_config(cfg)
    assert config.fused_projections
    plain = build_model_config(load_config("tiny", {"arch": "transformer++"}))
    assert dataclasses.replace(config, fused_projections=False) == plain
