"""Corpus specs built by the package (tokenformer.data.corpora): the pysource corpus is the
sorted *.py files of the named packages, identified by a sha256 of exactly those bytes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import tokenformer
from tokenformer.data import corpora
from tokenformer.errors import ConfigError, DataError


def test_pysource_is_the_sorted_source_files_and_its_hash_is_theirs():
    root = Path(tokenformer.__file__).parent
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    expected = b"".join(p.read_bytes() for p in files)
    assert corpora.pysource_bytes(("tokenformer",)) == expected
    info = corpora.corpus_info("pysource:tokenformer")
    assert info["sha256"] == hashlib.sha256(expected).hexdigest()
    assert info["bytes"] == len(expected)
    assert info["packages"] == [{"name": "tokenformer", "version": info["packages"][0]["version"],
                                 "files": len(files), "bytes": len(expected)}]


@pytest.mark.parametrize("spec", ["pysource:", "pysource:a,a", "pysource:not-a-name", "text:x"])
def test_bad_specs_refused_in_one_line(spec):
    with pytest.raises(ConfigError, match="corpus"):
        corpora.parse_corpus(spec)


def test_missing_package_refused():
    with pytest.raises(DataError, match="not installed"):
        corpora.corpus_info("pysource:no_such_package_here")
