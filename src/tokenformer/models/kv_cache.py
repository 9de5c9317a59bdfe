"""The key/value caches of the LM's attention: :class:`KVCache` (appends; the default) and
:class:`StaticKVCache` (fixed capacity, written at tensor positions: what a compiled decoding
step needs), and the two questions the model asks of any cache (:func:`is_static`,
:func:`cache_capacity`), transformers' included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import TokenFormerError


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
    ``capacity`` positions with a mask of the valid ones
    (:func:`tokenformer.models.lm.static_mask`, built once per forward by
    :meth:`tokenformer.models.lm.TokenFormerLM.body`). Zeros, not uninitialised memory: a masked
    key still multiplies its value by a weight of 0, and 0 · NaN would poison the row.
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
                torch._dynamo.mark_static_address(t, guard=False)

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
