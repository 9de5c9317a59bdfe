"""Growth's registries (issue 32): the table of strategies, the typed request, and the keys read
off them. The documented operator (docs/architecture.md, "Adding a growth operator") is run as
written; expectations come from the model before growth, Θ's definition and hand-written lists.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.ops.growth import (
    RECIPES,
    STRATEGY,
    GrowthOptions,
    Strategy,
    canonical_recipe,
    grow,
    grow_with_optimizer,
    register_strategy,
    resets_optimizer,
    unregister_strategy,
)
from tokenformer.ops.growth.tokens import exact_tokens, zero_key_tokens
from tokenformer.training.growth_events import GROW_KEYS, parse_grow_at

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def doc_example() -> str:
    """The python block of the architecture page's "Adding a growth operator" section."""
    section = DOC.read_text(encoding="utf-8").split("## Adding a growth operator", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def tiny(seed: int = 0) -> TokenFormerLM:
    torch.manual_seed(seed)
    return TokenFormerLM(TokenFormerConfig(vocab_size=97, hidden_size=32, num_layers=2,
                                           num_heads=4, qkv_tokens=16, proj_tokens=12,
                                           ffn_tokens=24, max_seq_len=16))


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_the_documented_operator_grows_through_grow() -> None:
    torch.manual_seed(0)
    namespace: dict = {}
    try:
        exec(compile(doc_example(), str(DOC), "exec"), namespace)
        small, big = namespace["small"], namespace["big"]
        assert "zeros" in STRATEGY
        assert (big.config.ffn_tokens, big.config.num_layers) == (64, 3)
        # exact=True holds Θ's factor at √n of the old n (l2_norm_gelu), not √64
        assert big.config.ffn_scale == pytest.approx(math.sqrt(32))
        for new_i, old_i in ((0, 0), (2, 1)):  # 2 → 3 blocks: block 1 is the inserted one
            old, new = small.layers[old_i].mlp, big.layers[new_i].mlp
            assert torch.equal(new.key_param_tokens[:32], old.key_param_tokens)
            assert torch.equal(new.value_param_tokens[:32], old.value_param_tokens)
            assert not new.key_param_tokens[32:].any() and not new.value_param_tokens[32:].any()
        # Zero keys give scores 0, which leave ‖scores‖ and GELU(0) = 0 unchanged: the logits
        # are the small model's (the inserted block is the identity).
        ids = torch.randint(0, 97, (2, 16), generator=gen(1))
        with torch.no_grad():
            before, after = small(ids).logits, big(ids).logits
        assert (before - after).abs().max() <= 1e-5 * before.abs().max()
    finally:
        if "zeros" in STRATEGY:
            unregister_strategy("zeros")
    assert "zeros" not in STRATEGY and tuple(STRATEGY) == RECIPES
    with pytest.raises(GrowthError, match="unknown growth strategy 'zeros'"):
        grow(small, ffn="2x", strategy="zeros")


def test_the_built_in_recipes_and_what_each_promises() -> None:
    assert RECIPES == ("exact", "paper", "official-init", "official-released")
    assert [n for n in RECIPES if resets_optimizer(n)] == ["official-released"]
    assert [n for n in RECIPES if STRATEGY[n].exact] == ["exact"]
    assert [n for n in RECIPES if STRATEGY[n].identity_blocks] == ["exact", "paper"]
    assert canonical_recipe("official", warn=False) == "official-init"
    assert resets_optimizer("official") is False


def test_a_taken_name_or_a_built_in_is_refused() -> None:
    with pytest.raises(GrowthError, match="'paper' is already registered"):
        register_strategy(Strategy("paper", exact_tokens))
    with pytest.raises(GrowthError, match="'official' is already registered"):
        register_strategy(Strategy("mine", exact_tokens, aliases=("official",)))
    with pytest.raises(GrowthError, match="built in"):
        unregister_strategy("exact")
    assert tuple(STRATEGY) == RECIPES


def test_a_registered_strategy_reaches_grow_at_and_the_optimizer_reset() -> None:
    """Its metadata is read where the built-ins' is: --grow-at accepts its name, and a strategy
    that resets the optimizer restarts the schedule and hands back fresh AdamW state."""
    register_strategy(Strategy("paper-fresh", zero_key_tokens, resets_optimizer=True))
    try:
        event = parse_grow_at("5:ffn=2x,strategy=paper-fresh")
        assert event.kwargs == {"ffn": "2x", "strategy": "paper-fresh"} and event.stage.restart
        model = tiny()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 97, (2, 16), generator=gen(1))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        grown, fresh = grow_with_optimizer(model, optimizer, ffn="2x", strategy="paper-fresh",
                                           generator=gen())
        assert fresh.state == {} and len(optimizer.state) > 0
        assert grown.config.ffn_tokens == 48 and grown.config.ffn_scale is None  # not exact
    finally:
        unregister_strategy("paper-fresh")


def test_grow_at_keys_are_the_options_fields_with_a_text_form() -> None:
    """Read off GrowthOptions (positions has no key=value form; recipe is strategy's other
    name; lr and lr_ramp are the schedule's): the list --grow-at has always had, and widen
    (a baseline's MLP widening, a field since the frontier's widening arms grow through it)."""
    assert GROW_KEYS == ("qkv", "proj", "ffn", "layers", "hidden", "heads", "how", "width_noise",
                         "widen", "strategy", "recipe", "freeze_old", "noise_old", "lr",
                         "lr_ramp")


def test_an_options_object_and_keywords_grow_the_same_model() -> None:
    """Keywords name GrowthOptions' fields, and override those of an object given with them."""
    model = tiny()
    by_words = grow(model, qkv="2x", layers=3, strategy="paper", generator=gen())
    by_object = grow(model, GrowthOptions(qkv="2x", layers=3, strategy="paper"),
                     generator=gen())
    overridden = grow(model, GrowthOptions(qkv="2x", layers=3), strategy="paper",
                      generator=gen())
    expected = by_words.state_dict()
    for other in (by_object, overridden):
        assert other.config == by_words.config
        assert all(torch.equal(expected[k], v) for k, v in other.state_dict().items())
    with pytest.raises(GrowthError, match="unknown argument 'bogus'"):
        grow(model, GrowthOptions(qkv="2x"), bogus=1)
