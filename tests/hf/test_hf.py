"""Hugging Face integration: config/model registration, save/load, generate(), pipeline,
tokenizers, and official ↔ HF conversion. Skipped cleanly when transformers is not installed."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import sysconfig
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
    # A config saved alone carries the remote code its auto_map names, too.
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == H.AUTO_MAP
    assert (tmp_path / "modeling_tokenformer.py").is_file()
    assert (tmp_path / "configuration_tokenformer.py").is_file()
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


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_cache_under_either_name(hf_dir, name):
    """transformers 5.24 passes the cache as cache= (before: past_key_values=); either name is
    the cache, and the output hands back the same object under the installed release's field
    (the one generate reads: with a fresh cache per step, greedy decoding repeated one token)."""
    from transformers import DynamicCache

    model = H.load_hf(hf_dir)
    ids = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        first = model(ids[:, :8], use_cache=True, **{name: cache})
        returned = first[H.modeling.CACHE_FIELD]
        assert returned is cache and cache.get_seq_length() == 8
        last = model(ids[:, 8:], use_cache=True, **{name: returned}).logits
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(last[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def test_cache_under_both_names_refused(hf_dir):
    from transformers import DynamicCache

    model = H.load_hf(hf_dir)
    with pytest.raises(H.modeling.ConfigError, match="not both"):
        model(torch.tensor([[1, 2]]), cache=DynamicCache(config=model.config),
              past_key_values=DynamicCache(config=model.config))


def test_generate_refuses_a_cache_under_both_names(hf_dir):
    """transformers' generate warned and used cache=, dropping past_key_values= (issue 42): now
    the refusal forward makes, before either cache is touched."""
    from transformers import DynamicCache

    model = H.load_hf(hf_dir)
    old_name, new_name = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with pytest.raises(H.modeling.ConfigError, match=re.escape(
            H.modeling.BOTH_CACHE_NAMES_REFUSED)):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, past_key_values=old_name,
                       cache=new_name)
    assert old_name.get_seq_length() == new_name.get_seq_length() == 0


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


def run_without_tokenformer(script: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter that sees the virtualenv's packages but not tokenformer.

    ``-I -S`` ignores PYTHONPATH (our source tree) and skips site, so no ``.pth`` runs (not the
    editable install either); site-packages is put back on the path by hand, and an import hook
    makes ``tokenformer`` unimportable even where it is installed there (a non-editable install).
    """
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    code = (f"import sys\nsys.path.extend({paths!r})\n"
            "class NoTokenformer:\n"
            "    @staticmethod\n"
            "    def find_spec(name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'tokenformer':\n"
            "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
            "sys.meta_path.insert(0, NoTokenformer)\n"
            "try:\n    import tokenformer\nexcept ImportError:\n    pass\n"
            "else:\n    sys.exit('tokenformer is importable: not an isolated test')\n"
            "import torch\ntorch.set_num_threads(1)\n" + script)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf")}
    return subprocess.run([sys.executable, "-I", "-S", "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def assert_remote_logits_equal(folder: Path, reference: TokenFormerLM, tmp_path: Path,
                               auto: str = "AutoModelForCausalLM", extra: str = "") -> str:
    """Load ``folder`` with trust_remote_code=True where tokenformer is not installed; its logits
    must equal ``reference``'s (to float rounding: another process may pick other CPU kernels).
    """
    ids = torch.arange(0, 60, 3)[None] % reference.config.vocab_size
    with torch.no_grad():
        torch.save(reference.eval()(ids).logits, tmp_path / "ref.pt")
    script = (
        f"from transformers import {auto}\n"
        f"m = {auto}.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        f"with torch.no_grad():\n    out = m(torch.tensor({ids.tolist()})).logits\n"
        "print(type(m).__module__, (out - ref).abs().max().item())\n"
        "assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max()), 'logits differ'\n"
        + extra)
    done = run_without_tokenformer(script, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.startswith("transformers_modules."), done.stdout  # the folder's own code
    return done.stdout


def test_save_hf_folder_loads_where_tokenformer_is_not_installed(core, hf_dir, tmp_path):
    modeling = (hf_dir / "modeling_tokenformer.py").read_text()
    assert "tokenformer/nn/pattention.py" in modeling and "\nfrom ." not in modeling
    assert json.loads((hf_dir / "config.json").read_text())["auto_map"] == H.AUTO_MAP
    # Also: the base model, and a re-save from the remote classes loads again.
    extra = (f"from transformers import AutoModel\n"
             f"b = AutoModel.from_pretrained({str(hf_dir)!r}, trust_remote_code=True)\n"
             f"h = b(torch.tensor([[1, 2, 3]])).last_hidden_state\n"
             f"assert tuple(h.shape) == (1, 3, 32), h.shape\n"
             f"m.save_pretrained({str(tmp_path / 'again')!r})\n"
             f"again = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'again')!r}, "
             f"trust_remote_code=True)\n"
             f"assert torch.equal(again(torch.tensor([[5, 6]])).logits, "
             f"m(torch.tensor([[5, 6]])).logits)\n")
    assert_remote_logits_equal(hf_dir, core, tmp_path, extra=extra)


def test_remote_code_is_generated_from_the_package_source():
    from tokenformer.hf import remote as hf_remote
    from tokenformer.models import lm as model
    from tokenformer.nn import pattention

    text = hf_remote.generate()["modeling_tokenformer.py"]
    # The core classes are in the file verbatim (those without imports of the package).
    for module, cls in ((model, "class Attention("), (pattention, "class Pattention(")):
        source = Path(module.__file__).read_text()
        block = source[source.index(cls):].split("\n\n\n")[0]
        assert block in text
    # The package's own relative imports are all gone (transformers would look for the files).
    assert not re.search(r"^\s*from\s+\.", text, flags=re.MULTILINE)
    compile(text, "modeling_tokenformer.py", "exec")


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory) -> tuple[Path, TokenFormerLM]:
    """A ``Trainer`` run's ``checkpoint-2`` and the trained core model (what it should hold)."""
    from transformers import Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("trainer")
    torch.manual_seed(0)
    model = H.TokenFormerForCausalLM(H.TokenFormerHFConfig.from_core(tiny_config()))
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids}
            for ids in torch.randint(0, 257, (8, 24), generator=g)]
    args = TrainingArguments(output_dir=str(out / "run"), max_steps=2, save_steps=2,
                             per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
                             use_cpu=True, logging_steps=1, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data).train()
    H.to_hf_tokenizer(ByteTokenizer()).save_pretrained(out / "run" / "checkpoint-2")
    return out / "run" / "checkpoint-2", model.model.eval()


def test_trainer_checkpoint_loads_where_tokenformer_is_not_installed(trainer_checkpoint,
                                                                     tmp_path):
    checkpoint, core = trainer_checkpoint
    assert (checkpoint / "modeling_tokenformer.py").is_file()
    assert (checkpoint / "configuration_tokenformer.py").is_file()
    assert_remote_logits_equal(checkpoint, core, tmp_path)


def test_lm_eval_scores_a_trainer_checkpoint_without_tokenformer(trainer_checkpoint, tmp_path):
    """What ``lm_eval --model hf --model_args pretrained=checkpoint-2,trust_remote_code=True``
    does, where tokenformer is not installed: the loglikelihood is the core model's, by hand."""
    pytest.importorskip("lm_eval")
    checkpoint, core = trainer_checkpoint
    context, continuation = b"In the beginning", b" God"
    ids = torch.tensor([list(context + continuation)])
    with torch.no_grad():
        logp = core(ids).logits[0, :-1].double().log_softmax(-1)
    targets = ids[0, 1:]
    expected = logp[torch.arange(len(targets)), targets][-len(continuation):].sum().item()
    script = (
        "from lm_eval.api.instance import Instance\n"
        "from lm_eval.models.huggingface import HFLM\n"
        f"lm = HFLM(pretrained={str(checkpoint)!r}, trust_remote_code=True, batch_size=1, "
        "device='cpu')\n"
        "request = Instance(request_type='loglikelihood', doc={}, idx=0, "
        f"arguments=({context.decode()!r}, {continuation.decode()!r}))\n"
        "print(lm.loglikelihood([request])[0][0])\n")
    done = run_without_tokenformer(script, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) == pytest.approx(expected, abs=1e-4)


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


def test_neox_tokenizer_as_pretrained_tokenizer_fast(shared_dir):
    ours = HFTokenizer(shared_dir / "data" / "gpt-neox-20b-tokenizer.json")
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
    reference = TokenFormerLM.from_official(folder)
    assert model.config.max_seq_len == 48 and model.config.num_heads == 2
    ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_to_official_round_trip_identical(official_folder, tmp_path):
    folder, state = official_folder
    assert main(["convert", "official", str(folder / "pytorch_model.bin"),
                 str(tmp_path / "hf")]) == 0
    assert main(["convert", "to-official", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = torch.load(tmp_path / "back" / "pytorch_model.bin", weights_only=True)
    assert list(back) == list(state)  # same keys, same order as the released files
    for key, tensor in state.items():
        assert back[key].dtype == torch.float32 and torch.equal(back[key], tensor), key


def test_to_official_keeps_vocabulary_eos_and_tokenizer(core, tmp_path):
    """Our byte-level model (257 tokens, padded to 384 rows, eos 256) → official → HF: the
    config says 257 and 256 again, not 384 and 0, and the same logits and ids come back."""
    core.save(tmp_path / "ours")
    assert main(["convert", "to-official", str(tmp_path / "ours"), str(tmp_path / "o")]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"], config["num_attention_heads"],
            config["seq_length"]) == (257, 256, 2, 64)
    reloaded = TokenFormerLM.from_official(tmp_path / "o")
    assert (reloaded.config.vocab_size, reloaded.config.padded_vocab_size,
            reloaded.config.eos_token_id) == (257, 384, 256)
    ids = torch.randint(0, 257, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, core(ids).logits)
    assert main(["convert", "official", str(tmp_path / "o"), str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert (hf.config.vocab_size, hf.generation_config.eos_token_id) == (257, 256)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("héllo", add_special_tokens=False)["input_ids"] == list("héllo".encode())


def test_to_official_refuses_a_tokenizer_beside_the_model_that_does_not_fit(core, tmp_path,
                                                                             capsys):
    """A tokenizer.json beside the model with more tokens (400) than the model has rows (384) is
    refused with one line, not silently left out of the folder."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel

    core.save(tmp_path / "ours")
    (tmp_path / "ours" / "tokenizer_bytes.json").unlink(missing_ok=True)
    vocab = {f"w{i}": i for i in range(400)}
    RawTokenizer(WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "ours" / "tokenizer.json"))
    assert main(["convert", "to-official", str(tmp_path / "ours"), str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ("error: tokenizer has 400 tokens but the model's "
                                       "vocabulary has 384 rows\n")
    assert not (tmp_path / "o").exists()


def test_to_official_refuses_what_the_official_code_cannot_compute(tmp_path, capsys):
    TokenFormerLM(tiny_config(qkv_scale=3.0)).save(tmp_path / "grown")
    assert main(["convert", "to-official", str(tmp_path / "grown"), str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == ("error: the official layout cannot express qkv_scale=3.0: "
                                       "use to-hf\n")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv", [
    ["convert", "official", "{tmp}/missing.bin", "{tmp}/out"],
    ["convert", "to-official", "{tmp}/not-a-model", "{tmp}/x"],
    ["convert", "to-hf", "{tmp}/not-a-model", "{tmp}/out"],
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


# ------------------------------------------------------------------------------------- to-hf
@pytest.mark.parametrize("arch", ["tokenformer", "transformer++"])
def test_convert_to_hf_of_a_trained_model(arch, dataset_dir, tmp_path, capsys):
    """`train` → `convert to-hf` → AutoModelForCausalLM: the same logits and the same tokenizer
    ids as the trained model; the baseline also through its remote code, without tokenformer."""
    from tokenformer.formats.loading import load_model
    from tokenformer.training.config import load_config
    from tokenformer.training.lm import train

    cfg = load_config("tiny", {"data": str(dataset_dir), "out": str(tmp_path / "run"),
                               "threads": 1, "samples": 0, "eval_batches": 1, "steps": 2,
                               "eval_interval": 0, "arch": arch})
    train(cfg, progress=False, print_fn=lambda s: None)
    final = tmp_path / "run" / "final"
    assert main(["convert", "to-hf", str(final), str(tmp_path / "hf")]) == 0
    assert "trust_remote_code=True" in capsys.readouterr().out
    ours = load_model(final).eval()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model.model) is type(ours) and model.config.arch == arch
    ids = torch.randint(0, 257, (2, 20), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ours(ids).logits)
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("In the beginning", add_special_tokens=False)["input_ids"] == \
        list(b"In the beginning")
    if arch != "tokenformer":
        assert_remote_logits_equal(tmp_path / "hf", ours, tmp_path)


@pytest.mark.parametrize("convert", ["convert_to_hf", "convert_to_official"])
def test_library_convert_refuses_to_replace_its_own_input(convert, core, tmp_path):
    """Called from Python with overwrite=True (no CLI checks before it), a conversion whose
    output is its input, or lies inside it, is refused before anything is read or written: the
    model folder is left byte for byte as it was."""
    from tokenformer.errors import OutputError
    from tokenformer.formats import convert as conversions

    model_dir = core.save(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    for out in (model_dir, model_dir / "inside"):
        with pytest.raises(OutputError, match="input"):
            getattr(conversions, convert)(model_dir, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
