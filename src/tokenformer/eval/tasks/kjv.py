"""Offline lm-eval tasks built from the tail of the embedded King James Bible (no download).

The sentences come from the last ``TAIL_FRACTION`` of :func:`tokenformer.data.corpus.kjv_text`,
the part a default prepared dataset holds out for validation (its last 5 %), so a model
trained on the embedded corpus has not trained on them. They measure fit to this corpus — a smoke
test and a demo, not a general benchmark.

* ``kjv_lastword``: LAMBADA-style; the context is a sentence without its last word, the target is
  that word. Metrics: perplexity of the word and accuracy of greedy prediction.
* ``kjv_choice``: the first half of a sentence and four candidate second halves (the true one and
  the second halves of three other sentences). Metrics: acc and acc_norm (chance 0.25).
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

# absolute: lm-eval loads this file by its path, outside the package
from tokenformer.data.corpus import kjv_text

TAIL_FRACTION = 0.02
MAX_DOCS = 200
_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


@lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    """Sentences of 8 to 30 words ending in a plain word and a full stop, in text order."""
    text = kjv_text()
    tail = text[int(len(text) * (1 - TAIL_FRACTION)):]
    tail = tail[tail.find("\n") + 1:]  # start at a paragraph boundary
    out = []
    for paragraph in tail.splitlines():
        for sentence in _SENTENCE_END.split(paragraph.strip()):
            words = sentence.split()
            if 8 <= len(words) <= 30 and re.fullmatch(r"[A-Za-z]+\.", words[-1]):
                out.append(" ".join(words))
    return tuple(out)


def lastword_docs() -> list[dict[str, str]]:
    docs = []
    for sentence in sentences()[:MAX_DOCS]:
        *context, last = sentence[:-1].split(" ")
        docs.append({"context": " ".join(context), "target": " " + last})
    return docs


def choice_docs() -> list[dict[str, Any]]:
    halves = []
    for sentence in sentences()[:MAX_DOCS]:
        words = sentence.split(" ")
        cut = len(words) // 2
        halves.append((" ".join(words[:cut]), " ".join(words[cut:])))
    docs = []
    n = len(halves)
    for i, (context, ending) in enumerate(halves):
        # Distractors: endings of sentences far away in the list (deterministic), the true ending
        # at position i % 4 so that always answering one position scores chance.
        others = [halves[(i + k * n // 4) % n][1] for k in (1, 2, 3)]
        label = i % 4
        choices = [*others[:label], ending, *others[label:]]
        docs.append({"context": context, "choices": choices, "label": label})
    return docs


def requests(task: str) -> list[tuple[str, str]]:
    """Every (context, continuation) pair lm-eval scores for ``task`` (doc_to_text, target)."""
    if task == "kjv_lastword":
        return [(d["context"], d["target"]) for d in lastword_docs()]
    if task == "kjv_choice":
        return [(d["context"], " " + c) for d in choice_docs() for c in d["choices"]]
    raise KeyError(task)


def _dataset(docs: list[dict[str, Any]]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def lastword(**_: Any):
    """lm-eval ``custom_dataset`` hook for ``kjv_lastword``."""
    return _dataset(lastword_docs())


def choice(**_: Any):
    """lm-eval ``custom_dataset`` hook for ``kjv_choice``."""
    return _dataset(choice_docs())
