"""Token datasets: a prepared folder's ``train.bin``, ``val.bin`` and ``meta.json``, and batches.

:mod:`.prepare` writes such folders; :mod:`.corpus` prepares the embedded one.

A prepared directory holds the token ids of each split as raw little-endian ``uint16`` (vocab <=
65536) or ``uint32``, the tokenizer that produced them, and ``meta.json`` (written last) with the
tokenizer's identity and hash, the dtype and the token and UTF-8 byte counts of each split.
``val.bin`` is the last ``val_fraction`` of the input bytes and decodes to exactly the tail of
the corpus.

Batches are a pure function of ``(seed, step, split)``: a resumed run draws exactly the batches an
uninterrupted one draws, and DDP ranks take disjoint slices of the same global batch.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError, DataError, TokenFormerError
from ..io.paths import has_regular_file, sha256_file
from .tokenizer import (
    BYTES_MARKER,
    TOKENIZER_FILE,
    Tokenizer,
    load_tokenizer,
)

FORMAT = "tokenformer-tokens-v1"
META_FILE = "meta.json"
SPLITS = ("train", "val")


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest unsigned dtype holding every id of a ``vocab_size`` vocabulary."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise DataError(f"a vocabulary of {vocab_size} tokens is too large for the token files "
                    f"(at most 2**32 = {1 << 32} ids fit uint32)")


# ------------------------------------------------------------------------------------ the dataset
class TokenDataset:
    """A prepared directory (see :func:`prepare`): memory-mapped token ids and their metadata."""

    def __init__(self, path: Path, meta: dict, train: np.ndarray, val: np.ndarray) -> None:
        self.path = path
        self.meta = meta
        self.train = train
        self.val = val

    @classmethod
    def open(cls, path: str | Path) -> TokenDataset:
        path = Path(path)
        if not path.is_dir():
            raise DataError(f"no prepared dataset at {path} (create one with tokenformer prepare)")
        meta_path = path / META_FILE
        if not has_regular_file(meta_path, folder=path):
            raise DataError(f"{path} has no {META_FILE}: not a prepared dataset, or an "
                            f"interrupted one")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            dtype = meta["dtype"]
            vocab_size = int(meta["vocab_size"])
            counts = {s: int(meta[f"{s}_tokens"]) for s in SPLITS}
            for s in SPLITS:  # bytes_per_token needs them
                int(meta[f"{s}_bytes"])
            if meta["format"] != FORMAT:
                raise DataError(f"{meta_path} has format {meta['format']!r}, expected {FORMAT!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{meta_path} is corrupt ({type(exc).__name__}: {exc})") from None
        if dtype not in ("uint16", "uint32"):
            raise DataError(f"{meta_path} names dtype {dtype!r}; expected uint16 or uint32")
        if vocab_size > np.iinfo(dtype).max + 1:
            raise DataError(f"{meta_path}: a vocabulary of {vocab_size} does not fit {dtype}")
        _check_tokenizer_hash(path, meta)
        itemsize = np.dtype(dtype).itemsize
        arrays = {}
        for split in SPLITS:
            file = path / f"{split}.bin"
            expected = counts[split] * itemsize
            present = has_regular_file(file, folder=path)
            if not present or file.stat().st_size != expected or expected == 0:
                size = file.stat().st_size if present else "missing"
                raise DataError(f"{file} does not match {META_FILE} (expected {expected} bytes, "
                                f"found {size}): the dataset is corrupt; prepare it again")
            arrays[split] = np.memmap(file, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
        return cls(path, meta, arrays["train"], arrays["val"])

    def __repr__(self) -> str:
        m = self.meta
        return (f"TokenDataset({str(self.path)!r}, tokenizer={m['tokenizer']!r}, "
                f"vocab={m['vocab_size']}, train={m['train_tokens']:,}, val={m['val_tokens']:,})")

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer that produced the ids, rebuilt from the file :func:`prepare` saved."""
        try:
            return load_tokenizer(self.path)
        except TokenFormerError as exc:
            raise DataError(f"cannot load the tokenizer of {self.path}: {exc}") from None

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def tokens(self, split: str) -> np.ndarray:
        if split not in SPLITS:
            raise ConfigError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        return self.train if split == "train" else self.val

    def bytes_per_token(self, split: str = "val") -> float:
        """UTF-8 bytes of text per token: bits per byte = loss / ln 2 / bytes_per_token."""
        self.tokens(split)
        return self.meta[f"{split}_bytes"] / self.meta[f"{split}_tokens"]

    def check_model(self, vocab_size: int, seq_len: int, tokenizer: str | None = None) -> None:
        """DataError unless a model with this vocabulary and context can train on the data.

        ``tokenizer``: the identity of the tokenizer the model was trained with (e.g. a
        checkpoint's), if known; data from any other tokenizer is refused even if its ids fit.
        """
        if tokenizer is not None and tokenizer != self.meta["tokenizer"]:
            raise DataError(f"the data at {self.path} was tokenized with {self.meta['tokenizer']} "
                            f"but the model expects {tokenizer}")
        for split in SPLITS:
            self._require_length(split, seq_len)
        self.check_vocab(vocab_size, *SPLITS)

    def check_vocab(self, vocab_size: int, *splits: str) -> None:
        """DataError unless a model with ``vocab_size`` tokens can read ``splits``: the data's
        vocabulary fits the model's, and so does every id (:meth:`check_ids`). The one check of
        every command that runs a model on data (train, adapt, prune's calibration, eval)."""
        if self.vocab_size > vocab_size:
            raise DataError(f"the data at {self.path} uses a {self.vocab_size}-token vocabulary "
                            f"({self.meta['tokenizer']}) but the model has only {vocab_size}")
        self.check_ids(vocab_size, *splits)

    def check_ids(self, vocab_size: int, *splits: str) -> None:
        """DataError if a split holds an id beyond ``meta.json``'s or the model's vocabulary
        (ids past the model's would train or score the embedding's padding rows)."""
        for split in splits:
            top = self.max_id(split)
            if top >= min(vocab_size, self.vocab_size):
                raise DataError(f"the {split} split of {self.path} holds token id {top}, beyond "
                                f"the vocabulary ({self.vocab_size} tokens in {META_FILE}, "
                                f"{vocab_size} in the model): the dataset is corrupt; prepare "
                                f"it again")

    def max_id(self, split: str) -> int:
        """The largest token id in ``split`` (one pass over the memory-mapped file, then
        remembered)."""
        cache = self.__dict__.setdefault("_max_id", {})
        if split not in cache:
            cache[split] = int(self.tokens(split).max())
        return cache[split]

    def _require_length(self, split: str, seq_len: int) -> None:
        if seq_len <= 0:
            raise ConfigError(f"sequence length must be > 0, got {seq_len}")
        n = len(self.tokens(split))
        if n < seq_len + 1:
            raise DataError(f"the {split} split of {self.path} has {n} tokens, fewer than one "
                            f"sequence of {seq_len} + 1; use more text or a shorter seq_len")

    def batch(self, split: str, step: int, batch_size: int, seq_len: int, seed: int = 0,
              rank: int = 0, world_size: int = 1) -> torch.Tensor:
        """int64 input_ids ``[batch_size // world_size, seq_len]`` of random windows.

        The global batch depends only on ``(seed, step, split)``; rank r takes rows
        ``[r * b, (r + 1) * b)`` with ``b = batch_size // world_size``.
        """
        data = self.tokens(split)
        self._require_length(split, seq_len)
        if batch_size <= 0:
            raise ConfigError(f"batch size must be > 0, got {batch_size}")
        if world_size <= 0 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in a world of size {world_size}")
        if batch_size % world_size:
            raise ConfigError(f"batch size {batch_size} is not divisible by the world size "
                              f"{world_size}")
        if seed < 0 or step < 0:
            raise ConfigError(f"seed and step must be >= 0, got seed={seed}, step={step}")
        rng = np.random.default_rng([seed, step, SPLITS.index(split)])
        starts = rng.integers(0, len(data) - seq_len + 1, size=batch_size)
        per_rank = batch_size // world_size
        return _windows(data, starts[rank * per_rank:(rank + 1) * per_rank], seq_len)

    def eval_windows(self, split: str, seq_len: int, batch_size: int,
                     max_batches: int | None = None,
                     stride: int | None = None) -> Iterator[torch.Tensor]:
        """Deterministic evaluation batches: windows starting every ``stride`` tokens (default
        ``seq_len``, i.e. tiling the split; the last partial window is dropped). With
        ``max_batches``, ``max_batches * batch_size`` of them spread evenly from first to last."""
        data = self.tokens(split)
        self._require_length(split, seq_len)
        stride = seq_len if stride is None else stride
        if stride <= 0 or batch_size <= 0:
            raise ConfigError(f"stride and batch size must be > 0, got {stride}, {batch_size}")
        starts = np.arange(0, len(data) - seq_len + 1, stride)
        if max_batches is not None:
            k = max_batches * batch_size
            if k <= 0:
                raise ConfigError(f"max_batches must be > 0, got {max_batches}")
            if k < len(starts):
                starts = starts[np.arange(k) * (len(starts) - 1) // max(k - 1, 1)]
        for i in range(0, len(starts), batch_size):
            yield _windows(data, starts[i:i + batch_size], seq_len)


def _windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
    rows = data[starts[:, None] + np.arange(seq_len)]
    return torch.from_numpy(rows.astype(np.int64))


def _check_tokenizer_hash(path: Path, meta: dict) -> None:
    file = next((path / f for f in (TOKENIZER_FILE, BYTES_MARKER)
                 if has_regular_file(path / f, folder=path)), None)
    if file is None:
        raise DataError(f"{path} holds no tokenizer ({TOKENIZER_FILE} or {BYTES_MARKER})")
    if sha256_file(file) != meta.get("tokenizer_sha256"):
        raise DataError(f"{file} does not match the hash in {META_FILE}: the tokenizer was "
                        f"replaced or corrupted; prepare the dataset again")


def unigram_entropy(dataset: TokenDataset, split: str = "train") -> float:
    """Entropy of the split's token frequencies, in nats per token: the loss of the best model
    that ignores context (a trained LM should end far below it)."""
    data = dataset.tokens(split)
    counts = np.zeros(dataset.vocab_size, dtype=np.int64)
    for i in range(0, len(data), 1 << 24):
        chunk = np.bincount(data[i:i + (1 << 24)], minlength=dataset.vocab_size)
        if len(chunk) > dataset.vocab_size:
            raise DataError(f"{dataset.path}: token id {len(chunk) - 1} is outside the "
                            f"{dataset.vocab_size}-token vocabulary; the dataset is corrupt")
        counts += chunk
    p = counts[counts > 0] / len(data)
    return float(-(p * np.log(p)).sum())


def describe_tokenizer(spec: str | Path) -> str:
    """A tokenizer spec in a few words, for progress bars and messages."""
    return Path(spec).name if Path(str(spec)).exists() else str(spec)


def summary(dataset: TokenDataset) -> str:
    """A few lines for humans: tokens per split, vocabulary, bytes per token."""
    m = dataset.meta
    lines = [f"dataset      {dataset.path}",
             f"tokenizer    {m['tokenizer_spec']}  ({m['tokenizer']}), vocab {m['vocab_size']:,}, "
             f"{m['dtype']}"]
    for split in SPLITS:
        lines.append(f"{split:<13}{m[f'{split}_tokens']:,} tokens from {m[f'{split}_bytes']:,} "
                     f"bytes ({dataset.bytes_per_token(split):.3f} bytes/token)")
    return "\n".join(lines)
