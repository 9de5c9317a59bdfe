"""CLI `info` / `generate`: bad input gives one `error:` line, a non-zero exit, no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.models.official import save_official


def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse rejects bad option values by exiting
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, *needles: str) -> None:
    assert code != 0
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def tiny_config() -> TokenFormerConfig:
    return TokenFormerConfig(vocab_size=257, hidden_size=32, num_layers=2, num_heads=2,
                             qkv_tokens=8, proj_tokens=8, ffn_tokens=16, max_seq_len=32,
                             eos_token_id=256)


@pytest.fixture
def official_file(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "pytorch_model.bin"
    save_official(TokenFormerLM(tiny_config()), path)
    return path


def corrupt(path: Path, kind: str) -> str:
    """Damage an official checkpoint in place; returns what the error must mention."""
    state = torch.load(path, weights_only=True)
    if kind == "missing key":
        del state["sequential.3.attention.value.key_param_tokens"]
        needle = "sequential.3.attention.value.key_param_tokens"
    elif kind == "extra key":
        state["sequential.2.attention.rotary_emb.inv_freq"] = torch.ones(4)
        needle = "sequential.2.attention.rotary_emb.inv_freq"
    elif kind == "wrong shape":
        state["sequential.2.mlp.value_param_tokens"] = torch.ones(16, 33)
        needle = "sequential.2.mlp.value_param_tokens"
    elif kind == "truncated":
        torch.save(state, path)
        path.write_bytes(path.read_bytes()[:-300])
        return "truncated or corrupt"
    elif kind == "random bytes":
        path.write_bytes(os.urandom(2048))
        return "not a readable PyTorch checkpoint"
    else:  # a text file
        path.write_text("these are not the weights you are looking for\n")
        return "not a readable PyTorch checkpoint"
    torch.save(state, path)
    return needle


BAD_FILES = ["missing key", "extra key", "wrong shape", "truncated", "random bytes", "text"]


@pytest.mark.parametrize("kind", BAD_FILES)
@pytest.mark.parametrize("command", ["info", "generate"])
def test_bad_checkpoint_file(official_file: Path, kind: str, command: str,
                             capsys: pytest.CaptureFixture) -> None:
    needle = corrupt(official_file, kind)
    argv = [command, str(official_file)] + (["--prompt", "hi"] if command == "generate" else [])
    assert_one_error_line(*run(argv, capsys)[::2], needle)


def test_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for argv in (["info", str(tmp_path / "nope")],
                 ["generate", str(tmp_path / "nope"), "--prompt", "hi"]):
        assert_one_error_line(*run(argv, capsys)[::2], "not found", "nope")


def bad_config(kind: str) -> tuple[dict, str]:
    data = tiny_config().to_dict()
    if kind == "heads":
        data["num_heads"] = 3  # 32 % 3 != 0
        return data, "not divisible"
    data["rotary_pct"] = 0.1875  # head_dim 16 × 0.1875 = 3 rotary dims
    return data, "odd"


@pytest.mark.parametrize("kind", ["heads", "rotary"])
def test_bad_config(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture) -> None:
    data, needle = bad_config(kind)
    # 1. our model directory with a bad config.json
    TokenFormerLM(tiny_config()).save(tmp_path / "model")
    (tmp_path / "model" / "config.json").write_text(json.dumps(data))
    assert_one_error_line(*run(["info", str(tmp_path / "model")], capsys)[::2], needle)
    assert_one_error_line(*run(["generate", str(tmp_path / "model"), "--prompt", "x"],
                               capsys)[::2], needle)
    # 2. a config file given directly
    (tmp_path / "bad.yaml").write_text(json.dumps(data))  # JSON is valid YAML
    assert_one_error_line(*run(["info", str(tmp_path / "bad.yaml")], capsys)[::2], needle)
    # 3. an official folder whose config.json is bad
    official = tmp_path / "official"
    official.mkdir()
    save_official(TokenFormerLM(tiny_config()), official / "pytorch_model.bin")
    neox = {"num_layers": 2, "hidden_size": 32, "seq_length": 32,
            "num_attention_heads": data["num_heads"], "rotary_pct": data["rotary_pct"]}
    (official / "config.json").write_text(json.dumps(neox))
    assert_one_error_line(*run(["info", str(official)], capsys)[::2], needle)


def test_prompt_longer_than_rotary_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    TokenFormerLM(tiny_config()).save(tmp_path / "model")
    code, _, err = run(["generate", str(tmp_path / "model"), "--prompt", "a" * 40], capsys)
    assert_one_error_line(code, err, "40 tokens", "32")


@pytest.mark.parametrize("option", [["--top-k", "0"], ["--top-p", "1.5"], ["--max-new-tokens",
                                                                           "-3"]])
def test_bad_sampling_option(option: list[str], capsys: pytest.CaptureFixture) -> None:
    code, _, err = run(["generate", "tiny", "--prompt", "hi", *option], capsys)
    assert_one_error_line(code, err)


def test_info_and_generate_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, err = run(["info", "tokenformer-150m"], capsys)
    assert code == 0 and err == ""
    assert "151,881,216 total" in out
    tiny_config().save(tmp_path / "c.yaml")
    code, out, _ = run(["info", str(tmp_path / "c.yaml")], capsys)
    assert code == 0 and f"{tiny_config().num_parameters():,} total" in out

    torch.manual_seed(0)
    TokenFormerLM(tiny_config()).save(tmp_path / "model")
    argv = ["generate", str(tmp_path / "model"), "--prompt", "hello", "--max-new-tokens", "8"]
    for extra in (["--temperature", "0"], ["--top-k", "5", "--top-p", "0.9", "--seed", "3"]):
        code, out, err = run(argv + extra, capsys)
        assert code == 0 and err == "" and out.startswith("hello")
        again = run(argv + extra, capsys)[1]
        assert again == out  # seeded: the same text every time


def test_generate_released_layout_with_neox_tokenizer(tmp_path: Path, shared_dir: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    """A release folder (official weights + config.json + tokenizer.json) runs end to end."""
    tokenizer = shared_dir / "data" / "gpt-neox-20b-tokenizer.json"
    if not tokenizer.is_file():
        pytest.skip(f"{tokenizer} is absent")
    folder = tmp_path / "release"
    folder.mkdir()
    config = TokenFormerConfig(vocab_size=50277, hidden_size=32, num_layers=1, num_heads=2,
                               qkv_tokens=8, proj_tokens=8, ffn_tokens=16, max_seq_len=64)
    save_official(TokenFormerLM(config), folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(
        {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "seq_length": 64}))
    shutil.copy(tokenizer, folder / "tokenizer.json")
    code, out, err = run(["generate", str(folder), "--prompt", "Hello world",
                          "--max-new-tokens", "5", "--temperature", "0"], capsys)
    assert code == 0 and err == "" and out.startswith("Hello world")


def test_subprocess_errors(official_file: Path, tmp_path: Path) -> None:
    """The real entry point (``python -m tokenformer``), several bad inputs run concurrently."""
    needle = corrupt(official_file, "missing key")
    data, heads_needle = bad_config("heads")
    (tmp_path / "bad.json").write_text(json.dumps(data))
    cases = [  # each process pays torch's import (~2 s): a few representative cases only
        (["info", str(official_file)], needle),
        (["info", str(tmp_path / "bad.json")], heads_needle),
        (["generate", "tiny", "--prompt", "b" * 200], "exceeds the model's context"),
    ]
    env = {**os.environ, "TOKENFORMER_DEBUG": "0"}
    procs = [subprocess.Popen([sys.executable, "-m", "tokenformer", *argv], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for argv, _ in cases]
    for proc, (argv, needle) in zip(procs, cases, strict=True):
        out, err = proc.communicate(timeout=120)
        assert_one_error_line(proc.returncode, err, needle)
        assert out == "", argv


def test_generate_cache_options(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--cache static gives the dynamic cache's text (greedy and seeded sampling); the defaults
    pick the fast path on CUDA only."""
    from tokenformer.cli.commands.model import decoding_defaults

    torch.manual_seed(0)
    TokenFormerLM(tiny_config()).save(tmp_path / "model")
    argv = ["generate", str(tmp_path / "model"), "--prompt", "hello", "--max-new-tokens", "8"]
    for extra in (["--temperature", "0"], ["--top-k", "5", "--seed", "3"]):
        code, dynamic, _ = run(argv + extra, capsys)
        assert code == 0
        code, static, err = run(argv + extra + ["--cache", "static"], capsys)
        assert code == 0 and err == "" and static == dynamic
    assert decoding_defaults("cuda", None, None) == ("static", True)
    assert decoding_defaults("cuda:0", None, False) == ("static", False)
    assert decoding_defaults("cuda", "dynamic", None) == ("dynamic", False)
    assert decoding_defaults("cpu", None, None) == ("dynamic", False)
    assert decoding_defaults("cpu", "static", None) == ("static", False)


def test_generate_compile_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--compile asks for the static cache (on the CPU too, whose default is dynamic); with
    --cache dynamic it is one error line naming both flags, before the model is read (a missing
    model folder is not what it reports)."""
    from tokenformer.cli.commands.model import decoding_defaults

    assert decoding_defaults("cpu", None, True) == ("static", True)
    assert decoding_defaults("cuda", None, True) == ("static", True)
    code, _, err = run(["generate", str(tmp_path / "absent"), "--prompt", "hi", "--cache",
                        "dynamic", "--compile"], capsys)
    assert_one_error_line(code, err, "--compile needs --cache static")
