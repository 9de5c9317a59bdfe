"""New rows: the K and V of a grown Pattention under each built-in recipe (the functions the
table of :mod:`tokenformer.ops.growth.recipes` names), and the tokens and weights of an
inserted block. The math of each construction is in :mod:`tokenformer.ops.growth`'s docstring.

A recipe's token function has the signature of :data:`TokensFn`: ``(old, new, generator,
copy) -> (K, V)``, ``old`` the trained Pattention, ``new`` the grown one (its ``num_tokens``,
``key_init_std``, ``value_init_std`` and ``norm`` are what it reads), both results with
``new.num_tokens`` rows, the old rows first (``copy=False``: they may share ``old``'s storage
when nothing grows)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...nn.pattention import Pattention, resolve_top_k
from ...nn.theta import theta_variant

TokensFn = Callable[[Pattention, Pattention, torch.Generator | None, bool],
                    tuple[torch.Tensor, torch.Tensor]]


def randn_rows(rows: int, like: torch.Tensor, std: float, generator: torch.Generator | None
               ) -> torch.Tensor:
    """N(0, std²) rows as wide as ``like``, float32 on the CPU (callers convert with .to)."""
    return torch.empty(rows, like.shape[1]).normal_(0.0, std, generator=generator)


def fill_normal(t: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """Fill ``t`` with N(0, std²) in place, drawn from the CPU ``generator`` on any device."""
    if t.device.type == "cpu":
        t.normal_(0.0, std, generator=generator)
    else:  # the generator is a CPU one
        t.copy_(randn_rows(t.shape[0], t, std, generator))


def with_rows(old: torch.Tensor, rows: int, copy: bool = True, zero: bool = True
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


def _appended(old: Pattention, new: Pattention, generator: torch.Generator | None, copy: bool,
              draw_keys: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Old rows, then new ones: keys N(0, key_init_std²) if ``draw_keys`` else zero, values
    N(0, value_init_std²) (keys drawn first)."""
    keys, values = old.key_param_tokens.detach(), old.value_param_tokens.detach()
    n_old, n_new = keys.shape[0], new.num_tokens
    keys = with_rows(keys, n_new, copy, zero=not draw_keys)
    values = with_rows(values, n_new, copy, zero=False)
    if n_new > n_old:  # fill the rows with_rows left uninitialised
        if draw_keys:
            fill_normal(keys[n_old:], new.key_init_std, generator)
        fill_normal(values[n_old:], new.value_init_std, generator)
    return keys, values


def zero_key_tokens(old: Pattention, new: Pattention, generator: torch.Generator | None,
                    copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``paper``: new keys zero, new values drawn with the value init."""
    return _appended(old, new, generator, copy, draw_keys=False)


def exact_tokens(old: Pattention, new: Pattention, generator: torch.Generator | None,
                 copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``exact``: zero keys (:func:`zero_key_tokens`), or for a Θ whose ``exact_growth`` is
    ``"duplicate"`` (softmax) every old token repeated r times with its value split into r
    zero-sum parts."""
    keys, values = old.key_param_tokens.detach(), old.value_param_tokens.detach()
    n_old, n_new = keys.shape[0], new.num_tokens
    if theta_variant(old.norm).exact_growth == "duplicate" and n_new > n_old:
        r = n_new // n_old  # duplicate each token r times; split its value into r zero-sum parts
        noise = randn_rows(n_new, values, new.value_init_std, generator).view(r, n_old, -1)
        noise = (noise - noise.mean(dim=0, keepdim=True)).to(values)
        return keys.repeat(r, 1), (values.unsqueeze(0) + noise).reshape(n_new, -1)
    return zero_key_tokens(old, new, generator, copy)


def random_tokens(old: Pattention, new: Pattention, generator: torch.Generator | None,
                  copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``official-*``: new keys and values drawn with the model's init (the released code)."""
    return _appended(old, new, generator, copy, draw_keys=True)


def new_block_tokens(new: Pattention, like: Pattention, branch_output: bool,
                     generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for a Pattention of an inserted block; ``branch_output``: make its output zero."""
    n = new.num_tokens
    ref_k, ref_v = like.key_param_tokens, like.value_param_tokens
    if not branch_output:
        return (randn_rows(n, ref_k, new.key_init_std, generator).to(ref_k),
                randn_rows(n, ref_v, new.value_init_std, generator).to(ref_v))
    k = resolve_top_k(new.top_k, n)
    if k is not None and k < n:
        # Top-k keeps each row's k largest |Θ|: it may keep one member of a pair and drop the
        # other (equal |Θ|, a tie), so cancelling pairs are not exact. Zero values are, for
        # any selection; the values get a gradient on step 1 (Θ ≠ 0), the keys from step 2.
        return (randn_rows(n, ref_k, new.key_init_std, generator).to(ref_k),
                torch.zeros(n, ref_v.shape[1], dtype=ref_v.dtype))
    # Tokens come in groups sharing one key: pairs with values u, -u, plus, if n is odd, one triple
    # with values centred to sum to zero (rescaled to keep the value init's variance). Equal keys
    # give equal Θ weights, so every group's contribution cancels for every input.
    group = torch.arange(n) // 2
    if n % 2 and n > 1:
        group[-1] = group[-2]
    keys = randn_rows(int(group[-1]) + 1, ref_k, new.key_init_std, generator)[group]
    half = randn_rows(n // 2, ref_v, new.value_init_std, generator)
    values = torch.stack((half, -half), dim=1).reshape(-1, half.shape[1])
    if n % 2 and n > 1:
        triple = randn_rows(3, ref_v, new.value_init_std, generator)
        values = torch.cat((values[:-2], (triple - triple.mean(dim=0)) * math.sqrt(1.5)))
    elif n == 1:  # a lone token can only give zero output with a zero value
        values = torch.zeros(1, ref_v.shape[1])
    return keys.to(ref_k), values.to(ref_v)


def init_linear_block(block: nn.Module, config: Any, identity: bool,
                      generator: torch.Generator | None) -> None:
    """A Transformer baseline's inserted block: Linear weights drawn with the model's init, biases
    zero; with ``identity`` its two branch outputs (attention.proj, mlp.down) are zero, so the
    block is the identity (their gradients are not zero: they train from step 1)."""
    with torch.no_grad():
        for name, module in block.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            branch = name in ("attention.proj", "mlp.down")
            if branch and identity:
                module.weight.zero_()
            else:
                std = config.value_init_std if branch else config.init_std
                fill_normal(module.weight, std, generator)
            if module.bias is not None:
                module.bias.zero_()
