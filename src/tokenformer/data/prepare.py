"""Preparing a dataset: text files, folders or a saved Hugging Face dataset (or GPT-NeoX indexed
data) tokenized into a prepared folder (:mod:`.datasets` reads it).

The validation split is the **last** ``val_fraction`` of the input bytes, contiguous (moved
forward to the next line break so no line is cut in two). Inputs are concatenated in the order
given (directories in sorted path order); each document ends with ``<|endoftext|>`` when the
tokenizer has one. The folder is built under a temporary name and renamed when complete.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from ..io.files import atomic_dir, atomic_write_text
from ..io.outputs import check_output
from ..io.paths import check_folder_files, has_regular_file, regular_file, sha256_file
from .datasets import (
    FORMAT,
    META_FILE,
    SPLITS,
    TokenDataset,
    describe_tokenizer,
    dtype_for_vocab,
)
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

_CHUNK_CHARS = 1 << 18  # text is tokenized in pieces of about this size, cut after a line break


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
                _progress(total, f"tokenizing ({describe_tokenizer(tokenizer)})", progress))
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
        "tokenizer_sha256": sha256_file(tok_file),
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
        raise DataError(f"{path} holds token id {top} but the tokenizer "
                        f"({describe_tokenizer(tokenizer)}) has {tok.vocab_size} tokens: pass the "
                        f"tokenizer that produced it")
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
