"""Issue 27, what is *in* the files we load: one manifest rule for every load path (section 4),
adapter tensors checked like base weights (section 3), no allocation from a config or header
before it is checked (section 5), adapter names that cannot break the model (section 6).

Each test replays a case of the issue; each failed on the code before the fix (a flipped weight
byte loaded with exit 0, an adapter without a manifest or with NaN / int32 tensors was accepted,
num_layers 10⁶ was built until memory ran out, ``--name forward`` ended in a KeyError).
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tokenformer
from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main as cli
from tokenformer.errors import CheckpointError, ConfigError
from tokenformer.io import checkpoint as ckpt
from tokenformer.io.outputs import write_marker
from tokenformer.models import lm as model_module
from tokenformer.ops import adapters as ad

CONFIG = dict(vocab_size=257, hidden_size=32, num_layers=2, num_heads=2, qkv_tokens=8,
              proj_tokens=8, ffn_tokens=16, max_seq_len=32, eos_token_id=256)


def tiny(seed: int = 0) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig(**CONFIG))


def one_error_line(capsys: pytest.CaptureFixture, code: int) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def flip(path: Path, offset: int = -1) -> None:
    """One bit of one byte: the last byte of a safetensors file is weight data."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def with_manifest(directory: Path) -> Path:
    ckpt.write_manifest(directory)
    return directory


def edit_config(directory: Path, filename: str, /, **changes) -> None:
    """Change fields of a JSON file and rewrite the manifest to match (what an attacker, or a
    careless hand, can always do: a manifest is not a signature)."""
    file = directory / filename
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))
    if (directory / ckpt.MANIFEST_NAME).exists():
        ckpt.write_manifest(directory)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A model folder with a manifest (as train, grow, prune and merge write them)."""
    return with_manifest(tiny().save(tmp_path / "base"))


def save_adapter(base: Path, directory: Path, name: str = "adapter", seed: int = 1) -> Path:
    model = TokenFormerLM.load(base)
    ad.adapt(model, ffn=2, name=name, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # non-zero keys: the adapter changes the function
        for tensor in ad.adapter_state(model, name).values():
            tensor.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return ad.save_adapter(model, name, directory)


# ------------------------------------------------------------------ 4. one manifest rule
def _command(name: str, model: Path, tmp_path: Path, dataset_dir: Path) -> tuple[list, Path]:
    text = tmp_path / "text.txt"
    text.write_text("some text to evaluate on. " * 20)
    out = tmp_path / "out"
    return {
        "generate": ["generate", str(model), "--prompt", "hi", "--max-new-tokens", "2",
                     "--tokenizer", "bytes"],
        "info": ["info", str(model)],
        "eval": ["eval", str(model), "--data", str(text), "--tokenizer", "bytes",
                 "--seq-len", "16", "--no-progress"],
        "to-hf": ["convert", "to-hf", str(model), str(out), "--tokenizer", "bytes"],
        "to-official": ["convert", "to-official", str(model), str(out)],
        "prune": ["prune", str(model), str(out), "--ffn", "8", "--by", "value"],
        "grow": ["grow", str(model), "--ffn", "2x", "--out", str(out), "--no-progress"],
        "adapt": ["adapt", str(model), "--data", str(dataset_dir), "--tokens", "ffn=2",
                  "--out", str(out), "--steps", "1", "--seq-len", "16", "--batch-size", "2",
                  "--eval-batches", "1", "--no-progress"],
    }[name], out


@pytest.mark.parametrize("command", ["generate", "info", "eval", "to-hf", "to-official",
                                     "prune", "grow", "adapt"])
def test_flipped_weight_byte_is_refused_by_every_command(base, tmp_path, dataset_dir, capsys,
                                                         command):
    """One flipped byte in model.safetensors, manifest intact: generate, eval, info and convert
    loaded it with exit 0 (to-hf republished it); now every command refuses it in one line."""
    if command in ("to-hf", "to-official"):
        pytest.importorskip("transformers")
    flip(base / "model.safetensors")
    args, out = _command(command, base, tmp_path, dataset_dir)
    line = one_error_line(capsys, cli(args))
    assert "model.safetensors does not match its sha256" in line
    assert not out.exists()


def test_flipped_base_is_refused_with_adapters(base, tmp_path, capsys):
    """generate --adapter and merge load the base through the same rule."""
    adapter = save_adapter(base, tmp_path / "adapter")
    flip(base / "model.safetensors")
    line = one_error_line(capsys, cli(["merge", str(base), "--adapter", str(adapter),
                                       "--out", str(tmp_path / "m")]))
    assert "sha256" in line and not (tmp_path / "m").exists()
    line = one_error_line(capsys, cli(["generate", str(base), "--adapter", str(adapter),
                                       "--prompt", "hi", "--tokenizer", "bytes"]))
    assert "sha256" in line


def test_python_loaders_verify_a_folder_with_a_manifest(base, tmp_path):
    flip(base / "model.safetensors")
    for load in (tokenformer.load_model, TokenFormerLM.load, TokenFormerLM.from_pretrained):
        with pytest.raises(CheckpointError, match="sha256"):
            load(base)


def test_official_and_hf_folders_with_a_manifest_are_verified(tmp_path):
    """The rule is the folder's, not the format's: an official folder or a Hugging Face folder
    that holds a manifest is verified before it is read."""
    from tokenformer.models.official import save_official

    official = tmp_path / "official"
    official.mkdir()
    save_official(tiny(), official / "pytorch_model.bin")
    flip(with_manifest(official) / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin does not match its sha256"):
        tokenformer.load_model(official)
    pytest.importorskip("transformers")
    from tokenformer.hf import load_hf, save_hf

    hf = with_manifest(save_hf(tiny(), tmp_path / "hf"))
    flip(hf / "model.safetensors")
    for load in (tokenformer.load_model, load_hf):
        with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its sha256"):
            load(hf)


def test_file_added_after_the_manifest_is_refused(tmp_path):
    """A manifest covers what a loader reads: a model.safetensors it does not list (e.g. put
    beside a sharded checkpoint, whose manifest lists no such file) is not read unverified."""
    model = tiny().save(tmp_path / "m")
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").unlink()
    with_manifest(model)
    (model / "model.safetensors").write_bytes(weights)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not in the manifest"):
        tokenformer.load_model(model)


def test_adapter_without_manifest_is_refused(base, tmp_path, capsys):
    """save_adapter always writes a manifest; an adapter folder without one was accepted."""
    adapter = save_adapter(base, tmp_path / "adapter")
    (adapter / ckpt.MANIFEST_NAME).unlink()
    model = TokenFormerLM.load(base)
    with pytest.raises(CheckpointError,
                       match=r"no manifest\.json \(every adapter is saved with one"):
        ad.load_adapter(model, adapter)
    assert ad.adapter_names(model) == []
    line = one_error_line(capsys, cli(["generate", str(base), "--adapter", str(adapter),
                                       "--prompt", "hi", "--tokenizer", "bytes"]))
    assert "manifest" in line


@pytest.mark.parametrize("command", ["prune", "grow"])
def test_command_output_without_its_manifest_is_refused(base, command):
    """A folder whose marker says prune or grow wrote it always had a manifest: without one it
    is incomplete or tampered."""
    (base / ckpt.MANIFEST_NAME).unlink()
    write_marker(base, command)
    with pytest.raises(CheckpointError, match=f"tokenformer {command} wrote it with one"):
        tokenformer.load_model(base)


def test_plain_saved_folder_still_loads_silently(tmp_path, capsys):
    """TokenFormerLM.save writes no manifest (the minimal format, also what users assemble):
    it loads as before, without a word."""
    model = tiny()
    loaded = tokenformer.load_model(model.save(tmp_path / "plain"))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), loaded.parameters(),
                                                 strict=True))
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ 3. adapter tensors
def _forge_adapter(adapter: Path, change) -> Path:
    """Rewrite adapter.safetensors with ``change`` applied, manifest rewritten to match."""
    weights = adapter / ad.ADAPTER_WEIGHTS
    state = load_file(str(weights))
    key = sorted(state)[0]
    state[key] = change(state[key])
    save_file(state, str(weights), metadata={"format": "pt"})
    return with_manifest(adapter)


def _nan(t):
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t[-1, -1] = float("-inf")
    return t


@pytest.mark.parametrize("change,needle", [(_nan, "NaN or infinite"), (_inf, "NaN or infinite"),
                                           (lambda t: t.to(torch.int32), "not floating point"),
                                           (lambda t: t[:1], "has shape")])
def test_adapter_tensors_are_checked_like_base_weights(base, tmp_path, capsys, change, needle):
    """NaN/Inf adapters made generate print NUL bytes (exit 0) and merge write a model every
    loader refused; int32 ones were accepted. Now: one line, nothing attached, nothing written."""
    adapter = _forge_adapter(save_adapter(base, tmp_path / "adapter"), change)
    model = TokenFormerLM.load(base)
    with pytest.raises(CheckpointError, match=needle):
        ad.load_adapter(model, adapter)
    assert ad.adapter_names(model) == [] and not hasattr(model, "_adapter_order")
    line = one_error_line(capsys, cli(["merge", str(base), "--adapter", str(adapter),
                                       "--out", str(tmp_path / "m")]))
    assert needle in line and not (tmp_path / "m").exists()
    line = one_error_line(capsys, cli(["generate", str(base), "--adapter", str(adapter),
                                       "--prompt", "hi", "--tokenizer", "bytes"]))
    assert needle in line


# ------------------------------------------------------------------ 5. no allocation first
def forbid(monkeypatch: pytest.MonkeyPatch, owner: object, attr: str) -> None:
    """From now on, calling ``owner.attr`` fails the test: the refusal must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"{attr} was called before the check")

    monkeypatch.setattr(owner, attr, refuse)


def forbid_building(monkeypatch: pytest.MonkeyPatch) -> None:
    forbid(monkeypatch, model_module.Block, "__init__")  # no block of any model is built


@pytest.fixture
def million_layers(tmp_path: Path) -> Path:
    """A tiny model's folder whose config.json says num_layers = 10⁶ (no manifest)."""
    folder = tiny().save(tmp_path / "m")
    edit_config(folder, "config.json", num_layers=10**6)
    return folder


def test_config_with_a_million_layers_is_refused_before_building(million_layers, monkeypatch):
    """Parameters by hand: a block has 2·32·(3·8 + 8) attention + 2·16·32 FFN = 3,072; the
    embedding 384 (257 padded to 128s) × 32 = 12,288 and the final norm 64. The config says
    10⁶ blocks (3,072,012,352), the file holds 2 (18,496)."""
    forbid_building(monkeypatch)
    with pytest.raises(CheckpointError, match=r"describes a model of 3,072,012,352 parameters "
                                              r"but .* holds 18,496 values: they do not belong"):
        tokenformer.load_model(million_layers)


def test_million_layers_fail_fast_under_an_address_space_cap(million_layers):
    """The issue's replay: `info` under ulimit -v gave a MemoryError traceback after building
    blocks; now one line, at once, without approaching the cap."""
    cap = 3 * 2**30

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "tokenformer", "info", str(million_layers)],
                            preexec_fn=limit, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "do not belong together" in lines[0] and "Traceback" not in result.stderr
    assert time.monotonic() - start < 60


def test_model_beyond_available_memory_is_refused_before_building(tmp_path, monkeypatch):
    """A config that does fit its file is still estimated (models.memory.check_memory) against
    the memory available now before any tensor is made."""
    memory = importlib.import_module("tokenformer.models.memory")
    folder = tiny().save(tmp_path / "m")
    forbid_building(monkeypatch)
    monkeypatch.setattr(memory, "available_memory", lambda: 1000)
    with pytest.raises(CheckpointError, match=r"config.json: \d[\d,]* parameters need about "
                                              r".* GiB of memory; 0.0 GiB are available"):
        TokenFormerLM.load(folder)


def test_official_config_with_a_huge_context_is_refused(tmp_path):
    """An official folder's config.json sets the context (rotary cache) the weights do not
    bound: 10¹² positions are estimated, not allocated."""
    from tokenformer.models.official import official_config, save_official

    model = tiny()
    save_official(model, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(
        {**official_config(model.config), "seq_length": 10**12}))
    with pytest.raises(CheckpointError, match="GiB of memory"):
        tokenformer.load_model(tmp_path)


def test_hf_folder_with_a_million_layers_is_refused_before_building(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from tokenformer.hf import save_hf

    folder = save_hf(tiny(), tmp_path / "hf")
    edit_config(folder, "config.json", num_layers=10**6)
    forbid_building(monkeypatch)
    with pytest.raises(CheckpointError, match="do not belong together"):
        tokenformer.load_model(folder)


def test_adapter_declaring_millions_of_tokens_is_refused_before_allocating(base, tmp_path,
                                                                           monkeypatch, capsys):
    """adapter_config.json declares 3·10⁶ ffn tokens, the 4.5 KB file holds 2: adapt() used to
    allocate the declared tokens before any check. Now the header is compared first."""
    adapter = save_adapter(base, tmp_path / "adapter")
    edit_config(adapter, ad.ADAPTER_CONFIG, tokens={"qkv": 0, "proj": 0, "ffn": 3_000_000})
    assert (adapter / ad.ADAPTER_WEIGHTS).stat().st_size < 8000
    forbid(monkeypatch, ad, "adapt")  # adapt() allocates the declared tokens
    with pytest.raises(CheckpointError, match=r"has shape \(2, 32\), the model expects "
                                              r"\(3000000, 32\)"):
        ad.load_adapter(TokenFormerLM.load(base), adapter)


def test_adapter_header_declaring_more_than_the_file_holds_is_refused(base, tmp_path,
                                                                     monkeypatch):
    """A safetensors header that declares a [3·10⁶, 32] tensor in a few KB: refused from the
    header alone (safetensors checks it against the file's length), nothing allocated."""
    adapter = save_adapter(base, tmp_path / "adapter")
    edit_config(adapter, ad.ADAPTER_CONFIG, tokens={"qkv": 0, "proj": 0, "ffn": 3_000_000})
    header = {k: {"dtype": "F32", "shape": [3_000_000, 32], "data_offsets": [0, 384_000_000]}
              for k in ["layers.0.mlp.key_param_tokens"]}
    raw = json.dumps(header).encode()
    (adapter / ad.ADAPTER_WEIGHTS).write_bytes(len(raw).to_bytes(8, "little") + raw
                                               + bytes(4000))
    with_manifest(adapter)
    forbid(monkeypatch, ad, "adapt")
    with pytest.raises(CheckpointError, match=r"adapter\.safetensors is corrupt or truncated"):
        ad.load_adapter(TokenFormerLM.load(base), adapter)


# ------------------------------------------------------------------ 6. adapter names
RESERVED = ["forward", "keys", "__class__", "training", "_modules"]


@pytest.mark.parametrize("name", RESERVED)
def test_adapter_names_that_collide_with_torch_are_refused(name):
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"adapter name '{name}' is not allowed: use letters"):
        ad.adapt(model, ffn=2, name=name)
    assert ad.adapter_names(model) == []
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    ad.adapt(model, ffn=2, name="ok")  # the model is still usable


@pytest.mark.parametrize("name", ["forward", "_modules"])
def test_cli_adapt_with_a_reserved_name_is_one_line(base, tmp_path, dataset_dir, capsys, name):
    line = one_error_line(capsys, cli(["adapt", str(base), "--data", str(dataset_dir),
                                       "--tokens", "ffn=2", "--name", name,
                                       "--out", str(tmp_path / "a")]))
    assert f"adapter name '{name}' is not allowed" in line and "KeyError" not in line
    assert not (tmp_path / "a").exists()


def test_adapter_file_naming_a_reserved_name_is_refused(base, tmp_path):
    adapter = save_adapter(base, tmp_path / "adapter")
    edit_config(adapter, ad.ADAPTER_CONFIG, name="__class__")
    model = TokenFormerLM.load(base)
    with pytest.raises(CheckpointError,
                       match=r"malformed 'name': adapter name '__class__' is not allowed"):
        ad.load_adapter(model, adapter)
    assert ad.adapter_names(model) == []


def test_two_adapters_with_the_default_name_say_to_use_name(base, tmp_path, capsys):
    first = save_adapter(base, tmp_path / "a1", seed=1)
    second = save_adapter(base, tmp_path / "a2", seed=2)
    line = one_error_line(capsys, cli(["generate", str(base), "--adapter", str(first),
                                       "--adapter", str(second), "--prompt", "hi",
                                       "--tokenizer", "bytes"]))
    assert "already attached" in line and "--name" in line and str(second) in line
    line = one_error_line(capsys, cli(["merge", str(base), "--adapter", str(first),
                                       "--adapter", str(second), "--out", str(tmp_path / "m")]))
    assert "--name" in line and not (tmp_path / "m").exists()
    model = ad.load_adapted(base, [first])  # in Python, a second name is one argument away
    assert ad.load_adapter(model, second, name="second") == "second"
    assert ad.active_adapters(model) == ["adapter", "second"]
