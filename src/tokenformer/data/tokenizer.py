"""Tokenizers: the GPT-NeoX ``tokenizer.json`` the released models ship, and raw bytes.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``eos_token_id`` and ``identity`` (a string naming the tokenizer and hashing its definition, so a
prepared dataset can be checked against the model that reads it). :func:`train_bpe` trains a
byte-level BPE locally (``bpe:VOCAB`` in ``tokenformer prepare``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as _Tok
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import ConfigError
from ..io.files import atomic_write, atomic_write_text
from ..io.paths import has_regular_file, regular_file

TOKENIZER_FILE = "tokenizer.json"
BYTES_MARKER = "tokenizer_bytes.json"
BPE_PREFIX = "bpe:"
EOS_TOKEN = "<|endoftext|>"  # the end-of-text token of the GPT-NeoX tokenizer and ours
MIN_BPE_VOCAB = 257


class Tokenizer(Protocol):
    vocab_size: int
    eos_token_id: int | None
    identity: str

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def save(self, directory: str | Path) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, plus ``<|endoftext|>`` = 256 (vocab 257)."""

    vocab_size = 257
    eos_token_id = 256
    identity = "bytes-v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        atomic_write_text(Path(directory) / BYTES_MARKER, json.dumps({"type": "bytes"}) + "\n")


class HFTokenizer:
    """A ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file (no network, ever)."""

    def __init__(self, path: str | Path, folder: str | Path | None = None) -> None:
        """``folder``: the model or dataset folder ``path`` lies in (no links there)."""
        path = regular_file(path, "tokenizer file", folder=folder)
        raw = path.read_bytes()
        try:
            self._tok = _Tok.from_str(raw.decode("utf-8"))
        except Exception as exc:  # the tokenizers error types are not public
            raise ConfigError(f"{path} is not a valid tokenizer.json: {exc}") from None
        self._raw = raw
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self._tok.token_to_id(EOS_TOKEN)
        self.identity = f"tokenizer.json:sha256:{hashlib.sha256(raw).hexdigest()}"

    @classmethod
    def from_tokenizers(cls, tok) -> HFTokenizer:  # a tokenizers.Tokenizer
        self = cls.__new__(cls)
        self._tok = tok
        self._raw = tok.to_str().encode("utf-8")
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = tok.token_to_id(EOS_TOKEN)
        self.identity = f"tokenizer.json:sha256:{hashlib.sha256(self._raw).hexdigest()}"
        return self

    @property
    def backend(self):  # the underlying tokenizers.Tokenizer
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Encode in parallel (the ``tokenizers`` thread pool); ``add_special_tokens=False``
        skips any BOS/EOS template, as token files for training need."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids))

    def save(self, directory: str | Path) -> None:
        atomic_write(Path(directory) / TOKENIZER_FILE, lambda tmp: tmp.write_bytes(self._raw))


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """``"bytes"``, a ``tokenizer.json`` path, or a model directory holding either."""
    if str(spec) == "bytes":
        return ByteTokenizer()

    path = Path(spec)
    if path.is_dir():
        if has_regular_file(path / TOKENIZER_FILE, folder=path):
            return HFTokenizer(path / TOKENIZER_FILE, folder=path)
        if has_regular_file(path / BYTES_MARKER, folder=path):
            return ByteTokenizer()
        raise ConfigError(f"{path} holds no tokenizer ({TOKENIZER_FILE} or {BYTES_MARKER}); "
                          f"pass --tokenizer")
    return HFTokenizer(path)


def train_bpe(texts: Iterable[str], vocab_size: int, *, progress: bool | None = True,
              length: int | None = None) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2/NeoX style) on ``texts``, locally, with ``tokenizers``.

    The 256 byte symbols are always in the vocabulary, so any text encodes and decodes losslessly;
    ``<|endoftext|>`` is id 0 like in the GPT-NeoX tokenizer. ``length`` (the number of items in
    ``texts``) only sizes the progress bar.
    """
    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"a byte-level BPE needs a vocabulary of at least {MIN_BPE_VOCAB} "
                          f"(256 bytes + <|endoftext|>), got {vocab_size}")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=progress is not False and sys.stderr.isatty())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return HFTokenizer.from_tokenizers(tok)


def parse_bpe_spec(spec: str) -> int | None:
    """The vocabulary size of a ``bpe:VOCAB`` spec, or None if ``spec`` is not one."""
    if not spec.startswith(BPE_PREFIX):
        return None
    try:
        return int(spec[len(BPE_PREFIX):])
    except ValueError:
        raise ConfigError(f"expected bpe:VOCAB with an integer VOCAB, got {spec!r}") from None


def saved_tokenizer_folder(model_spec: str | Path) -> Path | None:
    """The folder holding the tokenizer saved beside a model (its directory, or the directory of
    a checkpoint file), or None when there is none."""
    path = Path(model_spec)
    folder = path if path.is_dir() else path.parent
    if path.exists() and any([has_regular_file(folder / name, folder=folder)
                              for name in (TOKENIZER_FILE, BYTES_MARKER)]):
        return folder
    return None


def resolve_tokenizer(model_spec: str | Path, config: Any,
                      tokenizer: str | Path | None = None) -> Tokenizer:
    """The tokenizer for a model: ``tokenizer`` if given, else the one saved beside the model
    (its directory, or the directory of a checkpoint file), else bytes for a 257-token
    vocabulary; checked against the model's vocabulary (``config.padded_vocab_size``)."""
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        folder = saved_tokenizer_folder(model_spec)
        if folder is not None:
            tok = load_tokenizer(folder)
        elif config.vocab_size == ByteTokenizer.vocab_size:
            tok = ByteTokenizer()
        else:
            raise ConfigError(f"no tokenizer found beside {model_spec}; pass --tokenizer "
                              f"(a tokenizer.json, or 'bytes')")
    if tok.vocab_size > config.padded_vocab_size:
        raise ConfigError(f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary has "
                          f"{config.padded_vocab_size} rows")
    return tok
