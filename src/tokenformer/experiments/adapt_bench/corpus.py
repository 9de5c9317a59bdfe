"""The adaptation benchmark's corpora: the embedded KJV (pretraining, old domain) and the pinned
Jinja2 source (new; :func:`tokenformer.data.corpora.code_dataset`, which ``tokenformer adapt
--data code`` opens too)."""

from __future__ import annotations

from typing import Any

from ...data import corpus


def kjv_dataset(progress: bool | None) -> Any:
    """The embedded King James Bible, byte-tokenized: the bases' pretraining corpus."""
    return corpus.default_dataset("bytes", progress=progress)
