"""Progressive scaling: grow a TokenFormer by appending parameter tokens (width) or blocks (depth).

A Pattention ``Y = Θ(X·Kᵀ)·V`` with n key/value tokens grows to n + m tokens by appending m rows
to K and V. Three recipes for the new rows (spec §5):

``paper``
    New keys zero, new values with the model's value init, Θ's factor follows the new n (the
    ``*_scale`` fields reset to None). For ``l2_norm_gelu`` with old scores a ∈ Rⁿ and new scores
    b = 0, Θ on the old tokens becomes GELU(a/‖a‖·√(n+m)): every old pre-activation is multiplied
    by √((n+m)/n) and, GELU not being homogeneous, the function changes.
``official-init`` (alias ``official``)
    What the released code does to the new rows: new keys N(0, init_std²), new values
    N(0, value_init_std²) with the *grown* config's value init, factor follows the new n. Changes
    the function. The optimizer is carried, like every recipe but the next.
``official-released``
    The released 354M → 757M training as released: ``official-init``'s rows, plus a fresh
    optimizer (:func:`grow_with_optimizer` resets it), and in a run a warmup restart and a new
    decay over the remaining steps (:mod:`tokenformer.training.schedule`).
``exact``
    The grown model computes the same function (to fp32 rounding), and every new token gets a
    non-zero gradient on the first step. Per Θ variant, with the factor s held at its pre-growth
    value (written into ``config.*_scale`` so save/load reproduces it):

    * ``l2_norm_gelu``: new keys zero ⇒ b = 0 for every input, ‖[a, b]‖ = ‖a‖, old
      pre-activations unchanged, and the new tokens' Θ = GELU(0) = 0, so whatever their values
      are, they add nothing. New values are drawn with the value init (non-zero) because the
      score gradient of a new token j is ∂L/∂b_j = GELU'(0)·(s/‖a‖)·(g·v_j) = ½·(s/‖a‖)·(g·v_j),
      with g = ∂L/∂Y: zero values would leave the new keys with zero gradient forever. On step 1
      the new *keys* move; the new *values* have gradient Θ_jᵀ·g = 0 (Θ_j = 0) and start moving
      on step 2, once the keys are non-zero.
    * ``gelu_l2_norm`` / ``gelu_l1_norm``: GELU(0) = 0 adds nothing to ‖GELU(·)‖, so the same
      construction is exact; ∂L/∂b_j = ½·s/‖GELU(a)‖·(g·v_j) (torch's |x| has gradient 0 at 0).
    * ``gelu`` (the MLP control, no norm): new scores 0 give GELU(0) = 0 and nothing else
      depends on n (the factor is 1 at every n), so zero new keys are exact under every recipe
      that zeroes them (``paper`` and ``exact`` coincide); ∂L/∂b_j = ½·s·(g·v_j).
    * ``softmax``: exp(x·k) > 0 for every finite key, so any new token takes a share of the
      normalisation and no choice of new rows alone preserves the function. What is exact: grow
      by a whole multiple r (n → r·n), repeat every old key r times and split every old value v_i
      into r values v_i + ε_c with Σ_c ε_c = 0 (ε drawn with the value init, then centred): the
      normaliser becomes r·Σe^a, the numerator r·Σe^a·v, and s is held. Old value rows change by
      ε, new tokens get non-zero key and value gradients on step 1 (their values differ).
      Non-integer multiples are refused.

Depth (``layers=``): new blocks are inserted at ``positions`` (indices in the grown model;
default spread evenly). For ``exact`` and ``paper`` a new block is the identity when inserted:
its attention-output Pattention (``attention.proj``) and FFN (``mlp``) get their tokens in groups
with one shared random key and values that sum to zero (pairs v, −v; one triple if the count is
odd), so the branch outputs are exactly zero for every input, while each of those keys and values
gets a non-zero gradient on step 1 (pair members see equal Θ and opposite values). Q, K and V are
drawn with the model's init; because the attention branch output is identically zero as a function
of Q/K/V's outputs, their gradient on step 1 is provably zero for *any* construction that makes
the branch identically zero; they start training on step 2. A lone token (count 1) gets value 0.
``official`` inserts freshly initialised blocks. Non-Pattention tensors of a new block (norm
weights, if any) are copied from the block before it.

Width (``hidden=``, :mod:`tokenformer.ops.cloning`): the hidden size times a whole number r by
duplication (HyperCloning), heads r·H of the old size, exact for every Θ variant, tied or untied
head, TokenFormer and the Transformer baselines (whose ``ffn=`` is then the MLP width, duplicated
the same way). Stacking (``how="stack"``, G_stack of "Stacking Your Transformers", Du et al.
2024): block i of the grown model is a copy of old block i mod L, the whole trained stack repeated
in order ([0..L−1, 0..L−1] for 2x); not function-preserving. A request runs as up to three
stages, each carrying the optimizer: width, then stacking, then tokens and identity blocks.

Old tokens (``freeze_old``, ``noise_old``): the rows of every parameter-token tensor that existed
before the growth (same tensor, same row, same width; not in an inserted block) are recorded on
the grown model (:func:`old_tokens`). ``noise_old`` adds N(0, (noise_old·rms)²) to them, rms over
the old rows of each tensor; ``freeze_old`` (steps, or ``"forever"``) is recorded for the trainer,
which keeps those rows bitwise unchanged (:mod:`tokenformer.training.freezing`).

The grown model is a new instance of the same class (``type(model)(new_config)``), so the same code
grows :class:`~tokenformer.TokenFormerLM` and the vision model; the input model is not modified.
:func:`grow_with_optimizer` also returns an optimizer carrying the AdamW moments over.

Where each piece lives: :mod:`.recipes` (the table of recipes, name → token function and
what it promises; a new recipe is one function and one line there), :mod:`.options` (the typed
request, :class:`GrowthOptions`), :mod:`.plan` (the grown config, every refusal before any
work), :mod:`.stages` (:func:`grow` and :func:`grow_with_optimizer`: width, stacking, tokens and
identity blocks), :mod:`.tokens` (the new rows), :mod:`.surgery` (:func:`rebuild`, shared with
pruning), :mod:`.optimizer`, :mod:`.old_tokens`, :mod:`.sizes` and :mod:`.report`.
"""

from .old_tokens import TOKEN_TENSORS, OldTokens, old_tokens
from .optimizer import NEW_ROW_MOMENTS
from .options import (
    FOREVER,
    OLD_TOKEN_KEYS,
    OPTION_KEYS,
    PLAN_KEYS,
    REQUEST_KEYS,
    TEXT_KEYS,
    GrowthOptions,
    freeze_request,
    parse_growth_request,
    refuse_unsupported,
)
from .plan import as_key, plan_growth, refuse_product_ffn, widening_refusal
from .recipes import (
    BUILT_IN_NAMES,
    BUILT_IN_RECIPES,
    HOWS,
    OLD_RECIPE_KEY,
    RECIPE_ALIASES,
    RECIPES,
    RELEASED,
    Recipe,
    canonical_recipe,
    grown_tokens,
    recipe_alias_note,
    recipe_named,
    recipe_names,
    register_recipe,
    register_strategy,
    resets_optimizer,
    take_old_recipe_key,
    unregister_recipe,
    unregister_strategy,
    warn_old_recipe_name,
    widen_names,
)
from .report import max_logit_change, size_lines
from .sizes import default_positions, resolve_size, size_request, width_factor
from .stages import BRANCH_OUTPUTS, grow, grow_with_optimizer
from .surgery import rebuild
from .widening import WIDENINGS, Widening, register_widening, unregister_widening

__all__ = [
    "BRANCH_OUTPUTS", "BUILT_IN_NAMES", "BUILT_IN_RECIPES", "FOREVER", "HOWS", "NEW_ROW_MOMENTS",
    "OLD_RECIPE_KEY", "OLD_TOKEN_KEYS", "OPTION_KEYS", "PLAN_KEYS", "RECIPES", "RECIPE_ALIASES",
    "RELEASED", "REQUEST_KEYS", "TEXT_KEYS", "TOKEN_TENSORS", "WIDENINGS", "GrowthOptions",
    "OldTokens", "Recipe", "Widening", "as_key", "canonical_recipe", "default_positions",
    "freeze_request", "grow", "grow_with_optimizer", "grown_tokens", "max_logit_change",
    "old_tokens", "parse_growth_request", "plan_growth", "rebuild", "recipe_alias_note",
    "recipe_named", "recipe_names", "refuse_product_ffn", "refuse_unsupported",
    "register_recipe", "register_strategy", "register_widening", "resets_optimizer",
    "resolve_size", "size_lines", "size_request", "take_old_recipe_key", "unregister_recipe",
    "unregister_strategy", "unregister_widening", "warn_old_recipe_name", "widen_names",
    "widening_refusal",
    "width_factor",
]
