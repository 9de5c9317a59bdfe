"""Vision TokenFormer: presets against the paper, the forward pass against a float64 reference,
data (digits and image folders, bad inputs), training through the trainer, exact growth, CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer.cli import main
from tokenformer.cli.commands.vision import vision_info
from tokenformer.data.images import ImageFolder, batch_fn, load_digits_split, random_shift
from tokenformer.errors import ConfigError, DataError
from tokenformer.eval.vision import evaluate
from tokenformer.models.vit import (
    TokenFormerViT,
    TokenFormerViTConfig,
    ViT,
    ViTConfig,
    load_vision_model,
    patchify,
)
from tokenformer.training.vision import train_vision

PIL = pytest.importorskip("PIL.Image")  # the `vision` extra
pytest.importorskip("sklearn")


def tiny_config(**kw) -> TokenFormerViTConfig:
    base = dict(image_size=8, patch_size=4, num_channels=3, num_classes=5, hidden_size=16,
                num_layers=2, num_heads=2, qkv_tokens=6, proj_tokens=5, ffn_tokens=12)
    return TokenFormerViTConfig(**{**base, **kw})


# ------------------------------------------------------------------------------- presets / sizes
# The paper's ImageNet-1K table (spec §7), in millions of parameters.
PAPER = {"vit-b16-matched": 86, "vit-b16": 109, "vit-l16-matched": 307, "vit-l16": 407}


@pytest.mark.parametrize("name", PAPER)
def test_paper_presets_match_the_paper(name):
    config = TokenFormerViTConfig.from_name(name)
    assert round(config.num_parameters() / 1e6) == PAPER[name]
    assert (config.image_size, config.patch_size, config.num_classes) == (224, 16, 1000)
    assert (config.hidden_size, config.num_layers) == ((768, 12) if "b16" in name else (1024, 24))
    with torch.device("meta"):  # the real modules, without allocating 400M floats
        model = TokenFormerViT(config)
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_matched_presets_match_vit_weight_matrices():
    # ViT-B/16 and L/16 as published by timm: an independent check of the stem accounting.
    assert ViTConfig.from_name("vit-b16").num_parameters() == 86_567_656
    assert ViTConfig.from_name("vit-l16").num_parameters() == 304_326_632
    tf = TokenFormerViTConfig.from_name("vit-b16-matched")
    vit = ViTConfig.matched_to(tf)
    assert vit.intermediate_size == 3072  # exactly ViT-B/16
    d = 768
    biases_and_norms = 13 * d  # qkv 3d + proj d + fc1 4d + fc2 d + two LayerNorms 4d
    assert vit.block_parameters() - biases_and_norms == tf.block_parameters() == 12 * d * d


@settings(max_examples=15, deadline=None)
@given(pool=st.sampled_from(["cls", "mean"]), block_norm=st.sampled_from(["none", "both"]),
       layers=st.integers(1, 3), q=st.integers(1, 9), f=st.integers(1, 20),
       arch=st.sampled_from(["tokenformer", "vit"]))
def test_num_parameters_from_shapes_equals_modules(pool, block_norm, layers, q, f, arch):
    config = tiny_config(pool=pool, block_norm=block_norm, num_layers=layers, qkv_tokens=q,
                         ffn_tokens=f)
    if arch == "tokenformer":
        model = TokenFormerViT(config)
    else:
        model = ViT(ViTConfig(image_size=8, patch_size=4, num_classes=5, hidden_size=16,
                              num_heads=2, num_layers=layers, pool=pool, intermediate_size=f))
    assert model.num_parameters() == model.config.num_parameters()


def test_flops_by_hand():
    c = tiny_config(pool="mean", qkv_tokens=6, proj_tokens=5, ffn_tokens=12)
    d, T, n_scores = 16, 4, 3 * 6 + 5 + 12
    per_token_layer = (2 * 2 * d * n_scores + 8 * n_scores  # Pattention matmuls + Θ (8/score)
                       + 2 * 2 * T * d + 5 * T * 2  # QKᵀ and AV, softmax over 2 heads
                       + 2 * 5 * d)  # two LayerNorms
    patch_embed = 2 * (3 * 16) * d * 4
    head = 2 * 5 * d + 5 * d
    forward = T * 2 * per_token_layer + patch_embed + head
    assert c.training_flops_per_image() == pytest.approx(3 * forward)
    # ViT-B/16's forward pass is the well-known 17.58 G multiply-accumulates (e.g. fvcore).
    macs = ViTConfig.from_name("vit-b16").training_flops_per_image() / 3 / 2
    assert macs == pytest.approx(17.58e9, rel=2e-3)


def test_config_errors():
    with pytest.raises(ConfigError, match="not divisible by patch_size"):
        tiny_config(image_size=10)
    with pytest.raises(ConfigError, match="pool"):
        tiny_config(pool="max")
    with pytest.raises(ConfigError, match="unknown preset"):
        TokenFormerViTConfig.from_name("vit-h14")
    with pytest.raises(ConfigError, match="unknown key"):
        TokenFormerViTConfig.from_name("vit-digits-tiny", vocab_size=3)
    with pytest.raises(DataError, match=r"pixel_values must be \[batch, 3, 8, 8\]"):
        TokenFormerViT(tiny_config())(torch.zeros(2, 1, 8, 8))


# ----------------------------------------------------------------------------------- forward
def _reference_logits(model: TokenFormerViT, x: torch.Tensor) -> torch.Tensor:
    """The Vision TokenFormer written out from its definition in float64 (no shared code)."""
    c = model.config
    s = {k: v.double() for k, v in model.state_dict().items()}
    B, p = x.shape[0], c.patch_size
    patches = x.double().unfold(2, p, p).unfold(3, p, p)  # [B, C, H/p, W/p, p, p]
    patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(B, -1, c.num_channels * p * p)
    h = patches @ s["patch_embed.weight"].T + s["patch_embed.bias"]
    if c.pool == "cls":
        h = torch.cat([s["cls_token"].expand(B, 1, -1), h], dim=1)
    h = h + s["pos_embed"]

    def ln(t):
        mu, var = t.mean(-1, keepdim=True), t.var(-1, unbiased=False, keepdim=True)
        return (t - mu) / torch.sqrt(var + c.layernorm_eps)

    def pattention(t, prefix):
        k, v = s[prefix + ".key_param_tokens"], s[prefix + ".value_param_tokens"]
        a = t @ k.T
        a = a / a.norm(dim=-1, keepdim=True) * math.sqrt(k.shape[0])
        return (0.5 * a * (1 + torch.erf(a / math.sqrt(2)))) @ v

    H, hd = c.num_heads, c.head_dim
    for i in range(c.num_layers):
        pre, u = f"layers.{i}.", ln(h)
        q, k, v = (pattention(u, pre + "attention." + n).view(B, -1, H, hd).transpose(1, 2)
                   for n in ("query", "key", "value"))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd), dim=-1)  # no mask
        h = h + pattention((att @ v).transpose(1, 2).reshape(B, -1, H * hd), pre + "attention.proj")
        h = h + pattention(ln(h), pre + "mlp")
    h = ln(h) * s["final_norm.weight"] + s["final_norm.bias"]
    pooled = h[:, 0] if c.pool == "cls" else h.mean(1)
    return pooled @ s["head.weight"].T + s["head.bias"]


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_forward_matches_float64_reference(pool):
    torch.manual_seed(0)
    model = TokenFormerViT(tiny_config(pool=pool)).double()
    with torch.no_grad():  # non-trivial positions and class token
        model.pos_embed.normal_()
        if model.cls_token is not None:
            model.cls_token.normal_()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    labels = torch.tensor([0, 4, 2])
    out = model(x, labels=labels)
    ref = _reference_logits(model, x)
    torch.testing.assert_close(out.logits, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.loss, F.cross_entropy(ref, labels), rtol=1e-10, atol=1e-12)


def test_patchify_equals_strided_convolution():
    torch.manual_seed(0)
    model = TokenFormerViT(tiny_config())
    x = torch.randn(2, 3, 8, 8)
    w = model.patch_embed.weight.view(16, 3, 4, 4)
    conv = F.conv2d(x, w, model.patch_embed.bias, stride=4).flatten(2).transpose(1, 2)
    torch.testing.assert_close(model.patch_embed(patchify(x, 4)), conv)


def test_baseline_vit_trains_a_step_and_saves(tmp_path):
    torch.manual_seed(0)
    vit = ViT(ViTConfig.matched_to(tiny_config(qkv_tokens=12, proj_tokens=12, ffn_tokens=48)))
    x, y = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    vit(x, labels=y).loss.backward()
    assert all(p.grad is not None for p in vit.parameters())
    vit.save(tmp_path / "vit")
    loaded = load_vision_model(tmp_path / "vit")
    assert type(loaded) is ViT
    torch.testing.assert_close(loaded.eval()(x).logits, vit.eval()(x).logits, rtol=0, atol=0)


# -------------------------------------------------------------------------------------- digits
def test_digits_split_is_fixed_and_disjoint():
    train, test = load_digits_split()
    assert (len(train), len(test)) == (1437, 360)
    assert train.images.shape[1:] == (1, 8, 8)
    assert 0 <= train.images.min() <= train.images.max() <= 1
    _, again = load_digits_split()
    assert torch.equal(test.images, again.images) and torch.equal(test.labels, again.labels)
    flat = {tuple(img.flatten().tolist()) for img in test.images}
    overlap = sum(tuple(img.flatten().tolist()) in flat for img in train.images)
    assert overlap <= 5  # the digits set holds a handful of exact duplicate images, no more
    assert set(test.labels.tolist()) == set(range(10))
    z = train.normalized()
    assert abs(float(z.mean())) < 1e-5 and abs(float(z.std()) - 1) < 1e-3


def test_random_shift_moves_pixels_by_at_most_one():
    img = torch.zeros(64, 1, 8, 8)
    img[:, 0, 3, 4] = 1.0
    shifted = random_shift(img, 1, torch.Generator().manual_seed(0))
    pos = shifted[:, 0].flatten(1).argmax(1)
    dy, dx = pos // 8 - 3, pos % 8 - 4
    assert shifted.sum() == 64  # nothing lost (the pixel stays inside)
    assert set(dy.tolist()) == {-1, 0, 1} and set(dx.tolist()) == {-1, 0, 1}
    assert torch.equal(random_shift(img, 0, torch.Generator()), img)


def test_batches_are_a_pure_function_of_seed_and_step():
    train, _ = load_digits_split()
    a, b = batch_fn(train, 32, seed=1), batch_fn(train, 32, seed=1)
    assert torch.equal(a(5)["pixel_values"], b(5)["pixel_values"])
    assert not torch.equal(a(5)["labels"], a(6)["labels"])


# -------------------------------------------------------------------------------- image folders
def _write(path: Path, mode: str, size=(12, 10), value=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(abs(hash(path.name)) % 2**32)
    shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
    array = rng.integers(0, 256, shape, dtype=np.uint8) if value is None else \
        np.full(shape, value, dtype=np.uint8)
    PIL.fromarray(array, mode).save(path)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "imgs"
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            _write(root / split / cls / "a.png", "RGB")
            _write(root / split / cls / "b.jpg", "L")  # grayscale among RGB images
    return root


def test_image_folder_loads_and_converts_grayscale_to_rgb(folder):
    ds = ImageFolder(folder, "train", image_size=8)
    assert ds.classes == ["cat", "dog"] and len(ds) == 4
    x, label = ds[1]
    assert x.shape == (3, 8, 8) and label == 0 and ds.samples[1][0].name == "b.jpg"
    raw = x * ds.std.view(3, 1, 1) + ds.mean.view(3, 1, 1)  # undo the normalisation
    torch.testing.assert_close(raw[0], raw[1], atol=1e-5, rtol=0)  # grey replicated
    torch.testing.assert_close(raw[1], raw[2], atol=1e-5, rtol=0)
    val = ImageFolder(folder, "val", image_size=8)
    assert torch.equal(val[0][0], val[0][0])  # evaluation transform is deterministic
    batch = ds.batch_fn(3, seed=0)(0)
    assert batch["pixel_values"].shape == (3, 3, 8, 8) and batch["labels"].shape == (3,)
    assert torch.equal(ds.batch_fn(3, seed=0)(0)["pixel_values"], batch["pixel_values"])
    gray = ImageFolder(folder, "val", image_size=8, num_channels=1)
    assert gray[0][0].shape == (1, 8, 8)  # RGB converted to grayscale


def test_image_folder_unreadable_file_names_the_file(folder):
    bad = folder / "train" / "dog" / "broken.jpg"
    bad.write_bytes(b"not a jpeg at all")
    ds = ImageFolder(folder, "train", image_size=8)
    index = [p for p, _ in ds.samples].index(bad)
    with pytest.raises(DataError, match=r"broken\.jpg: cannot decode image"):
        ds[index]


def test_image_folder_wrong_layouts(tmp_path, folder):
    with pytest.raises(DataError, match="image folder not found"):
        ImageFolder(tmp_path / "missing")
    flat = tmp_path / "flat"
    _write(flat / "x.png", "RGB")
    with pytest.raises(DataError, match="not in ImageNet layout"):
        ImageFolder(flat)
    _write(flat / "train" / "stray.png", "RGB")
    with pytest.raises(DataError, match=r"stray\.png: images must sit in one sub-folder"):
        ImageFolder(flat)
    (folder / "val" / "bird").mkdir()
    _write(folder / "val" / "bird" / "c.png", "RGB")
    with pytest.raises(DataError, match="class 'bird' has no folder"):
        ImageFolder(folder, "val")
    (folder / "train" / "empty").mkdir()
    with pytest.raises(DataError, match="empty holds no images"):
        ImageFolder(folder, "train")


def test_cli_trains_on_an_image_folder(folder, tmp_path, capsys):
    code = main(["vision", "train", "--data", str(folder), "--set", "num_channels=3",
                 "--set", "image_size=8", "--set", "patch_size=4", "--steps", "3",
                 "--batch-size", "4", "--out", str(tmp_path / "run")])
    assert code == 0 and "top-1" in capsys.readouterr().out
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["classes"] == ["cat", "dog"] and np.sum(results["confusion"]) == 4
    assert load_vision_model(tmp_path / "run" / "final").config.num_classes == 2


def test_cli_bad_folder_is_one_error_line(tmp_path, capsys):
    code = main(["vision", "train", "--data", str(tmp_path / "nothing"), "--out",
                 str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: image folder not found") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------- training and growth
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """vit-digits-tiny trained on digits through the trainer's fit (the small budget)."""
    out = tmp_path_factory.mktemp("vision") / "run"
    run = train_vision("vit-digits-tiny", "digits", out=out, steps=200, lr=4e-3, min_lr=4e-4,
                       warmup_steps=20, seed=0, progress=False)
    return run, out


def test_small_budget_reaches_80_percent_on_digits(trained):
    run, out = trained
    print(f"top-1 after 200 steps: {run.evaluation.accuracy:.4f}")
    assert run.evaluation.accuracy >= 0.80
    assert run.evaluation.confusion.sum() == 360
    results = json.loads((out / "results.json").read_text())
    assert results["accuracy"] == pytest.approx(run.evaluation.accuracy)
    assert (out / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reloaded = load_vision_model(out / "final")
    _, test = load_digits_split()
    again = evaluate(reloaded, [(test.normalized(), test.labels)])
    assert again.accuracy == run.evaluation.accuracy


def test_exact_growth_preserves_test_predictions(trained):
    grow = pytest.importorskip("tokenformer.ops.growth").grow
    model = trained[0].model
    _, test = load_digits_split()
    x = test.normalized()
    before = model.predict(x)
    for kwargs in (dict(qkv="2x", proj="2x", ffn="2x"), dict(layers=4),
                   dict(qkv=60, ffn=250, layers=3)):
        grown = grow(model, recipe="exact", generator=torch.Generator().manual_seed(0),
                     **kwargs)
        assert type(grown) is TokenFormerViT
        assert grown.num_parameters() > model.num_parameters()
        assert torch.equal(grown.predict(x), before), kwargs


def test_cli_info_and_eval(trained, capsys):
    assert main(["vision", "info", "vit-b16"]) == 0
    assert "109,008,616" in capsys.readouterr().out
    assert "86,567,656" in vision_info("vit-b16-matched", arch="vit")  # = ViT-B/16 itself
    assert main(["vision", "eval", str(trained[1] / "final")]) == 0
    assert f"top-1 {100 * trained[0].evaluation.accuracy:.2f}%" in capsys.readouterr().out


def test_image_folder_batches_are_the_same_with_prefetching_workers(folder):
    """Decoding in DataLoader worker processes (prefetched) yields exactly the batches of the
    in-process path, for consecutive steps and after a jump (a resumed run)."""
    ds = ImageFolder(folder, "train", image_size=8)
    inline = ds.batch_fn(5, seed=3, workers=0)
    workers = ds.batch_fn(5, seed=3, workers=2, prefetch=2)
    try:
        for step in (0, 1, 2, 3, 7, 8, 2):  # 7 and the second 2: restarts of the loader
            a, b = inline(step), workers(step)
            assert torch.equal(a["pixel_values"], b["pixel_values"]), step
            assert torch.equal(a["labels"], b["labels"]), step
        assert not torch.equal(inline(0)["pixel_values"], inline(1)["pixel_values"])
    finally:
        workers.close()


def test_vision_train_on_a_folder_with_workers_matches_without(folder, tmp_path):
    from tokenformer.training.vision import train_vision

    runs = [train_vision("vit-digits-tiny", str(folder), steps=3, batch_size=4, seed=0,
                         eval_interval=0, threads=1, workers=w,
                         model_overrides={"image_size": 8, "num_channels": 3, "num_classes": 2})
            for w in (0, 2)]
    assert runs[0].fit.losses == runs[1].fit.losses
