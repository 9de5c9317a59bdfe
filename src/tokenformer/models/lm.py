"""The TokenFormer language model, exactly as the official GPT-NeoX code computes it.

Read top to bottom: rotary embedding → KV cache → attention (Q, K, V and the output projection
are Pattentions) → block (pre-norm, non-parametric LayerNorm, FFN = one Pattention) → the LM
(word embeddings, blocks, parametric final LayerNorm, output tied to the embeddings) → generation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from ..errors import CheckpointError, ConfigError, TokenFormerError
from ..io.checkpoint import verify_checkpoint
from ..io.files import atomic_write, atomic_write_text, save_safetensors
from ..io.paths import has_regular_file
from ..nn.grouped import grouped_attend
from ..nn.pattention import Pattention, key_init_std
from ..nn.pattention import top_k_tokens as _top_k_tokens
from ..nn.product_keys import ProductKeyPattention
from .config import TokenFormerConfig
from .memory import check_memory
from .official import ours_to_official, read_official

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


# ---------------------------------------------------------------------------------------- rotary
class RotaryEmbedding(nn.Module):
    """GPT-NeoX rotary embedding ("rotate half": dim i pairs with dim i + r/2) on the first r dims.

    cos/sin are computed in float32 for positions 0..max_seq_len-1 and follow the model's dtype
    (the official code casts them to the parameter dtype too).
    """

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        self.dim = dim
        self.max_seq_len = max_seq_len
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` [B, H, T, head_dim] at ``position_ids`` [B, T]; dims past r pass through."""
        if self.dim == 0:
            return x
        cos = self.cos_cached[position_ids].unsqueeze(1).to(x.dtype)
        sin = self.sin_cached[position_ids].unsqueeze(1).to(x.dtype)
        rot, rest = x[..., : self.dim], x[..., self.dim:]
        half = self.dim // 2
        rotated_half = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated_half * sin, rest), dim=-1)


# -------------------------------------------------------------------------------------- KV cache
class KVCache:
    """Pre-allocated key/value cache: appending a token writes in place, never copies the past.

    Same ``update``/``get_seq_length`` interface as a Hugging Face ``Cache``, so the HF wrapper can
    hand the model a transformers cache instead.
    """

    def __init__(self, num_layers: int, max_len: int) -> None:
        self.max_len = max_len
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.lengths[layer_idx]
        end = start + key_states.shape[2]
        if end > self.max_len:
            raise TokenFormerError(f"KV cache holds {self.max_len} positions; {end} requested")
        if self.keys[layer_idx] is None:
            B, H, _, hd = key_states.shape
            shape = (B, H, self.max_len, hd)
            self.keys[layer_idx] = key_states.new_empty(shape)
            self.values[layer_idx] = value_states.new_empty(shape)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self.lengths[layer_idx] = end
        return keys[:, :, :end], values[:, :, :end]


class StaticKVCache:
    """A key/value cache of fixed capacity whose write position is a tensor: what a compiled,
    graph-captured decoding step needs (gpt-fast's recipe; transformers' ``StaticCache``).

    Every layer's keys and values are allocated once, zero-filled, as [B, H, capacity, head_dim];
    ``update`` writes the new positions in place (``index_copy_`` at ``cache_position``, a tensor)
    and returns the whole buffers, so the shapes never change from one step to the next and no
    Python integer that grows with the sequence enters the step. The attention then runs over all
    ``capacity`` positions with a mask of the valid ones (:func:`_mask`, built once per forward
    by :meth:`TokenFormerLM.body`). Zeros, not uninitialised memory: a masked key still multiplies
    its value by a weight of 0, and 0 · NaN would poison the row.
    """

    is_compileable = True  # what transformers' caches say; the model's static branch keys on it

    def __init__(self, num_layers: int, batch_size: int, num_heads: int, head_dim: int,
                 capacity: int, *, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch_size, num_heads, capacity, head_dim)
        self.max_cache_len = capacity
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Positions written, per layer: a tensor updated in place (a compiled step reads it back)
        self.lengths = torch.zeros(num_layers, dtype=torch.long, device=device)
        if not torch.compiler.is_compiling():
            # Fixed addresses: CUDA graphs then write into these buffers instead of copies
            for t in (*self.keys, *self.values, self.lengths):
                torch._dynamo.mark_static_address(t)

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, capacity: int) -> StaticKVCache:
        """A cache for ``model``'s layers, heads, dtype and device."""
        config, weight = model.config, model.word_embeddings.weight
        return cls(config.num_layers, batch_size, config.num_heads, config.head_dim, capacity,
                   dtype=weight.dtype, device=weight.device)

    def get_seq_length(self, layer_idx: int = 0) -> torch.Tensor:
        return self.lengths[layer_idx]

    def reset(self) -> None:
        """Empty, in place (the buffers keep their addresses)."""
        for t in (*self.keys, *self.values, self.lengths):
            t.zero_()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        position = (cache_kwargs or {}).get("cache_position")
        if position is None:
            position = (torch.arange(key_states.shape[2], device=key_states.device)
                        + self.lengths[layer_idx])
        self.keys[layer_idx].index_copy_(2, position, key_states)
        self.values[layer_idx].index_copy_(2, position, value_states)
        self.lengths[layer_idx] = position[-1] + 1
        return self.keys[layer_idx], self.values[layer_idx]


def cache_capacity(cache: Any) -> int:
    """The positions a static cache holds: ours, or a transformers ``StaticCache`` (whose
    accessor changed name between releases; every layer has ``max_cache_len``)."""
    if hasattr(cache, "max_cache_len") and not hasattr(cache, "layers"):
        return int(cache.max_cache_len)
    return max(int(layer.max_cache_len) for layer in cache.layers)


def is_static(cache: Any | None) -> bool:
    """A cache that hands back full-length buffers (ours or transformers'): see StaticKVCache."""
    return cache is not None and bool(getattr(cache, "is_compileable", False))


# ------------------------------------------------------------------------------------ attention
def _pattention(config: TokenFormerConfig, kind: str, d_out: int | None = None) -> Pattention:
    d = config.hidden_size
    return Pattention(d, d_out or d, getattr(config, f"{kind}_tokens"), config.norm,
                      scale=config.theta_scale(kind), eps=config.theta_eps,
                      key_init_std=key_init_std(config.norm, d, config.init_std),
                      value_init_std=config.value_init_std,
                      top_k=getattr(config, f"{kind}_top_k", None))


def _product_ffn(config: TokenFormerConfig) -> nn.Module:
    d = config.hidden_size
    return ProductKeyPattention(d, d, config.ffn_tokens, config.ffn_product_k, config.norm,
                                scale=config.ffn_scale, eps=config.theta_eps,
                                key_init_std=key_init_std(config.norm, d, config.init_std),
                                value_init_std=config.value_init_std)


class Attention(nn.Module):
    """Causal multi-head attention whose Q, K, V and output projections are Pattentions."""

    grouped_qkv = False  # one GEMM for Q, K and V (nn.grouped.set_grouped_qkv); opt-in

    def __init__(self, config: TokenFormerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # Vision configs set is_causal = False (patches attend both ways); LM configs lack it.
        self.is_causal: bool = getattr(config, "is_causal", True)
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.query = _pattention(config, "qkv")
        self.key = _pattention(config, "qkv")
        self.value = _pattention(config, "qkv")
        self.proj = _pattention(config, "proj")

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any | None,
                cache_position: torch.Tensor | None = None) -> torch.Tensor:
        """``cache_position`` [T] (a static cache only): where this call's positions are written;
        ``attention_mask`` is then the full [B, 1, T, capacity] mask that the body built."""
        B, T, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

        qkv = (self.query, self.key, self.value)
        q, k, v = grouped_attend(x, qkv) if self.grouped_qkv else (p(x) for p in qkv)
        q, k, v = rotary(heads(q), position_ids), rotary(heads(k), position_ids), heads(v)
        if cache_position is not None:  # a static cache: the whole buffers, masked
            k, v = cache.update(k, v, self.layer_idx, {"cache_position": cache_position})
            out = (_decode_attention(q, k, v, attention_mask) if T == 1 else
                   F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask))
            return self.proj(out.transpose(1, 2).reshape(B, T, d))
        past = 0
        if cache is not None:
            past = cache.get_seq_length(self.layer_idx)
            k, v = cache.update(k, v, self.layer_idx)
        if attention_mask is None and past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.is_causal)
        elif attention_mask is None and T == 1:
            out = _decode_attention(q, k, v)
        else:
            mask = _mask(attention_mask, B, torch.arange(past, past + T, device=x.device),
                         past + T)
            out = (_decode_attention(q, k, v, mask) if T == 1 else
                   F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
        return self.proj(out.transpose(1, 2).reshape(B, T, d))


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query row over the cache. In bf16/fp16 on the CPU, SDPA's reduced-
    precision kernel is 2–4x slower for a single row than float32 SDPA on upcast copies (at 1000
    cached positions, 1.2 vs 0.3 ms per layer; docs/performance.md, "Inference"), and float32 is
    the more accurate of the two; longer inputs (prefill) are faster in bf16 and stay there."""
    if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                              attn_mask=mask).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _mask(attention_mask: torch.Tensor | None, B: int, q_pos: torch.Tensor,
          S: int) -> torch.Tensor:
    """Boolean [B, 1, T, S] mask of the keys at cache slots 0..S-1 that the queries at slots
    ``q_pos`` [T] see: causal, and keys marked 0 in ``attention_mask`` [B, <= S] hidden (slots
    past its end count as real: a static cache's not-yet-written positions, hidden by causality).

    A query row with nothing visible (a left-padding position) sees every key instead, so that
    SDPA returns finite values there; those positions are ignored downstream.
    """
    mask = (torch.arange(S, device=q_pos.device) <= q_pos[:, None]).expand(B, 1, -1, S)
    if attention_mask is not None:
        keys = attention_mask[:, :S].bool()
        if keys.shape[1] < S:
            keys = F.pad(keys, (0, S - keys.shape[1]), value=True)
        mask = mask & keys[:, None, None, :]
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return mask


def static_mask(attention_mask: torch.Tensor | None, B: int, cache_position: torch.Tensor,
                capacity: int) -> torch.Tensor:
    """The mask of a static cache's valid positions for the queries at ``cache_position``: from a
    [B, <= capacity] padding mask (or none) as :func:`_mask`, or transformers' own 4-D mask
    (boolean, or additive with 0 where visible) as given, with :func:`_mask`'s rule for rows that
    see nothing."""
    if attention_mask is None or attention_mask.dim() == 2:
        return _mask(attention_mask, B, cache_position, capacity)
    mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return mask | ~mask.any(dim=-1, keepdim=True)


def positions_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of the last ``length`` tokens of a [B, S] ``attention_mask``: real tokens
    count from 0, so left padding is invisible (padding positions get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


# ----------------------------------------------------------------------------------------- block
class LayerNorm(nn.Module):
    """LayerNorm whose weight and bias are each optional (official blocks have neither)."""

    def __init__(self, dim: int, eps: float, affine: str = "both") -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine in ("weight", "both") else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine in ("bias", "both") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


class Block(nn.Module):
    """Pre-norm block: x + Proj(Attn(LN(x))), then x + FFN(LN(x)) with FFN a single Pattention."""

    def __init__(self, config: TokenFormerConfig, layer_idx: int) -> None:
        super().__init__()
        eps, affine = config.layernorm_eps, config.block_norm
        self.input_layernorm = LayerNorm(config.hidden_size, eps, affine)
        self.attention = Attention(config, layer_idx)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, affine)
        self.mlp = (_pattention(config, "ffn") if getattr(config, "ffn_keys", "dense") == "dense"
                    else _product_ffn(config))

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any | None,
                cache_position: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x), rotary, position_ids, attention_mask, cache,
                               cache_position)
        return x + self.mlp(self.post_attention_layernorm(x))


# -------------------------------------------------------------------------------------------- LM
@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    past_key_values: Any | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


@dataclass
class BodyOutput:
    """What :meth:`TokenFormerLM.body` returns: the final-normed hidden state (what the head reads)
    and, when asked for, every block's input plus that final state (transformers' convention)."""

    last_hidden_state: torch.Tensor
    past_key_values: Any | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


def output_head(config: Any) -> nn.Linear | None:
    """None when the head is the embedding matrix (``tie_embeddings``, the official layout), else
    a bias-free [padded vocab, hidden] Linear with the embedding's init."""
    if getattr(config, "tie_embeddings", True):
        return None
    head = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
    nn.init.normal_(head.weight, std=config.init_std)
    return head


class TokenFormerLM(nn.Module):
    """TokenFormer language model (official architecture, spec §2).

    ``model(input_ids, labels=input_ids)`` returns logits over the padded vocabulary and the mean
    next-token cross-entropy (labels are shifted inside, ``-100`` is ignored), as in Hugging Face.
    """

    config_class: Any = TokenFormerConfig  # subclasses (the baselines) load their own config

    def __init__(self, config: TokenFormerConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.final_norm = LayerNorm(config.hidden_size, config.layernorm_eps, "both")
        self.lm_head = output_head(config)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.max_seq_len, config.rotary_base)
        nn.init.normal_(self.word_embeddings.weight, std=config.init_std)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool = False,
        *,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        cache_position: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """``logits_to_keep`` > 0: logits of the last that many positions only (Hugging Face's
        argument of the same name; generation needs one and saves the [T, vocab] projection).
        ``cache_position`` [T]: with a static cache (:class:`StaticKVCache`, transformers'
        ``StaticCache``), the cache slots of this call's tokens; by default the next free ones.
        ``attention_mask`` is then [B, <= capacity] (1 = a real token) or a ready 4-D mask."""
        if logits_to_keep > 0 and labels is not None:
            raise ConfigError("logits_to_keep needs every position's logits when labels "
                              "are given; pass one or the other")
        body = self.body(input_ids, attention_mask, position_ids, past_key_values, use_cache,
                         inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                         cache_position=cache_position)
        x = body.last_hidden_state
        if logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        head = self.word_embeddings if self.lm_head is None else self.lm_head
        logits = F.linear(x, head.weight)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutput(logits=logits, loss=loss, past_key_values=body.past_key_values,
                              hidden_states=body.hidden_states)

    def body(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any | None = None,
        use_cache: bool = False,
        *,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        cache_position: torch.Tensor | None = None,
    ) -> BodyOutput:
        """Everything but the output head: embeddings (or ``inputs_embeds`` [B, T, d]), the
        blocks, the final norm. ``output_hidden_states``: the L block inputs, then the final-normed
        last block output (L + 1 tensors, as transformers models return them)."""
        if inputs_embeds is None:
            if input_ids is None or input_ids.dim() != 2:
                raise TokenFormerError(f"input_ids must be [batch, seq], got "
                                       f"{'None' if input_ids is None else tuple(input_ids.shape)}")
            x = self.word_embeddings(input_ids)
        elif input_ids is not None or inputs_embeds.dim() != 3:
            raise TokenFormerError("give input_ids [batch, seq] or inputs_embeds [batch, seq, "
                                   "hidden], not both")
        else:
            x = inputs_embeds
        B, T = x.shape[:2]
        if use_cache and past_key_values is None:
            past_key_values = KVCache(self.config.num_layers, self.config.max_seq_len)
        if is_static(past_key_values):
            cache_position, attention_mask = self._static_positions(
                past_key_values, cache_position, attention_mask, B, T, x.device)
            if position_ids is None:
                position_ids = cache_position.expand(B, T)
        else:
            cache_position = None  # the dynamic caches append: their blocks need no slots
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            self._check_length(past + T)
            if position_ids is None:
                position_ids = torch.arange(past, past + T, device=x.device).expand(B, T)
        hidden: list[torch.Tensor] | None = [] if output_hidden_states else None
        for block in self.layers:
            if hidden is not None:
                hidden.append(x)
            x = block(x, self.rotary, position_ids, attention_mask, past_key_values,
                      cache_position)
        x = self.final_norm(x)
        if hidden is not None:
            hidden.append(x)
        return BodyOutput(last_hidden_state=x,
                          past_key_values=past_key_values if use_cache else None,
                          hidden_states=tuple(hidden) if hidden is not None else None)

    def _check_length(self, length: int) -> None:
        if length > self.config.max_seq_len:
            raise TokenFormerError(
                f"sequence of {length} tokens exceeds the model's context of "
                f"{self.config.max_seq_len} tokens (max_seq_len, the size of the rotary cache)")

    def _static_positions(self, cache: Any, cache_position: torch.Tensor | None,
                          attention_mask: torch.Tensor | None, B: int, T: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots this call writes in a static cache and the [B, 1, T, capacity] mask of what
        each query sees there (built once here, not in each of the L layers)."""
        capacity = cache_capacity(cache)
        if cache_position is None:
            cache_position = torch.arange(T, device=device) + cache.get_seq_length()
        if not torch.compiler.is_compiling():  # one sync, eager only: a compiled step trusts it
            end = int(cache_position[-1]) + 1
            self._check_length(end)
            if end > capacity:
                raise TokenFormerError(f"the static cache holds {capacity} positions; "
                                       f"{end} requested")
        return cache_position, static_mask(attention_mask, B, cache_position, capacity)

    # ------------------------------------------------------------------ sizes
    def num_parameters(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:  # the embedding table, and an untied head (as num_parameters counts)
            n -= self.word_embeddings.weight.numel()
            n -= self.lm_head.weight.numel() if self.lm_head is not None else 0
        return n

    def pattentions(self) -> dict[str, Pattention]:
        """Every Pattention by qualified name (what growth and inspection iterate over)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, Pattention)}

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (each atomically) into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        atomic_write(directory / WEIGHTS_NAME,
                     lambda tmp: save_safetensors(tensors, tmp, metadata={"format": "pt"}))
        atomic_write_text(directory / CONFIG_NAME, json.dumps(self.config.to_dict(), indent=2))
        return directory

    @classmethod
    def load(cls, directory: str | Path, map_location: str | torch.device = "cpu", *,
             verify: bool = True) -> TokenFormerLM:
        """Load a directory written by :meth:`save` (safetensors: no code is ever unpickled).

        The folder is first checked against its manifest
        (:func:`tokenformer.io.checkpoint.verify_checkpoint`; ``verify=False`` only for a caller
        that has just done so), and the model its config describes against the weights file's
        header and the memory available (:func:`check_buildable`) before any tensor is made."""
        directory = Path(directory)
        if not directory.exists():
            raise CheckpointError(f"checkpoint not found: {directory}")
        if verify:

            verify_checkpoint(directory)
        config_file, weights = directory / CONFIG_NAME, directory / WEIGHTS_NAME
        if not all([has_regular_file(f, folder=directory) for f in (config_file, weights)]):
            raise CheckpointError(f"{directory} is not a tokenformer model directory "
                                  f"(expected {CONFIG_NAME} and {WEIGHTS_NAME})")
        require_shape_keys(config_file, cls.config_class)
        config = cls.config_class.load(config_file)
        check_buildable(config, str(config_file), weights)
        try:
            state = safetensors.torch.load_file(str(weights), device=str(map_location))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{weights} is corrupt or truncated: {exc}") from None
        model = cls(config)
        load_state_dict_strict(model, state, source=str(weights))
        return model

    @classmethod
    def from_official(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                      **kwargs: Any) -> TokenFormerLM:
        """Load a released checkpoint (``pytorch_model.bin``, its folder, or a DeepSpeed file;
        ``num_heads``, ``rotary_pct``, ``max_seq_len``, ``norm``, ``config``: see
        :func:`tokenformer.models.official.read_official`).

        Loading is strict (a missing or unexpected key, or a wrong shape, names the key) and never
        unpickles code. Weights are converted to ``dtype`` (fp16 DeepSpeed weights become fp32).
        """
        config, state, official = read_official(path, **kwargs)
        check_weights(state, str(path))
        check_buildable(config, str(path))  # e.g. a seq_length of 10⁹ in config.json
        model = TokenFormerLM(config)
        # Checked under the official names: an error must name the key as it is in the user's file.
        check_state_dict(ours_to_official(model.state_dict(), config.num_layers), official,
                         str(path))
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        return model.to(dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> TokenFormerLM:
        """Load our directory format, or fall back to the official formats."""
        path = Path(path)
        if path.is_dir() and (path / WEIGHTS_NAME).is_file():
            return cls.load(path)
        return cls.from_official(path, **kwargs)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        past_key_values: Any | None = None,
        top_k_tokens: Any | None = None,
        cache_implementation: str = "dynamic",
        compile: bool = False,
    ) -> torch.Tensor:
        """Continue ``input_ids`` [B, T]; returns [B, T + generated].

        Greedy unless ``do_sample``; sampling applies ``temperature``, then ``top_k``, then
        ``top_p`` (nucleus). Rows that emit ``eos_token_id`` are padded with it until every row
        has finished. Generation stops early at the model's context length. Batched prompts of
        different lengths are left-padded with ``attention_mask`` marking the real tokens.
        ``past_key_values``: a cache (:class:`KVCache`) already holding the first
        ``get_seq_length()`` tokens of ``input_ids``; only the rest is run through the model.
        ``top_k_tokens``: sparse Pattention for this call only (each row reads its k largest-|Θ|
        value rows; a count or fraction for every kind, a dict or ``"ffn=0.25,qkv=64"``;
        :func:`tokenformer.nn.pattention.top_k_tokens`); None keeps the model's own setting.
        ``cache_implementation``: ``"dynamic"`` (the default: a cache that appends) or
        ``"static"`` (transformers' name: a :class:`StaticKVCache` of the prompt plus
        ``max_new_tokens`` positions, written in place, so that one decoding step serves every
        position). ``compile=True`` (static only) runs that step through ``torch.compile``
        with ``fullgraph=True``: on CUDA ``mode="reduce-overhead"``, which captures it as a CUDA
        graph replayed at every token (the launch-bound step of a small model then costs little
        more than its memory reads); elsewhere inductor's kernels without graphs. The first
        call compiles (seconds to minutes); later calls with the same batch size and total
        length reuse it, and the same cache buffers (kept with the model until a static call of
        other shapes replaces them or the model is freed). The tokens equal the dynamic cache's,
        up to floating-point ties.
        """
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ConfigError(f"unknown cache_implementation {cache_implementation!r}; choose "
                              f"one of {', '.join(CACHE_IMPLEMENTATIONS)}")
        static = cache_implementation == "static"
        if compile and not static:
            raise ConfigError("compile=True needs cache_implementation='static' (a compiled step "
                              "needs the fixed shapes of a static cache)")
        if static and (past_key_values is not None or not use_cache):
            raise ConfigError("cache_implementation='static' makes its own cache: pass neither "
                              "past_key_values nor use_cache=False with it")
        with _top_k_tokens(self, top_k_tokens):
            return self._generate(input_ids, max_new_tokens, do_sample=do_sample,
                                  temperature=temperature, top_k=top_k, top_p=top_p,
                                  eos_token_id=eos_token_id, attention_mask=attention_mask,
                                  use_cache=use_cache, generator=generator,
                                  past_key_values=past_key_values, static=static,
                                  compile=compile)

    def _generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, do_sample: bool,
                  temperature: float, top_k: int | None, top_p: float | None,
                  eos_token_id: int | None, attention_mask: torch.Tensor | None,
                  use_cache: bool, generator: torch.Generator | None,
                  past_key_values: Any | None, static: bool = False,
                  compile: bool = False) -> torch.Tensor:
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if do_sample and temperature <= 0:
            raise ConfigError(f"temperature must be > 0 when sampling, got {temperature}")
        if top_k is not None and top_k <= 0:
            raise ConfigError(f"top_k must be a positive integer, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        B, T = input_ids.shape
        if T > self.config.max_seq_len:
            raise TokenFormerError(f"prompt of {T} tokens exceeds the model's context of "
                                   f"{self.config.max_seq_len} tokens (rotary cache)")
        max_new_tokens = min(max_new_tokens, self.config.max_seq_len - T)
        vocab = self.config.vocab_size  # never sample the padding rows of the embedding
        if static:
            return self._generate_static(
                input_ids, max_new_tokens, attention_mask,
                functools.partial(_next_token, do_sample=do_sample, temperature=temperature,
                                  top_k=top_k, top_p=top_p, generator=generator),
                eos_token_id, compile)
        tokens, cache = input_ids, past_key_values if use_cache else None
        finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        step_input = input_ids
        if cache is not None:
            if cache.get_seq_length() >= T:
                raise TokenFormerError(f"the cache already holds {cache.get_seq_length()} "
                                       f"positions; input_ids must have more than that ({T})")
            step_input = input_ids[:, cache.get_seq_length():]
        for _ in range(max_new_tokens):
            position_ids = None
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask, step_input.shape[1])
            out = self(step_input, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=use_cache, logits_to_keep=1)
            logits = out.logits[:, -1, :vocab].float()
            next_token = _next_token(logits, do_sample=do_sample, temperature=temperature,
                                     top_k=top_k, top_p=top_p, generator=generator)
            if eos_token_id is not None:
                next_token, finished = _after_eos(next_token, finished, eos_token_id)
            tokens = torch.cat((tokens, next_token[:, None]), dim=1)
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask, attention_mask.new_ones(B, 1)), dim=1)
            if use_cache:
                cache, step_input = out.past_key_values, next_token[:, None]
            else:
                step_input = tokens
            if eos_token_id is not None and bool(finished.all()):
                break
        return tokens

    def _generate_static(self, input_ids: torch.Tensor, max_new_tokens: int,
                         attention_mask: torch.Tensor | None,
                         choose: Callable[[torch.Tensor], torch.Tensor],
                         eos_token_id: int | None, compile: bool) -> torch.Tensor:
        """generate's loop over a :class:`StaticKVCache`: the prompt runs eagerly (it fills the
        cache), then every token through the same step, compiled or not, whose inputs are all
        tensors of fixed shape: the token, its position ids, its cache slot. The output is
        preallocated and written in place, as the cache is."""
        B, T = input_ids.shape
        if max_new_tokens == 0:
            return input_ids
        capacity = T + max_new_tokens  # the last token is never fed back: one slot to spare
        cache = _static_cache(self, B, capacity) if max_new_tokens > 1 else None
        device = input_ids.device
        mask = None
        if attention_mask is not None:  # [B, capacity]: the prompt's padding, then real tokens
            mask = F.pad(attention_mask.bool(), (0, capacity - T), value=True)
        positions = (positions_from_mask(attention_mask, T) if attention_mask is not None
                     else torch.arange(T, device=device).expand(B, T))
        out = self(input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                   use_cache=cache is not None, cache_position=torch.arange(T, device=device),
                   logits_to_keep=1)
        logits = out.logits[:, -1, :self.config.vocab_size].float()
        step = _compiled_decode_step(device) if compile else _decode_step
        tokens = input_ids.new_empty(B, T + max_new_tokens)
        tokens[:, :T] = input_ids
        position_ids = positions[:, -1:] + 1  # [B, 1], advanced in place after each step
        slot = torch.tensor([T], device=device)  # [1]
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        for i in range(max_new_tokens):
            next_token = choose(logits)
            if eos_token_id is not None:
                next_token, finished = _after_eos(next_token, finished, eos_token_id)
            tokens[:, T + i] = next_token
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(finished.all())):
                return tokens[:, :T + i + 1]
            logits = step(self, next_token[:, None], mask, position_ids, cache, slot)
            position_ids += 1
            slot += 1
        return tokens


CACHE_IMPLEMENTATIONS = ("dynamic", "static")
# The static cache of each model's last static generation, reused (zeroed) by the next one of the
# same batch size, capacity, dtype and device: the buffers keep their addresses, so a captured
# CUDA graph replays instead of being recorded again (torch re-records when a static input moves,
# and gives graphs up after a limit of re-recordings). One generation at a time per model.
_STATIC_CACHES: weakref.WeakKeyDictionary[nn.Module, StaticKVCache] = (
    weakref.WeakKeyDictionary())


def _static_cache(model: TokenFormerLM, batch_size: int, capacity: int) -> StaticKVCache:
    weight = model.word_embeddings.weight
    cache = _STATIC_CACHES.get(model)
    if (cache is not None and cache.max_cache_len == capacity
            and len(cache.keys) == model.config.num_layers
            and cache.keys[0].shape == (batch_size, model.config.num_heads, capacity,
                                        model.config.head_dim)
            and cache.keys[0].dtype == weight.dtype and cache.keys[0].device == weight.device):
        cache.reset()
        return cache
    _STATIC_CACHES.pop(model, None)  # its memory is free before the new one is allocated
    cache = _STATIC_CACHES[model] = StaticKVCache.for_model(model, batch_size, capacity)
    return cache


def _decode_step(model: TokenFormerLM, token: torch.Tensor, mask: torch.Tensor | None,
                 position_ids: torch.Tensor, cache: StaticKVCache,
                 slot: torch.Tensor) -> torch.Tensor:
    """One token [B, 1] through the model over a static cache: its float32 logits over the
    vocabulary (not the embedding's padding rows). What ``compile=True`` compiles."""
    out = model(token, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                use_cache=True, cache_position=slot, logits_to_keep=1)
    return out.logits[:, -1, :model.config.vocab_size].float()


_COMPILED_STEPS: dict[str, Callable[..., torch.Tensor]] = {}


def _compiled_decode_step(device: torch.device) -> Callable[..., torch.Tensor]:
    """:func:`_decode_step` compiled once per device type and process (a model, batch size or
    capacity not seen before recompiles it: torch.compile's guards). ``fullgraph=True``: a graph
    break is an error, not a silent fallback; ``dynamic=False``: each shape gets its own static
    kernels (CUDA graphs want fixed shapes)."""
    kind = torch.device(device).type
    if kind not in _COMPILED_STEPS:
        mode = "reduce-overhead" if kind == "cuda" else None
        _COMPILED_STEPS[kind] = torch.compile(_decode_step, fullgraph=True, dynamic=False,
                                              mode=mode)
    step = _COMPILED_STEPS[kind]
    if kind != "cuda":
        return step

    def graph_step(*args: Any) -> torch.Tensor:
        # A new CUDA-graph iteration: the previous step's logits (already consumed) may be reused
        torch.compiler.cudagraph_mark_step_begin()
        return step(*args)
    return graph_step


def _next_token(logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int | None,
                top_p: float | None, generator: torch.Generator | None) -> torch.Tensor:
    return (_sample(logits, temperature, top_k, top_p, generator) if do_sample
            else logits.argmax(dim=-1))


def _after_eos(next_token: torch.Tensor, finished: torch.Tensor,
               eos_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that have finished emit ``eos_token_id`` again; a row that emits it finishes."""
    next_token = torch.where(finished, torch.full_like(next_token, eos_token_id), next_token)
    return next_token, finished | (next_token == eos_token_id)


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
            generator: torch.Generator | None) -> torch.Tensor:
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # keep the token crossing p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# Keys a model directory's config.json must name: every other field has a default, these set
# tensor shapes, and a default here would only surface later as a shape mismatch.
SHAPE_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads")


def require_shape_keys(config_file: Path, config_class: type) -> None:
    """Refuse a config.json that leaves a shape-setting field (one ``config_class`` has) to its
    default."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return  # the config loader reports an unreadable file in its own words
    missing = [k for k in SHAPE_KEYS if k in fields and isinstance(data, dict) and k not in data]
    if missing:
        raise CheckpointError(f"{config_file} does not name {', '.join(missing)}: not a complete "
                              f"model config (it sets the weights' shapes; no default is safe)")


def non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first tensor holding NaN or infinity; None when all are finite."""
    return next((name for name, t in tensors if not bool(torch.isfinite(t).all())), None)


def check_weights(state: dict[str, torch.Tensor], source: str) -> None:
    """Refuse weights a model cannot compute with: integer (or bool) tensors, NaN or infinity."""
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            raise CheckpointError(f"{source}: weight {key!r} is {str(tensor.dtype)[6:]}, not "
                                  f"floating point: not model weights")
    key = non_finite(state.items())
    if key is not None:
        raise CheckpointError(f"{source}: weight {key!r} holds NaN or infinite values: the "
                              f"checkpoint is corrupt (or saved from a diverged run)")


def check_tensors(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                  source: str) -> None:
    """The one check of tensors read from a file before they enter a model (base weights and
    adapters alike): keys and shapes (:func:`check_state_dict`), then dtype and finiteness
    (:func:`check_weights`)."""
    check_state_dict(expected, state, source)
    check_weights(state, source)


def load_state_dict_strict(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """``load_state_dict(strict=True)`` with one error sentence naming the offending key, after
    :func:`check_tensors`."""
    check_tensors(model.state_dict(), state, source)
    model.load_state_dict(state, strict=True)


def header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a safetensors file declares, from its header alone (no tensor is read;
    safetensors refuses a header its file is too short to hold)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{file} is corrupt or truncated: {exc}") from None


def check_buildable(config: Any, source: str, weights: Path | None = None) -> None:
    """Refuse, before any tensor is made, a model described by a config read from disk
    (``source``) that its weights file cannot fill or this machine cannot hold: the config's
    parameter count (computed, nothing allocated) against the values the file's header declares
    (a 4 KB file cannot hold a 10⁶-layer model), then grow's memory estimate (the model and the
    weights read into it: two fp32 copies) against the memory available now."""
    if weights is not None:
        params = config.num_parameters()
        held = sum(math.prod(shape) for shape in header_shapes(weights).values())
        if params > held:
            raise CheckpointError(f"{source} describes a model of {params:,} parameters but "
                                  f"{weights} holds {held:,} values: they do not belong "
                                  f"together")
    check_memory(config, 2, source, error=CheckpointError)


def check_state_dict(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor],
                     source: str) -> None:
    """Raise one CheckpointError naming the first missing, unexpected or wrongly shaped key."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing:
        raise CheckpointError(f"{source}: missing key {missing[0]!r}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected key {unexpected[0]!r}"
                              + (f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1
                                 else ""))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise CheckpointError(f"{source}: key {key!r} has shape {tuple(tensor.shape)}, "
                                  f"the model expects {tuple(expected[key].shape)}")
