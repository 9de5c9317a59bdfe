"""A family's sizes as model configs (pure data, nothing is trained): TokenFormers with
``factor``× the tokens per size, the Transformer++ matched to each (or by width, v4), the
product-key TokenFormers matched in FLOPs per token, and a size's :class:`.schedule.Stage`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ...errors import ConfigError
from ...models.baselines import TransformerConfig, matched_config
from ...models.config import TokenFormerConfig, flops_per_token
from .presets import (
    PK_FLOPS_TOLERANCE,
    PRODUCT_KEY_FAMILIES,
    THETA_FAMILIES,
    Preset,
    family_sizes,
    tpp_shape,
)
from .schedule import Stage


def arch(family: str) -> str:
    """The model architecture (``baselines.model_class`` / the trainer's ``arch``) of a family:
    a product-key family is a TokenFormer."""
    return "transformer++" if family == "transformer++" else "tokenformer"


def product_key_config(dense: TokenFormerConfig, ratio: int, name: str | None = None
                       ) -> TokenFormerConfig:
    """``dense`` with its FFN Pattention replaced by product keys over n = s² ≈ ``ratio`` × its
    FFN tokens (s = the nearest integer to √(ratio·n)) and the top-k whose analytic FFN FLOPs per
    token are closest to the dense FFN's (``config.projection_flops``: sub-key scores 2·s·d,
    min(k, s)² candidate sums, Θ over k, k value rows 2·k·d). Everything else is ``dense``'s, so
    the whole model's FLOPs per token match too."""
    target = dense.projection_flops()[1]
    s = round(math.sqrt(ratio * dense.ffn_tokens))
    base = dataclasses.replace(dense, ffn_keys="product", ffn_tokens=s * s, ffn_scale=None,
                               name=name or f"{dense.name}-pk{ratio}")

    def ffn(k: int) -> float:
        return dataclasses.replace(base, ffn_product_k=k).projection_flops()[1]

    lo, hi = 1, s * s  # ffn(k) increases with k: the smallest k with ffn(k) >= target
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if ffn(mid) < target else (lo, mid)
    k = min((lo, max(lo - 1, 1)), key=lambda c: (abs(ffn(c) - target), c))
    if abs(ffn(k) / target - 1) > PK_FLOPS_TOLERANCE:
        raise ConfigError(f"frontier: no top-k of {s * s} product keys matches the dense FFN's "
                          f"{target:.0f} FLOPs/token within {PK_FLOPS_TOLERANCE:.0%}")
    return dataclasses.replace(base, ffn_product_k=k)


def size_tokens(preset: Preset, size: str) -> tuple[int, int, int]:
    """(qkv, proj, ffn) tokens of ``size``: ``base_tokens`` × factor^(k−1) for Sk (S0: ÷ factor)."""
    k = int(size[1:])
    if k < 1:
        return tuple(n // preset.factor ** (1 - k)  # type: ignore[return-value]
                     for n in preset.base_tokens)
    return tuple(n * preset.factor ** (k - 1) for n in preset.base_tokens)  # type: ignore


def model_configs(preset: Preset, family: str, vocab_size: int) -> dict[str, Any]:
    """Every size of ``family`` (:func:`family_sizes`), by name: TokenFormers with ``factor``×
    the tokens per size (``norm`` of :data:`THETA_FAMILIES` for those families), the
    Transformer++ matched to each in non-embedding parameters (MLP width), and the product-key
    TokenFormers matched to each in FLOPs per token (:func:`product_key_config`)."""
    out: dict[str, Any] = {}
    for name in family_sizes(preset, family):
        q, p, f = size_tokens(preset, name)
        tf = TokenFormerConfig(vocab_size=vocab_size, hidden_size=preset.hidden_size,
                               num_layers=preset.num_layers, num_heads=preset.num_heads,
                               qkv_tokens=q, proj_tokens=p, ffn_tokens=f,
                               max_seq_len=preset.seq_len, eos_token_id=None,
                               norm=THETA_FAMILIES.get(family, "l2_norm_gelu"),
                               name=f"{family}-{name}" if family in THETA_FAMILIES
                               else f"tokenformer-{name}")
        if family in PRODUCT_KEY_FAMILIES:
            out[name] = product_key_config(tf, PRODUCT_KEY_FAMILIES[family], f"{family}-{name}")
        elif family == "transformer++" and preset.tpp_widths is not None:
            d, heads, mlp = tpp_shape(preset, name)
            out[name] = TransformerConfig(
                arch=family, vocab_size=vocab_size, hidden_size=d, num_layers=preset.num_layers,
                num_heads=heads, intermediate_size=mlp, max_seq_len=preset.seq_len,
                eos_token_id=None, name=f"{family}-{name}")
            out[name].validate()
        elif family == "transformer++":
            out[name] = matched_config(tf, family, name=f"{family}-{name}")
        else:
            out[name] = tf
    return out


def sized_stage(preset: Preset, size: str, config: Any, start: int) -> Stage:
    per_token = flops_per_token(config, preset.seq_len, training=True)["total"]
    return Stage(size, config, start, per_token * preset.tokens_per_step)
