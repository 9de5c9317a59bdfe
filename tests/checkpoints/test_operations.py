"""The checkpoint operations called from Python (issue 44: the CLI is a thin layer over them):
each writes a folder that loads, and what it holds is checked against the operation of
:mod:`tokenformer.ops` applied to the loaded input by hand, and against the invariant the
operation promises (exact growth and a merge keep the function, pruning the newest tokens undoes
a growth), not against the function's own summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tokenformer
from tokenformer.checkpoints import (
    adapt_checkpoint,
    grow_checkpoint,
    merge_checkpoint,
    prune_checkpoint,
)
from tokenformer.cli import main as cli
from tokenformer.data.tokenizer import BYTES_MARKER
from tokenformer.errors import TokenFormerError
from tokenformer.io.training_state import STATE_NAME, load_optimizer_state
from tokenformer.ops import adapters as ad
from tokenformer.ops.growth import GrowthOptions


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset_dir) -> Path:
    """The final checkpoint of a 2-step tiny run: weights, AdamW state, the trainer's state,
    RNG state and the byte tokenizer's marker."""
    run = tmp_path_factory.mktemp("run") / "R"
    assert cli(["train", "--config", "tiny", "--steps", "2", "--out", str(run), "--data",
                str(dataset_dir), "--eval-interval", "0", "--threads", "1", "--samples", "0",
                "--eval-batches", "1", "--no-progress"]) == 0
    return run / "final"


def probe(vocab: int = 257) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(probe()).logits.double()


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_grow_checkpoint_writes_grow_of_the_loaded_model_with_its_training_state(trained,
                                                                                tmp_path):
    out = tmp_path / "grown"
    summary = grow_checkpoint(trained, out, GrowthOptions(ffn="2x", layers=3), seed=5,
                              progress=False)
    original = tokenformer.load_model(trained)
    grown = tokenformer.load_model(out)
    expected = tokenformer.grow(original, ffn="2x", layers=3,
                                generator=torch.Generator().manual_seed(5))
    assert same_weights(grown, expected)
    assert (grown.config.ffn_tokens, grown.config.num_layers) == (256, 3)  # tiny: 128, 2
    # exact growth: the function is kept (to fp32 rounding)
    torch.testing.assert_close(logits(grown), logits(original), rtol=0, atol=1e-5)
    assert summary["params_after"] == sum(p.numel() for p in grown.parameters())
    # training resumes from it: the AdamW state and the trainer's groups name the grown model
    names = {n for n, _ in grown.named_parameters()}
    state = json.loads((out / STATE_NAME).read_text())
    assert {n for group in state["param_groups"] for n in group} == names
    assert len(state["grown"]) == 1 and state["grown"][0]["from"] == str(trained)
    saved = load_optimizer_state(out)
    assert sum(len(g["params"]) for g in saved["param_groups"]) == len(names)
    assert (out / BYTES_MARKER).read_bytes() == (trained / BYTES_MARKER).read_bytes()


def test_grow_checkpoint_of_a_bare_model_folder_carries_no_optimizer(tmp_path):
    torch.manual_seed(0)
    source = tokenformer.TokenFormerLM(tokenformer.TokenFormerConfig.from_name(
        "tiny", vocab_size=257)).save(tmp_path / "bare")
    summary = grow_checkpoint(source, tmp_path / "wide", GrowthOptions(hidden="2x"),
                              progress=False)
    assert summary["optimizer"] is False
    wide = tokenformer.load_model(tmp_path / "wide")
    assert wide.config.hidden_size == 128
    assert not any(p.name.startswith("optimizer") for p in (tmp_path / "wide").iterdir())
    torch.testing.assert_close(logits(wide), logits(tokenformer.load_model(source)), rtol=0,
                               atol=1e-5)


def test_prune_checkpoint_writes_prune_of_the_loaded_model(trained, tmp_path):
    out = tmp_path / "pruned"
    prune_checkpoint(trained, out, ffn="0.5x", qkv=24, by="value")  # no calibration data
    expected = tokenformer.prune(tokenformer.load_model(trained).eval(), ffn="0.5x", qkv=24,
                                 by="value")
    pruned = tokenformer.load_model(out)
    assert (pruned.config.ffn_tokens, pruned.config.qkv_tokens) == (64, 24)
    assert same_weights(pruned, expected)
    assert (out / BYTES_MARKER).exists()


def test_pruning_the_newest_tokens_undoes_an_exact_growth(trained, tmp_path):
    grow_checkpoint(trained, tmp_path / "grown", GrowthOptions(ffn="2x", qkv=48),
                    progress=False)
    prune_checkpoint(tmp_path / "grown", tmp_path / "back", ffn=128, qkv=32, by="newest")
    back, original = tokenformer.load_model(tmp_path / "back"), tokenformer.load_model(trained)
    sb, so = back.state_dict(), original.state_dict()
    assert sb.keys() == so.keys() and all(torch.equal(sb[k], so[k]) for k in so)
    torch.testing.assert_close(logits(back), logits(original), rtol=0, atol=1e-5)


def test_merge_checkpoint_keeps_the_adapted_function(trained, tmp_path):
    model = tokenformer.load_model(trained)
    ad.adapt(model, ffn=3, qkv=2, name="domain", generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # a trained adapter's tokens: non-zero keys, so it changes the output
        for name, p in model.named_parameters():
            if ".adapters." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    ad.save_adapter(model, "domain", tmp_path / "adapter")
    summary = merge_checkpoint(str(trained), [str(tmp_path / "adapter")], tmp_path / "merged")
    merged = tokenformer.load_model(tmp_path / "merged")
    assert summary["adapters"] == ["domain"]
    assert (merged.config.ffn_tokens, merged.config.qkv_tokens) == (131, 34)
    adapted = ad.load_adapted(trained, [tmp_path / "adapter"])
    torch.testing.assert_close(logits(merged), logits(adapted), rtol=0, atol=1e-5)
    assert (logits(merged) - logits(tokenformer.load_model(trained))).abs().max() > 1e-3
    assert (tmp_path / "merged" / BYTES_MARKER).exists()


def test_adapt_checkpoint_trains_only_the_adapter(trained, tmp_path, dataset_dir):
    out = tmp_path / "adapter"
    summary = adapt_checkpoint(str(trained), str(dataset_dir), {"ffn": 2}, out, name="bible",
                               overrides={"steps": 2, "seq_len": 32, "batch_size": 2,
                                          "eval_batches": 1}, progress=False)
    assert summary["steps"] == 2
    # 2 tokens in each of the 2 FFN Pattentions, a key (64) and a value (64) each
    assert summary["trainable_parameters"] == 2 * 2 * (64 + 64)
    adapted = ad.load_adapted(trained, [out])
    assert ad.active_adapters(adapted) == ["bible"]
    base = tokenformer.load_model(trained)
    with ad.adapters_active(adapted, []):  # the base is frozen: exactly recoverable
        torch.testing.assert_close(logits(adapted), logits(base), rtol=0, atol=0)


def test_the_operations_are_the_package_s_public_names_and_refuse_in_one_line(tmp_path):
    assert (tokenformer.grow_checkpoint, tokenformer.prune_checkpoint,
            tokenformer.merge_checkpoint, tokenformer.adapt_checkpoint) == (
        grow_checkpoint, prune_checkpoint, merge_checkpoint, adapt_checkpoint)
    with pytest.raises(TokenFormerError, match="checkpoint not found: nowhere"):
        prune_checkpoint("nowhere", tmp_path / "out", ffn="0.5x")
    assert not (tmp_path / "out").exists()
