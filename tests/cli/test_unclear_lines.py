"""The unclear lines of issue 36, each now one line naming the argument: a symbolic link loop as
an output or an input, a seed beyond 32 bits, a fractional top-k on the command line (what
``--help`` promises), and ``train --resume`` given a model folder (a grow output). Issue 42's:
``generate --top-k-tokens`` of a Transformer baseline (ignored in silence), ``grow --widen`` of
one (answered in ``--grow-at`` keys and TokenFormer words), and a Triton fallback shown as
Python's two-line RuntimeWarning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.models.baselines import TransformerConfig, TransformerLM
from tokenformer.nn.kernels import triton_theta
from tokenformer.training.config import load_config


@pytest.fixture
def model_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig(
        vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, qkv_tokens=4, proj_tokens=4,
        ffn_tokens=8, max_seq_len=32, eos_token_id=None))
    model.save(tmp_path / "model")
    return tmp_path / "model"


@pytest.fixture
def baseline_dir(tmp_path) -> Path:
    """A Transformer baseline of 32 MLP units whose vocabulary is the byte tokenizer's."""
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(
        vocab_size=257, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
        max_seq_len=32, eos_token_id=None))
    model.save(tmp_path / "baseline")
    return tmp_path / "baseline"


@pytest.fixture
def loop(tmp_path) -> Path:
    """loop1 → loop2 → loop1."""
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    return tmp_path / "loop1"


def one_line(capsys, argv: list[str]) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own error: one line, exit 2
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "TOKENFORMER_DEBUG" not in lines[0], f"an unexpected exception: {lines[0]}"
    return lines[0]


@pytest.mark.parametrize("argv", [
    ["grow", "{model}", "{loop}", "--ffn", "2x", "--no-progress"],
    ["train", "--config", "tiny", "--out", "{loop}", "--steps", "1", "--no-progress"],
])
def test_a_symlink_loop_as_output(capsys, model_dir, loop, argv):
    line = one_line(capsys, [a.format(model=model_dir, loop=loop) for a in argv])
    assert str(loop) in line and "symbolic link loop" in line, line


@pytest.mark.parametrize("argv", [
    ["grow", "{loop}", "{new}", "--ffn", "2x", "--no-progress"],
    ["info", "{loop}"],
    ["prune", "{loop}", "{new}", "--ffn", "4", "--by", "value"],
    ["train", "--config", "tiny", "--init-from", "{loop}", "--out", "{new}", "--steps", "1",
     "--no-progress"],
])
@pytest.mark.parametrize("inside", [False, True])
def test_a_symlink_loop_as_input(capsys, loop, tmp_path, argv, inside):
    """The old line was "checkpoint not found", about a path that exists (as a link); a path
    through the loop (loop1/x) is the same loop."""
    given = loop / "x" if inside else loop
    line = one_line(capsys, [a.format(loop=given, new=tmp_path / "new") for a in argv])
    assert str(given) in line and "symbolic link loop" in line, line
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv", [
    ["grow", "{model}", "{new}", "--ffn", "2x", "--seed", "99999999999999999999999"],
    ["train", "--config", "tiny", "--out", "{new}", "--seed", "99999999999999999999999"],
    ["generate", "{model}", "--prompt", "a", "--seed", "4294967296"],
])
def test_a_seed_beyond_32_bits(capsys, model_dir, tmp_path, argv):
    """Was "ValueError: Overflow when unpacking long long", after the model was loaded."""
    line = one_line(capsys, [a.format(model=model_dir, new=tmp_path / "new") for a in argv])
    assert "seed" in line and "4294967295" in line, line
    assert not (tmp_path / "new").exists()


def test_a_fractional_top_k_on_the_command_line_is_a_fraction():
    """--help says INT|FLOAT|NONE: 0.9 is a fraction of the tokens, 3 a count, null dense."""
    model = load_config("tiny", {"model.qkv_top_k": "0.9", "model.ffn_top_k": "3",
                                 "model.proj_top_k": "null"}).model
    assert model["qkv_top_k"] == 0.9 and isinstance(model["qkv_top_k"], float)
    assert model["ffn_top_k"] == 3 and isinstance(model["ffn_top_k"], int)
    assert model["proj_top_k"] is None


def test_a_malformed_top_k_names_every_allowed_type(capsys, tmp_path):
    line = one_line(capsys, ["train", "--config", "tiny", "--out", tmp_path / "new",
                             "--model.qkv_top_k", "abc"])
    assert "model.qkv_top_k must be an integer or a number" in line, line


def test_train_resume_of_a_grow_output_says_to_init_from_it(capsys, model_dir, tmp_path):
    """Was an 880-character "unknown config key(s)" line: its config.json is a model's."""
    assert main(["grow", str(model_dir), str(tmp_path / "g"), "--ffn", "2x",
                 "--no-progress"]) == 0
    capsys.readouterr()
    line = one_line(capsys, ["train", "--resume", tmp_path / "g", "--no-progress"])
    # the length without the folder's path, which the temporary directory decides
    assert f"--init-from {tmp_path / 'g'}" in line, line
    assert len(line.replace(str(tmp_path / "g"), "G")) < 200, line


def test_a_memory_error_without_a_message_says_out_of_memory():
    """Under a memory limit the old line was "error: MemoryError: " with nothing after it."""
    from tokenformer.cli import describe_failure

    assert describe_failure(MemoryError()).startswith("MemoryError: out of memory")


@pytest.mark.parametrize(("argv", "said", "not_said"), [
    # was exit 0, the text byte-identical to a run without the flag
    (["generate", "{model}", "--prompt", "ab", "--tokenizer", "bytes", "--top-k-tokens", "4"],
     ["top-k tokens: a Transformer baseline (transformer) has no parameter tokens to select"],
     []),
    # was "widen=zero widens the MLP alone: give ffn= (its new width) and nothing else; ..."
    (["grow", "{model}", "{new}", "--widen", "zero"],
     ["--widen zero widens the MLP to the width --ffn gives: give it (e.g. --ffn 2x)"], ["="]),
    # was "ffn: the MLP already has 32 units; widen= needs more"
    (["grow", "{model}", "{new}", "--widen", "zero", "--ffn", "32"],
     ["the MLP already has 32 units", "give more than 32 (e.g. 64, or 2x)"], ["="]),
    # was "...; growth only adds parameter tokens or blocks"
    (["grow", "{model}", "{new}", "--widen", "net2net", "--ffn", "16"],
     ["ffn: cannot shrink from 32 to 16; growth only adds MLP units"], ["parameter tokens"]),
    (["grow", "{model}", "{new}", "--widen", "net2net", "--ffn", "64", "--layers", "2",
      "--how", "stack"],
     ["--widen net2net widens the MLP alone: --layers 2, --how stack make another growth"],
     ["="]),
    # was the "give ffn= ... and nothing else" line, naming neither the flag nor the cause
    (["grow", "{model}", "{new}", "--widen", "zero", "--ffn", "64", "--width-noise", "0.1"],
     ["--width-noise 0.1: --width-noise is the symmetry-breaking noise of a widening by "
      "duplication (--widen duplicate, or --hidden); --widen zero makes its new units its own "
      "way"], ["="]),
])
def test_decode_and_widening_flags_of_a_baseline_answer_in_their_words(
        capsys, baseline_dir, tmp_path, argv, said, not_said):
    line = one_line(capsys, [a.format(model=baseline_dir, new=tmp_path / "new") for a in argv])
    assert all(text in line for text in said), line
    assert not any(text in line for text in not_said), line
    assert not (tmp_path / "new").exists()


def test_a_triton_fallback_is_one_warning_line(capsys, monkeypatch, tmp_path):
    """``--pattention-impl triton`` on a CPU without TRITON_INTERPRET falls back to the fused
    path, as documented; the CLI said so in Python's two lines (the file, line number, category
    and the caller's source line). Now: one ``warning:`` line, the run unchanged."""
    monkeypatch.setattr(triton_theta, "_INTERPRET", False)
    monkeypatch.setattr(triton_theta, "_state", {})  # it warns once per process
    assert main(["train", "--config", "tiny", "--pattention-impl", "triton", "--steps", "1",
                 "--samples", "0", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "triton" in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("warning: Pattention impl 'triton' falls back to 'fused': "), err
    if triton_theta.available():  # installed: the reason is the CPU, and what to do about it
        assert lines[0].endswith("no Triton Θ for l2_norm_gelu float32 scores on cpu; set "
                                 "TRITON_INTERPRET=1 before starting to run it on the CPU "
                                 "(Triton's interpreter, slow)"), err
    assert "RuntimeWarning" not in err and "Warning:" not in err, err


@pytest.mark.parametrize("kind", ["folder", "parent-file"])
def test_sparse_study_refuses_a_json_it_cannot_write_before_measuring(capsys, tmp_path, model_dir,
                                                                     kind):
    """``sparse-study --json`` naming a folder (or a path under a file) ran the whole measurement
    and then failed with a raw IsADirectoryError; it is refused before anything is measured."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "file").write_text("x")
    target = tmp_path / "taken" if kind == "folder" else tmp_path / "file" / "out.json"
    line = one_line(capsys, ["sparse-study", "--json", target, "quality", model_dir])
    assert str(target) in line and "--json" in line, line
