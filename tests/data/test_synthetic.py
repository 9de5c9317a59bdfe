"""The generated corpus (tokenformer.data.synthetic): deterministic, the size asked for, the
language it describes, its entropy floor against an independent dense computation, and the
cached prepared dataset."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tokenformer.data import synthetic
from tokenformer.data.synthetic import Language, entropy_floor, generate, synthetic_dataset
from tokenformer.errors import ConfigError

SMALL = Language(seed=3, words=40, successors=4, doc_words=16)


def test_generated_text_is_deterministic_and_of_the_language():
    a, b = generate(20_000, SMALL), generate(20_000, SMALL)
    assert a == b and len(a) >= 20_000 and a != generate(20_000, Language(seed=4, words=40))
    lexicon, _, table, _ = synthetic._table(SMALL)
    assert len(set(lexicon)) == 40
    index = {w: i for i, w in enumerate(lexicon)}
    for line in a.splitlines()[:50]:  # every document: 16 lexicon words, bigrams in the table
        words = line.split(" ")
        assert len(words) == SMALL.doc_words and set(words) <= set(lexicon)
        for x, y in itertools.pairwise(words):
            assert index[y] in table[index[x]]
        assert all(ch in synthetic.CONSONANTS + synthetic.VOWELS for ch in "".join(words))
    with pytest.raises(ConfigError):
        generate(0, SMALL)


def test_entropy_floor_against_a_dense_stationary_distribution():
    """Independent: the dense transition matrix, its stationary distribution as the left
    eigenvector of eigenvalue 1, and the per-word entropies; over the mean bytes per word."""
    lexicon, _, table, slots = synthetic._table(SMALL)
    weights = np.diff(slots, prepend=0.0)
    n = SMALL.words
    transition = np.zeros((n, n))
    for w in range(n):
        for k in range(SMALL.successors):
            transition[w, table[w, k]] += weights[k]
    values, vectors = np.linalg.eig(transition.T)
    pi = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    pi = pi / pi.sum()
    row_entropy = [-sum(p * np.log(p) for p in row if p > 0) for row in transition]
    expected = float(pi @ row_entropy / (pi @ np.array([len(w) + 1 for w in lexicon])))
    assert entropy_floor(SMALL) == pytest.approx(expected, rel=1e-6)


def test_spec_and_the_cached_dataset(tmp_path):
    assert synthetic.parse_spec("synthetic:3e7") == 30_000_000
    for bad in ("synthetic:abc", "kjv:100", "synthetic:0", "synthetic:1.5"):
        with pytest.raises(ConfigError, match="synthetic"):
            synthetic.parse_spec(bad)
    ds = synthetic_dataset(50_000, SMALL, cache_dir=tmp_path, progress=False)
    text = generate(50_000, SMALL).encode()
    tokens = ds.meta["train_tokens"] + ds.meta["val_tokens"]
    assert ds.meta["tokenizer"].startswith("bytes") and len(text) <= tokens <= len(text) + 2
    assert bytes(ds.tokens("train")[:100].astype(np.uint8)) == text[:100]
    again = synthetic_dataset(50_000, SMALL, cache_dir=tmp_path, progress=False)
    assert again.path == ds.path  # prepared once, then reused
