"""Issue 27, the outputs part, replayed: the atomic commit never replaces what it was not asked
to (a folder that appears at OUT while the output is being built, a foreign folder swapped in
before an ``--overwrite`` commit), every path a command reads counts as an input, a kill -9
leaves no temporary folder behind for long, outputs are checked before any work, and odd OUTs
(a symbolic link, the current folder, a path under a file) get one clear line.

Each test asserts the outcome the issue asks for: the user's files byte-identical, one
``error:`` line and exit 2, no ``.OUT.*`` leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main as cli
from tokenformer.errors import OutputError
from tokenformer.io import checkpoint as ckpt
from tokenformer.io import files as io
from tokenformer.io.outputs import LOCK, MARKER
from tokenformer.ops import adapters as ad

PRUNE = ["--ffn", "0.5x", "--by", "mass"]  # no calibration data needed: fast
ADAPT = ["--tokens", "ffn=2", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
         "--eval-batches", "1", "--no-progress"]


# ------------------------------------------------------------------------------------ helpers
def run(capsys, *argv: object) -> tuple[int, str, str]:
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv: object, match: str) -> str:
    """The command fails with exactly one ``error:`` line containing ``match`` and exit 2."""
    code, _, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert match in lines[0], lines[0]
    return lines[0]


def ok(capsys, *argv: object) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    return out


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def leftovers(folder: Path) -> list[str]:
    """Temporary or replaced folders beside the outputs in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".old")))


def ffn_tokens(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["ffn_tokens"]


@pytest.fixture
def base(tmp_path) -> Path:
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig.from_name("tiny", vocab_size=257, eos_token_id=0,
                                                      max_seq_len=32))
    return model.save(tmp_path / "base")


@pytest.fixture
def adapter(tmp_path, base) -> Path:
    model = TokenFormerLM.load(base)
    ad.adapt(model, ffn=2, name="a", generator=torch.Generator().manual_seed(0))
    return ad.save_adapter(model, "a", tmp_path / "adapter")


def during_commit(monkeypatch, action) -> None:
    """Run ``action()`` inside the output's ``atomic_dir`` block, right after its manifest (the
    last file merge, prune and grow write): the commit is pending."""
    real = ckpt.write_manifest

    def write_manifest(directory):
        real(directory)
        action()

    monkeypatch.setattr(ckpt, "write_manifest", write_manifest)


def foreign_folder(path: Path) -> None:
    path.mkdir()
    (path / "notes.txt").write_text("years of work\n")


# ------------------------------------------------------------------------- 1. data loss
@pytest.mark.parametrize("command", ["merge", "prune"])
def test_a_folder_appearing_at_out_during_the_commit_is_never_replaced(
        capsys, monkeypatch, tmp_path, base, adapter, command):
    out = tmp_path / "out"
    during_commit(monkeypatch, lambda: foreign_folder(out))
    argv = (["merge", base, "--adapter", adapter, "--out", out] if command == "merge" else
            ["prune", base, out, *PRUNE])
    refused(capsys, *argv, match="appeared while this command was writing it")
    assert snapshot(out) == {"notes.txt": b"years of work\n"}
    assert leftovers(tmp_path) == []


def test_overwrite_replaces_only_a_folder_marked_at_commit_time(capsys, monkeypatch, tmp_path,
                                                                base):
    out = tmp_path / "pout"
    ok(capsys, "prune", base, out, *PRUNE)
    # between the check at the start and the commit, OUT became a folder prune did not write
    during_commit(monkeypatch, lambda: (shutil.rmtree(out), foreign_folder(out)))
    refused(capsys, "prune", base, out, "--ffn", "0.25x", "--by", "mass", "--overwrite",
            match="not (or no longer) an output of tokenformer prune")
    assert snapshot(out) == {"notes.txt": b"years of work\n"}
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    shutil.rmtree(out)
    ok(capsys, "prune", base, out, *PRUNE)
    ok(capsys, "prune", base, out, "--ffn", "0.25x", "--by", "mass", "--overwrite")
    assert ffn_tokens(out) == ffn_tokens(base) // 4  # replaced: it was prune's own
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "portable"])
def test_atomic_dir_commit_rule(monkeypatch, tmp_path, exchange):
    """The rule itself, with renameat2 and with the fallback used where it is missing (NFS,
    macOS): appearing folders are kept, even an empty one; --overwrite replaces only a folder
    that carries the command's marker when the commit happens."""
    if not exchange:
        monkeypatch.setattr(io, "_renameat2", lambda: None)
    elif io._renameat2() is None:
        pytest.skip("no renameat2 here")
    out = tmp_path / "out"
    for appear in (lambda: out.mkdir(), lambda: foreign_folder(out),
                   lambda: out.write_text("a file")):
        with pytest.raises(OutputError, match="appeared while"):
            with io.atomic_dir(out, command="merge") as tmp:
                (tmp / "weights").write_text("new")
                appear()
        assert not (out / "weights").exists() and leftovers(tmp_path) == []
        shutil.rmtree(out) if out.is_dir() else out.unlink()

    with io.atomic_dir(out, command="merge") as tmp:
        (tmp / "weights").write_text("v1")
    with io.atomic_dir(out, overwrite=True, command="merge") as tmp:
        (tmp / "weights").write_text("v2")
    assert (out / "weights").read_text() == "v2" and leftovers(tmp_path) == []
    for owner in ("prune", None):
        with pytest.raises(OutputError, match="not \\(or no longer\\) an output of tokenformer"):
            with io.atomic_dir(out, overwrite=True, command="merge") as tmp:
                (tmp / "weights").write_text("v3")
                shutil.rmtree(out)
                foreign_folder(out)
                if owner:
                    (out / MARKER).write_text(json.dumps({"command": owner}))
        assert (out / "notes.txt").read_text() == "years of work\n"
        assert leftovers(tmp_path) == []
        shutil.rmtree(out)
        out.mkdir()
        (out / MARKER).write_text(json.dumps({"command": "merge"}))
    # a rename-based no-replace never replaces an empty folder either
    (tmp_path / "src").mkdir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileExistsError):
        io.rename_noreplace(tmp_path / "src", tmp_path / "empty")
    assert (tmp_path / "src").is_dir()


def test_every_path_a_command_reads_counts_as_an_input(capsys, tmp_path, base, dataset_dir):
    pout = tmp_path / "pout"
    ok(capsys, "prune", base, pout, *PRUNE)
    shutil.copytree(dataset_dir, pout / "mydata")
    shutil.copy(base / "config.json", pout / "tokenizer.json")  # any file: it is never read
    before = snapshot(pout)
    refused(capsys, "prune", base, pout, "--overwrite", "--data", pout / "mydata",
            "--ffn", "0.5x", match="contains the input")
    refused(capsys, "prune", base, pout, "--overwrite", "--tokenizer", pout / "tokenizer.json",
            "--ffn", "0.5x", match="contains the input")
    assert snapshot(pout) == before
    # eval's lm-eval output folder: never inside the model
    refused(capsys, "eval", base, "--tasks", "kjv_lastword", "--output-path", base / "results",
            match="lies inside the input")
    assert snapshot(pout) == before and not (base / "results").exists()


# ---------------------------------------------------------------- 5. resources and leftovers
_KILLED_MERGE = """
import sys, time
from tokenformer.io import checkpoint as ckpt
from tokenformer.cli import main
real = ckpt.write_manifest
def write_manifest(directory):  # the merged model is written: pause before the commit
    real(directory)
    print("building", flush=True)
    time.sleep(120)
ckpt.write_manifest = write_manifest
main(["merge", *sys.argv[1:]])
"""


def test_kill_9_leaves_no_temporary_folder_for_the_next_run(capsys, tmp_path, base, adapter):
    out = tmp_path / "merged"
    merge = [str(base), "--adapter", str(adapter), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_MERGE, *merge], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "building\n"
        building = leftovers(tmp_path)
        assert len(building) == 1 and building[0].startswith(".merged.")
        # another merge into the same OUT meanwhile: the folder being built is in use, and kept
        ok(capsys, "merge", *merge)
        assert leftovers(tmp_path) == building
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert leftovers(tmp_path) == building  # what a kill -9 leaves: the size of the model
    shutil.rmtree(out)
    ok(capsys, "merge", *merge)  # the next run removes it
    assert leftovers(tmp_path) == []
    assert json.loads((out / MARKER).read_text())["command"] == "merge"


def test_convert_to_hf_removes_what_a_killed_conversion_left(capsys, tmp_path, base):
    pytest.importorskip("transformers")
    stale = tmp_path / ".hf.k1ll3d_9.tmp"  # the name atomic_dir gives, no process holding it
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1024))
    ok(capsys, "convert", "to-hf", base, tmp_path / "hf")
    assert leftovers(tmp_path) == []
    assert json.loads((tmp_path / "hf" / MARKER).read_text())["command"] == "convert to-hf"


def test_adapt_checks_its_output_before_training(capsys, monkeypatch, tmp_path, base,
                                                 dataset_dir):
    import tokenformer.training.adapt as adapt_command

    def fit(*args, **kwargs):
        raise AssertionError("trained before checking --out")

    monkeypatch.setattr(adapt_command, "fit", fit)
    data = ["--data", dataset_dir]
    refused(capsys, "adapt", base, *data, *ADAPT, "--out", tmp_path / ("a" * 250),
            match="too long")
    (tmp_path / "file").write_text("x")
    refused(capsys, "adapt", base, *data, *ADAPT, "--out", tmp_path / "file" / "adapter",
            match="is a file, not a folder")
    if Path("/sys").is_dir() and os.path.ismount("/sys"):  # a folder nobody may create in
        refused(capsys, "adapt", base, *data, *ADAPT, "--out", "/sys/tokenformer-adapter",
                match="cannot create folders in /sys")


@pytest.mark.parametrize("flag,match", [(["--seeds", "0"], "seed"),
                                        (["--budgets", "0.5,2"], "budgets in (0, 1)"),
                                        (["--threads", "-1"], "threads")])
def test_adapt_bench_refuses_bad_settings_before_creating_out(capsys, tmp_path, flag, match):
    out = tmp_path / "bench"
    refused(capsys, "adapt-bench", "--preset", "test", "--out", out, *flag, match=match)
    assert not out.exists()


def test_train_refuses_a_model_folder_as_its_run_folder(capsys, tmp_path, base, adapter,
                                                        dataset_dir):
    merged = tmp_path / "merged"
    ok(capsys, "merge", base, "--adapter", adapter, "--out", merged)
    train = ["train", "--config", "tiny", "--data", dataset_dir, "--steps", "1", "--no-progress"]
    for folder, match in ((merged, "holds the output of tokenformer merge"),
                          (base, "tokenformer did not write"),
                          (adapter, "tokenformer did not write")):
        before = snapshot(folder)
        refused(capsys, *train, "--out", folder, match=match)
        assert snapshot(folder) == before  # no lock, no marker written into it
        assert not (folder / LOCK).exists()


def test_overwrite_onto_a_symbolic_link_is_refused_and_leaves_nothing(capsys, tmp_path, base):
    real = tmp_path / "pout"
    ok(capsys, "prune", base, real, *PRUNE)
    before = snapshot(real)
    link = tmp_path / "latest"
    link.symlink_to(real)
    refused(capsys, "prune", base, link, "--ffn", "0.25x", "--by", "mass", "--overwrite",
            match="is a symbolic link")
    assert snapshot(real) == before and link.resolve() == real.resolve()
    assert leftovers(tmp_path) == []
    with pytest.raises(OutputError, match="symbolic link"):  # atomic_dir itself, in Python
        with io.atomic_dir(link, overwrite=True, command="prune"):
            pass
    assert snapshot(real) == before and leftovers(tmp_path) == []


def test_a_stale_old_folder_never_breaks_later_runs(capsys, tmp_path, base):
    out = tmp_path / "pout"
    ok(capsys, "prune", base, out, *PRUNE)
    elsewhere = tmp_path / "keep"
    ok(capsys, "prune", base, elsewhere, *PRUNE)
    kept = snapshot(elsewhere)
    # what earlier versions left: a link renamed aside (the symlink case), then a folder
    (tmp_path / ".pout.old").symlink_to(elsewhere)
    ok(capsys, "prune", base, out, "--ffn", "0.25x", "--by", "mass", "--overwrite")
    ok(capsys, "prune", base, out, "--ffn", "0.5x", "--by", "mass", "--overwrite")
    assert ffn_tokens(out) == ffn_tokens(base) // 2
    assert snapshot(elsewhere) == kept  # what the stale link points to is not touched


# ------------------------------------------------------------------------ 6. one clear line
def test_merge_and_adapt_have_the_overwrite_they_suggest(capsys, tmp_path, base, adapter,
                                                         dataset_dir):
    merged = tmp_path / "merged"
    ok(capsys, "merge", base, "--adapter", adapter, "--out", merged)
    refused(capsys, "merge", base, "--adapter", adapter, "--out", merged,
            match="pass --overwrite")
    ok(capsys, "merge", base, "--adapter", adapter, "--out", merged, "--overwrite")
    assert json.loads((merged / MARKER).read_text())["command"] == "merge"
    ckpt.verify_checkpoint(merged)  # the marker is part of the manifest, not a stray file
    pout = tmp_path / "pout"
    ok(capsys, "prune", base, pout, *PRUNE)
    refused(capsys, "merge", base, "--adapter", adapter, "--out", pout, "--overwrite",
            match="written by tokenformer prune, not merge")

    second = tmp_path / "second"
    ok(capsys, "adapt", base, "--data", dataset_dir, *ADAPT, "--out", second)
    refused(capsys, "adapt", base, "--data", dataset_dir, *ADAPT, "--out", second,
            match="pass --overwrite")
    ok(capsys, "adapt", base, "--data", dataset_dir, *ADAPT, "--out", second, "--overwrite",
       "--name", "b")
    assert ad.read_adapter_config(second)["name"] == "b"
    refused(capsys, "adapt", base, "--data", dataset_dir, *ADAPT, "--out", merged,
            "--overwrite", match="written by tokenformer merge, not adapt")
    assert leftovers(tmp_path) == []


def test_the_current_folder_or_its_parent_as_out(capsys, monkeypatch, tmp_path, base):
    pout = tmp_path / "pout"
    ok(capsys, "prune", base, pout, *PRUNE)
    before = snapshot(pout)
    monkeypatch.chdir(pout)
    refused(capsys, "prune", base, ".", *PRUNE, "--overwrite", match="is the current folder")
    (pout / "sub").mkdir()
    monkeypatch.chdir(pout / "sub")
    refused(capsys, "prune", base, "..", *PRUNE, "--overwrite", match="contains it")
    (pout / "sub").rmdir()
    assert snapshot(pout) == before
    monkeypatch.chdir(tmp_path)
    refused(capsys, "prune", base, "..", *PRUNE, "--overwrite", match="contains the input")


def test_an_out_under_a_file_is_one_line(capsys, tmp_path, base, adapter):
    (tmp_path / "notes").write_text("x")
    refused(capsys, "prune", base, tmp_path / "notes" / "out", *PRUNE,
            match="is a file, not a folder")
    refused(capsys, "merge", base, "--adapter", adapter, "--out", tmp_path / "notes" / "a" / "b",
            match="is a file, not a folder")
    assert (tmp_path / "notes").read_text() == "x"
