"""Released-checkpoint loading against an independent float64 reference forward (spec §2, §4).

The reference below is written from the spec with plain torch float64 ops; it imports nothing
from the package, so a shared misreading of the spec cannot make both sides agree.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tokenformer import CheckpointError, ConfigError, TokenFormerConfig, TokenFormerLM
from tokenformer.models.official import infer_config, official_to_ours, save_official


# ------------------------------------------------------------------------ the independent reference
@dataclass
class Official:
    layers: int
    d: int
    heads: int
    qkv: int
    proj: int
    ffn: int
    rows: int = 256
    seq: int = 64
    rotary_pct: float = 0.25
    variant: str = "l2_norm_gelu"
    key_std: float = 0.3  # large enough that GELU's curvature and exp's growth matter

    def config_json(self) -> dict:  # the NeoX YAML keys a released config.json copies
        return {"architectures": ["TokenFormerForCausalLM"], "num_layers": self.layers,
                "hidden_size": self.d, "num_attention_heads": self.heads,
                "qkv_slot_num": self.qkv, "proj_slot_num": self.proj,
                "ffn_slot_num": self.ffn, "seq_length": self.seq, "rotary_pct": self.rotary_pct,
                "norm_activation_type": self.variant, "pos_emb": "rotary"}


def official_state(c: Official, seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    """Random weights with the exact released key names, shapes and order (spec §4)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    state = OrderedDict()
    state["sequential.0.word_embeddings.weight"] = randn(c.rows, c.d, std=1.0)
    for i in range(c.layers):
        p = f"sequential.{i + 2}."
        for name, n in (("attention.query", c.qkv), ("attention.key", c.qkv),
                        ("attention.value", c.qkv), ("attention.proj", c.proj), ("mlp", c.ffn)):
            state[p + name + ".key_param_tokens"] = randn(n, c.d, std=c.key_std)
            state[p + name + ".value_param_tokens"] = randn(n, c.d, std=0.3)
    state[f"sequential.{c.layers + 3}.norm.weight"] = 1 + randn(c.d, std=0.2)
    state[f"sequential.{c.layers + 3}.norm.bias"] = randn(c.d, std=0.2)
    return state


def reference_logits(c: Official, state: dict[str, torch.Tensor], ids: torch.Tensor
                     ) -> torch.Tensor:
    w = {k: v.double() for k, v in state.items()}

    def layer_norm(x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5)

    def gelu(x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    def pattention(x: torch.Tensor, prefix: str) -> torch.Tensor:
        K, V = w[prefix + ".key_param_tokens"], w[prefix + ".value_param_tokens"]
        a, n = x @ K.T, K.shape[0]
        if c.variant == "l2_norm_gelu":
            s = gelu(a / a.norm(dim=-1, keepdim=True) * math.sqrt(n))
        elif c.variant == "gelu_l2_norm":
            s = gelu(a) / gelu(a).norm(dim=-1, keepdim=True) * math.sqrt(n)
        else:  # softmax
            s = torch.exp(a) / torch.exp(a).sum(-1, keepdim=True) * n
        return s @ V

    B, T = ids.shape
    hd = c.d // c.heads
    r = int(hd * c.rotary_pct)
    # Spec: inv_freq, the angles and their cos/sin are float32 numbers (then cast).
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    angles = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos = angles.cos().double()[None, :, None, :]
    sin = angles.sin().double()[None, :, None, :]

    def rotary(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, hd]; dims i and i + r/2 pair up
        out = x.clone()
        x1, x2 = x[..., : r // 2], x[..., r // 2: r]
        out[..., : r // 2] = x1 * cos - x2 * sin
        out[..., r // 2: r] = x2 * cos + x1 * sin
        return out

    x = w["sequential.0.word_embeddings.weight"][ids]
    for i in range(c.layers):
        p = f"sequential.{i + 2}."
        h = layer_norm(x)
        q, k, v = (pattention(h, p + f"attention.{name}").view(B, T, c.heads, hd)
                   for name in ("query", "key", "value"))
        q, k = rotary(q), rotary(k)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        attn = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, c.d)
        x = x + pattention(attn, p + "attention.proj")
        x = x + pattention(layer_norm(x), p + "mlp")
    final = f"sequential.{c.layers + 3}.norm."
    h = layer_norm(x) * w[final + "weight"] + w[final + "bias"]
    return h @ w["sequential.0.word_embeddings.weight"].T


def assert_logits_match(logits: torch.Tensor, reference: torch.Tensor, tol: float = 1e-5) -> None:
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    relative = (logits.double() - reference).abs().max() / reference.abs().max()
    assert relative <= tol, f"max relative error {relative:.3g}"


# ------------------------------------------------------------------------------------ the tests
CONFIGS = {
    # rotary dims (4) fewer than the head dim (16), 4 heads; tested with batch 3
    "l2_norm_gelu": Official(layers=2, d=64, heads=4, qkv=32, proj=24, ffn=96),
    # another Θ, 2 heads of 24 dims with 12 rotary dims, and a 50304-row style padded vocab
    "gelu_l2_norm": Official(layers=3, d=48, heads=2, qkv=20, proj=28, ffn=80, rows=384,
                             rotary_pct=0.5, variant="gelu_l2_norm"),
    # exp(x·k) amplifies fp32 rounding of the scores: keys kept smaller so that the fp32 check
    # measures the implementation, not the conditioning of random weights
    "softmax": Official(layers=2, d=32, heads=2, qkv=16, proj=16, ffn=64, variant="softmax",
                        key_std=0.1),
}


def write_release(tmp_path: Path, c: Official, state: dict, with_config: bool = True) -> Path:
    folder = tmp_path / "release"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    if with_config:
        (folder / "config.json").write_text(json.dumps(c.config_json()))
    return folder


@pytest.mark.parametrize("name", list(CONFIGS))
def test_from_official_matches_reference(tmp_path: Path, name: str) -> None:
    c = CONFIGS[name]
    state = official_state(c)
    folder = write_release(tmp_path, c, state)
    model = TokenFormerLM.from_official(folder).eval()
    assert (model.config.num_heads, model.config.norm, model.config.max_seq_len) == (
        c.heads, c.variant, c.seq)
    ids = torch.randint(0, c.rows, (3, 23), generator=torch.Generator().manual_seed(1))
    reference = reference_logits(c, state, ids)
    with torch.no_grad():
        # exp() without max-subtraction (the official "softmax") amplifies fp32 rounding, which
        # varies with the thread count's matmul kernels: measured up to 1.3e-5 there.
        assert_logits_match(model(ids).logits, reference, 5e-5 if name == "softmax" else 1e-5)
        # In float64 the only differences left are the order of floating-point operations.
        exact = model.double()(ids).logits
    assert (exact - reference).abs().max() / reference.abs().max() < 1e-12


def test_weights_file_without_config_json(tmp_path: Path) -> None:
    c = CONFIGS["l2_norm_gelu"]
    state = official_state(c)
    folder = write_release(tmp_path, c, state, with_config=False)
    model = TokenFormerLM.from_official(folder / "pytorch_model.bin", num_heads=c.heads,
                                        rotary_pct=c.rotary_pct, max_seq_len=c.seq)
    cfg = model.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.qkv_tokens, cfg.proj_tokens,
            cfg.ffn_tokens, cfg.max_seq_len, cfg.padded_vocab_size) == (2, 64, 4, 32, 24, 96, 64,
                                                                         256)
    ids = torch.randint(0, c.rows, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_logits_match(model(ids).logits, reference_logits(c, state, ids))


def test_vocab_rows_not_a_multiple_of_128(tmp_path: Path) -> None:
    c = Official(layers=1, d=32, heads=2, qkv=8, proj=8, ffn=16, rows=300)
    state = official_state(c)
    model = TokenFormerLM.from_official(write_release(tmp_path, c, state))
    assert model.config.padded_vocab_size == model.config.vocab_size == 300
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert_logits_match(model(ids).logits, reference_logits(c, state, ids))


@pytest.mark.parametrize("preset", ["tokenformer-150m", "tokenformer-450m", "tokenformer-900m",
                                    "tokenformer-1-5b", "tokenformer-354m-owt2",
                                    "tokenformer-757m-owt2"])
def test_infer_config_of_every_release(preset: str) -> None:
    """Shapes alone (meta tensors, nothing allocated) give back every released configuration."""
    want = TokenFormerConfig.from_name(preset)
    c = Official(want.num_layers, want.hidden_size, want.num_heads, want.qkv_tokens,
                 want.proj_tokens, want.ffn_tokens, rows=50304)
    shapes = {}
    for i in range(c.layers):
        for name, n in (("attention.query", c.qkv), ("attention.key", c.qkv),
                        ("attention.value", c.qkv), ("attention.proj", c.proj), ("mlp", c.ffn)):
            for kind in ("key", "value"):
                shapes[f"sequential.{i + 2}.{name}.{kind}_param_tokens"] = (n, c.d)
    shapes["sequential.0.word_embeddings.weight"] = (50304, c.d)
    shapes[f"sequential.{c.layers + 3}.norm.weight"] = (c.d,)
    shapes[f"sequential.{c.layers + 3}.norm.bias"] = (c.d,)
    state = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    got = infer_config(official_to_ours(state))
    # The context is not in the weights: the default is the Pile models' 2048.
    assert got == TokenFormerConfig.from_name(preset, max_seq_len=2048)
    assert (got.vocab_size, got.padded_vocab_size, got.rotary_dim) == (50277, 50304,
                                                                       got.head_dim // 4)
    assert got.num_parameters() == want.num_parameters()


class _Evil:
    """A pickled object whose unpickling would create a directory if it were ever run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_deepspeed_model_states(tmp_path: Path) -> None:
    """A DeepSpeed folder (fp16 "module" + pickled foreign objects) loads without running code."""
    c = CONFIGS["l2_norm_gelu"]
    state = OrderedDict((k, v.half()) for k, v in official_state(c, seed=3).items())
    marker = tmp_path / "code-was-executed"
    folder = tmp_path / "owt2"
    (folder / "global_step7").mkdir(parents=True)
    (folder / "latest").write_text("global_step7\n")
    (folder / "config.json").write_text(json.dumps(c.config_json()))
    torch.save({"module": state, "args": argparse.Namespace(num_layers=2, hidden_size=64),
                "global_steps": 7, "buffer_names": [], "optimizer": None,
                "ds_config": {"fp16": {"enabled": True}}, "ds_version": "0.3.15",
                "evil": _Evil(marker)},
               folder / "global_step7" / "mp_rank_00_model_states.pt")
    ids = torch.randint(0, c.rows, (2, 19), generator=torch.Generator().manual_seed(4))
    reference = reference_logits(c, state, ids)  # fp16 weights, computed in float64
    for path, kwargs in ((folder, {}),
                         (folder / "global_step7" / "mp_rank_00_model_states.pt",
                          {"num_heads": c.heads, "max_seq_len": c.seq})):
        model = TokenFormerLM.from_official(path, **kwargs).eval()
        assert model.word_embeddings.weight.dtype == torch.float32
        with torch.no_grad():
            assert_logits_match(model(ids).logits, reference)
    assert not marker.exists()


def test_save_official_round_trip(tmp_path: Path) -> None:
    c = CONFIGS["gelu_l2_norm"]
    state = official_state(c)
    model = TokenFormerLM.from_official(write_release(tmp_path, c, state))
    save_official(model, tmp_path / "again.bin")
    again = torch.load(tmp_path / "again.bin", weights_only=True)
    assert list(again) == list(state)  # the released key order
    assert all(torch.equal(again[k], state[k]) for k in state)


# ------------------------------------------------------------------------ strictness, bad files
def broken(kind: str) -> tuple[dict, str]:
    state = official_state(CONFIGS["softmax"])
    if kind == "missing":
        key = "sequential.3.mlp.value_param_tokens"
        del state[key]
    elif kind == "missing_final_norm":
        key = "sequential.5.norm.weight"
        del state[key]
        del state["sequential.5.norm.bias"]
    elif kind == "extra":
        key = "sequential.2.attention.rotary_emb.inv_freq"
        state[key] = torch.ones(4)
    else:
        key = "sequential.2.attention.proj.value_param_tokens"
        state[key] = torch.ones(16, 31)
    return state, key


@pytest.mark.parametrize("kind", ["missing", "missing_final_norm", "extra", "shape"])
def test_strict_loading_names_the_key(tmp_path: Path, kind: str) -> None:
    state, key = broken(kind)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")):
        TokenFormerLM.from_official(tmp_path / "pytorch_model.bin", num_heads=2)


@pytest.mark.parametrize("content", [b"", b"hello, world\n", os.urandom(4096)])
def test_not_a_checkpoint(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        TokenFormerLM.from_official(tmp_path / "pytorch_model.bin")


def test_truncated_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    torch.save(official_state(CONFIGS["softmax"]), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        TokenFormerLM.from_official(path)


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        TokenFormerLM.from_official(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no pytorch_model\.bin"):
        TokenFormerLM.from_official(tmp_path)


def test_config_json_inconsistent_with_weights(tmp_path: Path) -> None:
    c = CONFIGS["softmax"]
    folder = write_release(tmp_path, c, official_state(c))
    for key, value, message in (("num_attention_heads", 3, "not divisible"),
                                ("rotary_pct", 0.1875, "odd"),
                                ("hidden_size", 48, "hidden_size=48")):
        bad = dict(c.config_json(), **{key: value})
        (folder / "config.json").write_text(json.dumps(bad))
        with pytest.raises((ConfigError, CheckpointError), match=message):
            TokenFormerLM.from_official(folder)


# ------------------------------------------------------------------------ the released tokenizer
def test_neox_tokenizer(shared_dir: Path) -> None:
    from tokenformer import HFTokenizer, load_tokenizer

    path = shared_dir / "data" / "gpt-neox-20b-tokenizer.json"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("Hello world") == [12092, 1533]  # what GPT-NeoX-20B gives
    assert (tok.vocab_size, tok.eos_token_id) == (50277, 0)
    assert tok.backend.token_to_id("<|padding|>") == 1
    assert tok.decode(tok.encode("Pattention, 1.5B, naïve ✓")) == "Pattention, 1.5B, naïve ✓"
    assert tok.identity.startswith("tokenizer.json:sha256:56ac4821")  # spec §4
    assert tok.identity.endswith("5ade")
