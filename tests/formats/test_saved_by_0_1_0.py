"""Folders written by tokenformer 0.1.0, before the package was layered (tests/fixtures/v0.1.0,
saved by that code): our model folder, a Hugging Face folder (its config.json's auto_map names
``configuration_tokenformer`` / ``modeling_tokenformer``) and a training checkpoint still load,
compute the logits saved beside them, and the checkpoint resumes.

The weights load bit for bit. Logits and losses are compared to float32 rounding, not bit for
bit: the fixture was written on an AVX-512 CPU (AMD Zen 4), and another CPU's matmul kernels round
differently (up to 2.2e-7 on an AVX2 Zen 3), which says nothing about the format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenformer import TokenFormerLM, load_model
from tokenformer.io import checkpoint as ckpt
from tokenformer.io.training_state import read_state
from tokenformer.training import RunState, TrainConfig, fit

OLD = Path(__file__).resolve().parents[1] / "fixtures" / "v0.1.0"
IDS = torch.arange(12).view(1, 12) % 24  # what the fixture's logits.pt was computed on


# float32 rounding of these logits (|logit| < 0.1) on any CPU; a format error moves them by ≫ 1e-4
ROUNDING = {"rtol": 1e-5, "atol": 1e-6}


def saved_logits(which: str = "logits") -> torch.Tensor:
    return torch.load(OLD / "logits.pt", weights_only=True)[which]


def test_model_folder_loads_the_saved_tensors_bit_for_bit():
    saved = load_file(OLD / "model" / "model.safetensors")
    state = TokenFormerLM.load(OLD / "model").state_dict()
    assert saved.keys() <= state.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in saved.items())


def test_model_folder_loads_with_the_same_logits():
    for model in (load_model(OLD / "model"), TokenFormerLM.load(OLD / "model")):
        assert model.config.name == "fixture"
        torch.testing.assert_close(model.eval()(IDS).logits, saved_logits(), **ROUNDING)


def test_hf_folder_loads_with_the_same_logits():
    hf = pytest.importorskip("tokenformer.hf")
    config = json.loads((OLD / "hf" / "config.json").read_text())
    # the names a folder saved then points trust_remote_code at: still the files we write
    assert config["auto_map"] == {
        "AutoConfig": "configuration_tokenformer.TokenFormerHFConfig",
        "AutoModel": "modeling_tokenformer.TokenFormerModel",
        "AutoModelForCausalLM": "modeling_tokenformer.TokenFormerForCausalLM",
        "AutoModelForSequenceClassification":
            "modeling_tokenformer.TokenFormerForSequenceClassification"} == hf.AUTO_MAP
    with torch.no_grad():
        for logits in (hf.load_hf(OLD / "hf")(IDS).logits, load_model(OLD / "hf")(IDS).logits):
            torch.testing.assert_close(logits, saved_logits(), **ROUNDING)


def test_training_checkpoint_verifies_loads_and_resumes_exactly(tmp_path):
    """Resuming the old run's step-1 checkpoint with this code gives the loss the old code's
    uninterrupted run had at step 2 (same batches, RNG, optimizer state; to float32 rounding on
    another CPU, bit for bit on the one that wrote it)."""
    path = tmp_path / "checkpoint"
    shutil.copytree(OLD / "checkpoint", path)
    assert ckpt.verify_checkpoint(path)  # its manifest.json, in the format written then
    state = read_state(path)
    assert state["format"] == "tokenformer-trainer-v1" and state["step"] == 1
    with torch.no_grad():
        torch.testing.assert_close(TokenFormerLM.load(path).eval()(IDS).logits,
                                   saved_logits("checkpoint_logits"), **ROUNDING)
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=8, warmup_steps=1, eval_interval=0,
                      samples=0, weight_decay=0.0, checkpoint_interval=1, keep_last=1)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:  # the old run's batches
        ids = torch.randint(0, 24, (2, 8), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    result = fit(TokenFormerLM.load(path), batch_fn, cfg, start=RunState(resume_from=path),
                 progress=False)
    old = json.loads((OLD / "run_losses.json").read_text())["train_loss_by_step"]
    assert result.step == 2 and result.losses == [pytest.approx(old["2"], rel=1e-6)]
    assert result.tokens == state["tokens"] + 16
