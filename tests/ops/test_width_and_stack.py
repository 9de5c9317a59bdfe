"""Width growth by duplication and depth stacking (issue 24): grow(hidden=...), grow(how="stack").

Expectations are independent of the code under test: the logits of the model before growth (in
float64), the gradients of the un-grown model with scale factors derived by hand (the derivation
is in tokenformer.ops.cloning's docstring), the old blocks' tensors, and invariants.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.models.baselines import TransformerConfig, TransformerLM
from tokenformer.models.official import inexpressible
from tokenformer.nn.pattention import THETA_VARIANTS
from tokenformer.ops.growth import grow, grow_with_optimizer, plan_growth

VOCAB = 97


def tokenformer(norm: str = "l2_norm_gelu", seed: int = 0, **overrides) -> TokenFormerLM:
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=16,
                  proj_tokens=12, ffn_tokens=24, max_seq_len=32, norm=norm)
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig(**{**fields, **overrides}))


def baseline(arch: str = "transformer++", seed: int = 0, **overrides) -> TransformerLM:
    fields = dict(arch=arch, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                  intermediate_size=40, max_seq_len=32)
    torch.manual_seed(seed)
    return TransformerLM(TransformerConfig(**{**fields, **overrides}))


def trained_like(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Float64, every parameter moved off its init (norm weights no longer all one, biases no
    longer zero), so that no term of the construction is trivially zero."""
    model = model.double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    return model


def ids(seed: int = 2, B: int = 3, T: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def relative_change(a: torch.nn.Module, b: torch.nn.Module, batch: torch.Tensor | None = None
                    ) -> float:
    batch = ids() if batch is None else batch
    x, y = a(batch).logits, b(batch).logits
    return float((x - y).abs().max() / x.abs().max())


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------ width: exactness
@pytest.mark.parametrize("factor", ["2x", "4x"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_width_preserves_tokenformer_logits(norm: str, tied: bool, factor: str) -> None:
    model = trained_like(tokenformer(norm, tie_embeddings=tied, block_norm="both"))
    grown = grow(model, hidden=factor)
    r = int(factor[0])
    assert (grown.config.hidden_size, grown.config.num_heads) == (32 * r, 4 * r)
    assert grown.config.head_dim == 8 and grown.config.qkv_tokens == 16  # tokens untouched
    assert relative_change(model, grown) <= 1e-12


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ["transformer++", "transformer"])
def test_width_preserves_baseline_logits(arch: str, tied: bool) -> None:
    model = trained_like(baseline(arch, tie_embeddings=tied))
    for request in (dict(hidden="2x"), dict(hidden="4x"), dict(hidden=64, ffn="2x"),
                    dict(ffn="3x")):
        grown = grow(model, **request)
        assert relative_change(model, grown) <= 1e-12, request
    assert grow(model, hidden="2x", ffn="2x").config.intermediate_size == 80


@given(heads=st.integers(1, 4), head_dim=st.sampled_from([4, 8]), layers=st.integers(1, 3),
       r=st.integers(2, 3), rotary=st.sampled_from([0.0, 0.5, 1.0]),
       norm=st.sampled_from(THETA_VARIANTS), tied=st.booleans(),
       noise=st.sampled_from([0.0, 0.3]), q=st.integers(3, 12), f=st.integers(3, 20))
@settings(max_examples=25, deadline=None)
def test_width_is_exact_on_random_configs(heads, head_dim, layers, r, rotary, norm, tied, noise,
                                          q, f) -> None:
    model = trained_like(tokenformer(norm, hidden_size=heads * head_dim, num_heads=heads,
                                     num_layers=layers, qkv_tokens=q, proj_tokens=q,
                                     ffn_tokens=f, rotary_pct=rotary, tie_embeddings=tied))
    grown = grow(model, hidden=f"{r}x", width_noise=noise, generator=gen())
    assert relative_change(model, grown, ids(B=2, T=16)) <= 1e-12


def test_new_heads_are_copies_of_old_heads() -> None:
    """Head j of the widened model is old head j mod H: same queries (rotary included) and the
    same attention output, so the concatenation is [a, a]."""
    model = trained_like(tokenformer(rotary_pct=0.5))
    grown = grow(model, hidden="2x")
    x = model.word_embeddings(ids())
    wide = grown.word_embeddings(ids())
    assert torch.equal(wide, torch.cat([x, x], dim=-1))  # the stream is [x, x]
    B, T, _ = x.shape
    positions = torch.arange(T).expand(B, T)
    old, new = model.layers[0], grown.layers[0]
    q = old.attention.query(old.input_layernorm(x)).view(B, T, 4, 8).transpose(1, 2)
    q_new = new.attention.query(new.input_layernorm(wide)).view(B, T, 8, 8).transpose(1, 2)
    q, q_new = model.rotary(q, positions), grown.rotary(q_new, positions)
    for j in range(8):
        torch.testing.assert_close(q_new[:, j], q[:, j % 4], rtol=1e-12, atol=1e-12)
    a = old.attention(old.input_layernorm(x), model.rotary, positions, None, None)
    a_new = new.attention(new.input_layernorm(wide), grown.rotary, positions, None, None)
    torch.testing.assert_close(a_new, torch.cat([a, a], dim=-1), rtol=1e-12, atol=1e-12)


def test_width_refuses_what_it_cannot_do_exactly() -> None:
    model = tokenformer()
    with pytest.raises(GrowthError, match=r"not a whole multiple of 32.*64, 96, 128"):
        grow(model, hidden=48)
    with pytest.raises(GrowthError, match="whole multiple"):
        grow(model, hidden="1.5x")
    with pytest.raises(GrowthError, match="cannot shrink"):
        grow(model, hidden="0.5x")
    with pytest.raises(GrowthError, match="head size 8"):
        grow(model, hidden="2x", heads=4)
    with pytest.raises(GrowthError, match="head size"):
        grow(model, heads=8)  # heads alone would change the head size
    assert grow(model, hidden="2x", heads=8).config.num_heads == 8  # r·H restated: fine
    with pytest.raises(GrowthError, match="width_noise"):
        grow(model, ffn="2x", width_noise=0.1)  # no width growth to break the symmetry of
    with pytest.raises(GrowthError, match="width_noise"):
        grow(model, hidden="1x", heads=4, width_noise=0.1)  # 1x duplicates nothing
    with pytest.raises(GrowthError, match="width_noise"):
        grow(model, hidden="2x", width_noise=-1.0)
    product = tokenformer(ffn_tokens=64, ffn_keys="product", ffn_product_k=8)
    with pytest.raises(GrowthError, match="product-key"):
        grow(product, hidden="2x")
    with pytest.raises(GrowthError, match="parameter tokens"):
        grow(baseline(), qkv="2x")
    with pytest.raises(GrowthError, match="whole multiple"):
        grow(baseline(), ffn=60)


def test_plan_growth_gives_the_grown_config_without_building_it() -> None:
    config = TokenFormerConfig.from_name("tokenformer-150m")
    planned = plan_growth(config, hidden="2x", layers="2x", how="stack")
    assert (planned.hidden_size, planned.num_heads, planned.num_layers) == (1536, 24, 24)
    assert planned.head_dim == config.head_dim and planned.qkv_tokens == 768
    with pytest.raises(GrowthError, match="768 → 1024 is not a whole multiple"):
        plan_growth(config, hidden=1024)


# --------------------------------------------------- width: gradients, moments, symmetry
def _grads(model: torch.nn.Module, batch: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the next-token loss, in the model's dtype (the model's own loss is float32)."""
    model.zero_grad()
    logits = model(batch).logits[:, :-1].flatten(0, 1)
    torch.nn.functional.cross_entropy(logits, batch[:, 1:].flatten()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _tile(t: torch.Tensor, r: int) -> torch.Tensor:
    """Every axis of width d (= 32 here, never a token count or the vocabulary) tiled r times."""
    for dim, size in enumerate(t.shape):
        if size == 32:
            t = torch.cat([t] * r, dim=dim)
    return t


def expected_scale(name: str, tied: bool) -> float:
    """By hand (tokenformer.ops.cloning), r = 2: a gradient is divided by r once per *copy* axis.
    Keys are split ([K/2, K/2]) and see the old gradient; values and the embedding are copies
    (G/2); the final norm feeding the tied head is split (G); with an untied head the norm is a
    copy (G/2) and the head is split (G)."""
    if name.endswith("key_param_tokens") or name == "lm_head.weight":
        return 1.0
    if name.startswith("final_norm"):
        return 1.0 if tied else 0.5
    assert name.endswith("value_param_tokens") or name == "word_embeddings.weight", name
    return 0.5


@pytest.mark.parametrize("tied", [True, False])
def test_widened_gradients_and_carried_moments(tied: bool) -> None:
    model = trained_like(tokenformer(tie_embeddings=tied))
    batch = ids()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        _grads(model, batch)
        optimizer.step()
    small = _grads(model, batch)
    grown, carried = grow_with_optimizer(model, optimizer, hidden="2x")
    big = _grads(grown, batch)
    for name, g in small.items():
        scale = expected_scale(name, tied)
        torch.testing.assert_close(big[name], _tile(g, 2) * scale, rtol=1e-9, atol=1e-12)
        state = carried.state[dict(grown.named_parameters())[name]]
        old = optimizer.state[dict(model.named_parameters())[name]]
        torch.testing.assert_close(state["exp_avg"], _tile(old["exp_avg"], 2) * scale)
        torch.testing.assert_close(state["exp_avg_sq"], _tile(old["exp_avg_sq"], 2) * scale ** 2)
        assert float(state["step"]) == float(old["step"]) == 2


def test_width_noise_keeps_the_function_and_breaks_the_symmetry() -> None:
    model = trained_like(tokenformer())
    batch = ids()

    def split_after_steps(noise: float) -> tuple[float, float]:
        grown = grow(model, hidden="2x", width_noise=noise, generator=gen())
        change = relative_change(model, grown, batch)
        optimizer = torch.optim.Adam(grown.parameters(), lr=1e-3)
        for _ in range(3):
            _grads(grown, batch)
            optimizer.step()
        values = grown.layers[0].mlp.value_param_tokens.detach()
        return change, float((values[:, :32] - values[:, 32:]).abs().max())

    exact_change, exact_split = split_after_steps(0.0)
    noisy_change, noisy_split = split_after_steps(0.3)
    assert exact_change <= 1e-12 and noisy_change <= 1e-12  # the noise cancels across copies
    assert exact_split <= 1e-12  # identical gradients: the copies stay copies
    assert noisy_split > 1e-4  # with noise they diverge
    keys = grow(model, hidden="2x", width_noise=0.3, generator=gen()).layers[0].mlp
    k = keys.key_param_tokens.detach()
    old = model.layers[0].mlp.key_param_tokens.detach()
    torch.testing.assert_close(k[:, :32] + k[:, 32:], old, rtol=1e-12, atol=1e-15)
    noise = k[:, :32] - old / 2
    assert 0.15 < float(noise.std() / (old / 2).pow(2).mean().sqrt()) < 0.5  # ~0.3 of the rms


# ---------------------------------------------------------------------------------- stacking
@pytest.mark.parametrize("make", [tokenformer, baseline])
@pytest.mark.parametrize("layers", [4, 5])
def test_stack_repeats_the_trained_blocks_in_order(make, layers: int) -> None:
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = ids()
    _grads(model, batch)
    optimizer.step()
    grown, carried = grow_with_optimizer(model, optimizer, layers=layers, how="stack")
    assert grown.config.num_layers == layers
    old_params = dict(model.named_parameters())
    for i, block in enumerate(grown.layers):
        for name, param in block.named_parameters():
            source = old_params[f"layers.{i % 2}.{name}"]
            assert torch.equal(param, source), (i, name)
            state, old_state = carried.state[param], optimizer.state[source]
            assert torch.equal(state["exp_avg"], old_state["exp_avg"])
            assert torch.equal(state["exp_avg_sq"], old_state["exp_avg_sq"])
    # Every copy is its own tensor: training one block does not move another.
    first, third = grown.layers[0], grown.layers[2]
    for a, b in zip(first.parameters(), third.parameters(), strict=True):
        assert a.data_ptr() != b.data_ptr()
        assert carried.state[a]["exp_avg"].data_ptr() != carried.state[b]["exp_avg"].data_ptr()
    assert relative_change(model, grown) > 1e-3  # stacking does not preserve the function


def test_stack_refusals_and_product_keys() -> None:
    model = tokenformer()
    with pytest.raises(GrowthError, match="how"):
        grow(model, layers=4, how="sideways")
    with pytest.raises(GrowthError, match="positions"):
        grow(model, layers=4, how="stack", positions=[1, 3])
    with pytest.raises(GrowthError, match="cannot shrink"):
        grow(model, layers=1, how="stack")
    product = tokenformer(ffn_tokens=64, ffn_keys="product", ffn_product_k=8)
    stacked = grow(product, layers="2x", how="stack")  # copying blocks needs no zero branch
    for i, block in enumerate(stacked.layers):
        assert torch.equal(block.mlp.value_param_tokens,
                           product.layers[i % 2].mlp.value_param_tokens)
    # An inserted identity block would need a zero FFN branch; the old code inserted a copy of
    # the block before it and changed the logits by ~80 % of their size.
    with pytest.raises(GrowthError, match="product-key"):
        grow(product, layers=3)
    assert grow(product, layers=3, recipe="official").config.num_layers == 3


def test_an_inserted_block_never_shares_storage_even_with_copy_false() -> None:
    """copy=False shares what does not grow with the input model, but an inserted block's tensors
    copied from its template (block norms here) are its own: the old code handed both blocks one
    storage, so every update of one parameter moved the other."""
    model = trained_like(tokenformer(block_norm="both"))
    grown = grow(model, layers=3, copy=False)  # old0 new old1: block 1 is templated on block 0
    template, inserted = grown.layers[0].input_layernorm, grown.layers[1].input_layernorm
    assert torch.equal(template.weight, inserted.weight)
    assert template.weight.data_ptr() != inserted.weight.data_ptr()
    assert template.weight.data_ptr() == model.layers[0].input_layernorm.weight.data_ptr()


def test_identity_blocks_of_a_baseline_are_exact_and_train() -> None:
    model = trained_like(baseline())
    grown = grow(model, layers=4, generator=gen())
    assert relative_change(model, grown) <= 1e-12
    new = grown.layers[1]  # default positions 2 → 4: old0 new old1 new
    assert not new.attention.proj.weight.any() and not new.mlp.down.weight.any()
    assert new.attention.query.weight.std() > 0.01
    grads = _grads(grown, ids())
    assert grads["layers.1.attention.proj.weight"].abs().max() > 0
    assert grads["layers.1.mlp.down.weight"].abs().max() > 0


# ------------------------------------------------------------------------ training after
@pytest.mark.parametrize("make", [tokenformer, baseline])
def test_grown_model_trains_with_the_carried_optimizer(make) -> None:
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch = ids(B=4, T=32)
    for _ in range(3):
        _grads(model, batch)
        optimizer.step()
    grown, optimizer = grow_with_optimizer(model, optimizer, hidden="2x", layers="2x",
                                           how="stack", width_noise=0.01, generator=gen())
    for param in grown.parameters():
        assert optimizer.state[param]["exp_avg"].shape == param.shape
    losses = []
    for _ in range(12):
        loss = grown(batch, labels=batch).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0] - 0.1


# ------------------------------------------------------------------------------ untied head
def test_untied_head_counts_and_round_trips(tmp_path) -> None:
    for model in (tokenformer(tie_embeddings=False), baseline(tie_embeddings=False)):
        assert model.lm_head is not None
        assert model.config.num_parameters() == sum(p.numel() for p in model.parameters())
        assert model.config.num_parameters(non_embedding=True) == model.num_parameters(True)
        tied = type(model)(type(model.config)(**{**model.config.to_dict(),
                                                "tie_embeddings": True}))
        assert model.num_parameters() - tied.num_parameters() == 128 * 32
    model = trained_like(tokenformer(tie_embeddings=False)).float()
    model.save(tmp_path / "m")
    loaded = TokenFormerLM.load(tmp_path / "m")
    assert torch.equal(loaded(ids()).logits, model(ids()).logits)
    assert "tie_embeddings=False" in inexpressible(model.config)  # not in the released layout


# --------------------------------------------------------------------------------------- CLI
@pytest.fixture()
def checkpoint(tmp_path):
    from tokenformer.io.checkpoint import save_checkpoint
    from tokenformer.training.optim import group_names, param_groups

    model = tokenformer(vocab_size=257)
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    batch = torch.randint(0, 257, (2, 16), generator=gen())
    _grads(model, batch)
    optimizer.step()
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, model, optimizer, {"step": 1, "param_groups":
                                                   group_names(model, optimizer)})
    return directory


def test_cli_grows_width_and_stacks(checkpoint, tmp_path, capsys) -> None:
    from tokenformer.io.training_state import load_optimizer_state
    from tokenformer.training.optim import param_groups

    out = tmp_path / "grown"
    assert main(["grow", str(checkpoint), str(out), "--hidden", "2x", "--layers", "2x",
                 "--how", "stack", "--width-noise", "0.01"]) == 0
    printed = capsys.readouterr().out
    assert "hidden 32 -> 64" in printed and "heads 4 -> 8" in printed
    assert "layers 2 -> 4" in printed and "carried over" in printed
    grown = TokenFormerLM.load(out)
    assert (grown.config.hidden_size, grown.config.num_layers) == (64, 4)
    state = __import__("json").loads((out / "trainer_state.json").read_text())
    assert state["grown"][0]["hidden"] == "2x" and state["grown"][0]["how"] == "stack"
    resumed = torch.optim.AdamW(param_groups(grown, 0.1, state["param_groups"]), lr=1e-3)
    resumed.load_state_dict(load_optimizer_state(out))
    for param in grown.parameters():
        assert resumed.state[param]["exp_avg"].shape == param.shape


@pytest.mark.parametrize("args, message", [
    (["--hidden", "3x", "--heads", "8"], "heads=8"),
    (["--hidden", "48"], "not a whole multiple"),
    (["--hidden", "0.5x"], "cannot shrink"),
    (["--layers", "0.5x", "--how", "stack"], "cannot shrink"),
    (["--layers", "3", "--how", "stack", "--positions", "1"], "positions"),
    (["--width-noise", "0.1", "--ffn", "2x"], "width_noise"),
])
def test_cli_refuses_in_one_line_and_writes_nothing(checkpoint, tmp_path, capsys, args,
                                                    message) -> None:
    out = tmp_path / "grown"
    assert main(["grow", str(checkpoint), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err, err
    assert not out.exists()


def test_cli_output_is_positional_or_out_not_two(checkpoint, tmp_path, capsys) -> None:
    assert main(["grow", str(checkpoint), str(tmp_path / "a"), "--out", str(tmp_path / "b"),
                 "--hidden", "2x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "two outputs" in err and "\n" not in err
    assert main(["grow", str(checkpoint), "--hidden", "2x"]) == 2
    assert "output directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_cli_refuses_widening_a_product_key_model(tmp_path, capsys) -> None:
    source = tmp_path / "pk"
    tokenformer(ffn_tokens=64, ffn_keys="product", ffn_product_k=8).save(source)
    assert main(["grow", str(source), str(tmp_path / "out"), "--hidden", "2x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "product-key" in err
    assert not (tmp_path / "out").exists()


def test_info_shows_a_growth_before_and_after(capsys) -> None:
    assert main(["info", "tokenformer-150m", "--grow", "hidden=2x,layers=2x,how=stack"]) == 0
    text = capsys.readouterr().out
    small = TokenFormerConfig.from_name("tokenformer-150m")
    big = plan_growth(small, hidden="2x", layers="2x", how="stack")
    assert f"{small.num_parameters():,}" in text and f"{big.num_parameters():,}" in text
    assert "hidden" in text and "1536" in text and "24" in text
    assert main(["info", "tokenformer-150m", "--grow", "hidden=1024"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "not a whole multiple" in err
    assert main(["info", "tokenformer-150m", "--grow", "depth=2x"]) == 2
    assert "malformed" in capsys.readouterr().err
