"""Hugging Face integration: config/model registration, save/load, generate(), pipeline,
tokenizers, and official ↔ HF conversion. Skipped cleanly when transformers is not installed."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

# Never touch the network, even by accident (read when huggingface_hub is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, pipeline

import tokenformer.hf as H
from tokenformer import ByteTokenizer, HFTokenizer, TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.official import load_official

NEOX_TOKENIZER = Path(__file__).resolve().parents[2] / "shared/data/gpt-neox-20b-tokenizer.json"


def tiny_config(**overrides) -> TokenFormerConfig:
    base = dict(vocab_size=257, hidden_size=32, num_layers=2, num_heads=2, qkv_tokens=16,
                proj_tokens=16, ffn_tokens=48, max_seq_len=64, eos_token_id=256)
    base.update(overrides)
    return TokenFormerConfig(**base)


def spread_weights(model: TokenFormerLM, seed: int = 0) -> TokenFormerLM:
    """Larger random values than the official init, so that greedy decoding is not a constant
    token and comparisons between decoders are meaningful."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def core() -> TokenFormerLM:
    return spread_weights(TokenFormerLM(tiny_config()))


@pytest.fixture(scope="module")
def hf_dir(core, tmp_path_factory) -> Path:
    return H.save_hf(core, tmp_path_factory.mktemp("hf") / "model", tokenizer=ByteTokenizer())


# ------------------------------------------------------------------------------------- config
def test_config_round_trip_and_auto_registration(tmp_path):
    core_cfg = tiny_config(norm="softmax", qkv_scale=3.0, block_norm="both", theta_eps=1e-6)
    hf_cfg = H.TokenFormerHFConfig.from_core(core_cfg)
    assert hf_cfg.to_core() == core_cfg
    # Standard transformers names are aliases of ours.
    assert (hf_cfg.num_hidden_layers, hf_cfg.num_attention_heads,
            hf_cfg.max_position_embeddings) == (2, 2, 64)
    hf_cfg.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is H.TokenFormerHFConfig
    assert loaded.to_core() == core_cfg
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "tokenformer"
    assert type(AutoConfig.for_model("tokenformer")) is H.TokenFormerHFConfig


# ------------------------------------------------------------------------------ save and load
def test_save_load_round_trip_identical_logits(core, hf_dir):
    assert (hf_dir / "model.safetensors").is_file()
    assert not (hf_dir / "pytorch_model.bin").exists()
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # Core names under "model.": to-official is a rename; the tied head is stored once.
    assert keys == {f"model.{k}" for k in core.state_dict()}
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert type(model) is H.TokenFormerForCausalLM
    ids = torch.randint(0, 257, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, core(ids).logits)
        # The loss follows the HF convention (labels shifted inside), equal to the core's.
        assert torch.equal(model(ids, labels=ids).loss, core(ids, labels=ids).loss)
    # Rotary tables are non-persistent buffers: rebuilt on load, not read from the file.
    assert torch.equal(model.model.rotary.cos_cached, core.rotary.cos_cached)


def test_dynamic_cache_incremental_forward_matches_full(hf_dir):
    from transformers import DynamicCache

    model = H.load_hf(hf_dir)
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        first = model(ids[:, :7], past_key_values=cache, use_cache=True)
        steps = [model(ids[:, t:t + 1], past_key_values=first.past_key_values).logits
                 for t in range(7, 12)]
    incremental = torch.cat([first.logits, *steps], dim=1)
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 12


# --------------------------------------------------------------------------------- generation
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generate_equals_core(core, hf_dir, use_cache):
    model = H.load_hf(hf_dir)
    prompt = torch.tensor([list(b"The tokens")])
    ours = core.generate(prompt, 20, eos_token_id=256)
    theirs = model.generate(prompt, max_new_tokens=20, do_sample=False, use_cache=use_cache)
    assert theirs.tolist() == ours.tolist()
    assert len(set(ours[0, 10:].tolist())) > 1  # a non-trivial continuation


def test_left_padded_batch_generate_equals_core(core, hf_dir):
    model = H.load_hf(hf_dir)
    a, b = list(b"A longer prompt"), list(b"short")
    pad = len(a) - len(b)
    ids = torch.tensor([a, [256] * pad + b])
    mask = torch.tensor([[1] * len(a), [0] * pad + [1] * len(b)])
    ours = core.generate(ids, 10, attention_mask=mask, eos_token_id=256)
    theirs = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert theirs.tolist() == ours.tolist()
    # Row 2 generates what it generates alone.
    alone = core.generate(torch.tensor([b]), 10, eos_token_id=256)
    assert ours[1, pad:].tolist() == alone[0].tolist()


def test_padding_rows_never_generated(tmp_path):
    core = spread_weights(TokenFormerLM(tiny_config()))
    with torch.no_grad():  # make the embedding's padding rows win every argmax
        core.word_embeddings.weight[257:] *= 50
    prompt = torch.tensor([list(b"abc")])
    assert int(core(prompt).logits[0, -1].argmax()) >= 257
    model = H.load_hf(H.save_hf(core, tmp_path / "m"))
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert int(out.max()) < 257
    assert out.tolist() == core.generate(prompt, 8, eos_token_id=256).tolist()


def test_pipeline_text_generation(core, hf_dir):
    model, tok = H.load_hf(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    generator = pipeline("text-generation", model=model, tokenizer=tok)
    out = generator("In the beginning", max_new_tokens=12, do_sample=False)
    expected = core.generate(torch.tensor([list(b"In the beginning")]), 12, eos_token_id=256)
    assert out[0]["generated_text"] == ByteTokenizer().decode(expected[0].tolist())


def test_trust_remote_code_loads_without_importing_tokenformer_hf(core, hf_dir, tmp_path):
    ids = torch.arange(0, 40, 3)[None]
    with torch.no_grad():
        torch.save(core(ids).logits, tmp_path / "ref.pt")
    # A fresh interpreter: nothing registered, only the folder's auto_map. (Another process may
    # pick other CPU kernels, so the logits agree to float rounding rather than bit for bit.)
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "torch.set_num_threads(1)\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(hf_dir)!r}, trust_remote_code=True)\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        f"out = m(torch.tensor({ids.tolist()})).logits\n"
        "print(type(m).__module__, (out - ref).abs().max().item())\n"
        "sys.exit(0 if torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max()) "
        "else 3)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.startswith("tokenformer.hf ")


# --------------------------------------------------------------------------------- tokenizers
@functools.lru_cache(maxsize=1)
def _byte_hf_tokenizer():
    return H.to_hf_tokenizer(ByteTokenizer())


@settings(max_examples=40, deadline=None)
@given(st.text(max_size=40))
def test_byte_tokenizer_as_pretrained_tokenizer_fast(text):
    tok = _byte_hf_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == ByteTokenizer().decode(ids)


def test_byte_tokenizer_special_tokens(hf_dir):
    tok = AutoTokenizer.from_pretrained(hf_dir)
    assert (tok.eos_token_id, tok.pad_token_id, len(tok)) == (256, 256, 257)
    assert tok.decode([104, 105, 256], skip_special_tokens=True) == "hi"


@pytest.mark.skipif(not NEOX_TOKENIZER.is_file(), reason="shared GPT-NeoX tokenizer not present")
def test_neox_tokenizer_as_pretrained_tokenizer_fast():
    ours = HFTokenizer(NEOX_TOKENIZER)
    tok = H.to_hf_tokenizer(ours)
    text = "TokenFormer scales by adding parameter tokens. Ünïcödé too!"
    assert tok(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert (tok.eos_token_id, tok.pad_token_id) == (0, 1)


# --------------------------------------------------------------------------------- conversion
def random_official_state(L=2, d=32, qkv=16, proj=24, ffn=48, vocab_rows=128, seed=0):
    """A state dict with the released key names and order (spec §4), tiny dims."""
    g = torch.Generator().manual_seed(seed)
    sd = OrderedDict()
    sd["sequential.0.word_embeddings.weight"] = torch.randn(vocab_rows, d, generator=g) * 0.5
    for i in range(L):
        for name, n in (("attention.query", qkv), ("attention.key", qkv), ("attention.value", qkv),
                        ("attention.proj", proj), ("mlp", ffn)):
            sd[f"sequential.{i + 2}.{name}.key_param_tokens"] = torch.randn(n, d, generator=g)
            sd[f"sequential.{i + 2}.{name}.value_param_tokens"] = torch.randn(n, d, generator=g)
    sd[f"sequential.{L + 3}.norm.weight"] = 1 + 0.1 * torch.randn(d, generator=g)
    sd[f"sequential.{L + 3}.norm.bias"] = 0.1 * torch.randn(d, generator=g)
    return sd


@pytest.fixture(scope="module")
def official_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("official")
    state = random_official_state()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(
        {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 48,
         "rotary_pct": 0.5, "norm_activation_type": "l2_norm_gelu"}))
    return folder, state


def test_convert_official_loads_with_automodel(official_folder, tmp_path, capsys):
    folder, _ = official_folder
    assert main(["convert", "official", str(folder), str(tmp_path / "hf")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    reference = load_official(folder)
    assert model.config.max_seq_len == 48 and model.config.num_heads == 2
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_to_official_round_trip_identical(official_folder, tmp_path):
    folder, state = official_folder
    assert main(["convert", "official", str(folder / "pytorch_model.bin"),
                 str(tmp_path / "hf")]) == 0
    assert main(["convert", "to-official", str(tmp_path / "hf"), str(tmp_path / "back.bin")]) == 0
    back = torch.load(tmp_path / "back.bin", weights_only=True)
    assert list(back) == list(state)  # same keys, same order as the released files
    for key, tensor in state.items():
        assert back[key].dtype == torch.float32 and torch.equal(back[key], tensor), key


def test_to_official_from_our_own_folder(core, tmp_path):
    core.save(tmp_path / "ours")
    assert main(["convert", "to-official", str(tmp_path / "ours"), str(tmp_path / "o.bin")]) == 0
    reloaded = load_official(tmp_path / "o.bin", num_heads=2, max_seq_len=64)
    ids = torch.randint(0, 257, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, core(ids).logits)


@pytest.mark.parametrize("argv", [
    ["convert", "official", "{tmp}/missing.bin", "{tmp}/out"],
    ["convert", "to-official", "{tmp}/not-a-model", "{tmp}/x.bin"],
    ["convert", "official", "{tmp}/garbage.bin", "{tmp}/out"],
])
def test_convert_cli_errors_are_one_line(argv, tmp_path, capsys):
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "garbage.bin").write_bytes(b"not a checkpoint")
    code = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "x.bin").exists()


def test_convert_refuses_to_overwrite(official_folder, tmp_path, capsys):
    folder, _ = official_folder
    (tmp_path / "hf").mkdir()
    assert main(["convert", "official", str(folder), str(tmp_path / "hf")]) != 0
    assert "already exists" in capsys.readouterr().err
