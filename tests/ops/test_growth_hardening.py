"""Growth you can trust (issue 36): "exact" is exact for top-k models too, a growth never hands on
NaN or infinite weights or logits, official-released says and records what it does to the
optimizer, what ``grow`` reads beside the weights is checked, and absurd sizes are refused at
once, before any planning work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.io.checkpoint import write_manifest
from tokenformer.io.training_state import OPTIMIZER_NAME, STATE_NAME, load_optimizer_state
from tokenformer.io.tree import save_tree
from tokenformer.ops.growth import default_positions, grow, plan_growth
from tokenformer.ops.growth.sizes import layer_plan

try:
    import resource
except ImportError:  # not on Windows
    resource = None  # type: ignore[assignment]

VOCAB = 97


def top_k_model(seed: int = 0, **top_k) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=16,
        proj_tokens=12, ffn_tokens=24, max_seq_len=32, eos_token_id=None, **top_k)).double()


def relative_change(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """max |Δlogit| / max |logit| in float64, on a fixed batch."""
    ids = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x, y = a(ids).logits, b(ids).logits
    return float((x - y).abs().max() / x.abs().max())


# ------------------------------------------------------------------------ case 2: top-k exact
@pytest.mark.parametrize("top_k", [dict(proj_top_k=3, ffn_top_k=5),  # the model
                                   dict(proj_top_k=0.25, ffn_top_k=0.1, qkv_top_k=0.5)])
def test_identity_blocks_are_exact_with_top_k(top_k):
    """Cancelling pairs (v, -v) are a tie in |Θ| that top-k may split; the old code's relative
    Δlogit was 0.146 (0.05-0.12 fractional). Exact: below float64 rounding."""
    model = top_k_model(**top_k)
    grown = grow(model, layers=3, generator=torch.Generator().manual_seed(0)).double()
    assert grown.config.num_layers == 3
    assert relative_change(model, grown) < 1e-12
    # and the inserted block trains: its branch outputs' values get a gradient on step 1
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    grown(ids, labels=ids).loss.backward()
    inserted = next(i for i in range(3) if not grown.layers[i].mlp.value_param_tokens.any())
    for module in (grown.layers[inserted].mlp, grown.layers[inserted].attention.proj):
        assert module.value_param_tokens.grad.abs().sum() > 0


@pytest.mark.parametrize("norm", ["l2_norm_gelu", "gelu_l1_norm", "softmax"])
@pytest.mark.parametrize("top_k", [dict(ffn_top_k=0.25, qkv_top_k=0.5, proj_top_k=0.5),
                                   dict(ffn_top_k=5, qkv_top_k=3, proj_top_k=4)])
def test_exact_token_growth_holds_the_top_k_count(norm, top_k):
    """A fraction of the grown n keeps more old tokens than before: exact growth holds the
    count (r·k for softmax, whose every old token becomes r tokens), like Θ's factor."""
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=16,
        proj_tokens=12, ffn_tokens=24, max_seq_len=32, eos_token_id=None, norm=norm,
        **top_k)).double()
    grown = grow(model, qkv="2x", proj="2x", ffn="2x",
                 generator=torch.Generator().manual_seed(0)).double()
    # softmax splits each old value into r zero-sum parts drawn in float32: exact to its rounding
    assert relative_change(model, grown) < (1e-6 if norm == "softmax" else 1e-12)
    r = 2 if norm == "softmax" else 1
    assert grown.config.ffn_top_k == r * (round(0.25 * 24) if top_k["ffn_top_k"] == 0.25 else 5)


def test_cli_grow_layers_of_a_top_k_model_prints_a_change_at_rounding(tmp_path, capsys):
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=16,
        proj_tokens=12, ffn_tokens=24, max_seq_len=32, eos_token_id=None, proj_top_k=3,
        ffn_top_k=5))
    model.save(tmp_path / "m")
    assert main(["grow", str(tmp_path / "m"), str(tmp_path / "g"), "--layers", "3",
                 "--no-progress"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "relative" in x)
    assert float(line.rsplit("relative ", 1)[1].rstrip(")")) < 1e-5, line


# ----------------------------------------------------------------- case 4: non-finite refused
@pytest.mark.parametrize(("noise", "what"), [("1e30", "logits are NaN or infinite"),
                                             ("1e39", "holds NaN or infinite values")])
def test_a_growth_with_non_finite_output_is_refused_before_writing(tmp_path, capsys, noise,
                                                                   what):
    """1e30: finite weights but NaN logits (the old code wrote it, exit 0, and generate printed
    NUL bytes); 1e39: infinite weights (every loader refused the output)."""
    torch.manual_seed(0)
    top_k_model().float().save(tmp_path / "m")
    out = tmp_path / "g"
    code = main(["grow", str(tmp_path / "m"), str(out), "--hidden", "2x", "--width-noise",
                 noise, "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1, err
    assert what in err and "width" in err, err  # which check refused it: logits or weights
    assert not out.exists()


def test_every_growth_refuses_non_finite_weights():
    with pytest.raises(GrowthError, match=r"NaN or infinite.*width_noise=1e\+39"):
        grow(top_k_model().float(), hidden="2x", width_noise=1e39)
    with pytest.raises(GrowthError, match=r"NaN or infinite.*noise_old=1e\+39"):
        grow(top_k_model().float(), ffn="2x", noise_old=1e39)


# ----------------------------------------------------- cases 3 and 6: what grow carries over
@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset_dir):
    """A training checkpoint: weights, optimizer moments, trainer state, RNG."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(["train", "--config", "tiny", "--data", str(dataset_dir), "--steps", "2",
                 "--eval-interval", "0", "--threads", "1", "--samples", "0",
                 "--eval-batches", "1", "--no-progress", "--out", str(run)]) == 0
    return run / "final"


def test_official_released_says_and_records_a_fresh_optimizer(trained, tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["grow", str(trained), str(out), "--ffn", "2x", "--recipe",
                 "official-released", "--no-progress"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("optimizer"))
    assert "carried" not in line and "reset" in line and "official-released" in line, line
    state = json.loads((out / STATE_NAME).read_text())
    assert state["grown"][-1]["reset_optimizer"] is True
    assert load_optimizer_state(out)["state"] == {}  # what it wrote: no moments


def _damage(source, tmp_path, change):
    copy = tmp_path / "ckpt"
    import shutil
    shutil.copytree(source, copy)
    change(copy)
    write_manifest(copy)  # whole files, only wrong
    return copy


def test_optimizer_moments_of_the_wrong_shape_are_refused(trained, tmp_path, capsys):
    def wrong_moments(folder):
        state = load_optimizer_state(folder)
        for entry in list(state["state"].values())[:8]:
            entry["exp_avg"] = torch.zeros(3, 5)
        save_tree(folder / OPTIMIZER_NAME, state)

    source = _damage(trained, tmp_path, wrong_moments)
    out = tmp_path / "g"
    assert main(["grow", str(source), str(out), "--ffn", "2x", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "exp_avg of shape (3, 5)" in err, err
    assert OPTIMIZER_NAME in err and not out.exists()


@pytest.mark.parametrize("grown", ["abc", 5, [1, 2], {"a": 1}])
def test_a_malformed_growth_history_is_refused(trained, tmp_path, capsys, grown):
    """"abc" became the history ['a', 'b', 'c', {...}]; 5 was a TypeError."""
    def history(folder):
        state = json.loads((folder / STATE_NAME).read_text())
        state["grown"] = grown
        (folder / STATE_NAME).write_text(json.dumps(state))

    source = _damage(trained, tmp_path, history)
    out = tmp_path / "g"
    assert main(["grow", str(source), str(out), "--ffn", "2x", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "grown is" in err and STATE_NAME in err, err
    assert "TOKENFORMER_DEBUG" not in err and not out.exists()


# ------------------------------------------------------------------ case 7: sizes before work
def test_block_placement_is_planned_in_linear_time():
    """The placement of 200,000 new blocks: c4cb226 looked each index up in the list of
    positions (2e10 comparisons, minutes); a set makes it a fraction of a second."""
    started = time.perf_counter()
    positions = default_positions(2, 200_002)
    plan = layer_plan(2, 200_002, positions)
    assert time.perf_counter() - started < 5
    assert positions[:3] == [1, 2, 3] and len(set(positions)) == len(positions)
    # the two old blocks keep their order; each inserted block is templated on the old block
    # before it (block 0 for those before old block 1, block 1 after it)
    old_at = [i for i, (_, new) in enumerate(plan) if not new]
    assert len(old_at) == 2 and [plan[i][0] for i in old_at] == [0, 1]
    assert set(old_at) == set(range(200_002)) - set(positions)
    assert all(plan[i] == (0 if i < old_at[1] else 1, True) for i in positions)


def limited(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``tokenformer ARGV`` under a 4 GiB address-space limit (what the old code ran into: 24 GB
    and the OOM killer, or an empty MemoryError line under a limit), at most 120 s."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, "-m", "tokenformer", *argv], cwd=tmp_path,
                          preexec_fn=limit, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.skipif(resource is None, reason="needs RLIMIT_AS")
def test_info_of_a_billion_layers_is_arithmetic(tmp_path):
    """info allocates nothing: the sizes of 10⁹ blocks are printed at once (the old code built
    the placement of 10⁹ blocks first)."""
    done = limited(["info", "tiny", "--grow", "layers=1000000000"], tmp_path)
    assert done.returncode == 0, done.stderr
    sizes = [TokenFormerLM(TokenFormerConfig.from_name("tiny", num_layers=n)).num_parameters()
             for n in (2, 3)]
    expected = sizes[0] + (10**9 - 2) * (sizes[1] - sizes[0])
    assert f"parameters   {sizes[0]:,} -> {expected:,} " in done.stdout, done.stdout


@pytest.mark.skipif(resource is None, reason="needs RLIMIT_AS")
def test_grow_to_absurd_depth_is_refused_before_any_work(tmp_path, trained):
    done = limited(["grow", str(trained), str(tmp_path / "g"), "--layers", "20000000",
                    "--no-progress"], tmp_path)
    lines = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "the grown model" in lines[0] and "GiB" in lines[0], lines[0]
    assert not (tmp_path / "g").exists()


def test_a_plan_of_many_blocks_is_linear():
    config = top_k_model().config
    started = time.perf_counter()
    grown = plan_growth(config, layers=200_000)
    assert grown.num_layers == 200_000 and time.perf_counter() - started < 5
