"""Growth's registries (issue 32): the table of recipes, the typed request, and the keys read
off them. The documented operator (docs/architecture.md, "Adding a growth operator") is run as
written; expectations come from the model before growth, Θ's definition and hand-written lists.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenformer import GrowthError, TokenFormerConfig, TokenFormerLM
from tokenformer.models.baselines import TransformerConfig, TransformerLM
from tokenformer.ops.growth import (
    BUILT_IN_RECIPES,
    RECIPES,
    GrowthOptions,
    Recipe,
    canonical_recipe,
    grow,
    grow_with_optimizer,
    register_recipe,
    resets_optimizer,
    unregister_recipe,
    widening,
)
from tokenformer.ops.growth.tokens import exact_tokens, zero_key_tokens
from tokenformer.ops.growth.widening import WIDENINGS, Widening, zero_units
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
        assert "zeros" in RECIPES
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
        if "zeros" in RECIPES:
            unregister_recipe("zeros")
    assert "zeros" not in RECIPES and tuple(RECIPES) == BUILT_IN_RECIPES
    with pytest.raises(GrowthError, match="unknown growth recipe 'zeros'"):
        grow(small, ffn="2x", recipe="zeros")


def test_the_built_in_recipes_and_what_each_promises() -> None:
    assert BUILT_IN_RECIPES == ("exact", "paper", "official-init", "official-released")
    assert [n for n in BUILT_IN_RECIPES if resets_optimizer(n)] == ["official-released"]
    assert [n for n in BUILT_IN_RECIPES if RECIPES[n].exact] == ["exact"]
    assert [n for n in BUILT_IN_RECIPES if RECIPES[n].identity_blocks] == ["exact", "paper"]
    assert canonical_recipe("official", warn=False) == "official-init"
    assert resets_optimizer("official") is False


def test_a_taken_name_or_a_built_in_is_refused() -> None:
    with pytest.raises(GrowthError, match="'paper' is already registered"):
        register_recipe(Recipe("paper", exact_tokens))
    with pytest.raises(GrowthError, match="'official' is already registered"):
        register_recipe(Recipe("mine", exact_tokens, aliases=("official",)))
    with pytest.raises(GrowthError, match="'exact' is built in and cannot be unregistered"):
        unregister_recipe("exact")
    assert tuple(RECIPES) == BUILT_IN_RECIPES


def test_a_registered_recipe_reaches_grow_at_and_the_optimizer_reset() -> None:
    """Its metadata is read where the built-ins' is: --grow-at accepts its name, and a recipe
    that resets the optimizer restarts the schedule and hands back fresh AdamW state."""
    register_recipe(Recipe("paper-fresh", zero_key_tokens, resets_optimizer=True))
    try:
        event = parse_grow_at("5:ffn=2x,recipe=paper-fresh")
        assert event.kwargs == {"ffn": "2x", "recipe": "paper-fresh"} and event.lr_stage.restart
        model = tiny()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 97, (2, 16), generator=gen(1))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        grown, fresh = grow_with_optimizer(model, optimizer, ffn="2x", recipe="paper-fresh",
                                           generator=gen())
        assert fresh.state == {} and len(optimizer.state) > 0
        assert grown.config.ffn_tokens == 48 and grown.config.ffn_scale is None  # not exact
    finally:
        unregister_recipe("paper-fresh")


def test_grow_at_keys_are_the_options_fields_with_a_text_form() -> None:
    """Read off GrowthOptions (positions has no key=value form; strategy is recipe's old
    name; lr and lr_ramp are the schedule's): the list --grow-at has always had, and widen
    (a baseline's MLP widening, a field since the frontier's widening arms grow through it)."""
    assert GROW_KEYS == ("qkv", "proj", "ffn", "layers", "hidden", "heads", "how", "width_noise",
                         "widen", "recipe", "strategy", "freeze_old", "noise_old", "lr",
                         "lr_ramp")


def test_an_options_object_and_keywords_grow_the_same_model() -> None:
    """Keywords name GrowthOptions' fields, and override those of an object given with them."""
    model = tiny()
    by_words = grow(model, qkv="2x", layers=3, recipe="paper", generator=gen())
    by_object = grow(model, GrowthOptions(qkv="2x", layers=3, recipe="paper"),
                     generator=gen())
    overridden = grow(model, GrowthOptions(qkv="2x", layers=3), recipe="paper",
                      generator=gen())
    expected = by_words.state_dict()
    for other in (by_object, overridden):
        assert other.config == by_words.config
        assert all(torch.equal(expected[k], v) for k, v in other.state_dict().items())
    with pytest.raises(GrowthError, match="unknown argument 'bogus'"):
        grow(model, GrowthOptions(qkv="2x"), bogus=1)


NAME = "must be a non-empty string without spaces, ',' or '=' (options such as --grow-at write it"


@pytest.mark.parametrize(("call", "message"), [
    (lambda: register_recipe(None), "a growth recipe must be a Recipe, got None"),
    (lambda: register_recipe("x"), "a growth recipe must be a Recipe, got str 'x'"),
    (lambda: unregister_recipe("nope"),
     "no growth recipe named 'nope' is registered (registered: none, besides the built-in "
     "exact, paper, official-init, official-released, official)"),
    (lambda: unregister_recipe("official"), "'official' is built in"),
    (lambda: register_recipe(Recipe("weird", tokens=42)),
     "growth recipe 'weird': tokens must be a function (old, new, generator, copy) -> (keys, "
     "values), got int 42"),
    (lambda: register_recipe(Recipe("", exact_tokens)), f"a growth recipe's name {NAME}"),
    (lambda: register_recipe(Recipe(5, exact_tokens)), "name must be a non-empty string"),
    (lambda: register_recipe(Recipe("a,b", exact_tokens)), "got str 'a,b'"),
    (lambda: register_recipe(Recipe("x", exact_tokens, exact="yes")),
     "growth recipe 'x': exact must be True or False, got str 'yes'"),
    (lambda: register_recipe(Recipe("x", exact_tokens, aliases="old")),
     "growth recipe 'x': aliases must be a tuple of old names, got str 'old'"),
    (lambda: register_recipe(Recipe("x", exact_tokens, aliases=("",))),
     f"growth recipe 'x': every other name {NAME}"),
    (lambda: register_recipe(Recipe("x", exact_tokens, aliases=("x",))),
     "growth recipe 'x' gives one name twice: x, x"),
    (lambda: widening.register_widening(None), "an MLP widening must be a Widening, got None"),
    (lambda: widening.register_widening("zero"),
     "an MLP widening must be a Widening, got str 'zero'"),
    (lambda: widening.register_widening(Widening("duplicate", zero_units, "copies")),
     "an MLP widening cannot be named 'duplicate': that name is grow's widening by "
     "duplication"),
    (lambda: widening.register_widening(Widening("zero", zero_units, "again")),
     "an MLP widening named 'zero' is already registered; choose another name"),
    (lambda: widening.register_widening(Widening("", zero_units, "nameless")),
     f"an MLP widening's name {NAME}"),
    (lambda: widening.register_widening(Widening("w", 42, "a number")),
     "MLP widening 'w': units must be a function (old mlp, new mlp, generator, init_std) -> "
     "None, filling the new MLP's weights, got int 42"),
    (lambda: widening.register_widening(Widening("w", zero_units, " ")),
     "MLP widening 'w': what must be a non-empty string, got str ' '"),
    (lambda: widening.unregister_widening("net2net"),
     "MLP widening 'net2net' is built in and cannot be unregistered"),
    (lambda: widening.unregister_widening("nope"),
     "no MLP widening named 'nope' is registered (registered: none, besides the built-in "
     "zero, net2net)"),
])
def test_a_bad_recipe_or_widening_is_refused_when_registered(call: Callable[[], object],
                                                              message: str) -> None:
    """Each was an AttributeError, a KeyError, accepted to fail at the first growth ("'int'
    object is not callable"), or had no register function at all (widenings; issue 42): now one
    GrowthError in the registry's words, the tables unchanged."""
    try:
        with pytest.raises(GrowthError, match=re.escape(message)):
            call()
    finally:  # a regression that accepts it must not leave it to the next case
        for table, built_in in ((RECIPES, BUILT_IN_RECIPES), (WIDENINGS, ("zero", "net2net"))):
            for added in set(table) - set(built_in):
                del table[added]


def test_a_registered_widening_grows_a_baseline_and_leaves_again() -> None:
    """register_widening is what the table's comment promises: grow(widen=name) runs its units
    function (here zero's, under another name: the function is kept exactly), and after
    unregister_widening the name is unknown again."""
    torch.manual_seed(0)
    model = TransformerLM(TransformerConfig(vocab_size=97, hidden_size=32, num_layers=2,
                                            num_heads=4, intermediate_size=24, max_seq_len=16))
    again = Widening("zero-again", zero_units, "zero's units, under another name")
    try:
        assert widening.register_widening(again) is again
        grown = grow(model, ffn=40, widen="zero-again", generator=gen())
        ids = torch.randint(0, 97, (2, 16), generator=gen(1))
        with torch.no_grad():  # zero outgoing weights (the sum's order may differ: 1e-6)
            torch.testing.assert_close(grown(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
        assert not grown.layers[0].mlp.down.weight[:, 24:].any()
    finally:
        widening.unregister_widening("zero-again")
    with pytest.raises(GrowthError, match="unknown MLP widening widen='zero-again'"):
        grow(model, ffn=40, widen="zero-again")
