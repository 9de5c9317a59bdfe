"""Generation: :class:`GenerateMixin` gives :class:`tokenformer.models.lm.TokenFormerLM` (and
the baselines, its subclasses) ``model.generate(...)``, greedy or sampled, over a dynamic cache
or a static one whose decoding step can be compiled
(:class:`tokenformer.models.kv_cache.StaticKVCache`).

The mixin only calls the model (``self(...)``) and reads ``self.config``; it never imports the
model's module (which imports this one).
"""

from __future__ import annotations

import functools
import math
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, TokenFormerError
from ..nn.pattention import top_k_tokens as _top_k_tokens
from .kv_cache import StaticKVCache


def positions_from_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """Position ids of the last ``length`` tokens of a [B, S] ``attention_mask``: real tokens
    count from 0, so left padding is invisible (padding positions get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]


class GenerateMixin:
    """``generate`` for a causal LM module with a ``config`` (``vocab_size``, ``max_seq_len``,
    the cache's ``num_layers``/``num_heads``/``head_dim``) and ``word_embeddings``, called as
    ``self(input_ids, attention_mask=, position_ids=, past_key_values=, use_cache=,
    cache_position=, logits_to_keep=)``."""

    config: Any

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
        ``past_key_values``: a cache
        (:class:`tokenformer.models.kv_cache.KVCache`) already holding the first
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
        max_new_tokens = _whole_number("max_new_tokens", max_new_tokens)
        if max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if do_sample and not (math.isfinite(temperature) and temperature > 0):
            raise ConfigError(f"temperature must be a finite number > 0 when sampling, got "
                              f"{temperature}")
        if top_k is not None and _whole_number("top_k", top_k) <= 0:
            raise ConfigError(f"top_k must be a positive integer, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ConfigError(f"input_ids must be [batch, prompt length] with at least one "
                              f"prompt token, got shape {tuple(input_ids.shape)}")
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


def _static_cache(model: nn.Module, batch_size: int, capacity: int) -> StaticKVCache:
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


def _decode_step(model: nn.Module, token: torch.Tensor, mask: torch.Tensor | None,
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


def _whole_number(name: str, value: Any) -> int:
    """``value`` as an int (ints, numpy and 0-d integer tensors pass; 2.5 or "3" do not)."""
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be a whole number, got {value!r}") from None


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
