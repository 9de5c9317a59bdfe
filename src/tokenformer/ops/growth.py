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
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import GrowthError
from ..models.baselines import TransformerConfig
from ..models.checks import non_finite
from ..models.config import TokenFormerConfig
from ..nn.pattention import KINDS, Pattention, default_scale, kind_names, resolve_top_k
from .cloning import carry_moment, product_key_refusal, widen_tensor, widened_config, width_axes

# Growth recipes, by name. "official" is the earlier name of "official-init" (kept so saved plans,
# configs and docs stay valid); "official-released" also resets the optimizer and, in a run,
# restarts the schedule (training.schedule).
RECIPES = ("exact", "paper", "official-init", "official-released")
RECIPE_ALIASES = {"official": "official-init"}
STRATEGIES = (*RECIPES, *RECIPE_ALIASES)  # every name grow(strategy=...) accepts
RELEASED = "official-released"
# Depth: insert identity blocks (between the old ones, at positions) or stack the trained blocks.
HOWS = ("identity", "stack")
# The Pattentions whose output is added to the residual stream: zero them for an identity block.
BRANCH_OUTPUTS = kind_names("proj") + kind_names("ffn")

_CANNOT_GROW = {
    "hidden size": "grow the hidden size with hidden= (a whole multiple like '2x': width by "
                   "duplication)",
    "number of heads": "heads follow the hidden size (heads= may only restate r·heads: the "
                       "head size is kept)",
    "vocabulary": "the vocabulary is the embedding table fixed by the tokenizer, not a "
                  "Pattention, so adding parameter tokens cannot change it",
}
_ALIASES = {"hidden_size": "hidden size", "d_model": "hidden size", "width": "hidden size",
            "num_heads": "number of heads", "vocab": "vocabulary", "vocab_size": "vocabulary"}
_MULTIPLIER = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*[xX×]\s*$")


# ------------------------------------------------------------------------------------ sizes
def size_request(spec: object, current: int) -> int | float | None:
    """The count a size spec asks for, before the caller's rounding and bounds (grow's
    :func:`resolve_size`, prune's ``prune_size``): an int (numpy integers too) or "768" is that
    count; "2x" / "0.5x" is that multiple of ``current`` (a float); anything else (a bool
    included) is None, malformed."""
    if isinstance(spec, bool):
        return None
    if isinstance(spec, numbers.Integral):
        return int(spec)
    if isinstance(spec, str) and spec.strip().isdecimal():  # not isdigit: int() refuses '²'
        return int(spec)
    if isinstance(spec, str) and (match := _MULTIPLIER.match(spec)):
        return float(match.group(1)) * current
    return None


def resolve_size(spec: int | str | None, current: int, what: str) -> int:
    """The new count for ``what``: ``None`` keeps ``current``; an int or "768" is absolute;
    "2x" / "1.5x" multiplies ``current`` (the product must be a whole number). Never smaller."""
    if spec is None:
        return current
    if isinstance(spec, bool):
        raise GrowthError(f"{what}: expected a count or a multiplier like '2x', got {spec!r}")
    request = size_request(spec, current)
    if request is None:
        raise GrowthError(f"{what}: malformed size {spec!r}; give a count like 1536 or a "
                          f"multiplier like '2x' or '1.5x'")
    if isinstance(request, float) and abs(request - round(request)) > 1e-9:  # a multiplier
        raise GrowthError(f"{what}: {str(spec).strip()} of {current} is {request:g}, not a "
                          f"whole number; give an absolute count instead")
    new = round(request)
    if new < current:
        raise GrowthError(f"{what}: cannot shrink from {current} to {new}; growth only adds "
                          f"parameter tokens or blocks")
    return new


def width_factor(spec: int | str | None, current: int, what: str) -> int:
    """The whole multiple r a width request asks for: ``"2x"``, ``"4x"``, or an absolute size
    that is r times ``current``; None is 1. Anything else is one GrowthError saying what is
    possible (768 → 1024 is not: duplication makes whole copies)."""
    if spec is None:
        return 1
    request = size_request(spec, current)
    if request is None:
        raise GrowthError(f"{what}: malformed size {spec!r}; give a whole multiple like '2x' or "
                          f"a size like {2 * current}")
    if request < current:
        raise GrowthError(f"{what}: cannot shrink from {current} to {request:g}; width growth "
                          f"only duplicates units (a factor of at least 1x)")
    ratio = request / current
    if abs(ratio - round(ratio)) > 1e-9:
        raise GrowthError(
            f"{what}: {current} → {request:g} is not a whole multiple of {current}; width growth "
            f"duplicates every unit, so the new size must be {current}·r "
            f"({', '.join(str(current * r) for r in (2, 3, 4))}, ...)")
    return round(ratio)


def default_positions(old_layers: int, new_layers: int) -> list[int]:
    """Indices in the grown model of ``new_layers - old_layers`` inserted blocks, spread evenly:
    old block i is followed by round((i+1)·k/L) − round(i·k/L) new ones (k added, L old)."""
    k = new_layers - old_layers
    per_gap = [math.floor((i + 1) * k / old_layers + 0.5) - math.floor(i * k / old_layers + 0.5)
               for i in range(old_layers)]
    positions, index = [], 0
    for count in per_gap:
        index += 1  # the old block
        positions += range(index, index + count)
        index += count
    return positions


# ------------------------------------------------------------------------------------ growth
@dataclass
class _Growth:
    model: nn.Module
    # New parameter/buffer name -> the old name it carries over. A block inserted by depth growth
    # maps to the same tensor of its template (the old block before it): optimizer groups and step
    # counts come from there, while its contents are new.
    source: dict[str, str]
    inserted: set[str]
    # How an optimizer state tensor of a parameter carries over, when not by rows:
    # carry(new name, state key, old value) -> new value (width: tiled and rescaled moments;
    # stacking: copies).
    carry: Callable[[str, str, torch.Tensor], torch.Tensor] | None = None


def grow(model: nn.Module, *, qkv: int | str | None = None, proj: int | str | None = None,
         ffn: int | str | None = None, layers: int | str | None = None,
         hidden: int | str | None = None, heads: int | None = None, how: str = "identity",
         width_noise: float = 0.0, strategy: str = "exact", positions: list[int] | None = None,
         generator: torch.Generator | None = None, copy: bool = True, progress: bool = False,
         freeze_old: int | str | bool | None = None, noise_old: float = 0.0,
         **unsupported: object) -> nn.Module:
    """Return a larger copy of ``model`` (same class); ``model`` itself is left untouched.

    ``qkv``/``proj``/``ffn``: new token count of those Pattentions, absolute (``1536``) or a
    multiplier (``"2x"``); for a Transformer baseline ``ffn`` is its MLP width, a whole multiple.
    ``hidden``: a whole multiple of the hidden size (``"2x"``, or ``1536`` from 768), by exact
    duplication; ``heads`` follows it (r·H, head size kept). ``width_noise``: std, relative to
    each tensor's RMS, of the zero-sum noise that breaks the copies' symmetry
    (:mod:`tokenformer.ops.cloning`; still exact). ``layers``: new total block count;
    ``how="identity"`` inserts identity blocks at ``positions`` (indices in the grown model,
    default spread evenly), ``how="stack"`` repeats the trained stack in order (block i = old
    block i mod L). ``strategy`` is a recipe for new tokens and inserted blocks: ``exact``
    (function preserved), ``paper``, ``official-init`` (alias ``official``) or
    ``official-released``; the module docstring gives the math. ``generator`` (a CPU
    ``torch.Generator``) seeds every random draw. ``copy=False`` shares every tensor that does
    not grow with ``model`` instead of copying it (half the memory traffic; training the grown
    model then changes ``model``, so only use it when ``model`` is discarded). ``noise_old`` (a
    std relative to each tensor's rms) perturbs the old tokens; ``freeze_old`` (steps or
    ``"forever"``) is recorded for the trainer (:class:`OldTokens`); both only for a growth of
    tokens or identity blocks. Raises
    :class:`GrowthError` for shrinking, malformed or impossible sizes (non-whole width
    multiples, heads that change the head size), or requests to grow what cannot grow.
    """
    return grow_with_optimizer(model, None, qkv=qkv, proj=proj, ffn=ffn, layers=layers,
                               hidden=hidden, heads=heads, how=how, width_noise=width_noise,
                               strategy=strategy, positions=positions, generator=generator,
                               copy=copy, progress=progress, freeze_old=freeze_old,
                               noise_old=noise_old, **unsupported)[0]


NEW_ROW_MOMENTS: tuple[str, ...] = ("zero", "mean")


def grow_with_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                        reset_optimizer: bool = False, new_row_moments: str = "zero",
                        **grow_kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`grow` plus an optimizer of the same class over the grown model's parameters.

    Param groups and their hyper-parameters are kept, each new parameter joining the group of the
    old parameter of the same name (so weight-decay groups survive). Per-parameter state tensors
    shaped like the parameter (AdamW's ``exp_avg``/``exp_avg_sq``) keep their old rows, new rows
    are zero; scalar state (``step``) is kept. A block inserted by depth growth gets zero moments
    and the step count of the block before it; a stacked block (``how="stack"``) a copy of its
    source block's state. Width growth tiles every moment like the gradient it averages and
    scales it as that gradient scales: ``exp_avg`` by r⁻ᶜ, ``exp_avg_sq`` by r⁻²ᶜ, c the number of
    copied (not split) axes (:mod:`tokenformer.ops.cloning`). ``reset_optimizer=True`` gives
    fresh state (what the released code does; recipe ``official-released`` always does). With
    ``copy=False`` state that does not grow is shared with ``optimizer``, which must then be
    discarded. ``optimizer=None``: no optimizer (what :func:`grow` passes); None is returned.

    ``new_row_moments="mean"`` starts the second moment (``exp_avg_sq``) of every new row at the
    mean over the old rows of the same tensor (per column) instead of zero; the first moment
    stays zero. With a zero second moment Adam's first steps on a new row are ≈ ±(0.45–1.1)·lr
    per element whatever the gradient's size (β₂ = 0.95); with the old rows' scale they are as
    small as the gradient is relative to what the old rows see (docs/results.md, verdict 5).
    """
    if new_row_moments not in NEW_ROW_MOMENTS:
        raise GrowthError(f"new_row_moments must be one of {', '.join(NEW_ROW_MOMENTS)}, "
                          f"got {new_row_moments!r}")
    known = set(inspect.signature(grow).parameters) - {"model", "unsupported"}
    unsupported = {k: grow_kwargs.pop(k) for k in list(grow_kwargs) if k not in known}
    freeze = freeze_request(grow_kwargs.pop("freeze_old", None))  # checked before any work
    noise = _noise_level(grow_kwargs.pop("noise_old", 0.0))
    if (freeze is not None or noise) and (grow_kwargs.get("hidden") is not None
                                          or grow_kwargs.get("how", "identity") == "stack"):
        raise GrowthError("freeze_old and noise_old act on the parameter tokens a growth of tokens "
                          "or identity blocks keeps; not with hidden= or how=stack")
    copy = bool(grow_kwargs.get("copy", True))
    reset = reset_optimizer or resets_optimizer(str(grow_kwargs.get("strategy", "exact")))
    grown = model
    stages = list(_growths(model, unsupported=unsupported,
                           **grow_kwargs))  # type: ignore[arg-type]
    for old, growth in stages:
        if optimizer is not None:
            optimizer = _carry_optimizer(old, optimizer, growth, reset, copy, new_row_moments)
        grown, copy = growth.model, False  # later stages own their input: nothing to protect
    if len(stages) == 1:  # tokens and identity blocks: which rows are old is well defined
        _record_old_tokens(*stages[0], freeze, noise, grow_kwargs.get("generator"))
    _refuse_non_finite(grown, grow_kwargs.get("width_noise"), noise)
    return grown, optimizer


def _refuse_non_finite(model: nn.Module, width_noise: object, noise_old: float) -> None:
    """A growth never hands on NaN or infinite weights (a noise std so large that the noised
    rows overflow): every loader would refuse them, and training would diverge at once."""
    name = non_finite(model.named_parameters())
    if name is not None:
        causes = [f"{key}={value:g}" for key, value in (("width_noise", width_noise),
                                                        ("noise_old", noise_old)) if value]
        cause = f" ({', '.join(causes)} times each tensor's rms overflows)" if causes else ""
        raise GrowthError(f"the grown model's {name} holds NaN or infinite values{cause}; "
                          f"lower the noise")


def _growths(model: nn.Module, *, qkv=None, proj=None, ffn=None, layers=None, hidden=None,
             heads=None, how="identity", width_noise=0.0, strategy="exact", positions=None,
             generator=None, copy=True, progress=False, unsupported=None
             ) -> Iterator[tuple[nn.Module, _Growth]]:
    """The stages of one growth request, each (its input model, its growth): width, then stacking,
    then tokens and identity blocks (a same-size copy when nothing is asked). Everything is
    checked (:func:`plan_growth`) before the first stage runs."""
    refuse_unsupported(unsupported or {})
    config = model.config
    plan_growth(config, qkv=qkv, proj=proj, ffn=ffn, layers=layers, hidden=hidden, heads=heads,
                how=how, width_noise=width_noise, strategy=strategy, positions=positions)
    baseline = isinstance(config, TransformerConfig)
    r = width_factor(hidden, config.hidden_size, "hidden")
    r_ffn = width_factor(ffn, config.intermediate_size, "ffn") if baseline else 1
    current, stages = model, 0
    if r > 1 or r_ffn > 1:
        growth = _widen(current, r, heads, r_ffn, width_noise, generator, copy, progress)
        yield current, growth
        current, copy, stages = growth.model, False, stages + 1
    new_layers = resolve_size(layers, config.num_layers, "layers")
    if how == "stack" and new_layers > config.num_layers:
        growth = _stack(current, new_layers, copy, progress)
        yield current, growth
        current, copy, stages = growth.model, False, stages + 1
    tokens = not baseline and any(spec is not None for spec in (qkv, proj, ffn))
    if tokens or (how == "identity" and new_layers > config.num_layers) or not stages:
        yield current, _grow(current, qkv=None if baseline else qkv,
                             proj=None if baseline else proj, ffn=None if baseline else ffn,
                             layers=layers if how == "identity" else None, strategy=strategy,
                             positions=positions, generator=generator, copy=copy,
                             progress=progress)


def _grow(model: nn.Module, *, qkv=None, proj=None, ffn=None, layers=None, strategy="exact",
          positions=None, generator=None, copy=True, progress=False) -> _Growth:
    """Tokens and identity blocks (the stage :func:`grow` has always had)."""
    config = model.config
    new_config = plan_growth(config, qkv=qkv, proj=proj, ffn=ffn, layers=layers,
                             strategy=strategy, positions=positions)
    strategy = row_init(strategy)  # the recipes differ below only in how new rows are drawn
    old_layers, new_layers = config.num_layers, new_config.num_layers
    layer_source = _layer_plan(old_layers, new_layers, positions)

    prefix = _layers_prefix(model)
    old_index = {new_i: old_i for new_i, (old_i, _) in enumerate(layer_source)}
    inserted_layers = {i for i, (_, is_new) in enumerate(layer_source) if is_new}

    def source_of(name: str) -> tuple[str, bool]:
        if not name.startswith(prefix):
            return name, False
        index, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{old_index[int(index)]}.{rest}", int(index) in inserted_layers

    def tokens_for(name: str, module: Pattention, old: Pattention
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        if source_of(name)[1]:
            branch = strategy != "official" and name.endswith(BRANCH_OUTPUTS)
            return _new_block_tokens(module, old, branch, generator)
        return grown_tokens(old, module, strategy, generator, copy)

    growth = rebuild(model, new_config, tokens_for, source_of, copy=copy, progress=progress,
                     desc="grow")
    if isinstance(config, TransformerConfig):  # Linear blocks: no Pattention to hand to tokens_for
        for index in sorted(inserted_layers):
            _init_linear_block(growth.model.layers[index], new_config, strategy, generator)
    return growth


def _init_linear_block(block: nn.Module, config: Any, strategy: str,
                       generator: torch.Generator | None) -> None:
    """A Transformer baseline's inserted block: Linear weights drawn with the model's init, biases
    zero; under exact/paper its two branch outputs (attention.proj, mlp.down) are zero, so the
    block is the identity (their gradients are not zero: they train from step 1)."""
    with torch.no_grad():
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            branch = name in ("attention.proj", "mlp.down")
            if branch and strategy != "official":
                module.weight.zero_()
            else:
                std = config.value_init_std if branch else config.init_std
                _fill_normal(module.weight, std, generator)
            if module.bias is not None:
                module.bias.zero_()


def _widen(model: nn.Module, r: int, heads: int | None, r_ffn: int, noise: float,
           generator: torch.Generator | None, copy: bool, progress: bool) -> _Growth:
    """Width by duplication (:mod:`tokenformer.ops.cloning`); every tensor is new."""
    axes = width_axes(model)
    factors = {"d": r, "f": r_ffn}
    new_config = widened_config(model.config, r, heads, r_ffn)

    def widen(name: str, old: torch.Tensor) -> torch.Tensor:
        return widen_tensor(old, axes.get(name, ()), factors, noise, generator)

    def tokens_for(name: str, module: Pattention, old: Pattention
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        return (widen(f"{name}.key_param_tokens", old.key_param_tokens),
                widen(f"{name}.value_param_tokens", old.value_param_tokens))

    growth = rebuild(model, new_config, tokens_for, tensor_for=widen, copy=copy,
                     progress=progress, desc="widen")
    growth.carry = lambda name, key, value: carry_moment(axes[name], factors)(key, value)
    return growth


def _stack(model: nn.Module, new_layers: int, copy: bool, progress: bool) -> _Growth:
    """G_stack: block i of the grown model is a copy of old block i mod L (the copies beyond the
    first L count as inserted); the optimizer state of each copy is a copy of its source's."""
    old_layers = model.config.num_layers
    prefix = _layers_prefix(model)

    def source_of(name: str) -> tuple[str, bool]:
        if not name.startswith(prefix):
            return name, False
        index, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{int(index) % old_layers}.{rest}", int(index) >= old_layers

    def tokens_for(name: str, module: Pattention, old: Pattention
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        fresh = copy or source_of(name)[1]  # a second copy never shares the first's storage
        return tuple(t.detach().clone() if fresh else t.detach()  # type: ignore[return-value]
                     for t in (old.key_param_tokens, old.value_param_tokens))

    growth = rebuild(model, dataclasses.replace(model.config, num_layers=new_layers), tokens_for,
                     source_of, copy=copy, progress=progress, desc="stack")
    growth.carry = lambda name, key, value: value.clone()
    return growth


def rebuild(model: nn.Module, new_config: Any, tokens_for: Any, source_of: Any = None, *,
            tensor_for: Any = None, copy: bool = True, progress: bool = False,
            desc: str = "resize") -> _Growth:
    """The one place token surgery happens (growth and :mod:`tokenformer.ops.pruning`): a new model
    of ``type(model)`` built for ``new_config`` whose every Pattention gets the K and V that
    ``tokens_for(name, new_module, old_module)`` returns, every other tensor copied (or shared,
    ``copy=False``, except into an inserted block) from the old tensor ``source_of(name) ->
    (old name, is_new)`` names (default: the same name), or, given ``tensor_for(name, old)``,
    what it returns. Per-module settings not in the config (``impl``) carry over."""
    source_of = source_of or (lambda name: (name, False))
    # Built on the meta device (no init cost), then every tensor is assigned below.
    with torch.device("meta"):
        new = type(model)(new_config)
    old_state = model.state_dict(keep_vars=True)
    old_modules = dict(model.named_modules())
    state: dict[str, torch.Tensor] = {}
    pattentions = [(n, m) for n, m in new.named_modules() if isinstance(m, Pattention)]

    for name, module in tqdm(pattentions, desc=desc, unit="Pattention",
                             disable=None if progress else True):
        old = old_modules[source_of(name)[0]]
        if hasattr(old, "impl"):  # per-module choice of forward implementation, not in the config
            module.impl = old.impl
        keys, values = tokens_for(name, module, old)
        state[f"{name}.key_param_tokens"], state[f"{name}.value_param_tokens"] = keys, values

    source, inserted = {}, set()
    for name, meta in new.state_dict(keep_vars=True).items():
        old_name, is_new = source_of(name)
        source[name] = old_name
        if is_new:
            inserted.add(name)
        if name in state:
            continue
        old = old_state[old_name]
        if tensor_for is not None:
            old = tensor_for(name, old)
        if old.shape != meta.shape:
            raise GrowthError(f"cannot resize {name}: shape {tuple(old.shape)} would have to "
                              f"become {tuple(meta.shape)}, which token surgery does not do")
        # An inserted block's tensors are its own even when the rest is shared: two parameters
        # on one storage would each apply the other's updates.
        state[name] = old.detach() if tensor_for or not (copy or is_new) else old.detach().clone()
    new.load_state_dict(state, strict=True, assign=True)
    # Non-persistent buffers (e.g. rotary tables) are not in a state dict: carry them over.
    old_buffers = dict(model.named_buffers())
    for name, buffer in new.named_buffers():
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            setattr(new.get_submodule(owner), leaf, old_buffers[source_of(name)[0]].clone())
    old_params = dict(model.named_parameters())
    for name, param in new.named_parameters():
        param.requires_grad_(old_params[source[name]].requires_grad)
    new.train(model.training)
    return _Growth(new, source, inserted)


def plan_growth(config: Any, *, qkv: int | str | None = None, proj: int | str | None = None,
                ffn: int | str | None = None, layers: int | str | None = None,
                hidden: int | str | None = None, heads: int | None = None,
                how: str = "identity", width_noise: float = 0.0, strategy: str = "exact",
                positions: list[int] | None = None) -> Any:
    """The config :func:`grow` would produce, computed without touching a tensor: every request
    (sizes, width multiples, heads, strategy, how, positions) is checked here, so a plan can be
    refused before any work."""
    strategy = row_init(canonical_recipe(strategy))
    if how not in HOWS:
        raise GrowthError(f"unknown depth growth how={how!r}; choose identity (insert identity "
                          f"blocks) or stack (repeat the trained blocks in order)")
    if isinstance(width_noise, bool) or not isinstance(width_noise, (int, float)) \
            or not 0 <= width_noise < math.inf:
        raise GrowthError(f"width_noise must be a number >= 0 (std relative to each tensor's "
                          f"RMS), got {width_noise!r}")
    baseline = isinstance(config, TransformerConfig)
    product = getattr(config, "ffn_keys", "dense") == "product"
    if baseline and (qkv is not None or proj is not None):
        raise GrowthError("a Transformer baseline has no parameter tokens: its attention width "
                          "is the hidden size (grow it with hidden=) and its MLP width is ffn=")
    r = width_factor(hidden, config.hidden_size, "hidden")
    r_ffn = width_factor(ffn, config.intermediate_size, "ffn") if baseline else 1
    if r > 1 or r_ffn > 1 or heads is not None:
        if not isinstance(config, (TokenFormerConfig, TransformerConfig)):
            raise GrowthError(f"width growth duplicates the units of a language model "
                              f"(TokenFormer or a Transformer baseline), not a "
                              f"{type(config).__name__} model")
        if product and r > 1:
            raise GrowthError(product_key_refusal("widen"))
        config = widened_config(config, r, heads, r_ffn)
    if width_noise and r == r_ffn == 1:
        raise GrowthError("width_noise breaks the symmetry of duplicated units: it needs a width "
                          "growth (hidden=2x, or ffn= of a Transformer baseline)")
    new_layers = resolve_size(layers, config.num_layers, "layers")
    if how == "stack":
        if positions is not None:
            raise GrowthError("positions place inserted identity blocks; how=stack repeats the "
                              "whole stack in order (block i is old block i mod L)")
        config = dataclasses.replace(config, num_layers=new_layers)
    else:
        if positions is not None:  # the default placement is valid by construction: a plan of
            # absurdly many blocks is refused by its size (check_memory), not by building it
            _layer_plan(config.num_layers, new_layers, positions)
        if product and new_layers > config.num_layers and strategy != "official":
            raise GrowthError("an identity block needs a branch that is zero for every input, "
                              "which a product-key FFN's top-k cannot give; use how=stack or "
                              "strategy=official")
    if baseline:
        return dataclasses.replace(config, num_layers=new_layers)
    sizes = {kind: resolve_size(spec, getattr(config, f"{kind}_tokens"), f"{kind} tokens")
             for kind, spec in zip(KINDS, (qkv, proj, ffn), strict=True)}
    refuse_product_ffn(config, sizes["ffn"], "grow")
    return _grown_config(config, sizes, new_layers, strategy)


def refuse_product_ffn(config: Any, ffn_tokens: int, what: str) -> None:
    """Token surgery here is for Pattentions: a product-key FFN changes n by its sub-keys
    (:meth:`tokenformer.nn.product_keys.ProductKeyPattention.grown`)."""
    if getattr(config, "ffn_keys", "dense") == "product" and ffn_tokens != config.ffn_tokens:
        raise GrowthError(f"cannot {what} the ffn tokens of a product-key FFN here: its n = s² "
                          f"changes by sub-keys (ProductKeyPattention.grown, docs/sparse.md)")


def _grown_config(config: Any, sizes: dict[str, int], num_layers: int, strategy: str) -> Any:
    """The grown model's config: new counts; Θ's factor held (exact) or following n (others)."""
    changes: dict[str, object] = {"num_layers": num_layers}
    for kind, n_new in sizes.items():
        n_old = getattr(config, f"{kind}_tokens")
        if n_new == n_old:
            continue
        changes[f"{kind}_tokens"] = n_new
        if strategy != "exact":
            changes[f"{kind}_scale"] = None  # Θ's factor follows the new n
            continue
        if config.norm == "softmax" and n_new % n_old:
            raise GrowthError(
                f"exact growth with Θ=softmax needs a whole multiple of {kind} tokens "
                f"({n_old} → {n_new} is not): exp(x·k) > 0 for every finite new key, so a new "
                f"token always takes a share of the normalisation; the exact construction "
                f"duplicates every old token instead")
        scale = getattr(config, f"{kind}_scale")
        changes[f"{kind}_scale"] = scale if scale is not None else default_scale(config.norm,
                                                                                 n_old)
        top_k = getattr(config, f"{kind}_top_k", None)
        if top_k is not None:
            # Top-k held like the factor: the new tokens' Θ is 0 (softmax: each old token is r
            # tokens, each with 1/r of its Θ), so the same k (r·k) largest |Θ| give the same
            # output, while a fraction of the new n would keep more old tokens than before.
            k = resolve_top_k(top_k, n_old)
            changes[f"{kind}_top_k"] = k * n_new // n_old if config.norm == "softmax" else k
    return dataclasses.replace(config, **changes)


def refuse_unsupported(requests: dict[str, object]) -> None:
    """Raise GrowthError for any growth request grow() does not take, explaining why."""
    for key in requests:
        if key in _ALIASES:
            what = _ALIASES[key]
            raise GrowthError(f"cannot grow the {what} with {key}=: {_CANNOT_GROW[what]}")
        raise GrowthError(f"grow() got an unknown argument {key!r}; it grows qkv, proj, ffn, "
                          f"hidden (heads follow) and layers")


REQUEST_KEYS = ("hidden", "heads", "layers", "how", "qkv", "proj", "ffn", "strategy",
                "width_noise")


def parse_growth_request(text: str) -> dict[str, Any]:
    """``"hidden=2x,layers=2x,how=stack"`` → :func:`grow`'s keyword arguments (sizes stay text:
    :func:`plan_growth` checks them; ``heads`` is a count, ``width_noise`` a number)."""
    usage = (f"growth request {text!r} is malformed: expected key=value,... with keys "
             f"{', '.join(REQUEST_KEYS)} (e.g. hidden=2x,layers=2x,how=stack)")
    kwargs: dict[str, Any] = {}
    for item in str(text).split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in REQUEST_KEYS or not value or key in kwargs:
            raise GrowthError(usage)
        if key == "heads":
            if not value.isdecimal() or int(value) < 1:
                raise GrowthError(f"heads={value!r} must be a positive count")
            kwargs[key] = int(value)
        elif key == "width_noise":
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise GrowthError(f"width_noise={value!r} must be a number") from None
        else:
            kwargs[key] = value
    return kwargs


def _layer_plan(old_layers: int, new_layers: int, positions: list[int] | None
                ) -> list[tuple[int, bool]]:
    """For each block of the grown model: (old block it comes from or is templated on, is_new)."""
    added = new_layers - old_layers
    if positions is None:
        positions = default_positions(old_layers, new_layers)
    positions = [int(p) for p in positions]
    if len(positions) != added:
        raise GrowthError(f"positions lists {len(positions)} new blocks but growing from "
                          f"{old_layers} to {new_layers} layers inserts {added}")
    if len(set(positions)) != added or any(not 0 <= p < new_layers for p in positions):
        raise GrowthError(f"positions must be distinct indices in the grown model, 0 to "
                          f"{new_layers - 1}; got {positions}")
    inserted, plan, old = set(positions), [], 0
    for index in range(new_layers):
        if index in inserted:  # a set: planning N blocks is O(N), not O(N²)
            plan.append((max(old - 1, 0), True))  # templated on the old block before it
        else:
            plan.append((old, False))
            old += 1
    return plan


def _layers_prefix(model: nn.Module) -> str:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise GrowthError(f"{type(model).__name__} has no .layers ModuleList of blocks; "
                          f"grow() needs the TokenFormerLM structure")
    name = next(n for n, m in model.named_modules() if m is layers)
    return f"{name}."


def _randn(rows: int, like: torch.Tensor, std: float, generator: torch.Generator | None
           ) -> torch.Tensor:
    """N(0, std²) rows as wide as ``like``, float32 on the CPU (callers convert with .to)."""
    return torch.empty(rows, like.shape[1]).normal_(0.0, std, generator=generator)


def _fill_normal(t: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    if t.device.type == "cpu":
        t.normal_(0.0, std, generator=generator)
    else:  # the generator is a CPU one
        t.copy_(_randn(t.shape[0], t, std, generator))


def _with_rows(old: torch.Tensor, rows: int, copy: bool = True, zero: bool = True
               ) -> torch.Tensor:
    """``old`` followed by zero rows (uninitialised if not ``zero``), ``rows`` in all (``old``
    itself if nothing grows and ``copy`` is False). One allocation, each byte written once:
    growth is bound by writing fresh memory."""
    if rows == old.shape[0]:
        return old.clone() if copy else old
    out = old.new_empty((rows, *old.shape[1:]))
    out[: old.shape[0]] = old
    if zero:
        out[old.shape[0]:].zero_()
    return out


def grown_tokens(old: Pattention, new: Pattention, strategy: str,
                  generator: torch.Generator | None, copy: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``new`` (at least as many rows as ``old``): old rows first, new rows by
    ``strategy``."""
    keys, values = old.key_param_tokens.detach(), old.value_param_tokens.detach()
    n_old, n_new = keys.shape[0], new.num_tokens
    if strategy == "exact" and old.norm == "softmax" and n_new > n_old:
        r = n_new // n_old  # duplicate each token r times; split its value into r zero-sum parts
        noise = _randn(n_new, values, new.value_init_std, generator).view(r, n_old, -1)
        noise = (noise - noise.mean(dim=0, keepdim=True)).to(values)
        return keys.repeat(r, 1), (values.unsqueeze(0) + noise).reshape(n_new, -1)
    keys = _with_rows(keys, n_new, copy, zero=strategy != "official")
    values = _with_rows(values, n_new, copy, zero=False)
    if n_new > n_old:  # fill the rows _with_rows left uninitialised
        if strategy == "official":
            _fill_normal(keys[n_old:], new.key_init_std, generator)
        _fill_normal(values[n_old:], new.value_init_std, generator)
    return keys, values


def _new_block_tokens(new: Pattention, like: Pattention, branch_output: bool,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for a Pattention of an inserted block; ``branch_output``: make its output zero."""
    n = new.num_tokens
    ref_k, ref_v = like.key_param_tokens, like.value_param_tokens
    if not branch_output:
        return (_randn(n, ref_k, new.key_init_std, generator).to(ref_k),
                _randn(n, ref_v, new.value_init_std, generator).to(ref_v))
    k = resolve_top_k(new.top_k, n)
    if k is not None and k < n:
        # Top-k keeps each row's k largest |Θ|: it may keep one member of a pair and drop the
        # other (equal |Θ|, a tie), so cancelling pairs are not exact. Zero values are, for
        # any selection; the values get a gradient on step 1 (Θ ≠ 0), the keys from step 2.
        return (_randn(n, ref_k, new.key_init_std, generator).to(ref_k),
                torch.zeros(n, ref_v.shape[1], dtype=ref_v.dtype))
    # Tokens come in groups sharing one key: pairs with values u, -u, plus, if n is odd, one triple
    # with values centred to sum to zero (rescaled to keep the value init's variance). Equal keys
    # give equal Θ weights, so every group's contribution cancels for every input.
    group = torch.arange(n) // 2
    if n % 2 and n > 1:
        group[-1] = group[-2]
    keys = _randn(int(group[-1]) + 1, ref_k, new.key_init_std, generator)[group]
    half = _randn(n // 2, ref_v, new.value_init_std, generator)
    values = torch.stack((half, -half), dim=1).reshape(-1, half.shape[1])
    if n % 2 and n > 1:
        triple = _randn(3, ref_v, new.value_init_std, generator)
        values = torch.cat((values[:-2], (triple - triple.mean(dim=0)) * math.sqrt(1.5)))
    elif n == 1:  # a lone token can only give zero output with a zero value
        values = torch.zeros(1, ref_v.shape[1])
    return keys.to(ref_k), values.to(ref_v)


# ---------------------------------------------------------------- recipes and old tokens
def canonical_recipe(name: str, *, warn: bool = True) -> str:
    """The recipe ``name`` stands for (``official`` → ``official-init``, with a
    DeprecationWarning unless ``warn`` is False); GrowthError for an unknown name."""
    if name in RECIPE_ALIASES:
        if warn:
            warnings.warn(recipe_alias_note(name), DeprecationWarning, stacklevel=2)
        return RECIPE_ALIASES[name]
    if name not in RECIPES:
        raise GrowthError(f"unknown growth strategy {name!r}; choose one of "
                          f"{', '.join(RECIPES)} ({', '.join(RECIPE_ALIASES)}: an old name)")
    return name


def recipe_alias_note(name: str) -> str:
    """The one-line note for an old recipe name."""
    return (f"growth strategy {name!r} is now called {RECIPE_ALIASES[name]!r} (the released "
            f"initialisation, optimizer carried); {RELEASED!r} is the released training recipe "
            f"(also a fresh optimizer, a warmup restart and a new decay)")


def row_init(strategy: str) -> str:
    """How a recipe draws new rows: ``exact``, ``paper`` or ``official`` (both official-*)."""
    name = canonical_recipe(strategy, warn=False)
    return "official" if name.startswith("official") else name


def resets_optimizer(strategy: str) -> bool:
    """Whether the recipe starts a fresh optimizer (and, in a run, restarts the schedule)."""
    return canonical_recipe(strategy, warn=False) == RELEASED


FOREVER = "forever"
TOKEN_TENSORS = ("key_param_tokens", "value_param_tokens")


@dataclass(frozen=True)
class OldTokens:
    """What a growth kept: the first ``rows[name]`` rows of the grown model's parameter-token
    tensor ``name`` existed before it (same tensor, same rows, same width; not an inserted
    block), and the ``freeze`` asked for: None, a number of steps, or :data:`FOREVER`."""

    rows: dict[str, int]
    freeze: int | str | None = None


def old_tokens(model: nn.Module) -> OldTokens | None:
    """The :class:`OldTokens` :func:`grow` recorded on the model it returned (None otherwise)."""
    return getattr(model, "_old_tokens", None)


def freeze_request(value: object) -> int | str | None:
    """``freeze_old`` as None (no freeze), a positive step count or :data:`FOREVER`; accepts
    None/False/0, a count (an int or its digits), ``"forever"`` or True."""
    if value is None or value is False or value == 0 or value == "0":
        return None
    if value is True or value == FOREVER:
        return FOREVER
    count = size_request(value, 0)
    if not isinstance(count, int) or count < 0:
        raise GrowthError(f"freeze_old must be a number of steps or {FOREVER!r}, got {value!r}")
    return count


def _noise_level(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            math.isfinite(value) and value >= 0):
        raise GrowthError(f"noise_old must be a number >= 0 (a std relative to each tensor's "
                          f"rms), got {value!r}")
    return float(value)


def _record_old_tokens(model: nn.Module, growth: _Growth, freeze: int | str | None,
                       noise: float, generator: torch.Generator | None) -> None:
    """Record on the grown model which rows of its parameter tokens ``model`` had (and noise
    them): the rows a growth of tokens or identity blocks kept, for ``freeze_old``/``noise_old``
    (checked by :func:`freeze_request` and :func:`_noise_level` before the growth ran)."""
    old_params = dict(model.named_parameters())
    rows = {}
    for name, param in growth.model.named_parameters():
        old = old_params.get(growth.source.get(name, ""))
        if (name.rpartition(".")[2] in TOKEN_TENSORS and name not in growth.inserted
                and old is not None and old.shape[1:] == param.shape[1:]):
            rows[name] = min(old.shape[0], param.shape[0])
    if (freeze is not None or noise) and not rows:
        raise GrowthError("freeze_old and noise_old act on the parameter tokens a growth keeps; "
                          "this growth keeps none (no token tensor kept its width)")
    if noise:
        _noise_old_rows(growth.model, rows, noise, generator)
    growth.model._old_tokens = OldTokens(rows, freeze)


@torch.no_grad()
def _noise_old_rows(model: nn.Module, rows: dict[str, int], noise: float,
                    generator: torch.Generator | None) -> None:
    """Add N(0, (noise·rms)²) to the old rows of each tensor (rms over those rows). Out of place:
    with ``copy=False`` a tensor that did not grow is the input model's own."""
    params = dict(model.named_parameters())
    for name, n in rows.items():
        param = params[name]
        old = param.detach()[:n]
        rms = float(old.double().pow(2).mean().sqrt())
        if rms == 0:
            continue
        delta = torch.empty(old.shape).normal_(0.0, noise * rms, generator=generator)
        new = param.detach().clone()
        new[:n] += delta.to(new)
        param.data = new


# --------------------------------------------------------------------------------- optimizer
def _carry_optimizer(old_model: nn.Module, optimizer: torch.optim.Optimizer, growth: _Growth,
                     reset: bool, copy: bool = True, new_row_moments: str = "zero"
                     ) -> torch.optim.Optimizer:
    old_names = {id(p): n for n, p in old_model.named_parameters()}
    group_of: dict[str, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in old_names:
                raise GrowthError("the optimizer holds a parameter that is not in the model; "
                                  "pass the optimizer that trains this model")
            group_of[old_names[id(p)]] = g
    new_params = dict(growth.model.named_parameters())
    members: list[list[str]] = [[] for _ in optimizer.param_groups]
    for name in new_params:
        old = growth.source[name]
        if old in group_of:  # parameters the old optimizer did not train stay out of it
            members[group_of[old]].append(name)
    groups = []
    for group, names in zip(optimizer.param_groups, members, strict=True):
        hyper = {k: v for k, v in group.items() if k != "params"}
        if "param_names" in hyper:
            hyper["param_names"] = list(names)
        groups.append({**hyper, "params": [new_params[n] for n in names]})
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    new_opt = type(optimizer)(groups, **kwargs)
    if reset:
        return new_opt
    old_params = dict(old_model.named_parameters())
    for name, names_param in new_params.items():
        old_param = old_params.get(growth.source[name])
        if old_param is None or old_param not in optimizer.state:
            continue
        is_new = name in growth.inserted
        state = {}
        for key, value in optimizer.state[old_param].items():
            if torch.is_tensor(value) and value.shape == old_param.shape and growth.carry:
                state[key] = growth.carry(name, key, value)
            elif torch.is_tensor(value) and value.shape == old_param.shape:
                state[key] = (torch.zeros_like(names_param, dtype=value.dtype) if is_new
                              else _with_rows(value, names_param.shape[0], copy))
                if (new_row_moments == "mean" and key == "exp_avg_sq" and not is_new
                        and names_param.shape[0] > value.shape[0]):
                    state[key][value.shape[0]:] = value.mean(dim=0, keepdim=True)
            else:
                state[key] = value.clone() if torch.is_tensor(value) else value
        new_opt.state[names_param] = state
    return new_opt


# ------------------------------------------------------------------------------------ report
@torch.no_grad()
def max_logit_change(before: nn.Module, after: nn.Module, *, batch_size: int = 2,
                     seq_len: int = 32, seed: int = 0) -> tuple[float, float]:
    """(max |Δlogit|, max |logit|) of two language models on a fixed random probe batch."""
    config = before.config
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (batch_size, min(seq_len, config.max_seq_len)),
                        generator=generator)
    device = next(before.parameters()).device
    a = before(ids.to(device)).logits.double()
    b = after(ids.to(next(after.parameters()).device)).logits.double().to(device)
    return float((a - b).abs().max()), float(a.abs().max())
