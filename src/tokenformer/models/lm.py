"""The TokenFormer language model, exactly as the official GPT-NeoX code computes it.

Read top to bottom: rotary embedding → attention (Q, K, V and the output projection are
Pattentions, over an optional KV cache) → block (pre-norm, non-parametric LayerNorm, FFN = one
Pattention) → the LM (word embeddings, blocks, parametric final LayerNorm, output tied to the
embeddings, loss). Beside it: the caches (:mod:`tokenformer.models.kv_cache`), generation
(:mod:`tokenformer.models.generation`, the ``generate`` mixin), saving and loading
(:mod:`tokenformer.models.persistence`) and the checks of what is loaded
(:mod:`tokenformer.models.checks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, TokenFormerError
from ..nn.grouped import StackedWeights, grouped_attend
from ..nn.pattention import Pattention, key_init_std
from ..nn.product_keys import ProductKeyPattention
from .config import TokenFormerConfig
from .generation import GenerateMixin
from .kv_cache import KVCache, cache_capacity, is_static
from .persistence import load_directory, load_official, load_pretrained, save_directory


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
        self.qkv_weights = StackedWeights()  # the one-GEMM Q/K/V's weights, kept for inference

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K and V of ``x`` [B, T, d], each [B, T, d]."""
        qkv = (self.query, self.key, self.value)
        q, k, v = (grouped_attend(x, qkv, self.qkv_weights) if self.grouped_qkv
                   else (p(x) for p in qkv))
        return q, k, v

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None, cache: Any | None,
                cache_position: torch.Tensor | None = None) -> torch.Tensor:
        """``cache_position`` [T] (a static cache only): where this call's positions are written;
        ``attention_mask`` is then the full [B, 1, T, capacity] mask that the body built."""
        B, T, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = self.project_qkv(x)
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


class TokenFormerLM(GenerateMixin, nn.Module):
    """TokenFormer language model (official architecture, spec §2).

    ``model(input_ids, labels=input_ids)`` returns logits over the padded vocabulary and the mean
    next-token cross-entropy (labels are shifted inside, ``-100`` is ignored), as in Hugging Face.
    ``model.generate(...)`` comes from :class:`tokenformer.models.generation.GenerateMixin`.
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
        ``cache_position`` [T]: with a static cache
        (:class:`~tokenformer.models.kv_cache.StaticKVCache`, transformers' ``StaticCache``), the
        cache slots of this call's tokens; by default the next free ones.
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

    # ------------------------------------------------------------------ files (persistence.py)
    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` and ``model.safetensors`` (each atomically) into ``directory``."""
        return save_directory(self, directory)

    @classmethod
    def load(cls, directory: str | Path, map_location: str | torch.device = "cpu", *,
             verify: bool = True) -> TokenFormerLM:
        """Load a directory written by :meth:`save`, checked first
        (:func:`tokenformer.models.persistence.load_directory`)."""
        return load_directory(cls, directory, map_location, verify=verify)

    @classmethod
    def from_official(cls, path: str | Path, *, dtype: torch.dtype = torch.float32,
                      **kwargs: Any) -> TokenFormerLM:
        """Load a released checkpoint as a TokenFormerLM, strictly, into ``dtype``
        (:func:`tokenformer.models.persistence.load_official`)."""
        return load_official(TokenFormerLM, path, dtype=dtype, **kwargs)

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> TokenFormerLM:
        """Load our directory format, or fall back to the official formats."""
        return load_pretrained(cls, path, **kwargs)
