"""The folder a checkpoint operation writes: a model derived from another (grown, pruned,
merged), committed atomically with its source's tokenizer files and a manifest."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from ..data.tokenizer import BYTES_MARKER, TOKENIZER_FILE, HFTokenizer
from ..io import checkpoint as ckpt
from ..io.files import atomic_dir
from ..io.paths import has_regular_file, read_json_object


def copy_tokenizer(source: Path, target: Path) -> None:
    """Copy the tokenizer files saved beside a model directory (none for a checkpoint file), so
    a model derived from it (grown, pruned, merged) keeps its tokenizer. Each must be a regular
    file inside the folder (a link is refused, never followed: docs/reliability.md) that parses:
    an output is never given a tokenizer nothing can load."""
    if not source.is_dir():
        return
    for name in (TOKENIZER_FILE, BYTES_MARKER, "tokenizer_config.json",
                 "special_tokens_map.json"):
        if has_regular_file(source / name, "tokenizer file", folder=source):
            if name == TOKENIZER_FILE:
                HFTokenizer(source / name, folder=source)
            else:
                read_json_object(source / name)
            shutil.copy2(source / name, target / name)


@contextlib.contextmanager
def derived_model_folder(out: Path, source: Path, *, command: str,
                         overwrite: bool = False) -> Iterator[Path]:
    """The temporary folder to save a model derived from ``source`` into (and what goes beside
    it); on leaving the block ``source``'s tokenizer files and the manifest are added and the
    folder is committed at ``out`` (:func:`tokenformer.io.files.atomic_dir`, with ``command``'s
    marker)."""
    with atomic_dir(out, overwrite=overwrite, command=command) as tmp:
        yield tmp
        copy_tokenizer(source, tmp)
        ckpt.write_manifest(tmp)
