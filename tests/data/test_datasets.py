"""The data pipeline: prepare → token files → batches, the embedded corpus, and every bad input."""

from __future__ import annotations

import json
import math
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenformer.cli import main
from tokenformer.data.corpus import default_dataset, kjv_text
from tokenformer.data.datasets import TokenDataset, unigram_entropy
from tokenformer.data.prepare import prepare
from tokenformer.errors import ConfigError, DataError

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
        "All:\nSpeak, speak. Ünïcödé ✓ 😀 — ok\n") * 20


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def _decode_splits(ds: TokenDataset) -> tuple[str, str]:
    return ds.tokenizer.decode(ds.train.tolist()), ds.tokenizer.decode(ds.val.tolist())


@pytest.fixture(scope="module")
def byte_ds(tmp_path_factory) -> TokenDataset:
    root = tmp_path_factory.mktemp("byte_ds")
    return prepare(_write(root / "in.txt", TEXT), "bytes", root / "out", val_fraction=0.1,
                   progress=False)


# ------------------------------------------------------------------------------ round trips
def test_bytes_round_trip_and_meta(byte_ds):
    train, val = _decode_splits(byte_ds)
    assert train + val == TEXT
    assert TEXT.endswith(val) and train.endswith("\n")  # the tail, cut after a line break
    m = byte_ds.meta
    assert m["train_bytes"] == len(train.encode()) and m["val_bytes"] == len(val.encode())
    assert m["train_bytes"] + m["val_bytes"] == len(TEXT.encode())
    assert abs(m["val_bytes"] / len(TEXT.encode()) - 0.1) < 0.02
    # bytes: one token per byte, plus <|endoftext|> closing the document (in the val split)
    assert (m["train_tokens"], m["val_tokens"]) == (m["train_bytes"], m["val_bytes"] + 1)
    assert byte_ds.val[-1] == 256 and m["vocab_size"] == 257 and m["dtype"] == "uint16"
    assert byte_ds.bytes_per_token("train") == 1.0
    assert byte_ds.bytes_per_token("val") == m["val_bytes"] / (m["val_bytes"] + 1)


def test_tiny_bpe_round_trip(tmp_path):
    ds = prepare(_write(tmp_path / "in.txt", TEXT), "bpe:300", tmp_path / "out",
                 val_fraction=0.1, progress=False)
    train, val = _decode_splits(ds)
    assert train + val == TEXT
    assert ds.meta["vocab_size"] == 300 and (ds.path / "tokenizer.json").is_file()
    assert ds.meta["train_tokens"] < ds.meta["train_bytes"]  # merges were learnt
    assert int(max(ds.train.max(), ds.val.max())) < 300
    # the tokenizer is trained on the training text only and reproducibly
    again = prepare(tmp_path / "in.txt", "bpe:300", tmp_path / "again", val_fraction=0.1,
                    progress=False)
    assert again.meta["tokenizer"] == ds.meta["tokenizer"]
    assert np.array_equal(again.train, ds.train)


def test_several_inputs_and_directories(tmp_path):
    a = _write(tmp_path / "a.txt", "alpha line\n" * 30)
    _write(tmp_path / "dir" / "2.txt", "second file\n" * 30)
    _write(tmp_path / "dir" / "1.txt", "first file\n" * 30)
    _write(tmp_path / "dir" / ".hidden", b"\xff not text, skipped")
    ds = prepare([a, tmp_path / "dir"], "bytes", tmp_path / "out", val_fraction=0.2,
                 progress=False)
    ids = np.concatenate([ds.train, ds.val])
    assert int((ids == 256).sum()) == 3  # one <|endoftext|> closing each document
    docs = bytes(ids[ids != 256].astype(np.uint8)).decode()
    assert docs == "alpha line\n" * 30 + "first file\n" * 30 + "second file\n" * 30
    assert ds.meta["documents"] == 3


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.text(min_size=1, max_size=30).filter(lambda s: "\r" not in s),
                      min_size=2, max_size=30),
       val_fraction=st.floats(0.05, 0.6))
def test_any_text_round_trips(tmp_path, lines, val_fraction):
    text = "\n".join(lines) + "\n"
    raw = text.encode()
    work = Path(tempfile.mkdtemp(dir=tmp_path))  # hypothesis reruns examples in one tmp_path
    out = work / "out"
    try:
        ds = prepare(_write(work / "in.txt", text), "bytes", out, val_fraction=val_fraction,
                     progress=False)
    except DataError as exc:  # too little text to hold out a split: never a partial output
        assert "too small" in str(exc) and not out.exists()
        return
    train, val = _decode_splits(ds)
    assert train + val == text and train and val
    requested = max(1, round(len(raw) * val_fraction))
    cut = len(raw) - requested
    assert 0 < ds.meta["val_bytes"] <= requested  # the cut only moves forward...
    assert train.endswith("\n") or b"\n" not in raw[cut:-1]  # ...to the next line break


@pytest.mark.skipif(not (SHARED / "gpt-neox-20b-tokenizer.json").is_file(),
                    reason="../shared/data/gpt-neox-20b-tokenizer.json not present")
def test_gpt_neox_tokenizer_json(tmp_path):
    import hashlib

    from tokenizers import Tokenizer

    tok_path = SHARED / "gpt-neox-20b-tokenizer.json"
    ds = prepare(_write(tmp_path / "in.txt", TEXT), tok_path, tmp_path / "out", progress=False)
    assert ds.meta["vocab_size"] == 50277 and ds.meta["dtype"] == "uint16"
    digest = hashlib.sha256(tok_path.read_bytes()).hexdigest()
    assert ds.meta["tokenizer"] == f"tokenizer.json:sha256:{digest}"
    assert "".join(_decode_splits(ds)) == TEXT
    reference = Tokenizer.from_file(str(tok_path))  # the ids are the tokenizer's own
    train_text = _decode_splits(ds)[0]
    assert ds.train.tolist() == reference.encode(train_text).ids


def test_large_vocab_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    text = " ".join(f"w{i}" for i in range(0, 70_000, 997)) + "\n"
    ds = prepare(_write(tmp_path / "in.txt", text * 4), tmp_path / "tok.json", tmp_path / "out",
                 val_fraction=0.25, progress=False)
    assert ds.meta["dtype"] == "uint32" and ds.train.dtype == np.dtype("<u4")
    assert ds.train[:71].tolist() == list(range(0, 70_000, 997))
    assert (tmp_path / "out" / "train.bin").stat().st_size == 4 * ds.meta["train_tokens"]


# ------------------------------------------------------------------------------------ batches
def test_batch_is_a_pure_function_of_seed_step_split(byte_ds):
    b = byte_ds.batch("train", step=3, batch_size=8, seq_len=16, seed=1)
    assert b.dtype == torch.int64 and b.shape == (8, 16)
    assert torch.equal(b, byte_ds.batch("train", 3, 8, 16, seed=1))
    assert not torch.equal(b, byte_ds.batch("train", 4, 8, 16, seed=1))
    assert not torch.equal(b, byte_ds.batch("train", 3, 8, 16, seed=2))
    train = bytes(byte_ds.train.astype(np.uint8))
    for row in b.tolist():  # every row is a contiguous window of the training tokens
        assert bytes(row) in train
    val = byte_ds.batch("val", 3, 8, 16, seed=1)
    val_ids = byte_ds.val.tolist()
    for row in val.tolist():
        assert any(val_ids[i:i + 16] == row for i in range(len(val_ids) - 15))


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_slices_concatenate_to_the_global_batch(byte_ds, world_size):
    full = byte_ds.batch("train", 7, 8, 12, seed=5)
    parts = [byte_ds.batch("train", 7, 8, 12, seed=5, rank=r, world_size=world_size)
             for r in range(world_size)]
    assert all(p.shape == (8 // world_size, 12) for p in parts)
    assert torch.equal(torch.cat(parts), full)


def test_batches_cover_the_split(tmp_path):
    rng = np.random.default_rng(0)  # aperiodic text, so a window's position is unambiguous
    text = "".join(rng.choice(list("abcdefghij \n"), size=4000))
    ds = prepare(_write(tmp_path / "a.txt", text), "bytes", tmp_path / "out", progress=False)
    train, T = bytes(ds.train.astype(np.uint8)), 16
    starts = [train.find(bytes(row)) for s in range(40) for row in ds.batch("train", s, 32, T)
              .tolist()]
    assert min(starts) >= 0  # contiguous windows of the split...
    assert min(starts) < len(train) * 0.02 and max(starts) > len(train) * 0.95  # ...anywhere


def test_eval_windows_tile_the_split_deterministically(byte_ds):
    T, B = 10, 7
    windows = list(byte_ds.eval_windows("val", T, B))
    again = list(byte_ds.eval_windows("val", T, B))
    assert all(torch.equal(a, b) for a, b in zip(windows, again, strict=True))
    flat = torch.cat(windows).flatten()
    n_windows = len(byte_ds.val) // T  # non-overlapping tiles from token 0; the tail is dropped
    assert flat.tolist() == byte_ds.val[:n_windows * T].tolist()
    assert [len(w) for w in windows] == [B] * (n_windows // B) + (
        [n_windows % B] if n_windows % B else [])


def test_eval_windows_max_batches_spread_evenly(byte_ds):
    T, B = 8, 4
    ids = byte_ds.val.tolist()
    windows = torch.cat(list(byte_ds.eval_windows("val", T, B, max_batches=3)))
    assert windows.shape == (12, T)
    last_tile = (len(ids) - T) // T * T
    starts = []
    for row in windows.tolist():
        starts.append(next(i for i in range(0, len(ids) - T + 1, T) if ids[i:i + T] == row))
    assert starts[0] == 0 and starts[-1] == last_tile
    gaps = np.diff(starts)
    assert gaps.min() > 0 and gaps.max() - gaps.min() <= T  # even spacing, to one tile
    strided = next(byte_ds.eval_windows("val", T, B, stride=3))
    assert strided[1].tolist() == ids[3:3 + T]


# ------------------------------------------------------------------------ the default corpus
def test_default_dataset_offline_and_cached(tmp_path, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the default dataset must never touch the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setenv("TOKENFORMER_CACHE", str(tmp_path / "cache"))
    ds = default_dataset(progress=False)
    assert ds.path.parent == tmp_path / "cache"
    text = kjv_text()
    assert text.startswith("The First Book of Moses, called Genesis\n\nIn the beginning God "
                           "created the heaven and the earth.")
    assert text.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert "[" not in text and len(text.encode()) > 4_000_000
    assert ds.meta["train_bytes"] + ds.meta["val_bytes"] == len(text.encode())
    assert ds.tokenizer.decode(ds.val.tolist()) == text[-len(ds.tokenizer.decode(
        ds.val.tolist())):]
    mtime = (ds.path / "train.bin").stat().st_mtime_ns
    start = time.perf_counter()
    again = default_dataset(progress=False)
    assert time.perf_counter() - start < 0.5 and again.path == ds.path
    assert (ds.path / "train.bin").stat().st_mtime_ns == mtime  # reused, not rebuilt
    # a damaged cache is rebuilt, not trusted
    (ds.path / "val.bin").write_bytes(b"\x00\x01")
    assert default_dataset(progress=False).meta == ds.meta


# --------------------------------------------------------------------------------- entropy
def test_unigram_entropy_by_hand(tmp_path):
    # 11 bytes, val 45 % → cut at byte 6, moved after the next line break: train "aaab\ncc\n"
    ds = prepare(_write(tmp_path / "in.txt", "aaab\ncc\ndd\n"), "bytes", tmp_path / "out",
                 val_fraction=0.45, progress=False)
    assert _decode_splits(ds) == ("aaab\ncc\n", "dd\n")
    # train counts a:3 b:1 \n:2 c:2 of 8
    expected = -(3 / 8 * math.log(3 / 8) + 1 / 8 * math.log(1 / 8) + 2 * (2 / 8) * math.log(2 / 8))
    assert unigram_entropy(ds) == pytest.approx(expected, rel=1e-12)
    # val: d d \n <|endoftext|>
    assert unigram_entropy(ds, "val") == pytest.approx(1.5 * math.log(2), rel=1e-12)
    assert ds.bytes_per_token("val") == 3 / 4


# ------------------------------------------------------------------------------- bad data
def _cli_fails(capsys, argv: list[str], out: Path, needle: str) -> None:
    assert main(argv) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.mark.parametrize("case", ["empty", "undecodable", "missing", "empty_dir", "vocab_dtype",
                                  "bad_bpe", "val_fraction", "late_undecodable"])
def test_bad_inputs_fail_cleanly(tmp_path, capsys, case):
    out = tmp_path / "out"
    tokenizer = "bytes"
    inputs: list[Path] = []
    if case == "empty":
        inputs, needle = [_write(tmp_path / "e.txt", "")], "empty"
    elif case == "undecodable":
        inputs, needle = [_write(tmp_path / "bad.txt", b"hello\xff world\n")], "offset 5"
    elif case == "late_undecodable":  # fails after the first file was already tokenized
        inputs = [_write(tmp_path / "a.txt", TEXT), _write(tmp_path / "z.txt", b"ok\n\xc3(")]
        needle = "z.txt is not UTF-8 text: byte 0xc3 at offset 3"
    elif case == "missing":
        inputs, needle = [tmp_path / "nope.txt"], "not found"
    elif case == "empty_dir":
        (tmp_path / "d").mkdir()
        inputs, needle = [tmp_path / "d"], "holds no files"
    elif case == "vocab_dtype":
        inputs, needle = [_write(tmp_path / "a.txt", TEXT)], "too large"
        tokenizer = f"bpe:{(1 << 32) + 1}"
    elif case == "bad_bpe":
        inputs, needle = [_write(tmp_path / "a.txt", TEXT)], "integer VOCAB"
        tokenizer = "bpe:lots"
    else:
        inputs, needle = [_write(tmp_path / "a.txt", TEXT)], "val_fraction"
    expected = ConfigError if case in ("bad_bpe",) else (DataError, ConfigError)
    with pytest.raises(expected, match=None) as info:
        prepare(inputs, tokenizer, out, val_fraction=1.5 if case == "val_fraction" else 0.05,
                progress=False)
    assert needle in str(info.value)
    argv = ["prepare", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out),
            "--no-progress"]
    if case == "val_fraction":
        argv += ["--val-fraction", "1.5"]
    _cli_fails(capsys, argv, out, needle)


def test_output_is_never_overwritten_by_accident(tmp_path, capsys, byte_ds):
    src = _write(tmp_path / "a.txt", TEXT)
    out = tmp_path / "out"
    prepare(src, "bytes", out, progress=False)
    with pytest.raises(DataError, match="already exists"):
        prepare(src, "bytes", out, progress=False)
    assert main(["prepare", str(src), "--out", str(out), "--no-progress"]) != 0
    assert "already exists" in capsys.readouterr().err
    assert main(["prepare", str(src), "--out", str(out), "--no-progress", "--overwrite",
                 "--tokenizer", "bpe:280"]) == 0
    assert TokenDataset.open(out).meta["vocab_size"] == 280
    summary = capsys.readouterr().out
    assert "bytes/token" in summary and "unigram entropy" in summary


def test_too_short_for_one_sequence(tmp_path):
    ds = prepare(_write(tmp_path / "a.txt", "tiny\ntext\n"), "bytes", tmp_path / "out",
                 val_fraction=0.5, progress=False)
    ds.check_model(vocab_size=257, seq_len=4)
    for call in (lambda: ds.check_model(257, 64), lambda: ds.batch("train", 0, 2, 64),
                 lambda: next(ds.eval_windows("val", 64, 2))):
        with pytest.raises(DataError, match="fewer than one sequence"):
            call()


def test_meta_must_match_the_model(byte_ds):
    with pytest.raises(DataError, match="257-token vocabulary"):
        byte_ds.check_model(vocab_size=256, seq_len=8)
    byte_ds.check_model(vocab_size=384, seq_len=8)  # a padded embedding is fine
    byte_ds.check_model(384, 8, tokenizer="bytes-v1")
    with pytest.raises(DataError, match="tokenized with bytes-v1"):
        byte_ds.check_model(50304, 8, tokenizer="tokenizer.json:sha256:abc")


def test_unwritable_cache_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DataError, match="TOKENFORMER_CACHE"):
        default_dataset(cache_dir=tmp_path / "file" / "cache", progress=False)


@pytest.mark.parametrize("damage", ["no_dir", "no_meta", "bad_json", "truncated", "tokenizer",
                                    "dtype", "missing_key"])
def test_corrupt_directories_are_refused(tmp_path, damage):
    out = tmp_path / "out"
    prepare(_write(tmp_path / "a.txt", TEXT), "bytes", out, progress=False)
    meta = json.loads((out / "meta.json").read_text())
    needle = {"no_dir": "no prepared dataset", "no_meta": "has no meta.json",
              "bad_json": "corrupt", "truncated": "does not match meta.json",
              "tokenizer": "does not match the hash", "dtype": "does not fit uint16",
              "missing_key": "corrupt"}[damage]
    if damage == "no_dir":
        out = tmp_path / "elsewhere"
    elif damage == "no_meta":
        (out / "meta.json").unlink()
    elif damage == "bad_json":
        (out / "meta.json").write_text("{ not json")
    elif damage == "truncated":
        with open(out / "train.bin", "r+b") as f:
            f.truncate(10)
    elif damage == "tokenizer":
        (out / "tokenizer_bytes.json").write_text('{"type": "something else"}\n')
    elif damage == "dtype":
        (out / "meta.json").write_text(json.dumps(meta | {"vocab_size": 70_000}))
    else:
        del meta["val_bytes"]
        (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=needle):
        TokenDataset.open(out)


def test_bad_batch_arguments(byte_ds):
    with pytest.raises(ConfigError, match="not divisible"):
        byte_ds.batch("train", 0, batch_size=6, seq_len=8, world_size=4)
    with pytest.raises(ConfigError, match="rank 2"):
        byte_ds.batch("train", 0, 4, 8, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="unknown split"):
        byte_ds.batch("test", 0, 4, 8)


# ----------------------------------------------------------------- other input formats
def _write_indexed(prefix: Path, docs: list[list[int]], dtype=np.uint16, code: int = 8) -> Path:
    """A GPT-NeoX/Megatron MMapIndexedDataset, written from the format's description."""
    sizes = np.array([len(d) for d in docs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype("<i8") * np.dtype(dtype).itemsize
    prefix.with_suffix(".bin").write_bytes(b"".join(np.asarray(d, dtype).tobytes() for d in docs))
    prefix.with_suffix(".idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
        + struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1)
        + sizes.tobytes() + pointers.tobytes() + np.arange(len(docs) + 1, dtype="<i8").tobytes())
    return prefix.with_suffix(".idx")


def test_gpt_neox_indexed_dataset(tmp_path, capsys):
    texts = ["First document ✓\n", "Second one\n" * 10, "Third\n" * 30]
    docs = [[*t.encode(), 256] for t in texts]  # NeoX appends the end-of-document id
    idx = _write_indexed(tmp_path / "corpus_text_document", docs)
    ds = prepare(idx, "bytes", tmp_path / "out", val_fraction=0.65, progress=False)
    assert ds.train.tolist() + ds.val.tolist() == [i for d in docs for i in d]
    assert ds.val.tolist() == docs[2]  # the split starts at the next document boundary
    assert ds.meta["train_bytes"] == len((texts[0] + texts[1]).encode())
    assert ds.meta["val_bytes"] == len(texts[2]) and ds.meta["documents"] == 3
    # the .bin path and the CLI work too; int32 storage is converted to the smallest dtype
    _write_indexed(tmp_path / "wide", docs, dtype=np.int32, code=4)
    assert main(["prepare", str(tmp_path / "wide.bin"), "--out", str(tmp_path / "o2"),
                 "--val-fraction", "0.65", "--no-progress"]) == 0
    assert TokenDataset.open(tmp_path / "o2").train.tolist() == ds.train.tolist()
    assert "bytes/token" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["id_too_large", "truncated", "mixed", "bpe"])
def test_bad_indexed_datasets(tmp_path, capsys, case):
    docs = [[*b"some text\n", 256]] * 5
    if case == "id_too_large":
        docs = [*docs, [300, 256]]
    idx = _write_indexed(tmp_path / "d", docs)
    inputs, tokenizer = [str(idx)], "bytes"
    needle = {"id_too_large": "token id 300", "truncated": "truncated",
              "mixed": "must be the only input", "bpe": "already tokenized"}[case]
    if case == "truncated":
        with open(tmp_path / "d.bin", "r+b") as f:
            f.truncate(20)
    elif case == "mixed":
        inputs.append(str(_write(tmp_path / "a.txt", TEXT)))
    elif case == "bpe":
        tokenizer = "bpe:300"
    with pytest.raises((DataError, ConfigError), match=needle):
        prepare(inputs, tokenizer, tmp_path / "out", progress=False)
    _cli_fails(capsys, ["prepare", *inputs, "--tokenizer", tokenizer, "--out",
                        str(tmp_path / "out"), "--no-progress"], tmp_path / "out", needle)


class _FakeHF:
    """The slice of the ``datasets`` API that reading a saved dataset uses."""

    class Value:
        def __init__(self, dtype: str) -> None:
            self.dtype = dtype

    class Dataset:
        def __init__(self, columns: dict[str, list]) -> None:
            self.columns = columns
            self.features = {k: _FakeHF.Value("string" if isinstance(v[0], str) else "int64")
                             for k, v in columns.items()}

        def __getitem__(self, key: str) -> list:
            return self.columns[key]

    class DatasetDict(dict):
        pass


def _save_fake_hf(path: Path, dataset) -> Path:
    path.mkdir()
    marker = "dataset_dict.json" if isinstance(dataset, dict) else "dataset_info.json"
    (path / marker).write_text("{}")
    (path / "state.json").write_text("{}")
    return path


def test_saved_hf_dataset_directory(tmp_path, monkeypatch, capsys):
    import types

    rows = {"train": ["row one\n", "row two ✓\n", "row three\n"] * 10, "test": ["held\n"]}
    saved = {"all": _FakeHF.DatasetDict({k: _FakeHF.Dataset({"text": v, "n": [1] * len(v)})
                                         for k, v in rows.items()}),
             "one": _FakeHF.Dataset({"content": rows["train"]}),
             "ambiguous": _FakeHF.Dataset({"a": ["x"], "b": ["y"]})}
    module = types.ModuleType("datasets")
    module.DatasetDict = _FakeHF.DatasetDict
    module.load_from_disk = lambda p: saved[Path(p).name]
    monkeypatch.setitem(sys.modules, "datasets", module)
    for name in saved:
        _save_fake_hf(tmp_path / name, saved[name])
    for name in ("all", "one"):  # a DatasetDict reads its train split; one string column is text
        ds = prepare(tmp_path / name, "bytes", tmp_path / f"out_{name}", progress=False)
        ids = np.concatenate([ds.train, ds.val])
        assert int((ids == 256).sum()) == 30  # one document per row
        assert bytes(ids[ids != 256].astype(np.uint8)).decode() == "".join(rows["train"])
    with pytest.raises(DataError, match="which column"):
        prepare(tmp_path / "ambiguous", "bytes", tmp_path / "out_x", progress=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed: a clear error
    _cli_fails(capsys, ["prepare", str(tmp_path / "one"), "--out", str(tmp_path / "o"),
                        "--no-progress"], tmp_path / "o", "needs the 'datasets' package")


def test_real_saved_hf_dataset(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    rows = ["row one\n", "row two ✓\n", "row three\n"] * 10
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": rows, "id": list(range(30))}),
        "validation": datasets.Dataset.from_dict({"text": ["unused\n"], "id": [0]}),
    }).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_dict({"body": rows}).save_to_disk(str(tmp_path / "single"))
    for name in ("saved", "single"):
        ds = prepare(tmp_path / name, "bytes", tmp_path / f"out_{name}", progress=False)
        ids = np.concatenate([ds.train, ds.val])
        assert int((ids == 256).sum()) == 30
        assert bytes(ids[ids != 256].astype(np.uint8)).decode() == "".join(rows)


def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    src = _write(tmp_path / "a.txt", TEXT)
    for tty, progress, shown in ((True, True, True), (True, None, True), (True, False, False),
                                 (False, True, False)):
        err = Terminal() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        prepare(src, "bytes", tmp_path / f"out{tty}{progress}", progress=progress)
        assert ("tokenizing (bytes)" in err.getvalue()) == shown, (tty, progress)
