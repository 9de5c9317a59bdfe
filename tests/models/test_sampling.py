"""Choosing tokens on the device (tokenformer.models.sampling): the noise is the documented hash
and Exponential(1); the argmax of probs / noise samples the softmax; top-k and top-p keep what an
independent reference keeps."""

from __future__ import annotations

import math

import pytest
import torch

from tokenformer.models import sampling as sampling_module
from tokenformer.models.sampling import Sampling, choose_tokens, exponential_noise, filter_logits

MASK32 = 0xFFFFFFFF


def lowbias32(x: int) -> int:
    """Wellons' lowbias32 on Python integers (the reference: no int64 tricks)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def reference_noise(seed: int, step: int, rows: int, vocab: int) -> torch.Tensor:
    """The documented formula of exponential_noise, in Python integers and float64."""
    out = []
    for b in range(rows):
        key = lowbias32((lowbias32(lowbias32(seed) ^ step) + b) & MASK32)
        hashes = (lowbias32(((v * 0x9E3779B1) & MASK32) ^ key) for v in range(vocab))
        out.append([-math.log(((h >> 9) + 0.5) / 2 ** 23) for h in hashes])
    return torch.tensor(out, dtype=torch.float64)


def sampling(seed: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None) -> Sampling:
    return Sampling(seed=torch.tensor(seed), temperature=torch.tensor(temperature), top_k=top_k,
                    top_p=None if top_p is None else torch.tensor(top_p))


def reference_kept(row: list[float], top_k: int | None, top_p: float | None) -> set[int]:
    """The ids top-k then top-p keep, by their definitions, in Python floats: top-k keeps what is
    at least the k-th largest; top-p the shortest most-likely-first prefix whose probability
    (renormalised over what top-k kept) reaches p."""
    kept = list(range(len(row)))
    if top_k is not None:
        kth = sorted(row, reverse=True)[min(top_k, len(row)) - 1]
        kept = [i for i in kept if row[i] >= kth]
    if top_p is not None:
        kept.sort(key=lambda i: -row[i])
        weights = [math.exp(row[i] - row[kept[0]]) for i in kept]
        mass, nucleus = 0.0, []
        for i, w in zip(kept, weights, strict=True):
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += w / sum(weights)
        kept = nucleus
    return set(kept)


@pytest.mark.parametrize(("seed", "step"), [(0, 0), (12345, 7), (2 ** 32 - 1, 1000)])
def test_noise_is_the_documented_hash(seed: int, step: int) -> None:
    noise = exponential_noise(torch.tensor(seed), step, 3, 50)
    assert noise.dtype == torch.float32 and noise.shape == (3, 50)
    torch.testing.assert_close(noise.double(), reference_noise(seed, step, 3, 50), rtol=2e-6,
                               atol=1e-12)
    as_tensor = exponential_noise(torch.tensor(seed), torch.tensor(step), 3, 50)
    assert torch.equal(as_tensor, noise)  # the counter as a tensor (the compiled step's)


def test_extreme_hashes_give_finite_positive_noise() -> None:
    """The largest and smallest 32-bit words: u stays inside (0, 1) in float32 (with 24 bits, 2^24
    - 1/2 would round to 2^24, u to 1 and the noise to 0: that token would always win)."""
    words = torch.tensor([0, 511, 512, 2 ** 31, 2 ** 32 - 513, 2 ** 32 - 1])
    noise = sampling_module._exponential(words).double()
    want = torch.tensor([-math.log(((w >> 9) + 0.5) / 2 ** 23) for w in words.tolist()],
                        dtype=torch.float64)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    torch.testing.assert_close(noise, want, rtol=1e-4, atol=0)


def test_noise_is_exponential_and_independent() -> None:
    """262,144 draws: mean and variance 1, the tail P(E > 3) = e^-3, all finite and > 0; no
    correlation between steps, rows or seeds (each bound: four standard deviations)."""
    rows, vocab = 256, 1024
    n = rows * vocab
    noise = exponential_noise(torch.tensor(99), 0, rows, vocab).double()
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert abs(noise.mean().item() - 1) < 4 / math.sqrt(n)
    assert abs(noise.var().item() - 1) < 4 * math.sqrt(8 / n)  # Var of s² for Exp(1): 8/n
    tail = (noise > 3).double().mean().item()
    assert abs(tail - math.exp(-3)) < 4 * math.sqrt(math.exp(-3) / n)

    def corr(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.corrcoef(torch.stack((a.flatten(), b.flatten())))[0, 1].item()

    other_step = exponential_noise(torch.tensor(99), 1, rows, vocab).double()
    other_seed = exponential_noise(torch.tensor(100), 0, rows, vocab).double()
    for other in (other_step, other_seed):
        assert abs(corr(noise, other)) < 4 / math.sqrt(n)
    assert abs(corr(noise[:-1], noise[1:])) < 4 / math.sqrt(n - vocab)  # neighbouring rows
    assert abs(corr(noise[:, :-1], noise[:, 1:])) < 4 / math.sqrt(n - rows)  # neighbouring ids


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, None, None), (0.7, None, None), (1.3, 5, None), (1.0, None, 0.6),
                          (2.0, 12, 0.8)])
def test_sample_is_the_argmax_of_probs_over_the_noise(temperature: float, top_k: int | None,
                                                       top_p: float | None) -> None:
    """choose_tokens is argmax(p / E), p the filtered softmax of logits / temperature computed
    here in float64 from the reference filter, E the reference noise of that seed and step."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    for seed, step in ((5, 0), (5, 1), (77, 3)):
        got = choose_tokens(logits, sampling(seed, temperature, top_k, top_p), step)
        noise = reference_noise(seed, step, 6, 40).tolist()
        want = []
        for row, row_noise in zip((logits.double() / temperature).tolist(), noise, strict=True):
            kept = reference_kept(row, top_k, top_p)
            z = sum(math.exp(row[i]) for i in kept)
            want.append(max(kept, key=lambda i: math.exp(row[i]) / z / row_noise[i]))
        assert got.tolist() == want, (seed, step)
    assert torch.equal(choose_tokens(logits, None, 0), logits.argmax(-1))  # greedy


@pytest.mark.parametrize(("top_k", "top_p"), [(1, None), (3, None), (7, None), (40, None),
                                              (100, None), (None, 0.05), (None, 0.5),
                                              (None, 0.9), (4, 0.5), (10, 0.95)])
def test_filter_keeps_what_the_reference_keeps(top_k: int | None, top_p: float | None) -> None:
    """Random logits, and for top-k alone rows with ties at the k-th value (rounded logits):
    the finite entries are exactly the reference's set."""
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(2)) * 2
    if top_p is None:
        logits[4:] = logits[4:].round()  # many ties
    kept = filter_logits(logits, top_k, None if top_p is None else torch.tensor(top_p))
    for row, out in zip(logits.tolist(), kept, strict=True):
        assert set(torch.isfinite(out).nonzero().flatten().tolist()) == reference_kept(
            row, top_k, top_p)
        assert torch.equal(out[torch.isfinite(out)],
                           torch.tensor(row)[torch.isfinite(out)])  # kept logits unchanged


def test_sample_distribution() -> None:
    """Frequencies follow softmax(logits / T) restricted to the top-k / nucleus set, over 4000
    rows of one step; and over 2000 steps of one row."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def freq(temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None) -> torch.Tensor:
        draws = choose_tokens(logits.expand(4000, 4), sampling(2024, temperature, top_k, top_p),
                              0)
        return torch.bincount(draws, minlength=4).double() / 4000

    def expect(p: list[float]) -> torch.Tensor:
        p = torch.tensor(p, dtype=torch.float64)
        return p / p.sum()

    tol = 4 * math.sqrt(0.25 / 4000)  # four standard deviations of a frequency
    plain = freq()
    assert (plain - expect([0.5, 0.3, 0.15, 0.05])).abs().max() < tol
    hot = freq(temperature=2.0)  # p^(1/2), renormalised
    assert (hot - expect([math.sqrt(p) for p in (0.5, 0.3, 0.15, 0.05)])).abs().max() < tol
    top2 = freq(top_k=2)
    assert top2[2:].sum() == 0 and (top2 - expect([0.5, 0.3, 0, 0])).abs().max() < tol
    # 0.5 < 0.7 <= 0.8: the nucleus is the smallest prefix reaching p, here tokens 0 and 1
    nucleus = freq(top_p=0.7)
    assert nucleus[2:].sum() == 0 and (nucleus - expect([0.5, 0.3, 0, 0])).abs().max() < tol
    steps = torch.cat([choose_tokens(logits, sampling(7), step) for step in range(2000)])
    by_step = torch.bincount(steps, minlength=4).double() / 2000
    assert (by_step - expect([0.5, 0.3, 0.15, 0.05])).abs().max() < 4 * math.sqrt(0.25 / 2000)


def test_draw_takes_its_seed_from_the_generator() -> None:
    """One seed per call from the generator: the same generator state, the same seed; a top-k
    of the whole vocabulary and a top-p of 1 are dropped (they filter nothing)."""
    def draw(seed: int, **kw) -> Sampling:
        return Sampling.draw(temperature=0.5, vocab=50, device=torch.device("cpu"),
                             generator=torch.Generator().manual_seed(seed), **kw)

    a, b = draw(3, top_k=50, top_p=1.0), draw(3, top_k=49, top_p=0.9)
    assert a.seed.item() == b.seed.item() != draw(4, top_k=None, top_p=None).seed.item()
    assert 0 <= a.seed.item() < 2 ** 32 and a.temperature.item() == 0.5
    assert (a.top_k, a.top_p, b.top_k) == (None, None, 49)
    assert b.top_p.item() == pytest.approx(0.9)
