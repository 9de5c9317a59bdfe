"""A generated corpus: text of a random but fixed language, as large as asked, never downloaded.

For experiments that need more tokens than the embedded King James Bible (≈ 4 M bytes), e.g. the
``gpu-30m`` frontier preset, where no run may see its training split more than 4 times. One
``seed`` fixes the language:

* a lexicon of ``words`` distinct words, each 1–3 syllables (consonant + vowel, sometimes a final
  consonant) of lowercase ASCII;
* Zipfian word frequencies (weight 1/rank);
* a bigram table: each word has ``successors`` next words, drawn by those frequencies, taken
  with Zipfian weights 1/slot (a sparse random transition matrix);
* documents of ``doc_words`` words: the first drawn by frequency, each next one from its
  predecessor's successors; words separated by a space, documents by a newline.

Learning it means spelling the lexicon and memorising the bigram table (``words`` ×
``successors`` transitions): a capacity-bound task on which larger models keep gaining, with an
exactly known floor, :func:`entropy_floor` (nats per byte). Text of a given (seed, size) is the
same on every machine: every random number is a uniform double of numpy's PCG64 ``Generator``
(whose stream numpy keeps stable), turned into choices by ``searchsorted`` on fixed cumulative
weights. Generation is vectorised over documents (≈ 10–20 MB/s on one core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .corpus import cached_corpus
from .datasets import TokenDataset

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
SPEC_PREFIX = "synthetic:"  # a corpus spec: "synthetic:<bytes>" (e.g. "synthetic:3e7")


@dataclass(frozen=True)
class Language:
    """The generated language's parameters (module docstring)."""

    seed: int = 0
    words: int = 8192
    successors: int = 32
    doc_words: int = 512


def _uniform(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.random(shape)


def _zipf_cdf(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return np.cumsum(w) / w.sum()


def _draw(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Index k with cdf[k-1] <= u < cdf[k] (the last index for u rounding past the end)."""
    return np.minimum(np.searchsorted(cdf, u, side="right"), len(cdf) - 1)


def _lexicon(rng: np.random.Generator, n: int) -> list[str]:
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        u = _uniform(rng, 10)
        syllables = 1 + int(u[0] * 3)
        word = "".join(CONSONANTS[int(u[1 + 3 * i] * len(CONSONANTS))]
                       + VOWELS[int(u[2 + 3 * i] * len(VOWELS))]
                       + (CONSONANTS[int(u[3 + 3 * i] / 0.2 * len(CONSONANTS))]  # 1 in 5
                          if u[3 + 3 * i] < 0.2 else "")
                       for i in range(syllables))
        if word not in seen:
            seen.add(word)
            words.append(word)
    return words


def _table(language: Language) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The lexicon, the word-frequency CDF, the successor table [words, successors] and the
    successor-slot CDF."""
    rng = np.random.Generator(np.random.PCG64(language.seed))
    lexicon = _lexicon(rng, language.words)
    freq = _zipf_cdf(language.words)
    table = _draw(freq, _uniform(rng, language.words, language.successors))
    return lexicon, freq, table, _zipf_cdf(language.successors)


def generate(num_bytes: int, language: Language = Language()) -> str:
    """At least ``num_bytes`` bytes of the language (whole documents), deterministic."""
    if num_bytes <= 0:
        raise ConfigError(f"a generated corpus needs a positive size, got {num_bytes}")
    lexicon, freq, table, slots = _table(language)
    lengths = np.array([len(w) + 1 for w in lexicon])  # with its separator
    mean_bytes = float((np.diff(freq, prepend=0.0) * lengths).sum())
    docs = max(1, math.ceil(1.1 * num_bytes / (mean_bytes * language.doc_words)))
    # the documents' stream is its own generator, independent of the lexicon's draws
    rng = np.random.Generator(np.random.PCG64([language.seed, 1]))
    ids = np.empty((docs, language.doc_words), dtype=np.int64)
    ids[:, 0] = _draw(freq, _uniform(rng, docs))
    for t in range(1, language.doc_words):
        ids[:, t] = table[ids[:, t - 1], _draw(slots, _uniform(rng, docs))]
    words = np.array(lexicon, dtype=object)
    lines, total = [], 0
    for row in ids:  # whole documents until the size is reached
        line = " ".join(words[row]) + "\n"
        lines.append(line)
        total += len(line)
        if total >= num_bytes:
            break
    return "".join(lines)


def entropy_floor(language: Language = Language()) -> float:
    """The language's entropy rate in nats per byte: the expected entropy of the next word given
    the previous one (duplicate successors merged), under the words' long-run frequencies,
    over the mean bytes per word. No model can go below it on a long sample."""
    lexicon, freq, table, slots = _table(language)
    weights = np.diff(slots, prepend=0.0)
    entropy = np.empty(language.words)
    for w in range(language.words):
        p = np.bincount(table[w], weights=weights, minlength=language.words)
        p = p[p > 0]
        entropy[w] = float(-(p * np.log(p)).sum())
    # long-run word frequencies: the stationary distribution of the bigram chain (power
    # iteration on the sparse table)
    flow = np.tile(weights, language.words)
    pi = np.diff(freq, prepend=0.0)
    for _ in range(200):
        pi = np.bincount(table.ravel(), weights=np.repeat(pi, language.successors) * flow,
                         minlength=language.words)
    lengths = np.array([len(w) + 1 for w in lexicon])
    return float((pi * entropy).sum() / (pi * lengths).sum())


def parse_spec(spec: str) -> int:
    """The size in bytes of a ``"synthetic:<bytes>"`` corpus spec (``3e7`` is allowed)."""
    try:
        size = float(spec.removeprefix(SPEC_PREFIX))
    except ValueError:
        raise ConfigError(f"corpus {spec!r}: expected 'synthetic:<bytes>', e.g. "
                          f"'synthetic:3e7'") from None
    if not spec.startswith(SPEC_PREFIX) or size < 1 or size != int(size):
        raise ConfigError(f"corpus {spec!r}: expected 'synthetic:<bytes>' with a whole, "
                          f"positive number of bytes")
    return int(size)


def synthetic_dataset(num_bytes: int, language: Language = Language(),
                      cache_dir: str | Path | None = None, progress: bool | None = True
                      ) -> TokenDataset:
    """The generated corpus of ``num_bytes`` bytes, prepared byte-level on first use and cached
    like the embedded corpus (``$TOKENFORMER_CACHE`` or ``~/.cache/tokenformer``)."""
    source = (f"tokenformer.data.synthetic:seed={language.seed},words={language.words},"
              f"successors={language.successors},doc_words={language.doc_words},"
              f"bytes={num_bytes}")
    name = (f"synthetic-s{language.seed}-w{language.words}-k{language.successors}-"
            f"d{language.doc_words}-{num_bytes}")
    return cached_corpus(name, source, lambda: generate(num_bytes, language), "bytes",
                         cache_dir, progress)
