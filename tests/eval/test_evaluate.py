"""Evaluation: sliding windows, loss/perplexity/bits-per-byte against hand-computed NLL, the eval
CLI and its errors, and one lm-eval run on the shipped offline tasks."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# Never touch the network, even by accident (read when huggingface_hub is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.eval.evaluate import evaluate_text, sliding_windows

TEXT = "In the beginning was the Word — ünïcödé, and tabs\tand lines.\n"


@pytest.fixture(scope="module")
def model() -> TokenFormerLM:
    torch.manual_seed(0)
    config = TokenFormerConfig(vocab_size=257, hidden_size=32, num_layers=2, num_heads=2,
                               qkv_tokens=16, proj_tokens=16, ffn_tokens=48, max_seq_len=96,
                               eos_token_id=256)
    model = TokenFormerLM(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # spread the weights so that losses differ between contexts
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "model"
    model.save(path)
    return path


def nll_float64(model: TokenFormerLM, ids: list[int]) -> list[float]:
    """Per-token NLL of ids[1:] given everything before, in float64, from one forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [-float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


# ------------------------------------------------------------------------------------ windows
@settings(max_examples=200, deadline=None)
@given(st.integers(2, 300), st.integers(2, 64), st.data())
def test_windows_score_every_token_once_with_enough_context(n, seq_len, data):
    stride = data.draw(st.integers(1, seq_len - 1))
    windows = sliding_windows(n, seq_len, stride)
    scored = []
    for begin, end, k in windows:
        assert 0 <= begin < end <= n and end - begin <= seq_len and k >= 1
        for p in range(end - k, end):
            assert p - begin >= min(p, seq_len - stride)  # context inside the window
            scored.append(p)
    assert scored == list(range(1, n))


def test_one_window_loss_equals_hand_computed_nll(model):
    ids = list(TEXT.encode())
    result = evaluate_text(model, ids, progress=False)
    expected = nll_float64(model, ids)
    assert result["tokens"] == len(ids) - 1
    assert result["loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)


def test_stride_one_gives_each_token_its_full_window_of_context(model):
    ids = np.random.default_rng(0).integers(0, 257, 40).tolist()
    L = 12
    expected = [nll_float64(model, ids[max(0, p - L + 1):p + 1])[-1] for p in range(1, 40)]
    result = evaluate_text(model, ids, seq_len=L, stride=1, batch_size=5, progress=False)
    assert result["tokens"] == 39
    assert result["loss"] == pytest.approx(sum(expected) / len(expected), rel=1e-5)


def test_batching_does_not_change_the_result(model):
    ids = torch.randint(0, 257, (300,), generator=torch.Generator().manual_seed(5))
    a = evaluate_text(model, ids, seq_len=32, stride=20, batch_size=1, progress=False)
    b = evaluate_text(model, ids, seq_len=32, stride=20, batch_size=7, progress=False)
    assert a["tokens"] == b["tokens"] == 299
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


# --------------------------------------------------------------------------------------- CLI
def test_cli_eval_text_file_matches_hand_computed(model, model_dir, tmp_path, capsys):
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    assert main(["eval", str(model_dir), "--data", str(text_file), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = nll_float64(model, list(TEXT.encode()))
    loss = sum(expected) / len(expected)
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    # Byte tokenizer: one byte per token, so bits per byte = loss / ln 2.
    assert result["bits_per_byte"] == pytest.approx(loss / math.log(2), rel=1e-6)
    assert (result["seq_len"], result["stride"]) == (96, 95)


def test_cli_eval_prepared_folder(model, model_dir, tmp_path, capsys):
    from tokenformer.data.datasets import TokenDataset
    from tokenformer.data.prepare import prepare

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"Line of text number {i}.\n" for i in range(200)))
    prepare([corpus], "bytes", tmp_path / "prepared", val_fraction=0.1, progress=False)
    dataset = TokenDataset.open(tmp_path / "prepared")
    assert main(["eval", str(model_dir), "--data", str(tmp_path / "prepared"), "--json",
                 "--seq-len", "64", "--stride", "32"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = evaluate_text(model, np.asarray(dataset.val), 64, 32, progress=False)
    assert result["tokens"] == len(dataset.val) - 1
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    assert result["bits_per_byte"] == pytest.approx(
        expected["loss"] / math.log(2) / dataset.bytes_per_token("val"), rel=1e-6)


@pytest.mark.parametrize("case", ["missing model", "empty data", "missing data", "bad task",
                                  "stride too large"])
def test_cli_eval_bad_input_is_one_error_line(case, model_dir, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = {
        "missing model": ["eval", str(tmp_path / "nope"), "--data", str(text)],
        "empty data": ["eval", str(model_dir), "--data", str(empty)],
        "missing data": ["eval", str(model_dir), "--data", str(tmp_path / "none.txt")],
        "bad task": ["eval", str(model_dir), "--tasks", "no_such_task_xyz", "--limit", "2"],
        "stride too large": ["eval", str(model_dir), "--data", str(text), "--stride", "96"],
    }[case]
    if case == "bad task":
        tasks = pytest.importorskip("lm_eval.tasks")
        # Indexing lm-eval's ~15k stock tasks takes 10-30 s; the error path is ours either way.
        stock_manager = tasks.TaskManager
        monkeypatch.setattr(tasks, "TaskManager", lambda include_path=None, **_: stock_manager(
            include_path=include_path, include_defaults=False))
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert err.startswith("error: ") and err.count("\n") == 1, err


# ------------------------------------------------------------------------------------ lm-eval
def test_lm_eval_offline_tasks_run_and_return_metrics(model_dir, capsys):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    assert main(["eval", str(model_dir), "--tasks", "kjv_lastword,kjv_choice", "--limit", "6",
                 "--batch-size", "6", "--json"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert results["kjv_lastword"]["samples"] == results["kjv_choice"]["samples"] == 6
    assert 0.0 <= results["kjv_lastword"]["acc,none"] <= 1.0
    assert results["kjv_lastword"]["perplexity,none"] > 1.0
    assert 0.0 <= results["kjv_choice"]["acc,none"] <= 1.0
    assert 0.0 <= results["kjv_choice"]["acc_norm,none"] <= 1.0


def test_offline_task_data_is_deterministic_and_well_formed():
    from tokenformer.eval.tasks import kjv

    last, choice = kjv.lastword_docs(), kjv.choice_docs()
    assert len(last) == len(choice) == kjv.MAX_DOCS
    for doc in last:
        assert doc["target"].startswith(" ") and doc["target"][1:].isalpha()
        assert not doc["context"].endswith(" ")
    labels = [doc["label"] for doc in choice]
    assert sorted(set(labels)) == [0, 1, 2, 3]
    for doc, lw in zip(choice, last, strict=True):
        truth = doc["choices"][doc["label"]]
        assert doc["context"] + " " + truth == lw["context"] + lw["target"] + "."
        assert len(set(doc["choices"])) == 4


def test_task_dir_is_the_installed_folder_of_the_shipped_tasks(capsys):
    """`tokenformer eval --task-dir` is what `lm_eval --include_path` needs, no source checkout."""
    assert main(["eval", "--task-dir"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.is_absolute()
    names = {p.name for p in folder.iterdir()}
    assert {"kjv_lastword.yaml", "kjv_choice.yaml", "kjv.py"} <= names


@pytest.mark.parametrize("argv", [["eval"], ["eval", "tiny"], ["eval", "--data", "x.txt"]])
def test_eval_without_model_or_what_is_one_error_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_a_context_shorter_than_a_shipped_answer_says_what_is_needed(tmp_path, capsys):
    """lm-eval stops on a bare AssertionError when an answer exceeds the context; we say what
    context the task needs. kjv_choice's longest answer, byte tokenizer: ' ' + the longest
    choice, counted here from the documents themselves."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    from tokenformer.eval.tasks import kjv

    longest = 1 + max(len(c.encode()) for d in kjv.choice_docs() for c in d["choices"])
    config = TokenFormerConfig(vocab_size=257, hidden_size=16, num_layers=1, num_heads=2,
                               qkv_tokens=8, proj_tokens=8, ffn_tokens=8, max_seq_len=64,
                               eos_token_id=256)
    TokenFormerLM(config).save(tmp_path / "short")
    assert 64 < longest
    assert main(["eval", str(tmp_path / "short"), "--tasks", "kjv_choice", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: kjv_choice needs a model context of at least {longest} "
                          f"tokens"), err
    assert "this model's is 64" in err


def test_output_path_and_log_samples_write_lm_eval_files(model_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    pytest.importorskip("transformers")
    out = tmp_path / "results"
    assert main(["eval", str(model_dir), "--tasks", "kjv_lastword", "--limit", "3",
                 "--output-path", str(out), "--log-samples", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results_files = list(out.rglob("results_*.json"))
    sample_files = list(out.rglob("samples_kjv_lastword_*.jsonl"))
    assert len(results_files) == 1 and len(sample_files) == 1, list(out.rglob("*"))
    saved = json.loads(results_files[0].read_text())
    assert saved["results"]["kjv_lastword"]["acc,none"] == printed["kjv_lastword"]["acc,none"]
    rows = [json.loads(line) for line in sample_files[0].read_text().splitlines()]
    assert len(rows) == 3
    from tokenformer.eval.tasks import kjv

    assert [r["doc"]["target"] for r in rows] == [d["target"] for d in kjv.lastword_docs()[:3]]


def test_log_samples_without_output_path_is_refused(model_dir, capsys):
    pytest.importorskip("lm_eval")
    assert main(["eval", str(model_dir), "--tasks", "kjv_lastword", "--log-samples"]) == 2
    assert "--log-samples needs --output-path" in capsys.readouterr().err
