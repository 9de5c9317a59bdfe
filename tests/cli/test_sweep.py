"""Issue 27, the sweep: every CLI command × every path argument × every kind of bad path gives
exit code 2 and exactly one ``error:`` line that names the path, at once.

One table, :data:`ROWS`, lists each command with one of its path arguments and a minimal valid
rest of the command line; a new command or flag is covered by adding a row. The kinds of bad path
(:data:`FILE_KINDS`, :data:`FOLDER_KINDS`, :data:`OUTPUT_KINDS`):

* a file argument: missing, empty, a FIFO, a directory, not UTF-8 (bytes no reader accepts),
  truncated (the valid file cut in half);
* a folder argument: missing, an empty folder, a FIFO, a file (not UTF-8) where the folder
  belongs, and, for each file the command reads inside it (the row's ``inner``), that file as a
  FIFO, a directory, not UTF-8, truncated, and a symbolic link to a valid copy outside the folder
  (the symlink rule of docs/reliability.md; not for a user's corpus, where links are followed);
* an output argument: a FIFO, the wrong kind (a file for a folder, a folder for a file), and a
  path whose parent is a file.

Every case runs the CLI in-process (``tokenformer.cli.main``): a few tens of milliseconds each. A
FIFO is watched by a thread that notices the moment anything opens it (and then lets the opener
go, so a hang is a failure, not a stuck test); an alarm stops anything else that takes longer
than :data:`LIMIT_S`. The error line must not be the catch-all for unexpected exceptions
("TOKENFORMER_DEBUG=1 shows the traceback"): a bad path is an expected failure with its own words.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenformer.cli import main

LIMIT_S = 20  # a case that runs longer hangs (each takes well under a second)

FILE_KINDS = ("missing", "empty", "fifo", "dir", "not-utf8", "truncated")
FOLDER_KINDS = ("missing", "empty", "fifo", "file", "loop")  # plus, per inner file: INNER_KINDS
INNER_KINDS = ("fifo", "dir", "not-utf8", "truncated", "symlink")
OUTPUT_KINDS = ("fifo", "wrong-kind", "parent-file", "loop")
NOT_UTF8 = b"\xff\xfe\x00\x80 not \xc3\x28 UTF-8 \xe2\x82 and no format at all \xa0\xa1" * 4


# ---------------------------------------------------------------------------------- fixtures
@dataclasses.dataclass(frozen=True)
class Kind:
    """A kind of path argument: folder or file, and the files a reader opens inside a folder.
    ``corpus``: a user's folder of texts or images, where links are followed (the symlink rule
    is for the folders this package writes: models, adapters, datasets, runs)."""

    folder: bool
    inner: tuple[str, ...] = ()
    corpus: bool = False


KINDS = {
    "model": Kind(True, ("config.json", "model.safetensors", "tokenizer.json")),
    "topk-model": Kind(True, ("config.json", "model.safetensors", "tokenizer.json")),
    "official-dir": Kind(True, ("pytorch_model.bin", "config.json")),
    "dataset": Kind(True, ("meta.json", "train.bin", "tokenizer_bytes.json")),
    "adapter": Kind(True, ("adapter_config.json", "adapter.safetensors")),
    "run": Kind(True, ("config.json", "metrics.jsonl")),
    "vision-model": Kind(True, ("config.json", "model.safetensors")),
    "images": Kind(True, ("train/c0/a.png", "val/c0/a.png"), corpus=True),
    "corpus": Kind(True, ("a.txt",), corpus=True),
    "text": Kind(False),
    "tokenizer": Kind(False),
    "yaml": Kind(False),
    "config-json": Kind(False),
    "official-bin": Kind(False),
}


def _tiny_lm(vocab: int, **overrides):
    from tokenformer import TokenFormerConfig, TokenFormerLM

    return TokenFormerLM(TokenFormerConfig(
        vocab_size=vocab, eos_token_id=0, hidden_size=32, num_layers=1, num_heads=2,
        qkv_tokens=4, proj_tokens=4, ffn_tokens=8, max_seq_len=32, **overrides))


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """One valid instance of every kind of path argument (copied, then damaged, per case)."""
    import matplotlib.pyplot  # noqa: F401  imports a first case would otherwise pay for, in its
    import torch
    import transformers  # noqa: F401  time limit (seconds on a busy machine)
    from PIL import Image

    from tokenformer.data.corpus import kjv_text
    from tokenformer.data.prepare import prepare
    from tokenformer.data.tokenizer import train_bpe
    from tokenformer.models.official import official_config, save_official
    from tokenformer.models.vit import TokenFormerViT, TokenFormerViTConfig
    from tokenformer.ops import adapters as ad

    root = tmp_path_factory.mktemp("pristine")
    text = kjv_text()[:20_000]
    paths = {"text": root / "text.txt", "corpus": root / "corpus"}
    paths["text"].write_text(text)
    paths["corpus"].mkdir()
    (paths["corpus"] / "a.txt").write_text(text[:10_000])
    (paths["corpus"] / "b.txt").write_text(text[10_000:])
    tok = train_bpe([text], 260, progress=False)
    paths["tokenizer"] = root / "tok" / "tokenizer.json"
    paths["tokenizer"].parent.mkdir()
    tok.save(paths["tokenizer"].parent)

    torch.manual_seed(0)
    model = _tiny_lm(tok.vocab_size)
    paths["model"] = root / "model"
    model.save(paths["model"])
    tok.save(paths["model"])
    torch.manual_seed(1)  # a top-k model (a count and a fraction): what growth treats apart
    paths["topk-model"] = root / "topk-model"
    _tiny_lm(tok.vocab_size, ffn_top_k=3, proj_top_k=0.5).save(paths["topk-model"])
    tok.save(paths["topk-model"])
    paths["config-json"] = root / "config.json"
    shutil.copy(paths["model"] / "config.json", paths["config-json"])
    paths["official-bin"] = root / "pytorch_model.bin"
    save_official(model, paths["official-bin"])
    paths["official-dir"] = root / "official"
    paths["official-dir"].mkdir()
    shutil.copy(paths["official-bin"], paths["official-dir"])
    (paths["official-dir"] / "config.json").write_text(json.dumps(official_config(model.config)))

    paths["dataset"] = root / "dataset"
    prepare(paths["text"], "bytes", paths["dataset"], val_fraction=0.2, progress=False)
    ad.adapt(model, ffn=2, name="a")
    paths["adapter"] = ad.save_adapter(model, "a", root / "adapter")

    paths["yaml"] = root / "train.yaml"
    # one flow mapping: cut anywhere, it no longer parses (cut block YAML often still does)
    paths["yaml"].write_text(
        f"{{model: {{preset: tiny, hidden_size: 32, num_layers: 1, num_heads: 2,\n"
        f"         qkv_tokens: 4, proj_tokens: 4, ffn_tokens: 8, max_seq_len: 32}},\n"
        f" data: {paths['dataset']},\n steps: 2, batch_size: 2, seq_len: 16, warmup_steps: 0,\n"
        f" eval_interval: 0, eval_batches: 1, samples: 0, threads: 1, out: {root / 'run'}}}\n")
    assert main(["train", "--config", str(paths["yaml"]), "--no-progress"]) == 0
    paths["run"] = root / "run"

    vision = TokenFormerViT(TokenFormerViTConfig.from_name("vit-digits-tiny"))
    paths["vision-model"] = root / "vision"
    vision.save(paths["vision-model"])
    paths["images"] = root / "images"
    for split in ("train", "val"):
        for c in range(10):
            (paths["images"] / split / f"c{c}").mkdir(parents=True)
            Image.new("L", (8, 8), color=c * 20).save(paths["images"] / split / f"c{c}" / "a.png")
    return paths


# --------------------------------------------------------------------------------- the table
@dataclasses.dataclass(frozen=True)
class Row:
    """``argv``: the command line; ``{ARG}`` is the path under test, ``{kind}`` a valid instance
    of another kind, ``{NEW}``/``{NEW2}`` fresh output paths. ``kind``: what ``{ARG}`` is
    ("out-dir"/"out-file" for outputs). ``inner``: the files inside a folder this command reads
    (default: the kind's). ``exempt``: kinds that are valid input here, with the reason."""

    name: str
    argv: str
    kind: str
    inner: tuple[str, ...] | None = None
    exempt: tuple[tuple[str, str], ...] = ()


TRUNCATED_TEXT_IS_TEXT = ("truncated", "half a UTF-8 text file is a UTF-8 text file")
CUT_LOG_LINE = ("truncated:metrics.jsonl", "a metrics line cut short by a kill is dropped, by "
                                           "design (docs/reliability.md)")
ADAPT = "--tokens ffn=2 --steps 1 --seq-len 16 --batch-size 2 --eval-batches 1 --no-progress"
ROWS = [
    Row("prepare-input", "prepare {ARG} --out {NEW} --no-progress", "text",
        exempt=(TRUNCATED_TEXT_IS_TEXT, ("dir", "a folder of text files is an input too"))),
    Row("prepare-input-folder", "prepare {ARG} --out {NEW} --no-progress", "corpus",
        exempt=(("truncated:a.txt", TRUNCATED_TEXT_IS_TEXT[1]),
                ("dir:a.txt", "a sub-folder of text files is read too"))),
    Row("prepare-tokenizer", "prepare {text} --tokenizer {ARG} --out {NEW} --no-progress",
        "tokenizer"),
    Row("prepare-out", "prepare {text} --out {ARG} --no-progress", "out-dir"),
    Row("train-config", "train --config {ARG} --out {NEW} --no-progress", "yaml"),
    Row("train-data", "train --config {yaml} --data {ARG} --out {NEW} --no-progress", "dataset"),
    Row("train-init-from", "train --config {yaml} --init-from {ARG} --out {NEW} --no-progress",
        "model", inner=("config.json", "model.safetensors")),
    Row("train-resume", "train --resume {ARG} --steps 3 --no-progress", "run",
        exempt=(CUT_LOG_LINE,)),
    Row("train-out", "train --config {yaml} --out {ARG} --no-progress", "out-dir"),
    # growth inside a run (issue 36): a path is refused before the plan is even looked at
    Row("train-grow-at-config", "train --config {ARG} --grow-at 1:hidden=2x,width_noise=0.1 "
                                "--out {NEW} --no-progress", "yaml"),
    Row("train-grow-at-data", "train --config {yaml} --data {ARG} --grow-at 1:ffn=2x,layers=2 "
                              "--out {NEW} --no-progress", "dataset"),
    Row("train-grow-at-out", "train --config {yaml} --grow-at 1:qkv=2x --out {ARG} "
                             "--no-progress", "out-dir"),
    # a resume whose --grow-at differs from the run's recorded plan (none): the path first
    Row("train-resume-other-growth", "train --resume {ARG} --steps 3 --grow-at 2:ffn=2x "
                                     "--no-progress", "run", exempt=(CUT_LOG_LINE,)),
    Row("plot-runs", "plot {ARG} --out {NEW}.png", "run", inner=("metrics.jsonl",),
        exempt=(CUT_LOG_LINE,)),
    Row("plot-out", "plot {run} --out {ARG}", "out-file"),
    Row("info-model", "info {ARG}", "model", inner=("config.json", "model.safetensors")),
    Row("info-config", "info {ARG}", "config-json"),
    Row("info-official", "info {ARG}", "official-bin"),
    Row("generate-model", "generate {ARG} --prompt a --max-new-tokens 2", "model"),
    Row("generate-tokenizer", "generate {model} --tokenizer {ARG} --prompt a --max-new-tokens 2",
        "tokenizer"),
    Row("generate-adapter", "generate {model} --adapter {ARG} --prompt a --max-new-tokens 2",
        "adapter"),
    Row("eval-model", "eval {ARG} --data {text} --seq-len 16 --no-progress", "model"),
    Row("eval-data-text", "eval {model} --data {ARG} --seq-len 16 --no-progress", "text",
        exempt=(TRUNCATED_TEXT_IS_TEXT,)),
    Row("eval-data-dataset", "eval {model} --data {ARG} --seq-len 16 --no-progress", "dataset"),
    Row("eval-tokenizer", "eval {model} --data {text} --tokenizer {ARG} --seq-len 16 "
                          "--no-progress", "tokenizer"),
    Row("grow-model", "grow {ARG} --ffn 2x --out {NEW} --no-progress", "model"),
    Row("grow-out", "grow {model} --ffn 2x --out {ARG} --no-progress", "out-dir"),
    Row("grow-width-noise", "grow {ARG} --hidden 2x --width-noise 0.1 --out {NEW} "
                            "--no-progress", "model"),
    Row("grow-top-k-model", "grow {ARG} --layers 2 --ffn 2x --out {NEW} --no-progress",
        "topk-model"),
    Row("grow-top-k-out", "grow {topk-model} --layers 2 --out {ARG} --no-progress", "out-dir"),
    Row("prune-model", "prune {ARG} {NEW} --ffn 4 --by value", "model"),
    Row("prune-data", "prune {model} {NEW} --ffn 4 --data {ARG}", "dataset"),
    Row("prune-tokenizer", "prune {model} {NEW} --ffn 4 --tokenizer {ARG}", "tokenizer"),
    Row("prune-out", "prune {model} {ARG} --ffn 4 --by value", "out-dir"),
    Row("adapt-base", f"adapt {{ARG}} --data {{dataset}} --out {{NEW}} {ADAPT}", "model",
        inner=("config.json", "model.safetensors")),
    Row("adapt-data", f"adapt {{model}} --data {{ARG}} --out {{NEW}} {ADAPT}", "dataset"),
    Row("adapt-out", f"adapt {{model}} --data {{dataset}} --out {{ARG}} {ADAPT}", "out-dir"),
    Row("merge-base", "merge {ARG} --adapter {adapter} --out {NEW}", "model"),
    Row("merge-adapter", "merge {model} --adapter {ARG} --out {NEW}", "adapter"),
    Row("merge-out", "merge {model} --adapter {adapter} --out {ARG}", "out-dir"),
    Row("adapt-bench-out", "adapt-bench --preset test --out {ARG} --no-progress", "out-dir"),
    Row("convert-official-file", "convert official {ARG} {NEW}", "official-bin"),
    Row("convert-official-dir", "convert official {ARG} {NEW}", "official-dir"),
    Row("convert-official-tokenizer", "convert official {official-bin} {NEW} --tokenizer {ARG}",
        "tokenizer"),
    Row("convert-official-out", "convert official {official-bin} {ARG}", "out-dir"),
    Row("convert-to-hf-model", "convert to-hf {ARG} {NEW}", "model"),
    Row("convert-to-hf-tokenizer", "convert to-hf {model} {NEW} --tokenizer {ARG}", "tokenizer"),
    Row("convert-to-hf-out", "convert to-hf {model} {ARG}", "out-dir"),
    Row("convert-to-official-model", "convert to-official {ARG} {NEW}", "model"),
    Row("convert-to-official-tokenizer", "convert to-official {model} {NEW} --tokenizer {ARG}",
        "tokenizer"),
    Row("convert-to-official-out", "convert to-official {model} {ARG}", "out-dir"),
    Row("scale-data", "scale --plan --data {ARG}", "dataset"),
    Row("scale-data-run", "scale --data {ARG} --out {NEW} --no-progress", "dataset"),
    Row("scale-out", "scale --out {ARG} --no-progress", "out-dir"),
    Row("ablate-data", "ablate --study theta --task lm --data {ARG} --out {NEW} --no-progress",
        "dataset"),
    Row("ablate-out", "ablate --study theta --task lm --data {dataset} --out {ARG} "
                      "--no-progress", "out-dir"),
    Row("vision-train-data", "vision train --data {ARG} --steps 1 --workers 0 --out {NEW} "
                             "--no-progress", "images", inner=("train/c0/a.png",)),
    Row("vision-train-out", "vision train --steps 1 --out {ARG} --no-progress", "out-dir"),
    Row("vision-eval-model", "vision eval {ARG}", "vision-model"),
    Row("vision-eval-data", "vision eval {vision-model} --data {ARG} --workers 0", "images",
        inner=("val/c0/a.png",)),
    Row("vision-eval-png", "vision eval {vision-model} --confusion-png {ARG}", "out-file"),
]

# Known defects: (row, kind) -> reason, marked xfail(strict), so a fixed one must leave the table.
XFAIL: dict[tuple[str, str], str] = {}


def _cases() -> Iterator[object]:
    for row in ROWS:
        if row.kind.startswith("out-"):
            kinds = list(OUTPUT_KINDS)
        elif KINDS[row.kind].folder:
            inner = row.inner if row.inner is not None else KINDS[row.kind].inner
            kinds = [*FOLDER_KINDS, *(f"{k}:{f}" for f in inner for k in INNER_KINDS
                                      if not (k == "symlink" and KINDS[row.kind].corpus))]
        else:
            kinds = list(FILE_KINDS)
        exempt = dict(row.exempt)
        for kind in kinds:
            if kind in exempt:
                continue
            marks = ([pytest.mark.xfail(reason=XFAIL[row.name, kind], strict=True)]
                     if (row.name, kind) in XFAIL else [])
            yield pytest.param(row, kind, id=f"{row.name}-{kind}", marks=marks)


# ------------------------------------------------------------------------------ bad paths
def _damage(path: Path, kind: str, valid: Path, outside: Path) -> Path | None:
    """Make ``path`` (a copy of ``valid``, or absent) bad in the way ``kind`` says; returns the
    FIFO made, if any."""
    if kind != "missing" and not path.parent.exists():
        path.parent.mkdir(parents=True)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "empty":
        path.write_bytes(b"")
    elif kind in ("fifo",):
        os.mkfifo(path)
        return path
    elif kind == "dir":
        path.mkdir()
        (path / "inside").write_text("a folder where a file belongs\n")
    elif kind == "not-utf8":
        path.write_bytes(NOT_UTF8)
    elif kind == "truncated":
        data = valid.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif kind == "symlink":  # a valid copy, outside the folder
        outside.mkdir(parents=True, exist_ok=True)
        target = outside / valid.name
        shutil.copy(valid, target)
        path.symlink_to(target)
    return None


def _bad_argument(row: Row, kind: str, pristine: dict[str, Path], tmp: Path
                  ) -> tuple[Path, Path | None]:
    """The path under test, made bad; and the FIFO to watch, if any."""
    arg = tmp / "arg"  # one distinctive name: the error line must contain it
    if row.kind.startswith("out-"):
        if kind == "fifo":
            os.mkfifo(arg)
            return arg, arg
        if kind == "wrong-kind":
            if row.kind == "out-dir":
                arg.write_text("a file where a folder belongs\n")
            else:
                arg.mkdir()
            return arg, None
        if kind == "loop":
            _loop(arg)
            return arg, None
        (tmp / "parent").write_text("a file\n")  # parent-file
        return tmp / "parent" / "arg", None
    source = pristine[row.kind]
    suffix = "" if KINDS[row.kind].folder else source.suffix
    arg = arg.with_name(f"arg{suffix}")  # info tells a config file by its suffix
    if kind in FOLDER_KINDS and KINDS[row.kind].folder:
        if kind == "empty":
            arg.mkdir()
        elif kind == "fifo":
            os.mkfifo(arg)
            return arg, arg
        elif kind == "file":
            arg.write_bytes(NOT_UTF8)
        elif kind == "loop":
            _loop(arg)
        return arg, None
    if KINDS[row.kind].folder:
        shutil.copytree(source, arg, symlinks=True)
        what, inner = kind.split(":")
        return arg, _damage(arg / inner, what, source / inner, tmp / "outside")
    if kind != "missing":
        shutil.copy(source, arg)
    return arg, _damage(arg, kind, source, tmp / "outside")


def _loop(arg: Path) -> None:
    """``arg`` → ``arg-2`` → ``arg``: a symbolic link loop, which exists (as a link) and leads
    nowhere."""
    other = arg.with_name(f"{arg.name}-2")
    other.symlink_to(arg)
    arg.symlink_to(other)


class FifoWatch:
    """Notices, from a thread, the moment anything opens ``fifo`` (for reading: a probe writer
    opens without blocking exactly when a reader is there; for writing: a probe reader finds a
    writer attached), records it, and lets the opener go on with end-of-file (or a broken pipe),
    so that the command fails instead of hanging forever."""

    def __init__(self, fifo: Path | None) -> None:
        self.fifo, self.opened = fifo, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> FifoWatch:
        if self.fifo is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.fifo is not None:
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            try:
                fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:  # ENXIO: no reader; ENOENT: replaced
                if exc.errno not in (errno.ENXIO, errno.ENOENT):
                    raise
            else:
                os.close(fd)
                self.opened = self.opened or "opened for reading"
            try:
                fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                continue
            try:
                if os.read(fd, 1):
                    self.opened = self.opened or "written to"
            except BlockingIOError:  # a writer is attached
                self.opened = self.opened or "opened for writing"
            finally:
                os.close(fd)


@pytest.fixture(scope="module", autouse=True)
def index_once() -> Iterator[None]:
    """``cli.main`` parses command modules' source for its index and for the trainer flags' help
    (a fresh process does it once): here, once for the whole sweep, not in every case."""
    from tokenformer import cli
    from tokenformer.cli import options
    from tokenformer.cli.commands import train as train_command

    index = cli.command_index()
    docs = functools.cache(options.field_docs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "command_index", lambda: index)
        for module in (options, train_command):  # where the flags' help reads them
            patch.setattr(module, "field_docs", docs)
        yield


@pytest.fixture
def alarm() -> Iterator[None]:
    """A case that runs past LIMIT_S (a hang that is not on a FIFO) fails instead of stalling."""
    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize(("row", "kind"), list(_cases()))
def test_bad_path(row: Row, kind: str, pristine: dict[str, Path], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                  alarm: None) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENFORMER_CACHE", str(tmp_path / "cache"))
    arg, fifo = _bad_argument(row, kind, pristine, tmp_path)
    values = {name: str(path) for name, path in pristine.items()}
    values.update(ARG=str(arg), NEW=str(tmp_path / "new"))
    argv = [_fill(word, values) for word in row.argv.split()]
    started = time.monotonic()
    with FifoWatch(fifo) as watch:
        code = main(argv)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert not watch.opened, f"the FIFO {fifo} was {watch.opened}: {err}"
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1, f"exit {code}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert "TOKENFORMER_DEBUG" not in lines[0], f"an unexpected exception: {lines[0]}"
    assert str(arg) in lines[0], f"the line does not name {arg}: {lines[0]}"
    assert elapsed < 10, f"took {elapsed:.1f} s"  # each takes well under a second


def _fill(word: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        word = word.replace(f"{{{name}}}", value)
    return word
