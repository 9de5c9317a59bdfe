"""Progressive scaling: grow a TokenFormer by appending parameter tokens (width) or blocks (depth).

A Pattention ``Y = Θ(X·Kᵀ)·V`` with n key/value tokens grows to n + m tokens by appending m rows
to K and V. Three recipes for the new rows (spec §5):

``paper``
    New keys zero, new values with the model's value init, Θ's factor follows the new n (the
    ``*_scale`` fields reset to None). For ``l2_norm_gelu`` with old scores a ∈ Rⁿ and new scores
    b = 0, Θ on the old tokens becomes GELU(a/‖a‖·√(n+m)): every old pre-activation is multiplied
    by √((n+m)/n) and, GELU not being homogeneous, the function changes.
``official``
    What the released code does: new keys N(0, init_std²), new values N(0, value_init_std²) with
    the *grown* config's value init, factor follows the new n. Changes the function.
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import GrowthError
from ..nn.pattention import KINDS, Pattention, default_scale, kind_names

STRATEGIES = ("exact", "paper", "official")
# The Pattentions whose output is added to the residual stream: zero them for an identity block.
BRANCH_OUTPUTS = kind_names("proj") + kind_names("ffn")

_CANNOT_GROW = {
    "hidden size": "the hidden size is the width of every token (the residual stream, the "
                   "embeddings and every key and value parameter token), so adding parameter "
                   "tokens cannot change it",
    "number of heads": "heads split the hidden size inside the token-token attention, which has "
                       "no parameter tokens, so adding tokens cannot change how many there are",
    "vocabulary": "the vocabulary is the embedding table fixed by the tokenizer, not a "
                  "Pattention, so adding parameter tokens cannot change it",
}
_ALIASES = {"hidden": "hidden size", "hidden_size": "hidden size", "d_model": "hidden size",
            "width": "hidden size", "heads": "number of heads", "num_heads": "number of heads",
            "vocab": "vocabulary", "vocab_size": "vocabulary"}
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


def grow(model: nn.Module, *, qkv: int | str | None = None, proj: int | str | None = None,
         ffn: int | str | None = None, layers: int | str | None = None, strategy: str = "exact",
         positions: list[int] | None = None, generator: torch.Generator | None = None,
         copy: bool = True, progress: bool = False, **unsupported: object) -> nn.Module:
    """Return a larger copy of ``model`` (same class); ``model`` itself is left untouched.

    ``qkv``/``proj``/``ffn``: new token count of those Pattentions, absolute (``1536``) or a
    multiplier (``"2x"``); ``layers``: new total block count, new blocks at ``positions`` (indices
    in the grown model, default spread evenly). ``strategy`` is ``exact`` (function preserved),
    ``paper`` or ``official``; the module docstring gives the math. ``generator`` (a CPU
    ``torch.Generator``) seeds the new random rows. ``copy=False`` shares every tensor that does
    not grow with ``model`` instead of copying it (half the memory traffic; training the grown
    model then changes ``model``, so only use it when ``model`` is discarded). Raises
    :class:`GrowthError` for shrinking, malformed sizes, or requests to grow what tokens cannot
    grow (hidden size, heads, vocabulary).
    """
    return _grow(model, qkv=qkv, proj=proj, ffn=ffn, layers=layers, strategy=strategy,
                 positions=positions, generator=generator, copy=copy, progress=progress,
                 unsupported=unsupported).model


NEW_ROW_MOMENTS: tuple[str, ...] = ("zero", "mean")


def grow_with_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                        reset_optimizer: bool = False, new_row_moments: str = "zero",
                        **grow_kwargs: object) -> tuple[nn.Module, torch.optim.Optimizer]:
    """:func:`grow` plus an optimizer of the same class over the grown model's parameters.

    Param groups and their hyper-parameters are kept, each new parameter joining the group of the
    old parameter of the same name (so weight-decay groups survive). Per-parameter state tensors
    shaped like the parameter (AdamW's ``exp_avg``/``exp_avg_sq``) keep their old rows, new rows
    are zero; scalar state (``step``) is kept. A block inserted by depth growth gets zero moments
    and the step count of the block before it. ``reset_optimizer=True`` gives fresh state (what
    the released code does). With ``copy=False`` state that does not grow is shared with
    ``optimizer``, which must then be discarded.

    ``new_row_moments="mean"`` starts the second moment (``exp_avg_sq``) of every new row at the
    mean over the old rows of the same tensor (per column) instead of zero; the first moment
    stays zero. With a zero second moment Adam's first steps on a new row are ≈ ±(0.45–1.1)·lr
    per element whatever the gradient's size (β₂ = 0.95); with the old rows' scale they are as
    small as the gradient is relative to what the old rows see (docs/results.md, verdict 5).
    """
    if new_row_moments not in NEW_ROW_MOMENTS:
        raise GrowthError(f"new_row_moments must be one of {', '.join(NEW_ROW_MOMENTS)}, "
                          f"got {new_row_moments!r}")
    growth = _grow(model, **grow_kwargs)  # type: ignore[arg-type]
    copy = bool(grow_kwargs.get("copy", True))
    return growth.model, _carry_optimizer(model, optimizer, growth, reset_optimizer, copy,
                                          new_row_moments)


def _grow(model: nn.Module, *, qkv=None, proj=None, ffn=None, layers=None, strategy="exact",
          positions=None, generator=None, copy=True, progress=False, unsupported=None
          ) -> _Growth:
    refuse_unsupported(unsupported or {})
    config = model.config
    new_config = plan_growth(config, qkv=qkv, proj=proj, ffn=ffn, layers=layers,
                             strategy=strategy, positions=positions)
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

    return rebuild(model, new_config, tokens_for, source_of, copy=copy, progress=progress,
                   desc="grow")


def rebuild(model: nn.Module, new_config: Any, tokens_for: Any, source_of: Any = None, *,
            copy: bool = True, progress: bool = False, desc: str = "resize") -> _Growth:
    """The one place token surgery happens (growth and :mod:`tokenformer.ops.pruning`): a new model
    of ``type(model)`` built for ``new_config`` whose every Pattention gets the K and V that
    ``tokens_for(name, new_module, old_module)`` returns, every other tensor copied (or shared,
    ``copy=False``) from the old tensor ``source_of(name) -> (old name, is_new)`` names
    (default: the same name). Per-module settings not in the config (``impl``) carry over."""
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
        if old.shape != meta.shape:
            raise GrowthError(f"cannot resize {name}: shape {tuple(old.shape)} would have to "
                              f"become {tuple(meta.shape)}, which token surgery does not do")
        state[name] = old.detach().clone() if copy else old.detach()
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
                strategy: str = "exact", positions: list[int] | None = None) -> Any:
    """The config :func:`grow` would produce, computed without touching a tensor: every request
    (sizes, strategy, positions) is checked here, so a plan can be refused before any work."""
    if strategy not in STRATEGIES:
        raise GrowthError(f"unknown growth strategy {strategy!r}; choose one of "
                          f"{', '.join(STRATEGIES)}")
    sizes = {kind: resolve_size(spec, getattr(config, f"{kind}_tokens"), f"{kind} tokens")
             for kind, spec in zip(KINDS, (qkv, proj, ffn), strict=True)}
    refuse_product_ffn(config, sizes["ffn"], "grow")
    new_layers = resolve_size(layers, config.num_layers, "layers")
    _layer_plan(config.num_layers, new_layers, positions)
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
    return dataclasses.replace(config, **changes)


def refuse_unsupported(requests: dict[str, object]) -> None:
    """Raise GrowthError for any growth request other than qkv/proj/ffn/layers, explaining why."""
    for key in requests:
        if key in _ALIASES:
            what = _ALIASES[key]
            raise GrowthError(f"cannot grow the {what}: {_CANNOT_GROW[what]}")
        raise GrowthError(f"grow() got an unknown argument {key!r}; it grows qkv, proj, ffn "
                          f"and layers")


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
    plan, old = [], 0
    for index in range(new_layers):
        if index in positions:
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
            if torch.is_tensor(value) and value.shape == old_param.shape:
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
