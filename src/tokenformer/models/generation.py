"""Generation: :class:`GenerateMixin` gives :class:`tokenformer.models.lm.TokenFormerLM` (and
the baselines, its subclasses) ``model.generate(...)``, greedy or sampled, over a dynamic cache
or a static one whose decoding step can be compiled
(:class:`tokenformer.models.kv_cache.StaticKVCache`); the tokens are chosen on the device by
:mod:`tokenformer.models.sampling`.

The compiled step is gpt-fast's design: one function that feeds the last token through the model
over a static cache, chooses the next one (greedy or sampled, inside the graph), marks the rows
that emitted eos and writes the token into a preallocated buffer; every tensor it reads or writes
has a fixed shape and address (:class:`DecodeState`), so on CUDA it is captured once as a CUDA
graph and replayed at every token with no host sync. The cache's capacity comes in buckets
(:func:`static_capacity`), so a new prompt length inside a bucket replays the same graph.

The mixin only calls the model (``self(...)``) and reads ``self.config``; it never imports the
model's module (which imports this one).
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, TokenFormerError
from ..nn.pattention import top_k_tokens as _top_k_tokens
from .kv_cache import StaticKVCache
from .sampling import Sampling, choose_tokens

# Tokens generated between two reads of the rows' finished flags (with an eos_token_id). Each read
# makes the host wait for the device, so it happens once per this many tokens, not at every one:
# generation may run up to this many - 1 tokens past the one at which every row had finished, and
# the output is then cut back to that token (what a read at every token would return).
EOS_CHECK_INTERVAL = 8
# The static cache's capacity for a prompt plus its new tokens: the next power of two from this
# one, at most the model's context (static_capacity).
SMALLEST_CAPACITY = 64
# Graphs the compiled step may hold: torch._dynamo's recompile_limit while it runs (its default, 8,
# would fail the 9th: batch sizes × capacity buckets × sampling variants). Past it, the step's
# graphs are all dropped and compiled again as they are needed.
STEP_GRAPH_LIMIT = 64
# Decoding states (static caches and their buffers) kept per model: the most recently used ones.
KEPT_STATES = 4


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
        ``"static"`` (transformers' name: a :class:`StaticKVCache` holding the prompt plus
        ``max_new_tokens`` positions, rounded up to a capacity bucket (:func:`static_capacity`:
        64, 128, 256, ... up to the model's context), written in place, so that one decoding
        step serves every position and every prompt length of the bucket). ``compile=True``
        (static only) runs that step through ``torch.compile`` with ``fullgraph=True``: on CUDA
        ``mode="reduce-overhead"``, which captures it as a CUDA graph replayed at every token
        (the launch-bound step of a small model then costs little more than its memory reads);
        elsewhere inductor's kernels without graphs. One graph per batch size, capacity bucket
        and way of choosing (greedy; sampled; each top-k; with top-p); the first call of each
        compiles (seconds to minutes), later ones replay it, over the same buffers (the
        :data:`KEPT_STATES` most recent shapes stay with the model until it is freed). The
        tokens equal the dynamic cache's, up to floating-point ties.

        Sampling draws one seed from ``generator`` (torch's default generator on the device when
        None) and chooses on the device with noise derived from it
        (:mod:`tokenformer.models.sampling`): the same seed gives the same tokens on every path
        (dynamic or static cache, eager or compiled, any capacity bucket), up to floating-point
        differences in the logits. With ``eos_token_id`` the rows' finished flags are read every
        :data:`EOS_CHECK_INTERVAL` tokens (a host sync), and the output cut back to where every
        row had finished.
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
        if top_k is not None and (top_k := _whole_number("top_k", top_k)) <= 0:
            raise ConfigError(f"top_k must be a positive integer, got {top_k}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ConfigError(f"input_ids must be [batch, prompt length] with at least one "
                              f"prompt token, got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if T > self.config.max_seq_len:
            raise TokenFormerError(f"prompt of {T} tokens exceeds the model's context of "
                                   f"{self.config.max_seq_len} tokens (rotary cache)")
        max_new_tokens = min(max_new_tokens, self.config.max_seq_len - T)
        if max_new_tokens == 0:
            return input_ids
        # never sample the padding rows of the embedding (choose sees vocab_size logits)
        sampling = Sampling.draw(temperature=temperature, top_k=top_k, top_p=top_p,
                                 vocab=self.config.vocab_size, generator=generator,
                                 device=input_ids.device) if do_sample else None
        if static:
            return self._generate_static(input_ids, max_new_tokens, attention_mask, sampling,
                                         eos_token_id, compile)
        return self._generate_dynamic(input_ids, max_new_tokens, attention_mask, sampling,
                                      eos_token_id, past_key_values if use_cache else None,
                                      use_cache)

    def _generate_dynamic(self, input_ids: torch.Tensor, max_new_tokens: int,
                          attention_mask: torch.Tensor | None, sampling: Sampling | None,
                          eos_token_id: int | None, cache: Any | None,
                          use_cache: bool) -> torch.Tensor:
        """generate's loop over a cache that appends (or none: every step runs the whole
        sequence), eager; the tokens are written into a preallocated output."""
        B, T = input_ids.shape
        tokens = input_ids.new_empty(B, T + max_new_tokens)
        tokens[:, :T] = input_ids
        finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        step_input = input_ids
        if cache is not None:
            if cache.get_seq_length() >= T:
                raise TokenFormerError(f"the cache already holds {cache.get_seq_length()} "
                                       f"positions; input_ids must have more than that ({T})")
            step_input = input_ids[:, cache.get_seq_length():]
        generated = 0
        while True:
            position_ids = None
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask, step_input.shape[1])
            out = self(step_input, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=use_cache, logits_to_keep=1)
            token = choose_tokens(out.logits[:, -1, :self.config.vocab_size].float(), sampling,
                                  generated)
            if eos_token_id is not None:
                token, finished = _after_eos(token, finished, eos_token_id)
            tokens[:, T + generated] = token
            generated += 1
            if generated == max_new_tokens or _all_finished(finished, eos_token_id, generated):
                break
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask, attention_mask.new_ones(B, 1)), dim=1)
            if use_cache:
                cache, step_input = out.past_key_values, tokens[:, T + generated - 1:T + generated]
            else:
                step_input = tokens[:, :T + generated]
        return _cut_at_eos(tokens[:, :T + generated], T, eos_token_id)

    def _generate_static(self, input_ids: torch.Tensor, max_new_tokens: int,
                         attention_mask: torch.Tensor | None, sampling: Sampling | None,
                         eos_token_id: int | None, compile: bool) -> torch.Tensor:
        """generate's loop over a :class:`StaticKVCache`: the prompt runs eagerly (it fills the
        cache) and chooses the first token, then every further token comes from the same step,
        compiled or not (:func:`_decode_step`), over the tensors of a :class:`DecodeState`."""
        B, T = input_ids.shape
        state = _decode_state(self, B, static_capacity(T + max_new_tokens,
                                                       self.config.max_seq_len))
        positions = state.start(input_ids, attention_mask, eos_token_id)
        out = self(input_ids, attention_mask=state.mask, position_ids=positions,
                   past_key_values=state.cache, use_cache=True,
                   cache_position=torch.arange(T, device=input_ids.device), logits_to_keep=1)
        sampling = state.hold(sampling)
        _emit(state, out.logits[:, -1, :self.config.vocab_size].float(), sampling)
        step = _compiled_decode_step(input_ids.device) if compile else _decode_step
        generated = 1
        with _step_graph_limit() if compile else contextlib.nullcontext():
            while (generated < max_new_tokens
                   and not _all_finished(state.finished, eos_token_id, generated)):
                step(self, state, sampling)
                generated += 1
        return _cut_at_eos(state.tokens[:, :T + generated].clone(), T, eos_token_id)


CACHE_IMPLEMENTATIONS = ("dynamic", "static")


def static_capacity(length: int, max_seq_len: int) -> int:
    """The static cache's capacity for ``length`` positions (prompt plus new tokens): the next
    power of two from :data:`SMALLEST_CAPACITY`, at most ``max_seq_len`` (the model's context,
    itself the last bucket when it is no power of two). A compiled step is specialised to its
    capacity: buckets let every prompt length of one replay its graph, at the price of up to
    twice the cache memory and attention over up to twice the slots (masked)."""
    return min(max(SMALLEST_CAPACITY, 1 << (length - 1).bit_length()), max_seq_len)


class DecodeState:
    """Everything the decoding step reads and writes, for one model, batch size and capacity:
    the static cache, the tokens, the padding mask, the position, slot and step counters, the
    rows' finished flags, the eos id and the sampling parameters, each a tensor allocated once
    at a fixed address (marked static for torch.compile) and reused, emptied, by later calls of
    the same shapes. A captured CUDA graph then replays on the same addresses (torch records a
    graph again when a static input moves, and gives graphs up after a limit of re-recordings),
    and nothing the step needs is a Python value that changes from call to call."""

    def __init__(self, model: nn.Module, batch_size: int, capacity: int) -> None:
        device = model.word_embeddings.weight.device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.cache = StaticKVCache.for_model(model, batch_size, capacity)
        self.tokens = zeros(batch_size, capacity)  # the prompt, then each generated token
        self.mask = zeros(batch_size, capacity, dtype=torch.bool)  # True: a real token
        self.position = zeros(batch_size, 1)  # the position id of the token at ``slot``
        self.slot = zeros(1)  # the cache slot of the last token written (the next one fed)
        self.step = zeros()  # tokens generated so far: the sampling noise's counter
        self.finished = zeros(batch_size, dtype=torch.bool)  # rows that have emitted eos
        self.eos = zeros()  # the eos id; -1 without one (no token equals it)
        self.seed = zeros()
        self.temperature = zeros(dtype=torch.float32)
        self.top_p = zeros(dtype=torch.float32)
        if not torch.compiler.is_compiling():
            for t in (self.tokens, self.mask, self.position, self.slot, self.step, self.finished,
                      self.eos, self.seed, self.temperature, self.top_p):
                torch._dynamo.mark_static_address(t, guard=False)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              eos_token_id: int | None) -> torch.Tensor:
        """Empty the state for a new prompt [B, T] and return its position ids [B, T] (real
        tokens count from 0); the counters point at its last token."""
        B, T = input_ids.shape
        self.cache.reset()
        self.tokens[:, :T] = input_ids
        self.mask.fill_(True)  # the slots past the prompt: real tokens, hidden by causality
        if attention_mask is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        else:
            self.mask[:, :T] = attention_mask.bool()
            positions = positions_from_mask(attention_mask, T)
        self.position.copy_(positions[:, -1:])
        self.slot.fill_(T - 1)
        self.step.zero_()
        self.finished.zero_()
        self.eos.fill_(-1 if eos_token_id is None else eos_token_id)
        return positions

    def hold(self, sampling: Sampling | None) -> Sampling | None:
        """``sampling`` with its tensors copied into this state's (fixed addresses)."""
        if sampling is None:
            return None
        self.seed.copy_(sampling.seed)
        self.temperature.copy_(sampling.temperature)
        if sampling.top_p is not None:
            self.top_p.copy_(sampling.top_p)
        return Sampling(seed=self.seed, temperature=self.temperature, top_k=sampling.top_k,
                        top_p=None if sampling.top_p is None else self.top_p)


# The decoding states of each model, the most recently used last (at most KEPT_STATES)
_DECODE_STATES: weakref.WeakKeyDictionary[nn.Module, OrderedDict[tuple, DecodeState]] = (
    weakref.WeakKeyDictionary())


def _decode_state(model: nn.Module, batch_size: int, capacity: int) -> DecodeState:
    config, weight = model.config, model.word_embeddings.weight
    key = (batch_size, capacity, config.num_layers, config.num_heads, config.head_dim,
           weight.dtype, weight.device)
    states = _DECODE_STATES.setdefault(model, OrderedDict())
    state = states.pop(key, None)
    if state is None:
        while len(states) >= KEPT_STATES:  # the oldest's memory is free before the new one's
            states.popitem(last=False)
        state = DecodeState(model, batch_size, capacity)
    states[key] = state
    return state


def _emit(state: DecodeState, logits: torch.Tensor, sampling: Sampling | None) -> None:
    """Choose the next token of each row from its float32 ``logits`` [B, vocab], pad finished
    rows with eos, and write it at the next slot; the counters advance."""
    token = choose_tokens(logits, sampling, state.step)
    token, finished = _after_eos(token, state.finished, state.eos)
    state.finished.copy_(finished)
    state.slot += 1
    state.tokens.index_copy_(1, state.slot, token[:, None])
    state.position += 1
    state.step += 1


def _decode_step(model: nn.Module, state: DecodeState, sampling: Sampling | None) -> None:
    """One token: the last one written goes through the model over the static cache, and the
    next one is chosen and written (:func:`_emit`). What ``compile=True`` compiles: nothing in it
    reads a value back to the host, and every shape is the state's."""
    token = state.tokens.index_select(1, state.slot)  # [B, 1]
    out = model(token, attention_mask=state.mask, position_ids=state.position,
                past_key_values=state.cache, use_cache=True, cache_position=state.slot,
                logits_to_keep=1)
    _emit(state, out.logits[:, -1, :model.config.vocab_size].float(), sampling)


_COMPILED_STEPS: dict[str, Callable[..., None]] = {}


def _compiled_decode_step(device: torch.device) -> Callable[..., None]:
    """:func:`_decode_step` compiled once per device type and process (each model, batch size,
    capacity and way of choosing gets its own graph: torch.compile's guards). ``fullgraph=True``:
    a graph break is an error, not a silent fallback; ``dynamic=False``: each shape gets its own
    static kernels (CUDA graphs want fixed shapes). Past :data:`STEP_GRAPH_LIMIT` graphs (or
    torch._dynamo's accumulated limit) every graph of the step is dropped and compiled again as
    needed (a compile, not an error); if even that fails, one error line says what to do."""
    kind = torch.device(device).type
    if kind not in _COMPILED_STEPS:
        mode = "reduce-overhead" if kind == "cuda" else None
        _COMPILED_STEPS[kind] = torch.compile(_decode_step, fullgraph=True, dynamic=False,
                                              mode=mode)
    compiled = _COMPILED_STEPS[kind]

    def step(model: nn.Module, state: DecodeState, sampling: Sampling | None) -> None:
        if kind == "cuda":  # a new CUDA-graph iteration (nothing of the last one is still read)
            torch.compiler.cudagraph_mark_step_begin()
        try:
            compiled(model, state, sampling)
            return
        except torch._dynamo.exc.FailOnRecompileLimitHit:  # nothing ran: compiling failed
            torch._dynamo.reset_code(_decode_step.__code__)
        try:
            compiled(model, state, sampling)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            raise TokenFormerError(
                "torch.compile refuses to compile the decoding step again in this process "
                "(torch._dynamo's recompile limits); generate with compile=False, or in a new "
                "process") from None
    return step


@contextlib.contextmanager
def _step_graph_limit() -> Any:
    """torch._dynamo's recompile_limit raised to :data:`STEP_GRAPH_LIMIT` (never lowered)."""
    limit = max(torch._dynamo.config.recompile_limit, STEP_GRAPH_LIMIT)
    with torch._dynamo.config.patch(recompile_limit=limit):
        yield


def _all_finished(finished: torch.Tensor, eos_token_id: int | None, generated: int) -> bool:
    """Whether every row has emitted eos, read (a host sync) only every
    :data:`EOS_CHECK_INTERVAL` generated tokens; False without an eos id."""
    return (eos_token_id is not None and generated % EOS_CHECK_INTERVAL == 0
            and bool(finished.all()))


def _cut_at_eos(tokens: torch.Tensor, prompt_length: int,
                eos_token_id: int | None) -> torch.Tensor:
    """``tokens`` [B, T + n] ending at the first step at which every row had emitted eos (rows
    that finished earlier hold eos after theirs): what stopping right there returns."""
    if eos_token_id is None:
        return tokens
    hit = tokens[:, prompt_length:] == eos_token_id
    if not bool(hit.any(dim=1).all()):
        return tokens
    last = int(hit.int().argmax(dim=1).max())  # the first eos of the row that finished last
    return tokens[:, :prompt_length + last + 1]


def _whole_number(name: str, value: Any) -> int:
    """``value`` as an int (ints, numpy and 0-d integer tensors pass; 2.5 or "3" do not)."""
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be a whole number, got {value!r}") from None


def _after_eos(token: torch.Tensor, finished: torch.Tensor,
               eos_token_id: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that have finished emit ``eos_token_id`` again; a row that emits it finishes."""
    token = torch.where(finished, eos_token_id, token)
    return token, finished | (token == eos_token_id)
