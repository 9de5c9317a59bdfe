"""Parameter-token adapters (tokenformer.adapters): exact start, frozen base, on/off, stacking,
save/load/remove/merge round trips, the CLI, and a tiny adapt-bench end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.errors import CheckpointError, ConfigError
from tokenformer.nn.pattention import Pattention
from tokenformer.ops import adapters as ad

GELU_VARIANTS = ("l2_norm_gelu", "gelu_l2_norm", "gelu_l1_norm")


def make(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig.from_name("tiny", max_seq_len=32, **overrides)).to(
        dtype)


def ids(seed: int = 1, B: int = 2, T: int = 16) -> torch.Tensor:
    return torch.randint(0, 257, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


def train_steps(model: torch.nn.Module, steps: int = 3, lr: float = 3e-2,
                weight_decay: float = 0.1) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    for step in range(steps):
        x = ids(10 + step)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------- exact start
@pytest.mark.parametrize("norm", GELU_VARIANTS)
def test_exact_start_float64(norm: str) -> None:
    model = make(dtype=torch.float64, norm=norm)
    x = ids()
    before = logits(model, x)
    ad.adapt(model, qkv=3, proj=2, ffn=5, name="a", generator=gen())
    after = logits(model, x)
    # The function is preserved mathematically; only float64 summation order may differ.
    assert (after - before).abs().max().item() < 1e-12
    for layer in model.pattentions().values():
        tokens = layer.adapters["a"]
        assert torch.count_nonzero(tokens.key_param_tokens) == 0  # exact recipe: zero keys
        assert torch.count_nonzero(tokens.value_param_tokens) > 0  # ... non-zero values


def test_only_new_tokens_trainable_and_counts() -> None:
    model = make()
    c = model.config
    ad.adapt(model, ffn=4, qkv=2, name="a")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".adapters.a." in n for n in names)
    # per layer: FFN 4 tokens × (d_in + d_out), Q/K/V 2 tokens × 2d each
    d = c.hidden_size
    assert ad.trainable_parameters(model) == c.num_layers * (4 * 2 * d + 3 * 2 * 2 * d)
    assert ad.adapter_sizes(model, "a") == {"qkv": 2, "proj": 0, "ffn": 4}


def test_softmax_and_bad_requests_refused() -> None:
    with pytest.raises(ConfigError, match="softmax"):
        ad.adapt(make(norm="softmax"), ffn=2)
    model = make()
    with pytest.raises(ConfigError, match="needs tokens"):
        ad.adapt(model)
    with pytest.raises(ConfigError, match="non-negative"):
        ad.adapt(model, ffn=-1)
    ad.adapt(model, ffn=1, name="a")
    with pytest.raises(ConfigError, match="already attached"):
        ad.adapt(model, ffn=1, name="a")


# ------------------------------------------------------------------------- training, on / off
def test_frozen_base_bitwise_unchanged_and_off_is_base() -> None:
    model = make()
    x = ids()
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    base_logits = logits(model, x)
    ad.adapt(model, ffn=4, proj=2, name="a", generator=gen())
    train_steps(model)  # AdamW with weight decay: must not touch a base row
    for key, value in base_state.items():
        assert torch.equal(model.state_dict()[key], value), key
    on = logits(model, x)
    assert (on - base_logits).abs().max() > 1e-3  # the adapter learned something
    assert all(torch.count_nonzero(layer.adapters["a"].key_param_tokens) > 0
               for layer in model.pattentions().values() if "a" in getattr(layer, "adapters",
                                                                           {}))
    with ad.adapters_active(model, []):  # trained (non-zero) keys: dropped from the norm too
        assert torch.equal(logits(model, x), base_logits)
    assert ad.active_adapters(model) == ["a"]
    assert torch.equal(logits(model, x), on)


def test_adapted_layer_matches_float64_reference() -> None:
    """Θ over [base; adapter] tokens with the *base's* factor (growth's exact forward),
    computed independently from the module."""
    model = make(norm="l2_norm_gelu")
    ad.adapt(model, ffn=3, name="a", generator=gen())
    layer = model.layers[0].mlp
    with torch.no_grad():
        layer.adapters["a"].key_param_tokens.normal_(0, 0.05, generator=gen(3))
    x = torch.randn(5, layer.in_features, generator=gen(4))
    K = torch.cat([layer.key_param_tokens, layer.adapters["a"].key_param_tokens]).double()
    V = torch.cat([layer.value_param_tokens, layer.adapters["a"].value_param_tokens]).double()
    s = x.double() @ K.t()
    scale = math.sqrt(layer.num_tokens)  # the base's n, not n + m
    expected = F.gelu(s / s.norm(dim=-1, keepdim=True) * scale) @ V
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ stack, save, load, remove
def test_stack_switch_and_order() -> None:
    model = make()
    x = ids()
    base = logits(model, x)
    ad.adapt(model, ffn=3, name="a", generator=gen(1))
    train_steps(model)
    only_a = logits(model, x)
    ad.adapt(model, qkv=2, name="b", generator=gen(2))
    assert ad.adapter_names(model) == ["a", "b"] and ad.active_adapters(model) == ["a", "b"]
    # b starts silent on top of a
    torch.testing.assert_close(logits(model, x), only_a, rtol=0, atol=1e-6)
    # training b on top of a: a is frozen like the base
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".adapters.b." in n]
    a_before = {k: v.clone() for k, v in ad.adapter_state(model, "a").items()}
    train_steps(model)
    assert all(torch.equal(v, a_before[k]) for k, v in ad.adapter_state(model, "a").items())
    both = logits(model, x)
    ad.set_active(model, ["b", "a"])  # applied in attachment order whatever the list order
    assert ad.active_adapters(model) == ["a", "b"]
    assert torch.equal(logits(model, x), both)
    ad.set_active(model, "a")
    a_now = logits(model, x)
    ad.set_active(model, None)
    assert torch.equal(logits(model, x), base)
    with pytest.raises(ConfigError, match="no adapter named 'c'"):
        ad.set_active(model, ["c"])
    ad.set_active(model, ["a", "b"])
    ad.remove_adapter(model, "b")
    assert ad.adapter_names(model) == ["a"]
    assert torch.equal(logits(model, x), a_now)


def test_save_load_remove_round_trip(tmp_path: Path) -> None:
    base = make()
    base.save(tmp_path / "base")
    x = ids()
    base_logits = logits(base, x)
    model = TokenFormerLM.load(tmp_path / "base")
    ad.adapt(model, ffn=4, proj=1, name="code", generator=gen())
    train_steps(model)
    adapted = logits(model, x)
    ad.save_adapter(model, "code", tmp_path / "adapter")
    files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert files == ["adapter.safetensors", "adapter_config.json", "manifest.json"]
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "adapter" / "adapter.safetensors"))
    L = base.config.num_layers
    assert len(stored) == 2 * 2 * L  # K and V of FFN and proj in each layer: nothing else
    assert sum(t.numel() for t in stored.values()) == ad.trainable_parameters(model)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_sha256"] == ad.base_fingerprint(base)
    assert config["tokens"] == {"qkv": 0, "proj": 1, "ffn": 4}

    fresh = TokenFormerLM.load(tmp_path / "base")
    assert ad.load_adapter(fresh, tmp_path / "adapter") == "code"
    assert torch.equal(logits(fresh, x), adapted)
    ad.remove_adapter(fresh, "code")
    assert torch.equal(logits(fresh, x), base_logits)
    assert all(type(m) is Pattention for m in fresh.pattentions().values())
    assert set(fresh.state_dict()) == set(base.state_dict())
    assert all(p.requires_grad for p in fresh.parameters())  # original flags restored
    with pytest.raises(ConfigError, match="no adapter named"):
        ad.remove_adapter(fresh, "code")


def test_load_onto_another_base_refused(tmp_path: Path) -> None:
    model = make(seed=0)
    ad.adapt(model, ffn=2, name="a")
    ad.save_adapter(model, "a", tmp_path / "adapter")
    other = make(seed=1)
    with pytest.raises(CheckpointError, match="hash mismatch") as info:
        ad.load_adapter(other, tmp_path / "adapter")
    message = str(info.value)
    assert ad.base_fingerprint(model)[:16] in message and ad.base_fingerprint(other)[:16] in message
    assert "\n" not in message
    assert ad.adapter_names(other) == []  # nothing was attached


def test_tampered_adapter_refused(tmp_path: Path) -> None:
    model = make()
    ad.adapt(model, ffn=2, name="a")
    ad.save_adapter(model, "a", tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        ad.load_adapter(make(), tmp_path / "adapter")


@pytest.mark.parametrize("tokens", [{"ffn": "2"}, {"ffn": -1}, {"mlp": 2}, None])
def test_malformed_adapter_config_refused(tmp_path: Path, tokens) -> None:
    """A config that passes its manifest (rewritten) but names bad token counts: one
    CheckpointError, nothing attached."""
    from tokenformer.io.checkpoint import write_manifest

    model = make()
    ad.adapt(model, ffn=2, name="a")
    ad.save_adapter(model, "a", tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["tokens"] = tokens
    config_file.write_text(json.dumps(config))
    write_manifest(tmp_path / "adapter")
    fresh = make()
    with pytest.raises(CheckpointError, match="malformed 'tokens'"):
        ad.load_adapter(fresh, tmp_path / "adapter")
    assert ad.adapter_names(fresh) == []


def test_fingerprint_ignores_adapters_and_sees_any_base_change() -> None:
    model = make()
    h = ad.base_fingerprint(model)
    ad.adapt(model, ffn=2, name="a")
    train_steps(model)
    assert ad.base_fingerprint(model) == h
    with torch.no_grad():
        model.layers[0].mlp.value_param_tokens[0, 0] += 1e-6
    assert ad.base_fingerprint(model) != h


# ------------------------------------------------------------------------------------- merge
def test_merge_equals_adapted_forward(tmp_path: Path) -> None:
    model = make()
    c = model.config
    x = ids()
    ad.adapt(model, ffn=4, qkv=1, name="a", generator=gen(1))
    train_steps(model)
    ad.adapt(model, ffn=2, name="b", generator=gen(2))
    train_steps(model)
    adapted = logits(model, x)
    merged = ad.merge(model)
    assert type(merged) is TokenFormerLM
    mc = merged.config
    assert (mc.qkv_tokens, mc.proj_tokens, mc.ffn_tokens) == (c.qkv_tokens + 1, c.proj_tokens,
                                                               c.ffn_tokens + 6)
    assert mc.ffn_scale == pytest.approx(math.sqrt(c.ffn_tokens))  # Θ's factor held
    torch.testing.assert_close(logits(merged, x), adapted, rtol=0, atol=1e-5)
    assert all(p.requires_grad for p in merged.parameters())
    merged.save(tmp_path / "merged")
    torch.testing.assert_close(logits(TokenFormerLM.load(tmp_path / "merged"), x), adapted,
                               rtol=0, atol=1e-5)
    assert ad.adapter_names(model) == ["a", "b"]  # the input is untouched
    assert torch.equal(logits(model, x), adapted)  # ... its tensors included
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        n for n, _ in model.named_parameters() if ".adapters.b." in n]  # and its flags
    with pytest.raises(ConfigError, match="no adapter is active"):
        ad.set_active(model, [])
        ad.merge(model)


def test_hf_wrapper_shares_the_base_fingerprint(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tokenformer.hf import TokenFormerForCausalLM

    core = make()
    ad.adapt(core, ffn=3, name="a", generator=gen())
    train_steps(core)
    ad.save_adapter(core, "a", tmp_path / "adapter")
    wrapped = TokenFormerForCausalLM.from_core(make())
    ad.load_adapter(wrapped, tmp_path / "adapter")
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x).logits[..., :257], core(x).logits[..., :257],
                                   rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------- CLI
def run(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_adapt_generate_merge(tmp_path: Path, dataset_dir: Path, capsys) -> None:
    make().save(tmp_path / "base")
    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    code, out, err = run(["adapt", base, "--data", str(dataset_dir), "--tokens", "ffn=4,qkv=1",
                          "--out", adapter, "--steps", "3", "--seq-len", "32", "--batch-size",
                          "4", "--eval-batches", "1", "--no-progress", "--name", "kjv"], capsys)
    assert code == 0, err
    assert "trainable parameters" in out and "val loss" in out
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["name"] == "kjv" and config["training"]["steps"] == 3
    code, out, err = run(["generate", base, "--adapter", adapter, "--prompt", "And",
                          "--max-new-tokens", "4", "--temperature", "0"], capsys)
    assert code == 0 and out.startswith("And"), err
    code, out, err = run(["merge", base, "--adapter", adapter, "--out",
                          str(tmp_path / "merged")], capsys)
    assert code == 0, err
    merged = TokenFormerLM.load(tmp_path / "merged")
    loaded = ad.load_adapted(base, [adapter])
    x = ids()
    torch.testing.assert_close(logits(merged, x), logits(loaded, x), rtol=0, atol=1e-5)


def test_cli_adapter_for_another_base_is_one_error_line(tmp_path: Path, capsys) -> None:
    model = make(seed=0)
    ad.adapt(model, ffn=2, name="a")
    ad.save_adapter(model, "a", tmp_path / "adapter")
    make(seed=1).save(tmp_path / "other")
    code, _, err = run(["generate", str(tmp_path / "other"), "--adapter",
                          str(tmp_path / "adapter"), "--prompt", "And"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ")
    assert "hash mismatch" in lines[0] and "sha256" in lines[0]
    code, _, err = run(["merge", str(tmp_path / "other"), "--adapter",
                          str(tmp_path / "adapter"), "--out", str(tmp_path / "m")], capsys)
    assert code == 2 and "hash mismatch" in err and not (tmp_path / "m").exists()


@pytest.mark.parametrize("tokens,needle", [("ffn", "KIND=COUNT"), ("mlp=4", "KIND=COUNT"),
                                           ("ffn=x", "KIND=COUNT"), ("ffn=0", "count > 0")])
def test_cli_bad_tokens(tmp_path: Path, dataset_dir: Path, capsys, tokens: str,
                        needle: str) -> None:
    make().save(tmp_path / "base")
    code, _, err = run(["adapt", str(tmp_path / "base"), "--data", str(dataset_dir),
                        "--tokens", tokens, "--out", str(tmp_path / "a")], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0]
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------- the bench
@pytest.mark.slow
def test_adapt_bench_end_to_end(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("peft")
    pytest.importorskip("scipy")
    from importlib.metadata import version

    from tokenformer.data.corpora import CODE_PACKAGE, CODE_VERSION
    if version(CODE_PACKAGE) != CODE_VERSION:  # the corpus is that release's source, exactly
        pytest.skip(f"the code corpus needs {CODE_PACKAGE}=={CODE_VERSION}, "
                    f"found {version(CODE_PACKAGE)}")
    monkeypatch.setenv("TOKENFORMER_CACHE", str(tmp_path / "cache"))
    from tokenformer.experiments.adapt_bench import run_adapt_bench

    results = run_adapt_bench("test", out=tmp_path / "bench", progress=False)
    report = (tmp_path / "bench" / "report.md").read_text()
    assert "| token adapter, FFN |" in report and "## Verdict" in report
    assert (tmp_path / "bench" / "pareto.png").stat().st_size > 0
    cells = results["summary"]["cells"]
    assert {c["arm"] for c in cells} == {"tok-ffn", "tok-all", "lora-ffn", "lora-tpp", "full"}
    for cell in cells:
        if cell["arm"].startswith("tok"):
            assert cell["off_exact"] and cell["base_unchanged"]
    full = next(c for c in cells if c["arm"] == "full")
    assert full["trainable"] == results["base_parameters"]["tokenformer"]
    assert results["tuning"]["tok-ffn@0.05"]["grid"] == [1e-2, 3e-2]
    assert set(results["tuning"]) == {"tok-ffn@0.05", "tok-all@0.05", "lora-ffn@0.05",
                                      "lora-tpp@0.05", "full"}
    for r in results["runs"]:  # every measured run uses its (arm, budget)'s pick
        key = "full" if r["arm"] == "full" else f"{r['arm']}@{r['budget']:g}"
        assert r["lr"] == results["tuning"][key]["lr"]

    # A rerun with one more seed reuses the pretrained bases and every finished run: it trains
    # exactly the five new (arm, seed) runs.
    import tokenformer.experiments.adapt_bench.run as bench

    fits = []
    real_fit = bench._fit
    monkeypatch.setattr(bench, "_fit", lambda *a, **k: fits.append(1) or real_fit(*a, **k))
    again = run_adapt_bench("test", out=tmp_path / "bench", progress=False, seeds=3)
    assert len(fits) == 5 and len(again["runs"]) == 3 * 5
    assert again["base_loss"] == results["base_loss"]


def test_public_api() -> None:
    import tokenformer

    assert tokenformer.adapt is ad.adapt and tokenformer.merge is ad.merge
    assert tokenformer.load_adapter is ad.load_adapter


@pytest.mark.parametrize("optimum, chosen, added, edge", [
    (5e-3, 3e-3, [], False),                  # inside the grid: no extension
    (0.5, 0.27, [0.09, 0.27], True),          # beyond the top: two extensions, still at the edge
    (2e-4, 3.333e-4, [3.333e-4, 1.111e-4], False),  # one step below suffices; the next is worse
])
def test_adapt_bench_lr_tuning_extends_past_an_edge(optimum, chosen, added, edge):
    """A hand-made loss with its minimum at ``optimum`` (|log lr − log optimum|): the pick is the
    argmin of the points tried, a pick on the grid's edge adds one log step beyond it (at most
    twice per side), and each point is evaluated once."""
    from tokenformer.experiments.adapt_bench import tune_lr

    calls: list[float] = []

    def loss_of(lr: float) -> float:
        calls.append(lr)
        return abs(math.log(lr / optimum))

    out = tune_lr([1e-3, 3e-3, 1e-2, 3e-2], 2, loss_of)
    assert out["lr"] == pytest.approx(chosen, rel=1e-3)
    assert out["added"] == pytest.approx(added, rel=1e-3)
    assert out["edge"] is edge
    assert len(calls) == len(set(calls)) == 4 + len(added)
    assert out["lr"] == min(out["grid"], key=lambda lr: out["losses"][lr])
    nan_pick = tune_lr([1e-3, 3e-3, 1e-2], 0, lambda lr: math.nan if lr == 3e-3 else lr)
    assert nan_pick["lr"] == 1e-3 and nan_pick["losses"][3e-3] == math.inf
