"""The config a growth produces, computed without touching a tensor: :func:`plan_growth` checks
every request, so a plan can be refused before any work (``tokenformer grow``, ``info --grow``,
``--grow-at`` before the first step)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from ...errors import GrowthError
from ...models.baselines import TransformerConfig
from ...models.config import TokenFormerConfig
from ...nn.pattention import KINDS, default_scale, resolve_top_k
from ...nn.theta import theta_variant
from ..cloning import product_key_refusal, widened_config
from .options import GrowthOptions, refuse_unsupported
from .recipes import DUPLICATE, HOW, RECIPES, canonical_recipe, widen_names
from .sizes import layer_plan, resolve_size, width_factor


def plan_growth(config: Any, options: GrowthOptions | None = None, /,
                **request: Any) -> Any:
    """The config :func:`~tokenformer.ops.growth.grow` would produce for ``options`` (or
    :class:`GrowthOptions`' fields as keywords), computed without touching a tensor: every
    request (sizes, width multiples, heads, recipe, how, positions) is checked here, so a plan
    can be refused before any work. The old-token options change no config: grow checks them."""
    opts, unknown = GrowthOptions.of(options, request)
    refuse_unsupported(unknown)
    if getattr(config, "fused_projections", False):
        raise GrowthError("a Transformer baseline with fused_projections cannot grow: growth "
                          "works on separate Q/K/V and gate/up Linears; train it with "
                          "fused_projections false (the same function and FLOPs) to grow it")
    qkv, proj, ffn, layers, hidden, heads = (opts.qkv, opts.proj, opts.ffn, opts.layers,
                                             opts.hidden, opts.heads)
    how, width_noise, positions = opts.how, opts.width_noise, opts.positions
    recipe = RECIPES[canonical_recipe(opts.recipe)]  # GrowthOptions.of resolved an old name
    if how not in HOW:
        raise GrowthError(f"unknown depth growth how={how!r}; choose "
                          + " or ".join(f"{name} ({what})" for name, what in HOW.items()))
    if isinstance(width_noise, bool) or not isinstance(width_noise, (int, float)) \
            or not 0 <= width_noise < math.inf:
        raise GrowthError(f"width_noise must be a number >= 0 (std relative to each tensor's "
                          f"RMS), got {width_noise!r}")
    baseline = isinstance(config, TransformerConfig)
    product = getattr(config, "ffn_keys", "dense") == "product"
    if opts.widen != DUPLICATE:
        return _widened_mlp_config(config, opts, baseline)
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
            layer_plan(config.num_layers, new_layers, positions)
        if product and new_layers > config.num_layers and recipe.identity_blocks:
            raise GrowthError("an identity block needs a branch that is zero for every input, "
                              "which a product-key FFN's top-k cannot give; use how=stack or "
                              "recipe=official-init")
    if baseline:
        return dataclasses.replace(config, num_layers=new_layers)
    sizes = {kind: resolve_size(spec, getattr(config, f"{kind}_tokens"), f"{kind} tokens")
             for kind, spec in zip(KINDS, (qkv, proj, ffn), strict=True)}
    refuse_product_ffn(config, sizes["ffn"], "grow")
    return _grown_config(config, sizes, new_layers, recipe.exact)


def _widened_mlp_config(config: Any, opts: GrowthOptions, baseline: bool) -> Any:
    """The config of a baseline's MLP widened by ``widen=`` (zero or net2net, any width):
    ffn= alone, the MLP's new unit count."""
    names = widen_names()
    if opts.widen not in names:
        raise GrowthError(f"unknown MLP widening widen={opts.widen!r}; choose one of "
                          + ", ".join(f"{name} ({what})" for name, what in names.items()))
    if not baseline:
        raise GrowthError(f"widen={opts.widen} widens a Transformer baseline's MLP; a "
                          f"TokenFormer's FFN grows by its tokens (ffn=N, with a recipe)")
    refusal = widening_refusal(opts)
    if refusal is not None:
        raise GrowthError(refusal)
    old = config.intermediate_size
    width = resolve_size(opts.ffn, old, "ffn", adds="MLP units")
    if width == old:
        raise GrowthError(f"ffn: the MLP already has {old} units; a widening adds units: give "
                          f"more than {old} (e.g. {2 * old}, or 2x)")
    return dataclasses.replace(config, intermediate_size=width)


def as_key(key: str, value: object = None) -> str:
    """An option as ``grow()``'s keywords and ``--grow-at`` write it: ``ffn=64``; without a
    value, the key. (``tokenformer grow`` writes its flags instead: :func:`widening_refusal`.)"""
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return key if value is None else f"{key}={value}"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GrowthOptions)}


def widening_refusal(opts: GrowthOptions, spell: Callable[..., str] = as_key) -> str | None:
    """Why ``opts`` cannot be the MLP widening its ``widen`` names (zero, net2net, a registered
    one: ``duplicate`` is none), None if it can: a widening is the MLP's new width (``ffn``)
    alone. In the words of ``spell(key, value=None)``, how the caller's user wrote each option
    (:func:`as_key`; ``tokenformer grow``'s flags, checked before it loads the model)."""
    if opts.widen == DUPLICATE:
        return None
    widen = spell("widen", opts.widen)
    if opts.ffn is None:
        return f"{widen} widens the MLP to the width {spell('ffn')} gives: give it (e.g. " \
               f"{spell('ffn', '2x')})"
    others = [key for key in opts.planned() if key not in ("ffn", "widen", "recipe")
              and getattr(opts, key) != _DEFAULTS[key]]
    if "width_noise" in others:
        noise, duplicate = spell("width_noise"), spell("widen", DUPLICATE)
        return (f"{spell('width_noise', opts.width_noise)}: {noise} is the symmetry-breaking "
                f"noise of a widening by duplication ({duplicate}, or {spell('hidden')}); {widen}"
                f" makes its new units its own way and takes none: leave {noise} out, or widen "
                f"by duplication")
    if others:
        return (f"{widen} widens the MLP alone: "
                f"{', '.join(spell(key, getattr(opts, key)) for key in others)} "
                f"{'makes' if len(others) == 1 else 'make'} another growth; run it before or "
                f"after this one")
    return None


def refuse_product_ffn(config: Any, ffn_tokens: int, what: str) -> None:
    """Token surgery here is for Pattentions: a product-key FFN changes n by its sub-keys
    (:meth:`tokenformer.nn.product_keys.ProductKeyPattention.grown`)."""
    if getattr(config, "ffn_keys", "dense") == "product" and ffn_tokens != config.ffn_tokens:
        raise GrowthError(f"cannot {what} the ffn tokens of a product-key FFN here: its n = s² "
                          f"changes by sub-keys (ProductKeyPattention.grown, docs/sparse.md)")


def _grown_config(config: Any, sizes: dict[str, int], num_layers: int, exact: bool) -> Any:
    """The grown model's config: new counts; Θ's factor held (exact) or following n (others)."""
    changes: dict[str, object] = {"num_layers": num_layers}
    for kind, n_new in sizes.items():
        n_old = getattr(config, f"{kind}_tokens")
        if n_new == n_old:
            continue
        changes[f"{kind}_tokens"] = n_new
        if not exact:
            changes[f"{kind}_scale"] = None  # Θ's factor follows the new n
            continue
        duplicate = theta_variant(config.norm).exact_growth == "duplicate"
        if duplicate and n_new % n_old:
            raise GrowthError(
                f"exact growth with Θ={config.norm} needs a whole multiple of {kind} tokens "
                f"({n_old} → {n_new} is not): a new token with a zero key would take a share of "
                f"the normalisation (softmax: exp(x·k) > 0 for every finite key); the exact "
                f"construction duplicates every old token instead")
        scale = getattr(config, f"{kind}_scale")
        changes[f"{kind}_scale"] = scale if scale is not None else default_scale(config.norm,
                                                                                 n_old)
        top_k = getattr(config, f"{kind}_top_k", None)
        if top_k is not None:
            # Top-k held like the factor: the new tokens' Θ is 0 (duplicated: each old token is
            # r tokens, each with 1/r of its Θ), so the same k (r·k) largest |Θ| give the same
            # output, while a fraction of the new n would keep more old tokens than before.
            k = resolve_top_k(top_k, n_old)
            changes[f"{kind}_top_k"] = k * n_new // n_old if duplicate else k
    return dataclasses.replace(config, **changes)
