"""Growth (issue 3): exact/paper/official width growth, depth growth, optimizer carry-over, CLI.

Expectations are independent of the code under test: logits of the model before growth,
float64 formulas written out here, gradients of the un-grown model, and invariants.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main
from tokenformer.errors import ConfigError
from tokenformer.io.checkpoint import verify_checkpoint
from tokenformer.io.training_state import load_optimizer_state
from tokenformer.nn.pattention import THETA_VARIANTS
from tokenformer.nn.theta import THETAS, register_theta, unregister_theta
from tokenformer.ops.growth import (
    default_positions,
    grow,
    grow_with_optimizer,
    max_logit_change,
    resolve_size,
)
from tokenformer.training.config import TrainConfig

GROWABLE_EXACTLY = THETA_VARIANTS  # softmax too, for whole multiples (see test below)
KINDS = {"qkv": ("attention.query", "attention.key", "attention.value"),
         "proj": ("attention.proj",), "ffn": ("mlp",)}


def tiny(norm: str = "l2_norm_gelu", **overrides) -> TokenFormerConfig:
    fields = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, qkv_tokens=16,
                  proj_tokens=12, ffn_tokens=24, max_seq_len=32, norm=norm)
    return TokenFormerConfig(**{**fields, **overrides})


def make(norm: str = "l2_norm_gelu", seed: int = 0, **overrides) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(tiny(norm, **overrides))


def batch(seed: int = 1, B: int = 4, T: int = 24) -> torch.Tensor:
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def relative_change(a: TokenFormerLM, b: TokenFormerLM) -> float:
    delta, largest = max_logit_change(a, b, batch_size=4, seq_len=32, seed=3)
    return delta / largest


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------- sizes
def test_resolve_size_forms() -> None:
    assert resolve_size(None, 768, "ffn") == 768
    assert resolve_size(1536, 768, "ffn") == 1536
    assert resolve_size("1536", 768, "ffn") == 1536
    assert resolve_size("2x", 768, "ffn") == 1536
    assert resolve_size("1.5x", 768, "ffn") == 1152
    assert resolve_size("1x", 768, "ffn") == 768


@pytest.mark.parametrize("bad", ["2", "x2", "2y", "-2x", "two", "", "1.5", "2xx", True, 2.0])
def test_resolve_size_malformed(bad) -> None:
    if bad == "2":  # a valid absolute count, but smaller than the current one
        with pytest.raises(GrowthError, match="cannot shrink"):
            resolve_size(bad, 768, "ffn")
        return
    with pytest.raises(GrowthError, match="ffn"):
        resolve_size(bad, 768, "ffn")


def test_resolve_size_refuses_fractional_products() -> None:
    with pytest.raises(GrowthError, match="not a whole number"):
        resolve_size("1.5x", 33, "qkv")


@given(current=st.integers(1, 5000), extra=st.integers(0, 5000), mult=st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_resolve_size_properties(current: int, extra: int, mult: int) -> None:
    assert resolve_size(current + extra, current, "n") == current + extra
    assert resolve_size(f"{mult}x", current, "n") == mult * current
    if current > 1:
        with pytest.raises(GrowthError, match="cannot shrink"):
            resolve_size(current - 1, current, "n")


def test_default_positions_by_hand() -> None:
    assert default_positions(2, 3) == [1]          # o0 n o1
    assert default_positions(2, 4) == [1, 3]       # o0 n o1 n
    assert default_positions(4, 6) == [1, 4]       # o0 n o1 o2 n o3
    assert default_positions(3, 3) == []


@given(old=st.integers(1, 24), added=st.integers(0, 30))
@settings(max_examples=60, deadline=None)
def test_default_positions_spread_evenly(old: int, added: int) -> None:
    positions = default_positions(old, old + added)
    assert positions == sorted(set(positions)) and len(positions) == added
    assert all(0 <= p < old + added for p in positions)
    # Between consecutive old blocks the number of new blocks differs by at most one.
    per_gap = [0] * old
    old_seen = 0
    for i in range(old + added):
        if i in positions:
            per_gap[old_seen - 1] += 1
        else:
            old_seen += 1
    assert max(per_gap) - min(per_gap) <= 1


def test_refuses_shrinking_and_ungrowable() -> None:
    model = make()
    with pytest.raises(GrowthError, match="cannot shrink"):
        grow(model, ffn=8)
    with pytest.raises(GrowthError, match="cannot shrink"):
        grow(model, layers=1)
    for key, what in (("hidden_size", "hidden size"), ("num_heads", "heads"),
                      ("vocab_size", "vocabulary")):
        with pytest.raises(GrowthError, match=what):
            grow(model, **{key: 64})
    with pytest.raises(GrowthError, match="unknown argument"):
        grow(model, foo=1)
    with pytest.raises(GrowthError, match="recipe"):
        grow(model, ffn="2x", recipe="magic")
    with pytest.raises(GrowthError, match="positions"):
        grow(model, layers=4, positions=[1])
    with pytest.raises(GrowthError, match="distinct"):
        grow(model, layers=4, positions=[1, 1])


def test_input_model_is_untouched() -> None:
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grown = grow(model, qkv="2x", ffn="2x", layers=3, recipe="official", generator=gen())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(not p.data_ptr() == q.data_ptr() for p in model.parameters()
               for q in grown.parameters())


def test_copy_false_shares_only_what_does_not_grow() -> None:
    model = make()
    grown = grow(model, ffn="2x", copy=False, generator=gen())
    old, new = dict(model.named_parameters()), dict(grown.named_parameters())
    for name, param in new.items():
        shared = param.data_ptr() == old[name].data_ptr()
        assert shared == (".mlp." not in name), name
    assert relative_change(model, grown) <= 1e-5


# ----------------------------------------------------------------------------- exact width
@pytest.mark.parametrize("norm", GROWABLE_EXACTLY)
def test_exact_width_preserves_logits(norm: str) -> None:
    model = make(norm)
    grown = grow(model, qkv="2x", proj="2x", ffn="3x", recipe="exact", generator=gen())
    assert (grown.config.qkv_tokens, grown.config.proj_tokens, grown.config.ffn_tokens) == \
        (32, 24, 72)
    assert grown.num_parameters() - model.num_parameters() == 2 * 2 * 32 * (3 * 16 + 12 + 48)
    assert relative_change(model, grown) <= 1e-5
    # Θ's factor is held at the pre-growth value: √n (L2 variants) or n (L1 variants); plain
    # GELU has none (1 at every n).
    held = {"softmax": 16.0, "gelu_l1_norm": 16.0, "gelu": 1.0}.get(norm, math.sqrt(16))
    assert grown.layers[0].attention.query.scale == pytest.approx(held)
    assert grown.config.qkv_scale == pytest.approx(held)


@pytest.mark.parametrize("norm", ["l2_norm_gelu", "gelu_l2_norm", "gelu_l1_norm", "gelu"])
def test_exact_width_any_count_for_gelu_variants(norm: str) -> None:
    model = make(norm)
    grown = grow(model, qkv=17, proj=13, ffn=31, generator=gen())
    assert relative_change(model, grown) <= 1e-5
    for name, module in grown.pattentions().items():  # new keys zero, new values not
        n_old = model.get_submodule(name).num_tokens
        assert torch.all(module.key_param_tokens[n_old:] == 0)
        assert torch.all(module.value_param_tokens[n_old:].abs().sum(dim=1) > 0)


@pytest.mark.parametrize("recipe", ["paper", "exact"])
def test_plain_gelu_zero_key_growth_is_function_preserving(recipe: str) -> None:
    """The critics' control (issue 25): with Θ = plain GELU a new token with a zero key has
    score 0 and weight GELU(0) = 0, and no other weight depends on n, so zero-key growth (the
    paper recipe, which lets Θ's factor follow n, as much as exact) keeps every logit; the
    same paper recipe on the normalised Θ rescales the old scores by √((n+m)/n) and does not."""
    model = make("gelu")
    grown = grow(model, qkv="2x", proj=19, ffn="3x", recipe=recipe, generator=gen())
    assert relative_change(model, grown) <= 1e-6
    for name, module in grown.pattentions().items():
        n_old = model.get_submodule(name).num_tokens
        assert module.num_tokens > n_old and module.scale == 1.0
        assert torch.all(module.key_param_tokens[n_old:] == 0)
    normalised = make("l2_norm_gelu")
    assert relative_change(normalised, grow(normalised, qkv="2x", proj=19, ffn="3x",
                                            recipe="paper", generator=gen())) > 1e-3


def test_exact_softmax_needs_whole_multiples() -> None:
    with pytest.raises(GrowthError, match=r"softmax.*whole multiple"):
        grow(make("softmax"), ffn=30)


def test_exact_growth_follows_the_theta_registry_not_the_name() -> None:
    """A Θ registered with ``exact_growth="duplicate"`` grows as softmax does, whatever its name:
    GELU + L1 under that flag (r copies of a token each take 1/r of its L1 share, so duplication
    is exact for it too) refuses 24 → 30 ffn tokens, which the built-in gelu_l1_norm (zero keys)
    grows, and 24 → 48 repeats every old key twice and keeps the logits."""
    name = "gelu_l1_duplicated"
    built_in = THETAS["gelu_l1_norm"]
    register_theta(name, dataclasses.replace(built_in, zero_keys_silent=False,
                                             exact_growth="duplicate", fused=None, triton=None))
    try:
        with pytest.raises(GrowthError, match=rf"Θ={name} needs a whole multiple of ffn"):
            grow(make(name), ffn=30)
        assert grow(make("gelu_l1_norm"), ffn=30).config.ffn_tokens == 30
        model = make(name)
        grown = grow(model, ffn="2x", generator=gen())
        old_keys = model.layers[0].mlp.key_param_tokens
        assert torch.equal(grown.layers[0].mlp.key_param_tokens, torch.cat([old_keys, old_keys]))
        assert relative_change(model, grown) <= 1e-5
    finally:
        unregister_theta(name)


def _new_rows(old: TokenFormerLM, new: TokenFormerLM) -> dict[str, tuple[str, int]]:
    """Every Pattention parameter of ``new`` that has new rows -> (name, first new row)."""
    rows = {}
    for name, module in new.pattentions().items():
        n_old = old.get_submodule(name).num_tokens
        if module.num_tokens > n_old:
            rows[f"{name}.key_param_tokens"] = n_old
            rows[f"{name}.value_param_tokens"] = n_old
    return rows


def _train_step(model: TokenFormerLM, optimizer: torch.optim.Optimizer, ids: torch.Tensor
                ) -> float:
    optimizer.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


@pytest.mark.parametrize("norm", GROWABLE_EXACTLY)
def test_exact_new_tokens_train(norm: str) -> None:
    """Every new token (key row + value row) changes after one optimizer step.

    GELU variants: new keys are zero, so Θ_new = GELU(0) = 0 and the new values' gradient
    Θ_newᵀ·g is exactly zero on step 1, while the new keys' gradient ½·s/‖a‖·(g·v) is not: keys
    move on step 1, values from step 2. Softmax (duplicated tokens): both move on step 1.
    Plain Adam without weight decay, so nothing moves without a gradient.
    """
    model = make(norm)
    grown = grow(model, qkv="2x", proj="2x", ffn="2x", generator=gen())
    rows = _new_rows(model, grown)
    params = dict(grown.named_parameters())
    optimizer = torch.optim.Adam(grown.parameters(), lr=1e-3)
    start = {name: params[name].detach().clone() for name in rows}
    ids = batch()
    _train_step(grown, optimizer, ids)

    def changed(name: str) -> torch.Tensor:  # per new row: did it change?
        first = rows[name]
        return (params[name][first:] != start[name][first:]).any(dim=1)

    for name in rows:
        if name.endswith("key_param_tokens") or norm == "softmax":
            assert changed(name).all(), name
        else:
            assert not changed(name).any(), name
            assert torch.all(params[name].grad[rows[name]:] == 0)
    _train_step(grown, optimizer, ids)
    assert all(changed(name).all() for name in rows)


def test_exact_growth_gradient_of_old_rows_is_unchanged() -> None:
    """Zero new keys give Θ_new = 0 exactly, so the old rows see the same gradient as before."""
    model = make()
    grown = grow(model, qkv="2x", ffn="2x", generator=gen())
    ids = batch()
    model(ids, labels=ids).loss.backward()
    grown(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        new_grad = dict(grown.named_parameters())[name].grad[: param.shape[0]]
        torch.testing.assert_close(new_grad, param.grad, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------------------ paper/official
def _gelu64(z: torch.Tensor) -> torch.Tensor:
    return 0.5 * z * (1.0 + torch.special.erf(z / math.sqrt(2.0)))


def test_paper_growth_scales_preactivations_by_sqrt_ratio() -> None:
    """One l2_norm_gelu Pattention (the FFN of a 1-layer model), n = 24 → n + m = 40 tokens.

    By hand in float64: with new keys 0 the new scores are 0, ‖[a, 0]‖ = ‖a‖, so the old tokens'
    pre-activations a/‖a‖·√(n+m) are the old ones a/‖a‖·√n times √((n+m)/n), and the new tokens
    contribute GELU(0)·v = 0.
    """
    model = make(num_layers=1)
    grown = grow(model, ffn=40, recipe="paper", generator=gen())
    n, m = 24, 16
    assert grown.config.ffn_scale is None and grown.layers[0].mlp.scale == math.sqrt(n + m)
    old, new = model.layers[0].mlp, grown.layers[0].mlp
    assert torch.all(new.key_param_tokens[n:] == 0)
    x = torch.randn(5, 7, 32, generator=gen(4))
    x64 = x.double()
    K, V = new.key_param_tokens.detach().double(), new.value_param_tokens.detach().double()
    scores = x64 @ K.T                                        # [.., n + m], last m exactly 0
    a = scores[..., :n]
    old_pre = a / a.norm(dim=-1, keepdim=True) * math.sqrt(n)
    new_pre = scores / scores.norm(dim=-1, keepdim=True) * math.sqrt(n + m)
    torch.testing.assert_close(new_pre[..., :n], old_pre * math.sqrt((n + m) / n))
    expected = _gelu64(new_pre) @ V
    before = _gelu64(old_pre) @ old.value_param_tokens.detach().double()
    with torch.no_grad():
        got, got_before = new(x).double(), old(x).double()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_before, before, rtol=1e-5, atol=1e-6)
    assert (expected - before).abs().max() > 1e-3 * before.abs().max()  # it did change


@pytest.mark.parametrize("recipe", ["paper", "official"])
def test_paper_and_official_change_the_function(recipe: str) -> None:
    model = make()
    grown = grow(model, qkv="2x", proj="2x", ffn="2x", recipe=recipe, generator=gen())
    assert relative_change(model, grown) > 1e-2
    assert grown.config.qkv_scale is None  # the factor follows the new n
    assert grown.layers[1].mlp.scale == math.sqrt(48)


def test_official_new_rows_use_the_grown_models_init() -> None:
    model = make(qkv_tokens=256, ffn_tokens=512)
    grown = grow(model, ffn="4x", layers=4, recipe="official", generator=gen())
    wang = 2 / 4 / math.sqrt(32)  # value init of the grown config (4 layers), not the old one
    new_keys = torch.cat([block.mlp.key_param_tokens[512:] for block in grown.layers])
    new_values = torch.cat([block.mlp.value_param_tokens[512:] for block in grown.layers])
    assert float(new_keys.detach().std()) == pytest.approx(0.02, rel=0.03)
    assert float(new_values.detach().std()) == pytest.approx(wang, rel=0.03)
    assert torch.equal(grown.layers[0].mlp.key_param_tokens[:512],
                       model.layers[0].mlp.key_param_tokens)


# ------------------------------------------------------------------------------------- depth
@pytest.mark.parametrize("norm", THETA_VARIANTS)
def test_exact_depth_preserves_logits(norm: str) -> None:
    model = make(norm, proj_tokens=13)  # odd: one zero-sum triple besides the pairs
    grown = grow(model, layers=4, positions=[0, 3], generator=gen())
    assert grown.config.num_layers == 4 and len(grown.layers) == 4
    assert relative_change(model, grown) <= 1e-5
    # Old blocks keep their tensors, at their new indices.
    for new_i, old_i in ((1, 0), (2, 1)):
        for key, value in model.layers[old_i].state_dict().items():
            assert torch.equal(grown.layers[new_i].state_dict()[key], value)
    for new_i in (0, 3):
        for branch in ("attention.proj", "mlp"):
            module = grown.layers[new_i].get_submodule(branch)
            K, V = module.key_param_tokens, module.value_param_tokens
            assert torch.equal(K[0::2][: K.shape[0] // 2], K[1::2][: K.shape[0] // 2])
            assert V.abs().sum(dim=1).gt(0).all()
            assert V.sum(dim=0).abs().max() < 1e-6


def test_exact_width_and_depth_together_and_roundtrip(tmp_path) -> None:
    model = make()
    grown = grow(model, qkv="2x", proj="1.5x", ffn="2x", layers=3, generator=gen())
    assert relative_change(model, grown) <= 1e-5
    grown.save(tmp_path / "g")
    loaded = TokenFormerLM.load(tmp_path / "g")
    assert loaded.config.qkv_scale == grown.config.qkv_scale == 4.0
    ids = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, grown(ids).logits, rtol=0, atol=0)


def test_depth_gradients_on_first_and_second_step() -> None:
    """New block: proj/FFN keys and values get a non-zero gradient on step 1 (pairs see equal Θ
    and opposite values); Q, K, V get zero gradient (to rounding) on step 1, because the
    attention branch output is identically zero, and a non-zero one on step 2."""
    model = make(proj_tokens=13)
    grown = grow(model, layers=3, positions=[1], generator=gen())
    block = grown.layers[1]
    optimizer = torch.optim.Adam(grown.parameters(), lr=1e-3)
    ids = batch()
    optimizer.zero_grad()
    grown(ids, labels=ids).loss.backward()
    branch_grads = [getattr(m, p).grad for m in (block.attention.proj, block.mlp)
                    for p in ("key_param_tokens", "value_param_tokens")]
    for grad in branch_grads:
        assert grad.abs().sum(dim=1).gt(0).all()  # every row
    scale = max(float(g.abs().max()) for g in branch_grads)
    qkv = [block.attention.get_submodule(n) for n in ("query", "key", "value")]
    step1 = max(float(p.grad.abs().max()) for m in qkv for p in m.parameters())
    assert step1 <= 1e-6 * scale
    optimizer.step()
    optimizer.zero_grad()
    grown(ids, labels=ids).loss.backward()
    step2 = min(float(p.grad.abs().max()) for m in qkv for p in m.parameters())
    assert step2 > 1e3 * max(step1, 1e-12)


def test_official_depth_inserts_random_blocks() -> None:
    model = make()
    grown = grow(model, layers=3, recipe="official", generator=gen())
    assert relative_change(model, grown) > 1e-2


# ------------------------------------------------------------------------------- optimizer
def _adamw(model: TokenFormerLM) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if "value" in n]
    rest = [p for n, p in model.named_parameters() if "value" not in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


def _trained(steps: int = 3) -> tuple[TokenFormerLM, torch.optim.AdamW, torch.Tensor]:
    model = make()
    optimizer = _adamw(model)
    ids = batch()
    for _ in range(steps):
        _train_step(model, optimizer, ids)
    return model, optimizer, ids


def test_optimizer_state_carried_over() -> None:
    model, optimizer, _ = _trained()
    grown, new_opt = grow_with_optimizer(model, optimizer, qkv="2x", ffn="2x", layers=3,
                                         positions=[2], generator=gen())
    assert type(new_opt) is torch.optim.AdamW
    names = {id(p): n for n, p in grown.named_parameters()}
    assert [g["weight_decay"] for g in new_opt.param_groups] == [0.1, 0.0]
    for group in new_opt.param_groups:
        assert group["betas"] == (0.9, 0.95) and group["lr"] == 3e-3
        expected_wd = 0.1 if group is new_opt.param_groups[0] else 0.0
        assert all(("value" in names[id(p)]) == (expected_wd == 0.1) for p in group["params"])
    assert sum(len(g["params"]) for g in new_opt.param_groups) == len(list(grown.parameters()))
    old_params = dict(model.named_parameters())
    for name, param in grown.named_parameters():
        state = new_opt.state[param]
        assert float(state["step"]) == 3
        if name.startswith("layers.2."):  # inserted: zero moments
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
            continue
        old_state = optimizer.state[old_params[name]]
        n = old_params[name].shape[0]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key][:n], old_state[key])
            assert not state[key][n:].any()
    _, fresh = grow_with_optimizer(model, optimizer, ffn="2x", reset_optimizer=True)
    assert len(fresh.state) == 0 and [g["weight_decay"] for g in fresh.param_groups] == [0.1, 0]


def test_new_row_second_moments_from_the_old_rows_mean() -> None:
    """``new_row_moments="mean"``: new rows of a grown tensor start with exp_avg_sq = the old
    rows' per-column mean (hand-computed here), exp_avg zero; old rows, inserted blocks and the
    function are untouched; the trainer's ``growth_optimizer="carry-mean"`` selects it."""
    model, optimizer, _ = _trained()
    grown, new_opt = grow_with_optimizer(model, optimizer, ffn="2x", layers=3, positions=[2],
                                         generator=gen(), new_row_moments="mean")
    old_params = dict(model.named_parameters())
    seen = 0
    for name, param in grown.named_parameters():
        state = new_opt.state[param]
        if name.startswith("layers.2."):  # an inserted block: nothing to take a mean of
            assert not state["exp_avg_sq"].any()
            continue
        old = optimizer.state[old_params[name]]
        n = old_params[name].shape[0]
        assert torch.equal(state["exp_avg_sq"][:n], old["exp_avg_sq"])
        assert torch.equal(state["exp_avg"][:n], old["exp_avg"]) and not state["exp_avg"][n:].any()
        if param.shape[0] > n:
            seen += 1
            rows = old["exp_avg_sq"].double()
            expected = sum(rows[i] for i in range(n)) / n
            for row in state["exp_avg_sq"][n:].double():
                torch.testing.assert_close(row, expected, rtol=1e-6, atol=0)
            assert (state["exp_avg_sq"][n:] > 0).all()
    assert seen == 2 * 2  # mlp key and value tokens of the two old blocks
    assert max_logit_change(model, grown)[0] < 1e-5
    with pytest.raises(GrowthError, match="new_row_moments"):
        grow_with_optimizer(model, optimizer, ffn="2x", new_row_moments="old")
    TrainConfig(growth_optimizer="carry-mean").validate()
    with pytest.raises(ConfigError, match="growth_optimizer"):
        TrainConfig(growth_optimizer="carry-zero").validate()


def test_carried_optimizer_steps_old_rows_exactly_like_the_ungrown_model() -> None:
    """After exact growth the old rows see the same gradients (new tokens and blocks contribute
    nothing, and a zero branch has zero Jacobian), so one AdamW step with the carried state moves
    them exactly as the un-grown model's step does."""
    model, optimizer, ids = _trained()
    grown, new_opt = grow_with_optimizer(model, optimizer, qkv="2x", ffn="2x", layers=3,
                                         positions=[1], generator=gen())
    _train_step(model, optimizer, ids)
    _train_step(grown, new_opt, ids)
    new_params = dict(grown.named_parameters())
    for name, param in model.named_parameters():
        new_name = name.replace("layers.1.", "layers.2.")  # block 1 moved behind the new one
        torch.testing.assert_close(new_params[new_name][: param.shape[0]], param,
                                   rtol=1e-5, atol=1e-6)


def test_train_grow_continue_loss() -> None:
    model = make()
    optimizer = _adamw(model)
    ids = batch(B=8, T=32)
    for _ in range(6):
        _train_step(model, optimizer, ids)
    with torch.no_grad():
        before = float(model(ids, labels=ids).loss)
    grown, optimizer = grow_with_optimizer(model, optimizer, qkv="2x", proj="2x", ffn="2x",
                                           layers=3, generator=gen())
    with torch.no_grad():
        after = float(grown(ids, labels=ids).loss)
    assert abs(after - before) <= 1e-5 * before
    losses = [_train_step(grown, optimizer, ids) for _ in range(6)]
    with torch.no_grad():
        final = float(grown(ids, labels=ids).loss)
    assert losses[0] == pytest.approx(after, rel=1e-5)
    assert final < after - 0.05 and all(b < a for a, b in itertools.pairwise(losses))


# ------------------------------------------------------------------------------------ vision
def test_grows_the_vision_model_exactly() -> None:
    vit = pytest.importorskip("tokenformer.models.vit")
    torch.manual_seed(0)
    config = vit.TokenFormerViTConfig.from_name("vit-digits-tiny")
    model = vit.TokenFormerViT(config).eval()
    grown = grow(model, qkv="2x", ffn="1.5x", layers=3, generator=gen())
    assert type(grown) is type(model) and grown.config.ffn_tokens == 288
    images = torch.randn(3, 1, 8, 8, generator=gen(5))
    with torch.no_grad():
        a, b = model(images).logits, grown(images).logits
    assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max())


# --------------------------------------------------------------------------------------- CLI
@pytest.fixture()
def checkpoint(tmp_path):
    from tokenformer import ByteTokenizer

    torch.manual_seed(0)
    model = TokenFormerLM(tiny(vocab_size=257))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 257, (2, 16), generator=gen())
    _train_step(model, optimizer, ids)
    directory = tmp_path / "ckpt"
    model.save(directory)
    ByteTokenizer().save(directory)
    # an earlier version's optimizer.pt: still read (weights_only); grow writes the new format
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    return directory


def test_cli_grow(checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "grown"
    assert main(["grow", str(checkpoint), "--ffn", "2x", "--qkv", "24", "--layers", "3",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "parameters" in printed and "max |Δlogit|" in printed and "carried over" in printed
    before = TokenFormerLM.load(checkpoint)
    grown = TokenFormerLM.load(out)
    assert f"{before.num_parameters():,} -> {grown.num_parameters():,}" in printed
    assert (grown.config.ffn_tokens, grown.config.qkv_tokens, grown.config.num_layers) == \
        (48, 24, 3)
    assert relative_change(before, grown) <= 1e-5
    assert (out / "tokenizer_bytes.json").is_file()
    state = load_optimizer_state(out)
    fresh = torch.optim.AdamW(grown.parameters(), lr=1e-3)
    fresh.load_state_dict(state)  # loads into the grown model's parameters
    mlp = grown.layers[0].mlp.key_param_tokens
    assert fresh.state[mlp]["exp_avg"].shape == mlp.shape


@pytest.mark.parametrize("args, message", [
    (["--ffn", "12"], "cannot shrink"),
    (["--ffn", "two"], "malformed"),
    (["--qkv", "1.3x"], "whole number"),
    (["--hidden", "48"], "not a whole multiple"),
    (["--heads", "8"], "head size"),
    (["--vocab", "500"], "vocabulary"),
    (["--layers", "3", "--positions", "7"], "positions"),
])
def test_cli_bad_sizes(checkpoint, tmp_path, capsys, args, message) -> None:
    out = tmp_path / "grown"
    assert main(["grow", str(checkpoint), *args, "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and message in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing half-written


def test_cli_unknown_checkpoint_and_existing_output(checkpoint, tmp_path, capsys) -> None:
    assert main(["grow", str(tmp_path / "missing"), "--ffn", "2x", "--out",
                 str(tmp_path / "o")]) != 0
    assert "not found" in capsys.readouterr().err
    (tmp_path / "exists").mkdir()
    assert main(["grow", str(checkpoint), "--ffn", "2x", "--out", str(tmp_path / "exists")]) != 0
    err = capsys.readouterr().err
    assert err.startswith("error:") and "already exists" in err
    assert not any((tmp_path / "exists").iterdir())
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not a model")
    assert main(["grow", str(junk), "--ffn", "2x", "--out", str(tmp_path / "o")]) != 0
    assert capsys.readouterr().err.startswith("error:")
    assert not (tmp_path / "o").exists()


def test_cli_grows_a_training_checkpoint(tmp_path, capsys) -> None:
    """A trainer checkpoint (two named AdamW groups) grows into one the trainer can resume."""
    from tokenformer.io.checkpoint import save_checkpoint
    from tokenformer.training.optim import group_names, param_groups

    model = make()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    ids = batch()
    for _ in range(2):
        _train_step(model, optimizer, ids)
    source = tmp_path / "step-2"
    save_checkpoint(source, model, optimizer, {"step": 2, "param_groups":
                                                group_names(model, optimizer)})
    out = tmp_path / "grown"
    assert main(["grow", str(source), "--ffn", "2x", "--layers", "3", "--out", str(out)]) == 0
    assert "carried over" in capsys.readouterr().out
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["grown"][0]["ffn"] == "2x"
    grown = TokenFormerLM.load(out)
    resumed = torch.optim.AdamW(param_groups(grown, 0.1, state["param_groups"]), lr=1e-3)
    resumed.load_state_dict(load_optimizer_state(out))
    assert [g["weight_decay"] for g in resumed.param_groups] == [0.1, 0.0]
    old_key = model.layers[1].mlp.key_param_tokens
    new_key = dict(grown.named_parameters())[
        f"layers.{default_positions(2, 3)[0] + 1}.mlp.key_param_tokens"]
    assert torch.equal(resumed.state[new_key]["exp_avg"][:24], optimizer.state[old_key]["exp_avg"])
    assert not resumed.state[new_key]["exp_avg"][24:].any()
    assert float(resumed.state[new_key]["step"]) == 2
    assert (out / "rng.safetensors").is_file() and verify_checkpoint(out)


def test_cli_grows_an_official_checkpoint(tmp_path, capsys) -> None:
    """A released-layout pytorch_model.bin (here a tiny one) grows like 354M → 757M: qkv and proj
    768 → 1792, ffn 3072 → 7168 is ×7/3, scaled down to 12 → 28 and 48 → 112 tokens."""
    from tokenformer.models.official import save_official

    model = make(qkv_tokens=12, proj_tokens=12, ffn_tokens=48)
    source = tmp_path / "official"
    source.mkdir()
    save_official(model, source / "pytorch_model.bin")
    (source / "config.json").write_text(json.dumps({"num_attention_heads": 4, "seq_length": 32,
                                                    "norm_activation_type": "l2_norm_gelu"}))
    out = tmp_path / "grown"
    assert main(["grow", str(source), "--qkv", "28", "--proj", "28", "--ffn", "112",
                 "--out", str(out)]) == 0
    assert "optimizer    none found" in capsys.readouterr().out
    official = TokenFormerLM.from_official(source)
    grown = TokenFormerLM.load(out)
    assert (grown.config.qkv_tokens, grown.config.ffn_tokens) == (28, 112)
    assert grown.config.qkv_scale == math.sqrt(12) and grown.config.ffn_scale == math.sqrt(48)
    assert relative_change(official, grown) <= 1e-5
