"""Choosing the next token from the last position's logits, on the device and without a host
sync, so that it can run inside a compiled, CUDA-graph-captured decoding step (gpt-fast's
design; :mod:`tokenformer.models.generation` calls it on every path, compiled or not).

Greedy is the argmax. Sampling is the argmax of ``probs / E`` with ``E`` ~ Exponential(1), one
independent draw per row and vocabulary entry: P(argmax = i) = p_i exactly (the exponential race;
the same as adding Gumbel noise to the logits), with no cumulative sum, no ``torch.multinomial``
and no random-number generator state inside the step. The noise is a counter-based hash of (the
call's seed, the token's index among the generated ones, the batch row, the vocabulary id)
(:func:`exponential_noise`), so it is the same on every device and backend and for every cache
and capacity: one seed gives the same tokens eagerly and compiled, with the dynamic cache and the
static one, in any capacity bucket (up to floating-point differences in the logits themselves).

The seed is drawn once per ``generate`` call from the caller's ``torch.Generator`` (or torch's
default one on the device), so a seeded generator reproduces a call exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B1  # 2^32 / φ, odd: spreads consecutive vocabulary ids over 32 bits


@dataclass
class Sampling:
    """What sampling needs, as tensors on the model's device (a compiled step reads them, so a
    new value never recompiles it), except ``top_k``, a shape (each value compiles its own step,
    as in gpt-fast). ``top_k``/``top_p`` None: no filtering of that kind."""

    seed: torch.Tensor  # [] int64 in [0, 2^32)
    temperature: torch.Tensor  # [] float32 > 0
    top_k: int | None = None
    top_p: torch.Tensor | None = None  # [] float32 in (0, 1)

    @classmethod
    def draw(cls, *, temperature: float, top_k: int | None, top_p: float | None, vocab: int,
             generator: torch.Generator | None, device: torch.device) -> Sampling:
        """The sampling of one ``generate`` call: its seed drawn from ``generator`` (torch's
        default generator of ``device`` when None); a top-k that keeps the whole vocabulary and
        a top-p of 1 filter nothing and are dropped."""
        where = generator.device if generator is not None else device
        seed = torch.randint(0, 1 << 32, (), generator=generator, device=where).to(device)
        return cls(seed=seed,
                   temperature=torch.tensor(float(temperature), device=device),
                   top_k=top_k if top_k is not None and top_k < vocab else None,
                   top_p=(torch.tensor(float(top_p), device=device)
                          if top_p is not None and top_p < 1 else None))


def choose_tokens(logits: torch.Tensor, sampling: Sampling | None,
                  step: torch.Tensor | int) -> torch.Tensor:
    """The next token of each row, [B], from float32 ``logits`` [B, vocab]: the argmax when
    ``sampling`` is None, else a draw from softmax(logits / temperature) restricted by top-k
    then top-p, with the noise of generated token number ``step`` (0 for the first)."""
    if sampling is None:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p)
    noise = exponential_noise(sampling.seed, step, logits.shape[0], logits.shape[1])
    return (logits.softmax(dim=-1) / noise).argmax(dim=-1)


def filter_logits(logits: torch.Tensor, top_k: int | None,
                  top_p: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [B, vocab] with what top-k, then top-p (nucleus) excludes set to -inf.

    Top-k keeps every logit at least the k-th largest (ties with it included, as transformers
    does); top-p then keeps the smallest set of most likely tokens whose probability (after
    top-k) reaches p, the token that crosses p included. Fixed shapes throughout (a sort and a
    scatter, no boolean indexing): it runs inside a CUDA graph."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # the mass before each token
        logits = torch.full_like(logits, float("-inf")).scatter(
            -1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def exponential_noise(seed: torch.Tensor, step: torch.Tensor | int, rows: int,
                      vocab: int) -> torch.Tensor:
    """Exponential(1) noise [rows, vocab] (float32) for generated token number ``step``:
    entry (b, v) is -log(u) with u = (h // 2^9 + 1/2) / 2^23 and

        h = mix(((v · 0x9E3779B1) mod 2^32) xor mix(mix(mix(seed) xor step) + b))

    (all mod 2^32), ``mix`` being Chris Wellons' ``lowbias32`` integer hash (a bijection of
    32-bit words). 23 bits per draw, so that h // 2^9 + 1/2 is exact in float32: u is never 0
    or 1, and the noise is finite and positive. Integer arithmetic in int64 that never overflows
    (:func:`_mul32`): every device and backend computes the same bits."""
    device = seed.device
    row_key = _mix32((_mix32(_mix32(seed) ^ step) + torch.arange(rows, device=device)) & _MASK32)
    columns = _mul32(torch.arange(vocab, device=device), _GOLDEN32)
    return _exponential(_mix32(columns[None, :] ^ row_key[:, None]))


def _exponential(h: torch.Tensor) -> torch.Tensor:
    """-log(u), u = (h // 2^9 + 1/2) / 2^23: uniform 32-bit words to Exponential(1), float32."""
    return -torch.log(((h >> 9).float() + 0.5) * (1.0 / (1 << 23)))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons, hash-prospector) of 32-bit words held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for 32-bit words x in int64, in two 16-bit halves of c so that no
    product reaches 2^63 (signed overflow is not defined the same way everywhere)."""
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32
