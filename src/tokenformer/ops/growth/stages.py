"""The entry points, :func:`grow` and :func:`grow_with_optimizer`, and the stages a growth request
runs as: width by duplication, then stacking, then tokens and identity blocks (the last drawn by
the request's recipe, :mod:`tokenformer.ops.growth.recipes`); or a baseline's MLP widening
alone (``widen=``, :mod:`tokenformer.ops.growth.widening`). Every stage is a
:class:`~tokenformer.ops.growth.surgery.Growth` (most of them one
:func:`~tokenformer.ops.growth.surgery.rebuild`) and carries the optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ...errors import GrowthError
from ...models.baselines import TransformerConfig
from ...models.checks import non_finite
from ...nn.pattention import Pattention, kind_names
from ..cloning import carry_moment, widen_tensor, widened_config, width_axes
from .old_tokens import record_old_tokens
from .optimizer import NEW_ROW_MOMENTS, carry_optimizer
from .options import GrowthOptions, freeze_request, noise_level, refuse_unsupported
from .plan import plan_growth
from .recipes import DUPLICATE, recipe_named, resets_optimizer
from .sizes import layer_plan, resolve_size, width_factor
from .surgery import Growth, layers_prefix, rebuild
from .tokens import init_linear_block, new_block_tokens
from .widening import mlp_widening

# The Pattentions whose output is added to the residual stream: zero them for an identity block.
BRANCH_OUTPUTS = kind_names("proj") + kind_names("ffn")


def grow(model: nn.Module, options: GrowthOptions | None = None, *,
         generator: torch.Generator | None = None, copy: bool = True, progress: bool = False,
         **request: Any) -> nn.Module:
    """Return a larger copy of ``model`` (same class); ``model`` itself is left untouched.

    The request is ``options`` (a :class:`GrowthOptions`) and/or its fields as keywords:
    ``qkv``/``proj``/``ffn``: new token count of those Pattentions, absolute (``1536``) or a
    multiplier (``"2x"``); for a Transformer baseline ``ffn`` is its MLP width, a whole multiple.
    ``hidden``: a whole multiple of the hidden size (``"2x"``, or ``1536`` from 768), by exact
    duplication; ``heads`` follows it (r·H, head size kept). ``width_noise``: std, relative to
    each tensor's RMS, of the zero-sum noise that breaks the copies' symmetry
    (:mod:`tokenformer.ops.cloning`; still exact). ``layers``: new total block count;
    ``how="identity"`` inserts identity blocks at ``positions`` (indices in the grown model,
    default spread evenly), ``how="stack"`` repeats the trained stack in order (block i = old
    block i mod L). ``recipe`` draws the new tokens and inserted blocks, a name in
    :data:`~tokenformer.ops.growth.recipes.RECIPES`: ``exact`` (function preserved),
    ``paper``, ``official-init`` (alias ``official``) or ``official-released``; the package
    docstring gives the math (``strategy``, its old name, still works, with a deprecation
    warning). ``noise_old`` (a std relative to each tensor's rms) perturbs the
    old tokens; ``freeze_old`` (steps or ``"forever"``) is recorded for the trainer
    (:class:`OldTokens`); both only for a growth of tokens or identity blocks.

    ``generator`` (a CPU ``torch.Generator``) seeds every random draw. ``copy=False`` shares
    every tensor that does not grow with ``model`` instead of copying it (half the memory
    traffic; training the grown model then changes ``model``, so only use it when ``model`` is
    discarded). Raises :class:`GrowthError` for shrinking, malformed or impossible sizes
    (non-whole width multiples, heads that change the head size), or requests to grow what
    cannot grow.
    """
    return grow_with_optimizer(model, None, options, generator=generator, copy=copy,
                               progress=progress, **request)[0]


def grow_with_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                        options: GrowthOptions | None = None, *,
                        reset_optimizer: bool = False, new_row_moments: str = "zero",
                        generator: torch.Generator | None = None, copy: bool = True,
                        progress: bool = False, **request: Any
                        ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """:func:`grow` plus an optimizer of the same class over the grown model's parameters.

    Param groups and their hyper-parameters are kept, each new parameter joining the group of the
    old parameter of the same name (so weight-decay groups survive). Per-parameter state tensors
    shaped like the parameter (AdamW's ``exp_avg``/``exp_avg_sq``) keep their old rows, new rows
    are zero; scalar state (``step``) is kept. A block inserted by depth growth gets zero moments
    and the step count of the block before it; a stacked block (``how="stack"``) a copy of its
    source block's state. Width growth tiles every moment like the gradient it averages and
    scales it as that gradient scales: ``exp_avg`` by r⁻ᶜ, ``exp_avg_sq`` by r⁻²ᶜ, c the number of
    copied (not split) axes (:mod:`tokenformer.ops.cloning`). ``reset_optimizer=True`` gives
    fresh state (what the released code does; a recipe that resets the optimizer,
    ``official-released``, always does). With ``copy=False`` state that does not grow is shared
    with ``optimizer``, which must then be discarded. ``optimizer=None``: no optimizer (what
    :func:`grow` passes); None is returned.

    ``new_row_moments="mean"`` starts the second moment (``exp_avg_sq``) of every new row at the
    mean over the old rows of the same tensor (per column) instead of zero; the first moment
    stays zero. With a zero second moment Adam's first steps on a new row are ≈ ±(0.45–1.1)·lr
    per element whatever the gradient's size (β₂ = 0.95); with the old rows' scale they are as
    small as the gradient is relative to what the old rows see (docs/results.md, verdict 5).
    """
    if new_row_moments not in NEW_ROW_MOMENTS:
        raise GrowthError(f"new_row_moments must be one of {', '.join(NEW_ROW_MOMENTS)}, "
                          f"got {new_row_moments!r}")
    opts, unsupported = GrowthOptions.of(options, request)
    freeze = freeze_request(opts.freeze_old)  # checked before any work
    noise = noise_level(opts.noise_old)
    if (freeze is not None or noise) and (opts.hidden is not None or opts.how == "stack"):
        raise GrowthError("freeze_old and noise_old act on the parameter tokens a growth of tokens "
                          "or identity blocks keeps; not with hidden= or how=stack")
    copy = bool(copy)
    reset = reset_optimizer or resets_optimizer(str(opts.recipe))
    refuse_unsupported(unsupported)
    if opts.widen != DUPLICATE and new_row_moments != "zero" and optimizer is not None \
            and not reset:
        raise GrowthError(f"widen={opts.widen} starts the new units' AdamW moments at zero; "
                          f"new_row_moments {new_row_moments!r} (growth_optimizer carry-mean) is "
                          f"for growths of tokens, width and depth")
    grown = model
    stages = list(_stages(model, opts, generator, copy, progress))
    for old, growth in stages:
        if optimizer is not None:
            optimizer = carry_optimizer(old, optimizer, growth, reset, copy, new_row_moments)
        grown, copy = growth.model, False  # later stages own their input: nothing to protect
    if len(stages) == 1:  # tokens and identity blocks: which rows are old is well defined
        record_old_tokens(*stages[0], freeze, noise, generator)
    _refuse_non_finite(grown, opts.width_noise, noise)
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


def _stages(model: nn.Module, opts: GrowthOptions, generator: torch.Generator | None,
            copy: bool, progress: bool) -> Iterator[tuple[nn.Module, Growth]]:
    """The stages of one growth request, each (its input model, its growth): width, then stacking,
    then tokens and identity blocks (a same-size copy when nothing is asked). Everything is
    checked (:func:`plan_growth`) before the first stage runs."""
    config = model.config
    planned = plan_growth(config, opts)
    if opts.widen != DUPLICATE:  # a baseline's MLP alone, to any width (ops.growth.widening)
        yield model, mlp_widening(model, planned.intermediate_size, opts.widen, generator)
        return
    baseline = isinstance(config, TransformerConfig)
    r = width_factor(opts.hidden, config.hidden_size, "hidden")
    r_ffn = width_factor(opts.ffn, config.intermediate_size, "ffn") if baseline else 1
    current, stages = model, 0
    if r > 1 or r_ffn > 1:
        growth = _widen(current, r, opts.heads, r_ffn, opts.width_noise, generator, copy,
                        progress)
        yield current, growth
        current, copy, stages = growth.model, False, stages + 1
    new_layers = resolve_size(opts.layers, config.num_layers, "layers")
    if opts.how == "stack" and new_layers > config.num_layers:
        growth = _stack(current, new_layers, copy, progress)
        yield current, growth
        current, copy, stages = growth.model, False, stages + 1
    tokens = not baseline and any(spec is not None for spec in (opts.qkv, opts.proj, opts.ffn))
    if tokens or (opts.how == "identity" and new_layers > config.num_layers) or not stages:
        stage = GrowthOptions(
            qkv=None if baseline else opts.qkv, proj=None if baseline else opts.proj,
            ffn=None if baseline else opts.ffn,
            layers=opts.layers if opts.how == "identity" else None, recipe=opts.recipe,
            positions=opts.positions)
        yield current, _tokens_and_blocks(current, stage, generator, copy, progress)


def _tokens_and_blocks(model: nn.Module, opts: GrowthOptions, generator: torch.Generator | None,
                       copy: bool, progress: bool) -> Growth:
    """Tokens and identity blocks (the stage :func:`grow` has always had), drawn by the
    recipe: kept Pattentions get its :attr:`~.recipes.Recipe.tokens`, inserted blocks
    are the identity if it has ``identity_blocks``."""
    config = model.config
    new_config = plan_growth(config, opts)
    recipe = recipe_named(opts.recipe)
    old_layers, new_layers = config.num_layers, new_config.num_layers
    layer_source = layer_plan(old_layers, new_layers, opts.positions)

    prefix = layers_prefix(model)
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
            branch = recipe.identity_blocks and name.endswith(BRANCH_OUTPUTS)
            return new_block_tokens(module, old, branch, generator)
        return recipe.tokens(old, module, generator, copy)

    growth = rebuild(model, new_config, tokens_for, source_of, copy=copy, progress=progress,
                     desc="grow")
    if isinstance(config, TransformerConfig):  # Linear blocks: no Pattention to hand to tokens_for
        for index in sorted(inserted_layers):
            init_linear_block(growth.model.layers[index], new_config, recipe.identity_blocks,
                              generator)
    return growth


def _widen(model: nn.Module, r: int, heads: int | None, r_ffn: int, noise: float,
           generator: torch.Generator | None, copy: bool, progress: bool) -> Growth:
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


def _stack(model: nn.Module, new_layers: int, copy: bool, progress: bool) -> Growth:
    """G_stack: block i of the grown model is a copy of old block i mod L (the copies beyond the
    first L count as inserted); the optimizer state of each copy is a copy of its source's."""
    old_layers = model.config.num_layers
    prefix = layers_prefix(model)

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
