"""Issue 27 §2: no command opens what is not a regular file, and one rule for symbolic links
inside the folders the package reads (refused, never followed: docs/reliability.md, "Symlinks
and special files inside folders"). The sweep over every command is tests/test_cli_sweep.py;
these replay the issue's cases one by one."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
from test_sweep import FifoWatch, _tiny_lm

from tokenformer.cli import main
from tokenformer.data.tokenizer import train_bpe
from tokenformer.errors import CheckpointError, PathError
from tokenformer.io import checkpoint as ckpt
from tokenformer.io.paths import has_regular_file, regular_file
from tokenformer.ops import adapters as ad

SECRET = "user's private notes: not a tokenizer, never to be copied into a model\n"


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Path]:
    """A model folder (BPE tokenizer.json beside it), an adapter trained on it, a dataset."""
    from tokenformer.data.corpus import kjv_text
    from tokenformer.data.prepare import prepare

    root = tmp_path_factory.mktemp("parts")
    text = kjv_text()[:8_000]
    tok = train_bpe([text], 260, progress=False)
    model = _tiny_lm(tok.vocab_size)
    model.save(root / "model")
    tok.save(root / "model")
    ad.adapt(model, ffn=2, name="a")
    ad.save_adapter(model, "a", root / "adapter")
    (root / "text.txt").write_text(text)
    prepare(root / "text.txt", "bytes", root / "data", val_fraction=0.2, progress=False)
    return {"model": root / "model", "adapter": root / "adapter", "data": root / "data"}


def run(argv: list[str], capsys: pytest.CaptureFixture, fifo: Path | None = None
        ) -> tuple[int, str, str]:
    with FifoWatch(fifo) as watch:
        code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert not watch.opened, f"{fifo} was {watch.opened} ({err.strip()})"
    return code, out, err


def one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, err)
    assert "TOKENFORMER_DEBUG" not in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------- regular_file itself
def test_regular_file_names_every_kind_of_non_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    assert regular_file(tmp_path / "file") == tmp_path / "file"
    assert has_regular_file(tmp_path / "file") and not has_regular_file(tmp_path / "absent")
    assert not has_regular_file(tmp_path / "absent" / "below")
    os.mkfifo(tmp_path / "fifo")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    expected = {tmp_path / "absent": "tokenizer file not found:",
                tmp_path / "dangling": "which does not exist",
                tmp_path: "is a directory",
                tmp_path / "fifo": "is a FIFO (named pipe)",
                tmp_path / "sock": "is a socket",
                Path("/dev/null"): "is a character device"}
    try:
        for path, words in expected.items():
            with pytest.raises(PathError, match=re.escape(words)) as info:
                regular_file(path, "tokenizer file")
            assert str(path) in str(info.value) and "\n" not in str(info.value)
            if path.name != "absent":  # something is there: never taken for absent
                with pytest.raises(PathError, match=re.escape(words)):
                    has_regular_file(path, "tokenizer file")
    finally:
        server.close()
    with pytest.raises(CheckpointError):  # what callers caught before: still caught
        regular_file(tmp_path / "fifo")


def test_links_are_followed_where_named_and_refused_inside_folders(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").symlink_to(outside)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "weights").write_text("w")
    (folder / "linked").symlink_to(tmp_path / "elsewhere")
    assert regular_file(folder / "config.json") == folder / "config.json"  # the user named it
    for inside in (folder / "config.json", folder / "linked" / "weights"):
        with pytest.raises(PathError, match="is a symbolic link") as info:
            has_regular_file(inside, folder=folder)
        assert "missing" not in str(info.value) and "not found" not in str(info.value)
    (folder / "sub" / "real").write_text("r")
    assert has_regular_file(folder / "sub" / "real", folder=folder)
    linked_folder = tmp_path / "link-to-model"  # the folder itself may be a link (named)
    linked_folder.symlink_to(folder)
    assert has_regular_file(linked_folder / "sub" / "real", folder=linked_folder)


# ---------------------------------------------------------------- a FIFO named config.json
COMMANDS = {
    "generate": ["generate", "{model}", "--prompt", "a", "--max-new-tokens", "1"],
    "info": ["info", "{model}"],
    "prune": ["prune", "{model}", "{out}", "--ffn", "4", "--by", "value"],
    "adapt": ["adapt", "{model}", "--data", "{data}", "--tokens", "ffn=2", "--out", "{out}",
              "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--no-progress"],
    "merge": ["merge", "{model}", "--adapter", "{adapter}", "--out", "{out}"],
    "to-hf": ["convert", "to-hf", "{model}", "{out}"],
    "grow": ["grow", "{model}", "--ffn", "2x", "--out", "{out}", "--no-progress"],
    "eval": ["eval", "{model}", "--data", "{text}", "--seq-len", "16", "--no-progress"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_fifo_config_in_a_verified_model_is_refused_unopened(
        command: str, parts: dict[str, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    """The issue's hang: config.json a FIFO in a model folder whose manifest lists every other
    file (it verified before the one manifest rule refused unlisted files that loaders read).
    Each command must refuse at once, naming it as a FIFO, without opening it."""
    model = tmp_path / "model"
    shutil.copytree(parts["model"], model)
    (model / "config.json").unlink()
    ckpt.write_manifest(model)  # lists the weights and the tokenizer, not config.json
    os.mkfifo(model / "config.json")
    (tmp_path / "text.txt").write_text("In the beginning " * 20)
    argv = [a.format(model=model, out=tmp_path / "out", text=tmp_path / "text.txt",
                     **{k: v for k, v in parts.items() if k != "model"})
            for a in COMMANDS[command]]
    line = one_error_line(*run(argv, capsys, fifo=model / "config.json")[::2])
    assert f"{model / 'config.json'} is a FIFO" in line
    assert not (tmp_path / "out").exists()


# -------------------------------------------------------------- a symlinked tokenizer.json
@pytest.mark.parametrize("command", ["prune", "merge", "grow"])
def test_symlinked_tokenizer_is_never_copied(command: str, parts: dict[str, Path],
                                             tmp_path: Path, capsys) -> None:
    """A tokenizer.json that links anywhere on the machine was copied (its target's bytes) into
    the output and listed in its manifest; now the command refuses before writing anything."""
    model = tmp_path / "model"
    shutil.copytree(parts["model"], model)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(secret)
    argv = {"prune": ["prune", model, tmp_path / "out", "--ffn", "4", "--by", "value"],
            "merge": ["merge", model, "--adapter", parts["adapter"], "--out", tmp_path / "out"],
            "grow": ["grow", model, "--ffn", "2x", "--out", tmp_path / "out", "--no-progress"]}
    line = one_error_line(*run(argv[command], capsys)[::2])
    assert f"{model / 'tokenizer.json'} is a symbolic link (to {secret})" in line
    assert not (tmp_path / "out").exists()
    assert not any(SECRET in p.read_text(errors="replace") for p in tmp_path.rglob("*")
                   if p.is_file() and not p.is_symlink() and p != secret)


def test_a_listed_link_or_fifo_is_named_not_missing(parts: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """verify_checkpoint called a listed file that had become a link "missing" (and the one rule
    refuses links everywhere, so it must say that)."""
    model = tmp_path / "model"
    shutil.copytree(parts["model"], model)
    ckpt.write_manifest(model)
    copy = tmp_path / "config-copy.json"  # the same bytes: only the link is wrong
    shutil.copy(model / "config.json", copy)
    (model / "config.json").unlink()
    (model / "config.json").symlink_to(copy)
    with pytest.raises(CheckpointError, match="is a symbolic link") as info:
        ckpt.verify_checkpoint(model)
    assert "missing" not in str(info.value)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    with FifoWatch(model / "config.json") as watch, \
            pytest.raises(CheckpointError, match="is a FIFO") as info:
        ckpt.verify_checkpoint(model)
    assert not watch.opened and "missing" not in str(info.value)


@pytest.mark.parametrize("odd", ["symlink", "fifo"])
def test_write_manifest_refuses_links_and_special_files(odd: str, parts: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """A link was left out of the manifest silently, a FIFO hung its sha256: both refused."""
    model = tmp_path / "model"
    shutil.copytree(parts["model"], model)
    if odd == "symlink":
        (model / "notes.json").symlink_to(model / "config.json")
    else:
        os.mkfifo(model / "notes.json")
    with FifoWatch(model / "notes.json" if odd == "fifo" else None) as watch, \
            pytest.raises(PathError, match="symbolic link" if odd == "symlink" else "FIFO"):
        ckpt.write_manifest(model)
    assert not watch.opened and not (model / "manifest.json").exists()


# ------------------------------------------------------------------- what still works
def test_links_the_user_names_and_links_in_a_corpus_are_followed(
        parts: dict[str, Path], tmp_path: Path, capsys) -> None:
    """The rule is for the files inside the folders the package writes: a model folder named
    through a link, and a text corpus whose files are links, are read as before."""
    (tmp_path / "model-link").symlink_to(parts["model"])
    code, out, err = run(["generate", tmp_path / "model-link", "--prompt", "a",
                          "--max-new-tokens", "2", "--temperature", "0"], capsys)
    assert code == 0 and out.startswith("a"), err
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (tmp_path / "text.txt").write_text("In the beginning God created the heaven. " * 40)
    (corpus / "linked.txt").symlink_to(tmp_path / "text.txt")
    code, out, err = run(["prepare", corpus, "--out", tmp_path / "ds", "--no-progress"], capsys)
    assert code == 0, err
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    sentence = len("In the beginning God created the heaven. ")  # bytes: one token each
    assert meta["train_tokens"] + meta["val_tokens"] == 40 * sentence + 1  # + <|endoftext|>
