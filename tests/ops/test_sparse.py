"""Top-k (sparse) Pattention and pruning parameter tokens (issue 18, docs/sparse.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tokenformer
from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.data.tokenizer import train_bpe
from tokenformer.errors import ConfigError, GrowthError
from tokenformer.nn.pattention import (
    GATHER_ELEMENTS,
    Pattention,
    parse_top_k,
    resolve_top_k,
    set_pattention_top_k,
    top_k_pattention,
)


def _masked_dense_f64(x, key, value, scale, k):
    """Independent float64 reference: Θ (l2_norm_gelu, written out) over all n, zero all but
    each row's k largest |Θ|, dense matmul."""
    x, key, value = x.double(), key.double(), value.double()
    a = x @ key.t()
    th = F.gelu(a / a.norm(dim=-1, keepdim=True) * scale)
    kth = th.abs().sort(dim=-1, descending=True).values[..., k - 1: k]
    return (th * (th.abs() >= kth)) @ value


def _layer(n=24, d_in=16, d_out=12, top_k=None):
    torch.manual_seed(0)
    layer = Pattention(d_in, d_out, n, top_k=top_k)
    with torch.no_grad():  # keys wide enough that Θ has both signs and no ties
        layer.key_param_tokens.normal_(0, 0.5)
        layer.value_param_tokens.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("rows", [1, 3, 4096])  # 4096 rows: the masked-dense branch
def test_top_k_equal_n_is_dense(rows):
    layer = _layer()
    x = torch.randn(rows, 16)
    assert (rows * 24 * 12 > GATHER_ELEMENTS) == (rows == 4096)
    dense = layer(x)
    layer.top_k = 24  # the public path: k = n is the dense layer, bit for bit
    assert torch.equal(layer(x), dense)
    # the gather / masked path itself at k = n: the same sum in another order
    theta_ = tokenformer.theta(x @ layer.key_param_tokens.t(), "l2_norm_gelu", layer.scale)
    sparse = top_k_pattention(layer.value_param_tokens, theta_, 24)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 4096])
@pytest.mark.parametrize("k", [1, 5, 23])
def test_top_k_forward_and_gradients_match_float64_masked_dense(rows, k):
    layer = _layer(top_k=k)
    x = torch.randn(rows, 16, requires_grad=True)
    out = layer(x)
    key = layer.key_param_tokens.detach().double().requires_grad_()
    value = layer.value_param_tokens.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    ref = _masked_dense_f64(x64, key, value, layer.scale, k)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    (out.double() * g).sum().backward()
    (ref * g).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.key_param_tokens.grad.double(), key.grad, rtol=1e-4,
                               atol=1e-5)
    torch.testing.assert_close(layer.value_param_tokens.grad.double(), value.grad, rtol=1e-4,
                               atol=1e-5)


def test_top_k_ranks_by_magnitude_not_sign():
    """A negative GELU weight larger in size than a positive one is kept (k = 1 by hand)."""
    layer = Pattention(2, 1, 2, top_k=1, scale=1.0)
    with torch.no_grad():
        # x = (1, 0): scores (−0.8, 0.3)·‖·‖⁻¹ → GELU(−0.936) = −0.164, GELU(0.351) = 0.222
        layer.key_param_tokens.copy_(torch.tensor([[-0.8, 0.0], [0.3, 0.0]]))
        layer.value_param_tokens.copy_(torch.tensor([[10.0], [1.0]]))
    a = torch.tensor([-0.8, 0.3]) / 0.8544003745317531
    th = F.gelu(a)
    assert abs(th[1]) > abs(th[0])  # here the positive one is larger: it is kept
    assert torch.allclose(layer(torch.tensor([[1.0, 0.0]])), th[1:] * 1.0)
    with torch.no_grad():
        layer.key_param_tokens.copy_(torch.tensor([[-0.8, 0.0], [0.05, 0.0]]))
    a = torch.tensor([-0.8, 0.05]) / torch.tensor([-0.8, 0.05]).norm()
    th = F.gelu(a)  # GELU(−0.998) = −0.159 vs GELU(0.062) = 0.032: the negative one wins
    assert torch.allclose(layer(torch.tensor([[1.0, 0.0]])), th[:1] * 10.0)


def test_resolve_and_parse_top_k():
    assert resolve_top_k(None, 100) is None
    assert resolve_top_k(0.25, 100) == 25
    assert resolve_top_k(0.001, 100) == 1
    assert resolve_top_k(500, 100) == 100
    assert parse_top_k("0.25") == {"qkv": 0.25, "proj": 0.25, "ffn": 0.25}
    assert parse_top_k("ffn=0.5,qkv=64") == {"qkv": 64, "proj": None, "ffn": 0.5}
    for bad in ("0", "1.5", "x", "mlp=0.5", "ffn"):
        with pytest.raises(ConfigError):
            parse_top_k(bad)


def _model(**overrides):
    torch.manual_seed(0)
    return TokenFormerLM(TokenFormerConfig.from_name("tiny", **overrides)).eval()


def test_set_top_k_carries_through_config_save_load_and_hf(tmp_path):
    model = _model()
    ids = torch.randint(0, 257, (2, 16))
    dense = model(ids).logits
    set_pattention_top_k(model, qkv=0.5, ffn=32)
    assert model.layers[0].attention.query.top_k == 0.5
    assert model.layers[0].attention.proj.top_k is None
    assert model.layers[1].mlp.top_k == 32
    assert model.config.ffn_top_k == 32
    sparse = model(ids).logits
    assert not torch.allclose(sparse, dense)
    model.save(tmp_path / "m")
    loaded = TokenFormerLM.load(tmp_path / "m").eval()
    assert loaded.layers[1].mlp.top_k == 32 and loaded.config.qkv_top_k == 0.5
    assert torch.equal(loaded(ids).logits, sparse)
    pytest.importorskip("transformers")
    from tokenformer.hf.modeling import TokenFormerForCausalLM

    hf = TokenFormerForCausalLM.from_core(loaded)
    assert hf.config.ffn_top_k == 32
    hf.save_pretrained(tmp_path / "hf")
    again = TokenFormerForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert again.model.layers[1].mlp.top_k == 32
    torch.testing.assert_close(again(ids).logits, sparse)


def test_generate_top_k_tokens_is_temporary():
    model = _model()
    ids = torch.randint(0, 257, (1, 8))
    full = model.generate(ids, 4, top_k_tokens=128)  # ≥ n everywhere: dense
    assert torch.equal(full, model.generate(ids, 4))
    model.generate(ids, 4, top_k_tokens="ffn=0.25")
    assert model.layers[0].mlp.top_k is None and model.config.ffn_top_k is None


def test_config_rejects_bad_top_k():
    with pytest.raises(ConfigError, match="ffn_top_k"):
        TokenFormerConfig.from_name("tiny", ffn_top_k=0)
    with pytest.raises(ConfigError, match="qkv_top_k"):
        TokenFormerConfig.from_name("tiny", qkv_top_k=1.5)


# ------------------------------------------------------------------------------- pruning
@pytest.mark.parametrize("norm", ["l2_norm_gelu", "gelu_l1_norm"])
def test_grow_exact_then_prune_newest_restores_the_model(norm):
    model = _model(norm=norm)
    back = tokenformer.prune(tokenformer.grow(model, qkv="2x", proj=48, ffn="1.5x"),
                             qkv=32, proj=32, ffn=128, by="newest")
    assert back.config == model.config  # counts back, Θ factors back to the defaults
    ids = torch.randint(0, 257, (2, 24))
    assert torch.equal(back(ids).logits, model(ids).logits)


def test_prune_keeps_the_most_important_tokens_and_saves(tmp_path):
    model = _model()
    ffn = model.layers[0].mlp
    with torch.no_grad():
        ffn.value_param_tokens[7].mul_(100.0)  # by far the largest contribution
    ids = torch.randint(0, 257, (2, 32))
    small = tokenformer.prune(model, ffn="0.25x", qkv=16, by="contribution", calibration=ids)
    assert small.config.ffn_tokens == 32 and small.config.qkv_tokens == 16
    assert small.config.ffn_scale == pytest.approx(128 ** 0.5)  # held
    kept = small.layers[0].mlp.value_param_tokens
    assert any(torch.equal(row, ffn.value_param_tokens[7]) for row in kept)
    assert small.num_parameters() == small.config.num_parameters()
    small.save(tmp_path / "s")
    loaded = TokenFormerLM.load(tmp_path / "s").eval()
    assert torch.equal(loaded(ids).logits, small.eval()(ids).logits)
    assert model.config.ffn_tokens == 128  # input untouched


def test_prune_renorm_keeps_the_pre_activation_scale():
    model = _model()
    ids = torch.randint(0, 257, (2, 32))
    small = tokenformer.prune(model, ffn=64, by="value", calibration=ids, scale="renorm")
    assert small.config.ffn_scale < 128 ** 0.5  # fewer scores in the norm → smaller factor
    # by hand, in float64: √n times the mean over FFNs of the mean over rows of
    # ‖scores of the kept (largest-‖v‖) tokens‖ / ‖all scores‖
    inputs = []
    hooks = [block.mlp.register_forward_hook(lambda m, a, o: inputs.append(a[0]))
             for block in model.layers]
    model(ids)
    for h in hooks:
        h.remove()
    ratios = []
    for block, x in zip(model.layers, inputs, strict=True):
        key = block.mlp.key_param_tokens.double()
        scores = x.double().reshape(-1, key.shape[1]) @ key.t()
        kept = block.mlp.value_param_tokens.norm(dim=1).topk(64).indices
        ratios.append((scores[:, kept].norm(dim=1) / scores.norm(dim=1)).mean().item())
    assert small.config.ffn_scale == pytest.approx(128 ** 0.5 * sum(ratios) / len(ratios),
                                                   rel=1e-5)
    follow = tokenformer.prune(model, ffn=64, by="value", scale="follow")
    assert follow.config.ffn_scale is None


def test_prune_refuses_bad_requests():
    model = _model()
    with pytest.raises(GrowthError, match="cannot prune"):
        tokenformer.prune(model, ffn=256, by="value")
    with pytest.raises(GrowthError, match="malformed"):
        tokenformer.prune(model, ffn="half", by="value")
    with pytest.raises(GrowthError, match="calibration"):
        tokenformer.prune(model, ffn=64)
    with pytest.raises(GrowthError, match="unknown importance"):
        tokenformer.prune(model, ffn=64, by="random")
    from tokenformer.models.baselines import matched_config, model_class

    tpp = model_class("transformer++")(matched_config(model.config, "transformer++"))
    with pytest.raises(GrowthError, match="transformer\\+\\+ model has none"):
        tokenformer.prune(tpp, ffn="0.5x", by="value")


def _cli(capsys, *args):
    """Run the CLI in-process: (exit code, stdout, stderr)."""
    from tokenformer.cli import main

    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own exits
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _one_error_line(code, err):
    lines = err.strip().splitlines()
    return code == 2 and len(lines) == 1 and lines[0].startswith("error:")


def test_prune_cli(tmp_path, capsys):
    from tokenformer.data.tokenizer import TOKENIZER_FILE

    model = _model()
    model.save(tmp_path / "m")
    # a real one: prune parses the tokenizer it copies (issue 27), a stand-in is refused
    train_bpe(["a stand-in tokenizer"], 257, progress=False).save(tmp_path / "m")
    code, out, err = _cli(capsys, "prune", str(tmp_path / "m"), str(tmp_path / "out"), "--ffn",
                          "0.5x", "--by", "value")
    assert code in (0, None), err
    assert "ffn 64" in out
    assert TokenFormerLM.load(tmp_path / "out").config.ffn_tokens == 64
    from tokenformer.io.checkpoint import verify_checkpoint

    assert verify_checkpoint(tmp_path / "out")  # a manifest, as grow writes: train verifies it
    assert ((tmp_path / "out" / TOKENIZER_FILE).read_bytes()
            == (tmp_path / "m" / TOKENIZER_FILE).read_bytes())
    for args in (["--ffn", "999"], ["--by", "nope"], ["--ffn", "half"]):
        code, _, err = _cli(capsys, "prune", str(tmp_path / "m"), str(tmp_path / "bad"), *args)
        assert _one_error_line(code, err), err
        assert not (tmp_path / "bad").exists()
    code, _, err = _cli(capsys, "prune", str(tmp_path / "missing"), str(tmp_path / "bad2"))
    assert _one_error_line(code, err) and "not found" in err


def test_generate_cli_top_k_tokens(capsys):
    code, out, err = _cli(capsys, "generate", "tiny", "--prompt", "And", "--max-new-tokens", "4",
                          "--temperature", "0", "--top-k-tokens", "ffn=0.25,qkv=8")
    assert code in (0, None), err
    assert out.startswith("And")
    code, _, err = _cli(capsys, "generate", "tiny", "--prompt", "And", "--top-k-tokens", "mlp=2")
    assert _one_error_line(code, err), err


# ------------------------------------------------------------------- the sparse study (CLI)
def _pruned_rows(k: dict[str, float]) -> list[dict]:
    """Hand-made prune-seeds rows for seeds 0 and 1: unpruned loss 2 + seed (TokenFormer) or
    3 + seed (Transformer++); an arm pruned by f loses f × k[arm] + 0.01 × seed more."""
    rows = []
    for family, base, arms in (("tokenformer", 2.0, ("ffn/contribution", "all/contribution")),
                               ("transformer++", 3.0, ("mlp/magnitude", "mlp/activation"))):
        for seed in (0, 1):
            rows.append({"family": family, "arm": "unpruned", "pruned": 0.0, "seed": seed,
                         "params": 100, "val_loss": base + seed, "finetuned": None})
            for arm in arms:
                for frac in (0.25, 0.5, 0.75):
                    rows.append({"family": family, "arm": arm, "pruned": frac, "seed": seed,
                                 "params": round(100 * (1 - frac)), "finetuned": None,
                                 "val_loss": base + seed + frac * k[arm] + 0.01 * seed})
    return rows


def test_sparse_study_prune_seeds_statistics_from_json(tmp_path, capsys):
    """`sparse-study prune-seeds --from-json` re-renders measured rows: Δ vs each model's own
    unpruned loss, and the paired questions, checked against the hand-made rows."""
    import json

    k = {"ffn/contribution": 0.2, "all/contribution": 0.6, "mlp/magnitude": 0.4,
         "mlp/activation": 0.4}
    (tmp_path / "earlier.json").write_text(json.dumps({"rows": _pruned_rows(k), "sweeps": {}}))
    code, out, err = _cli(capsys, "sparse-study", "--json", str(tmp_path / "again.json"),
                          "prune-seeds", "--tokenformer", "tf0", "tf1", "--transformer", "t0",
                          "t1", "--by", "contribution", "--finetune-steps", "0",
                          "--from-json", str(tmp_path / "earlier.json"))
    assert code in (0, None), err
    assert out.startswith("### Sparse Pattention: prune-seeds\n\nCommand: `tokenformer ")
    saved = json.loads((tmp_path / "again.json").read_text())
    assert set(saved) == {"rows", "summary", "tests", "sweeps", "unpruned_difference"}
    ffn = next(e for e in saved["summary"] if e["arm"] == "ffn/contribution"
               and e["pruned"] == 0.5)
    assert ffn["delta_val_loss"]["values"] == pytest.approx([0.1, 0.11])
    assert ffn["delta_val_loss"]["mean"] == pytest.approx(0.105)
    # TokenFormer's FFN tokens lose 0.5 × (0.2 − 0.4) = −0.1 less than the MLP at every seed:
    # a zero-spread paired difference, resolved for the TokenFormer
    test = next(t for t in saved["tests"] if t["pruned"] == 0.5 and t["b"].endswith("magnitude")
                and t["a"] == "tokenformer ffn/contribution")
    assert test["mean"] == pytest.approx(-0.1) and test["winner"] == test["a"]
    assert saved["unpruned_difference"]["mean"] == pytest.approx(-1.0)  # 2 + s vs 3 + s
    assert "| 50% | tokenformer ffn/contribution | 50 |" in out


def test_sparse_study_bad_input_is_one_error_line(tmp_path, capsys):
    code, _, err = _cli(capsys, "sparse-study", "train", "--out", str(tmp_path / "runs"),
                        "--results", str(tmp_path / "missing.json"))
    assert _one_error_line(code, err) and "missing.json does not exist" in err
    code, _, err = _cli(capsys, "sparse-study", "quality")
    assert _one_error_line(code, err), err


def test_sparse_study_never_writes_over_what_it_reads(tmp_path, capsys):
    """--json onto the --from-json it re-renders, or a plot's --out onto one of its inputs, is
    refused before anything is written: the input stays byte for byte."""
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"rows": [], "sweeps": {}}')
    before = earlier.read_bytes()
    code, _, err = _cli(capsys, "sparse-study", "--json", str(earlier), "prune-seeds",
                        "--tokenformer", "tf0", "--transformer", "t0",
                        "--from-json", str(earlier))
    assert _one_error_line(code, err) and "--json" in err and "is the input" in err
    code, _, err = _cli(capsys, "sparse-study", "plot", str(earlier), str(earlier),
                        "--out", str(tmp_path))
    assert _one_error_line(code, err) and "contains the input" in err
    assert earlier.read_bytes() == before
