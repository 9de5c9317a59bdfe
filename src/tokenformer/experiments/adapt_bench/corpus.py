"""The corpora: the embedded KJV (pretraining, old domain) and the pinned Jinja2 source (new)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from pathlib import Path
from typing import Any

from ...data import corpus, datasets, prepare
from ...errors import DataError

CODE_PACKAGE, CODE_VERSION = "Jinja2", "3.1.6"
CODE_SOURCE = f"{CODE_PACKAGE}=={CODE_VERSION}:jinja2/*.py"


# --------------------------------------------------------------------------- the code corpus
@functools.lru_cache(maxsize=1)
def code_text() -> str:
    """The Python source of the pinned Jinja2 package (a dependency of torch, so present
    wherever torch is), files in sorted order, each headed by ``# file: jinja2/NAME``."""
    try:
        import jinja2
    except ImportError:
        raise DataError(f"the code corpus needs {CODE_PACKAGE}=={CODE_VERSION} "
                        f"(pip install 'tokenformer[adapt]')") from None
    version = importlib.metadata.version(CODE_PACKAGE)
    if version != CODE_VERSION:
        raise DataError(f"the code corpus is pinned to {CODE_PACKAGE}=={CODE_VERSION}, found "
                        f"{version}: pip install {CODE_PACKAGE}=={CODE_VERSION}")
    root = Path(jinja2.__file__).parent
    parts = [f"# file: jinja2/{p.relative_to(root).as_posix()}\n{p.read_text('utf-8')}"
             for p in sorted(root.rglob("*.py"))]
    return "\n".join(parts)


def code_dataset(cache_dir: str | Path | None = None, progress: bool | None = True) -> Any:
    """The code corpus byte-tokenized (the KJV base's tokenizer), last 10 % held out, cached
    beside the embedded corpus."""
    root = Path(cache_dir) if cache_dir is not None else corpus.default_cache_dir()
    path = root / f"code-{CODE_PACKAGE.lower()}-{CODE_VERSION}-bytes"
    root.mkdir(parents=True, exist_ok=True)
    with corpus.file_lock(root / ".code.lock"):
        if (path / datasets.META_FILE).is_file():
            with contextlib.suppress(DataError):
                dataset = datasets.TokenDataset.open(path)
                if dataset.meta.get("sources") == [CODE_SOURCE]:
                    return dataset
        text = code_text()
        doc = prepare.Document(CODE_SOURCE, len(text.encode("utf-8")), lambda: text)
        return prepare.prepare_documents([doc], "bytes", path, val_fraction=0.1, progress=progress,
                                      overwrite=True, sources=[CODE_SOURCE])


def kjv_dataset(progress: bool | None) -> Any:
    """The embedded King James Bible, byte-tokenized: the bases' pretraining corpus."""
    return corpus.default_dataset("bytes", progress=progress)
