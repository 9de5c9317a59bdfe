"""TokenFormer as a vLLM model: the core model's own modules, vLLM's attention and paged cache.

The model is the core :class:`~tokenformer.models.lm.TokenFormerLM` (or a Transformer baseline,
``config.arch``) held as ``model``, so its weights are named exactly as in a Hugging Face folder
(``model.<core name>``, :mod:`tokenformer.hf.modeling`) and load by name. Everything but
token–token attention runs the project's own code: the embedding, each block's forward
(:class:`~tokenformer.models.lm.Block`: pre-norm, residuals, the FFN Pattention), the Q/K/V and
output Pattentions (Θ by :mod:`tokenformer.nn`, the C++ kernel where it applies), rotary
(:class:`~tokenformer.models.lm.RotaryEmbedding`), the final norm and the tied head. Each block's
attention is replaced by :class:`PagedAttention`, which keeps the block's Q/K/V/proj modules
under their names and hands the rotated heads to vLLM's ``Attention`` (its paged KV cache and
continuous batching).

vLLM runs the model on a flat batch: ``input_ids`` and ``positions`` are [N] (every sequence's
new tokens back to back) and hidden states [N, d]; the blocks' forward takes that shape as it is.

Head sizes: an attention backend may run only some head sizes (vLLM's CPU backend: 32, 64, 80,
…; not 16). A head size it refuses is padded with zero dimensions to the next one it runs:
zeros add nothing to q·k, the softmax scale stays 1/√head_dim, and the zero value dimensions are
dropped from the output, so the result is exact at the cost of a larger cache.

Tensor parallelism (``tensor_parallel_size`` W > 1): every Pattention is split by parameter
token (:class:`~tokenformer.nn.sharded.ShardedPattention`, two all-reduces per layer) and the
heads by rank (H/W heads each, the cache split likewise), then the heads' outputs are gathered
for the output Pattention. The embedding, norms and head are replicated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.selector import get_attn_backend

from ..errors import CheckpointError, ConfigError
from ..models.baselines import model_class
from ..models.lm import RotaryEmbedding, TokenFormerLM
from ..nn.pattention import BLOCK_PATTENTIONS, Pattention
from ..nn.sharded import ShardedPattention
from .checks import PREFIX, check_servable


def backend_head_size(head_dim: int, cache_dtype: str) -> int:
    """``head_dim``, or the smallest larger head size the selected attention backend runs."""
    backend = get_attn_backend(head_dim, torch.get_default_dtype(), cache_dtype)
    if backend.supports_head_size(head_dim):
        return head_dim
    larger = [size for size in backend.get_supported_head_sizes() if size > head_dim]
    if not larger:
        raise ConfigError(f"head size {head_dim} is larger than any that vLLM's "
                          f"{backend.get_name()} attention runs "
                          f"({', '.join(map(str, backend.get_supported_head_sizes()))})")
    return min(larger)


class PagedAttention(nn.Module):
    """A block's attention with token–token attention in vLLM: the block's own ``query``,
    ``key``, ``value`` and ``proj`` modules (Pattentions, sharded ones, or a baseline's Linears),
    rotary by the core's tables, then vLLM's ``Attention`` over this rank's heads."""

    def __init__(self, core: nn.Module, head_dim: int, num_heads: int, *, cache_config: Any,
                 prefix: str, rank: int = 0, world_size: int = 1) -> None:
        super().__init__()
        self.query, self.key, self.value, self.proj = core.query, core.key, core.value, core.proj
        self.head_dim = head_dim
        self.num_heads = num_heads // world_size  # this rank's heads
        width = self.num_heads * head_dim
        self.columns = slice(rank * width, (rank + 1) * width)
        self.world_size = world_size
        cache_dtype = cache_config.cache_dtype if cache_config is not None else "auto"
        self.head_size = backend_head_size(head_dim, cache_dtype)
        self.attn = Attention(self.num_heads, self.head_size, head_dim ** -0.5,
                              cache_config=cache_config, prefix=prefix)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, position_ids: torch.Tensor,
                attention_mask: Any = None, cache: Any = None,
                cache_position: Any = None) -> torch.Tensor:
        """``x`` [N, d], ``position_ids`` [1, N]; the core block's call signature (its mask and
        cache arguments are vLLM's business here and arrive as None)."""
        N = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [N, d] → this rank's [1, H, N, hd]
            t = t[:, self.columns].reshape(N, self.num_heads, self.head_dim)
            return t.transpose(0, 1)[None]

        def flat(t: torch.Tensor) -> torch.Tensor:  # [1, H, N, hd] → [N, H · head_size]
            t = t[0].transpose(0, 1)
            if self.head_size != self.head_dim:
                t = F.pad(t, (0, self.head_size - self.head_dim))
            return t.reshape(N, self.num_heads * self.head_size)

        q = flat(rotary(heads(self.query(x)), position_ids))
        k = flat(rotary(heads(self.key(x)), position_ids))
        v = flat(heads(self.value(x)))
        out = self.attn(q, k, v).view(N, self.num_heads, self.head_size)[..., :self.head_dim]
        out = out.reshape(N, self.num_heads * self.head_dim)
        if self.world_size > 1:
            out = tensor_model_parallel_all_gather(out.contiguous(), dim=-1)
        return self.proj(out)


def _shard_block(block: nn.Module, rank: int, world_size: int) -> None:
    """Replace each of ``block``'s Pattentions by this rank's share of its tokens (what cannot
    be split was refused by :func:`~tokenformer.serving.checks.check_servable`)."""
    for name in BLOCK_PATTENTIONS:
        parent_name, _, leaf = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        full: Pattention = getattr(parent, leaf)
        setattr(parent, leaf, ShardedPattention(
            full.in_features, full.out_features, full.num_tokens, full.norm, scale=full.scale,
            eps=full.eps, rank=rank, world_size=world_size,
            all_reduce=tensor_model_parallel_all_reduce))


class TokenFormerForCausalLM(nn.Module):
    """vLLM's model for a Hugging Face folder of architecture ``TokenFormerForCausalLM``."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config.to_core()
        world_size = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        check_servable(config, world_size)
        self.config = config
        self.folder = vllm_config.model_config.model
        # Built without memory (every tensor comes from the checkpoint), sharded, then placed.
        with torch.device("meta"):
            core: TokenFormerLM = model_class(getattr(config, "arch", "tokenformer"))(config)
            if world_size > 1:
                for block in core.layers:
                    _shard_block(block, rank, world_size)
        device = vllm_config.device_config.device
        core.to_empty(device=device)
        for p in core.parameters():
            p.requires_grad_(False)
        # rotary tables are computed, not loaded (non-persistent buffers): recompute them here
        core.rotary = RotaryEmbedding(config.rotary_dim, config.max_seq_len,
                                      config.rotary_base).to(device)
        for i, block in enumerate(core.layers):
            block.attention = PagedAttention(
                block.attention, config.head_dim, config.num_heads,
                cache_config=vllm_config.cache_config,
                prefix=f"{prefix}{'.' if prefix else ''}model.layers.{i}.attention.attn",
                rank=rank, world_size=world_size)
        self.model = core

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.word_embeddings(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        position_ids = positions[None]  # [1, N]: the rotary tables' [batch, seq] layout
        for block in self.model.layers:
            x = block(x, self.model.rotary, position_ids, None, None)
        return self.model.final_norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits of the tokenizer's vocabulary: the embedding's padding rows are never
        candidates (our ``generate`` masks them the same way)."""
        head = self.model.word_embeddings if self.model.lm_head is None else self.model.lm_head
        return F.linear(hidden_states, head.weight[: self.config.vocab_size])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy each checkpoint tensor into the parameter of its name (this rank's rows of a
        sharded Pattention); a name the model lacks, a shape that differs or a parameter the
        checkpoint lacks is one CheckpointError."""
        params = {PREFIX + name: p for name, p in self.model.named_parameters()}
        shards = {PREFIX + name: m for name, m in self.model.named_modules()
                  if isinstance(m, ShardedPattention)}
        loaded: set[str] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"{self.folder}: unexpected weight {name!r}; the model "
                                      f"its config.json describes has no such parameter")
            owner = shards.get(name.rpartition(".")[0])
            if owner is not None:
                tensor = owner.shard(tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                raise CheckpointError(f"{self.folder}: weight {name!r} has shape "
                                      f"{tuple(tensor.shape)}, the model expects "
                                      f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(params.keys() - loaded)
        if missing:
            raise CheckpointError(f"{self.folder}: missing weight {missing[0]!r}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1
                                     else ""))
        return loaded
