"""Corpus specs: corpora the package builds itself, named by one string, never downloaded.

* ``"synthetic:<bytes>"``: the generated language of :mod:`.synthetic` (a smoke test: a word
  bigram chain, nothing beyond the previous word helps);
* ``"pysource:<package>[,<package>…]"``: real text, the Python source files (``*.py``) of
  installed packages, read from their install folders (``importlib.util.find_spec``: nothing is
  imported, so ``"pysource:transformers"`` does not load transformers), each package's files
  sorted by their path inside it, packages in the order named, concatenated byte for byte.
  The corpus is pinned by the packages' versions; :func:`corpus_info` records them and a
  sha256 over the concatenated bytes, so two runs on different installs are told apart (the
  experiment's fingerprint includes it). E.g. ``"pysource:torch,transformers,sympy"`` (the
  gpu-code preset's): 1.26e8 bytes with torch 2.13 (46 MB), transformers 5.24 (54 MB) and sympy
  (26 MB).

``code_dataset()``: the Python source of the pinned Jinja2 release, byte-tokenized (the
adaptation corpus of ``tokenformer adapt --data code`` and the adaptation benchmark).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError
from .corpus import cached_corpus
from .datasets import TokenDataset
from .synthetic import SPEC_PREFIX as SYNTHETIC_PREFIX
from .synthetic import parse_spec, synthetic_dataset

PYSOURCE_PREFIX = "pysource:"
KINDS = (SYNTHETIC_PREFIX, PYSOURCE_PREFIX)


def parse_corpus(spec: str) -> tuple[str, Any]:
    """``("synthetic", bytes)`` or ``("pysource", (package, …))``; one error line otherwise."""
    if spec.startswith(SYNTHETIC_PREFIX):
        return "synthetic", parse_spec(spec)
    if spec.startswith(PYSOURCE_PREFIX):
        names = tuple(n.strip() for n in spec.removeprefix(PYSOURCE_PREFIX).split(","))
        if not all(n.isidentifier() for n in names) or len(set(names)) != len(names):
            raise ConfigError(f"corpus {spec!r}: expected 'pysource:<package>[,<package>…]' "
                              f"naming distinct top-level packages")
        return "pysource", names
    raise ConfigError(f"corpus {spec!r}: expected 'synthetic:<bytes>' or "
                      f"'pysource:<package>[,…]'")


def _package_files(name: str) -> tuple[str, list[Path]]:
    """A package's version and its ``*.py`` files sorted by their path inside the package."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"corpus pysource: package {name!r} is not installed (as a package "
                        f"folder) in this environment")
    root = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    files = sorted((p for p in root.rglob("*.py") if p.is_file()),
                   key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"corpus pysource: package {name!r} at {root} has no .py files")
    return version, files


def pysource_documents(names: tuple[str, ...]) -> list[tuple[str, str]]:
    """The corpus of ``names`` as documents, one per file (``package/relative/path.py``), in
    corpus order (what :func:`tokenformer.data.heldout.split_documents` holds out from);
    invalid UTF-8 becomes U+FFFD, as in the prepared corpus."""
    out = []
    for name in names:
        root, files = _package_root(name), _package_files(name)[1]
        out += [(f"{name}/{p.relative_to(root).as_posix()}",
                 p.read_bytes().decode("utf-8", errors="replace")) for p in files]
    return out


def _package_root(name: str) -> Path:
    """The install folder of an installed package (:func:`_package_files` checked it)."""
    spec = importlib.util.find_spec(name)
    return Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]


def pysource_bytes(names: tuple[str, ...]) -> bytes:
    """The concatenated source bytes of ``names``."""
    return b"".join(p.read_bytes() for name in names for p in _package_files(name)[1])


@functools.lru_cache(maxsize=8)
def pysource_info(names: tuple[str, ...]) -> dict[str, Any]:
    """What identifies the corpus of ``names``: each package's version, file count and bytes,
    and a sha256 of the concatenated bytes. Hashed streaming, once per process (the runner asks
    for it to find the prepared cache and again to record it)."""
    digest, packages, total = hashlib.sha256(), [], 0
    for name in names:
        version, files = _package_files(name)
        size = 0
        for p in files:
            data = p.read_bytes()
            digest.update(data)
            size += len(data)
        packages.append({"name": name, "version": version, "files": len(files), "bytes": size})
        total += size
    return {"packages": packages, "bytes": total, "sha256": digest.hexdigest()}


def corpus_info(spec: str) -> dict[str, Any]:
    """What a results.json records about the corpus ``spec`` (pysource: versions and hash)."""
    kind, arg = parse_corpus(spec)
    if kind == "synthetic":
        return {"spec": spec, "bytes": arg}
    return {"spec": spec, **pysource_info(arg)}


def corpus_dataset(spec: str, progress: bool | None = True,
                   cache_dir: str | Path | None = None) -> TokenDataset:
    """The corpus ``spec`` prepared byte-level on first use and cached (``$TOKENFORMER_CACHE``
    or ``~/.cache/tokenformer``); a pysource corpus is prepared again when a package's files
    change (its recorded source names the versions and the hash)."""
    kind, arg = parse_corpus(spec)
    if kind == "synthetic":
        return synthetic_dataset(arg, cache_dir=cache_dir, progress=progress)
    info = pysource_info(arg)
    versions = ",".join(f"{p['name']}=={p['version']}" for p in info["packages"])
    source = f"tokenformer.data.corpora:pysource:{versions}:sha256={info['sha256']}"
    name = "pysource-" + "-".join(arg) + "-" + info["sha256"][:12]
    # invalid UTF-8 (rare in source files) becomes U+FFFD: the recorded hash is of the bytes read
    return cached_corpus(name, source, lambda: pysource_bytes(arg).decode("utf-8",
                                                                     errors="replace"),
                         "bytes", cache_dir, progress)


# ------------------------------------------------------------- the code corpus (adaptation)
# The Python source of one pinned package, byte-tokenized like the embedded corpus: the new
# domain of ``tokenformer adapt --data code`` and of the adaptation benchmark.
CODE_PACKAGE, CODE_VERSION = "Jinja2", "3.1.6"
CODE_SOURCE = f"{CODE_PACKAGE}=={CODE_VERSION}:jinja2/*.py"


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
    return cached_corpus(f"code-{CODE_PACKAGE.lower()}-{CODE_VERSION}", CODE_SOURCE, code_text,
                         "bytes", cache_dir, progress, val_fraction=0.1)
