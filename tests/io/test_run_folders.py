"""Issue 14, parts 2-5, replayed: outputs never lose data, one writer per run folder, crash
leftovers never block a run, interrupts save a checkpoint, and every failure is one line.

Each test replays a case the issue found and asserts the outcome the issue asks for: inputs
byte-identical, foreign files untouched, one ``error:`` line and exit 2 (no traceback), no
half-written output, and the run resumable afterwards with the losses of an uninterrupted run.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main as cli
from tokenformer.io.checkpoint import write_manifest
from tokenformer.io.metrics import read_metrics
from tokenformer.io.outputs import LOCK_PID, MARKER

# A few-second run: the tiny preset on the small prepared dataset, a checkpoint every 2 steps.
TRAIN = ["--config", "tiny", "--steps", "6", "--checkpoint-interval", "2", "--keep-last", "2",
         "--threads", "1", "--samples", "0", "--eval-batches", "1", "--eval-interval", "0",
         "--no-progress"]


# ------------------------------------------------------------------------------------ helpers
def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own errors (one line too, see cli._Parser)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv: str, match: str) -> str:
    """The command fails with exactly one ``error:`` line containing ``match`` and exit 2."""
    code, _, err = run(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert match in lines[0], lines[0]
    return lines[0]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` (or ``path`` itself) with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file()}


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["type"] == "train"]


def train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if r["type"] == "train"]


def leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.rglob("*") if p.name.endswith((".tmp", ".old")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, dataset_dir) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "run"
    assert cli(["train", *TRAIN, "--data", str(dataset_dir), "--out", str(out)]) == 0
    return out


@pytest.fixture
def corpus(tmp_path) -> Path:
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("In the beginning was the word.\n" * 40)
    (folder / "notes.md").write_text("unrelated notes\n")
    return folder


@pytest.fixture
def model_dir(tmp_path) -> Path:
    torch.manual_seed(0)
    model = TokenFormerLM(TokenFormerConfig.from_name("tiny", vocab_size=257, eos_token_id=0))
    return model.save(tmp_path / "model")


# ------------------------------------------------------------------- part 2: outputs, overwrite
def test_prepare_into_its_own_input_is_refused(capsys, corpus):
    before = snapshot(corpus)
    refused(capsys, "prepare", corpus, "--out", corpus, "--overwrite", "--no-progress",
            match="is the input")
    file = corpus / "a.txt"
    refused(capsys, "prepare", file, "--out", file, "--overwrite", "--no-progress",
            match="is the input")
    refused(capsys, "prepare", file, "--out", corpus, "--overwrite", "--no-progress",
            match="contains the input")
    refused(capsys, "prepare", corpus, "--out", corpus / "ds", "--no-progress",
            match="lies inside the input")
    link = corpus.parent / "link"
    link.symlink_to(corpus)
    refused(capsys, "prepare", corpus, "--out", link, "--overwrite", "--no-progress",
            match="is the input")
    assert snapshot(corpus) == before


def test_overwrite_replaces_only_the_commands_own_output(capsys, tmp_path, corpus):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work\n")
    refused(capsys, "prepare", corpus, "--out", foreign, "--overwrite", "--no-progress",
            match="not written by tokenformer prepare")
    assert snapshot(foreign) == {"thesis.tex": b"years of work\n"}

    out = tmp_path / "ds"
    assert run(capsys, "prepare", corpus, "--out", out, "--no-progress")[0] == 0
    assert json.loads((out / MARKER).read_text())["command"] == "prepare"
    refused(capsys, "prepare", corpus, "--out", out, "--no-progress", match="already exists")
    (corpus / "more.txt").write_text("And more text.\n" * 40)
    first = snapshot(out)
    assert run(capsys, "prepare", corpus, "--out", out, "--no-progress", "--overwrite")[0] == 0
    assert snapshot(out)["train.bin"] != first["train.bin"]  # replaced by the new corpus
    # a folder another command wrote is not prepare's to replace
    refused(capsys, "convert", "official", corpus, out, "--overwrite",
            match="written by tokenformer prepare, not convert official")


def test_convert_never_deletes_or_replaces_its_input(capsys, tmp_path, model_dir):
    pytest.importorskip("transformers")
    release = tmp_path / "release"
    bin_file = release / "pytorch_model.bin"
    assert run(capsys, "convert", "to-official", model_dir, release)[0] == 0
    before = snapshot(release)
    refused(capsys, "convert", "official", bin_file, bin_file, "--overwrite",
            match="is the input")
    refused(capsys, "convert", "official", release, release, "--overwrite",
            match="is the input")
    assert snapshot(release) == before

    # to-official writes a folder: an existing one is replaced only when to-official wrote it
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("precious")
    refused(capsys, "convert", "to-official", model_dir, other, match="already exists")
    refused(capsys, "convert", "to-official", model_dir, other, "--overwrite",
            match="was not written by tokenformer convert to-official")
    assert snapshot(other) == {"notes.txt": b"precious"}
    refused(capsys, "convert", "to-official", model_dir, model_dir / "release",
            match="lies inside the input")
    assert not (model_dir / "release").exists()
    again = tmp_path / "again"
    assert run(capsys, "convert", "to-official", model_dir, again)[0] == 0
    assert run(capsys, "convert", "to-official", model_dir, again, "--overwrite")[0] == 0
    assert (again / "pytorch_model.bin").read_bytes()[:2] == b"PK"  # a torch zip file

    hf = tmp_path / "hf"
    assert run(capsys, "convert", "official", bin_file, hf)[0] == 0
    assert json.loads((hf / MARKER).read_text())["command"] == "convert official"
    assert run(capsys, "convert", "official", bin_file, hf, "--overwrite")[0] == 0


def test_convert_to_hf_never_replaces_its_input(capsys, tmp_path, model_dir):
    pytest.importorskip("transformers")
    before = snapshot(model_dir)
    refused(capsys, "convert", "to-hf", model_dir, model_dir, "--overwrite", match="is the input")
    refused(capsys, "convert", "to-hf", model_dir, model_dir / "hf", match="lies inside the input")
    refused(capsys, "convert", "to-hf", model_dir, model_dir.parent, "--overwrite",
            match="contains the input")
    assert snapshot(model_dir) == before
    official = tmp_path / "official"
    assert run(capsys, "convert", "to-official", model_dir, official)[0] == 0
    refused(capsys, "convert", "to-hf", model_dir, official, "--overwrite",
            match="was written by tokenformer convert to-official, not convert to-hf")
    hf = tmp_path / "hf"
    assert run(capsys, "convert", "to-hf", model_dir, hf)[0] == 0
    assert json.loads((hf / MARKER).read_text())["command"] == "convert to-hf"
    assert run(capsys, "convert", "to-hf", model_dir, hf, "--overwrite")[0] == 0
    assert snapshot(model_dir) == before


def test_grow_train_and_plot_outputs(capsys, tmp_path, model_dir, dataset_dir, reference):
    before = snapshot(model_dir)
    refused(capsys, "grow", model_dir, "--ffn", "2x", "--out", model_dir / "grown",
            match="lies inside the input")
    refused(capsys, "grow", model_dir, "--ffn", "2x", "--out", model_dir, match="is the input")
    assert snapshot(model_dir) == before
    grown = tmp_path / "grown"
    assert run(capsys, "grow", model_dir, "--ffn", "2x", "--out", grown)[0] == 0
    assert json.loads((grown / MARKER).read_text())["command"] == "grow"
    refused(capsys, "grow", model_dir, "--ffn", "4x", "--out", grown, match="already exists")
    assert run(capsys, "grow", model_dir, "--ffn", "4x", "--out", grown, "--overwrite")[0] == 0
    ffn = TokenFormerLM.load(model_dir).config.ffn_tokens
    assert TokenFormerLM.load(grown).config.ffn_tokens == 4 * ffn

    data_before = snapshot(dataset_dir)
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", dataset_dir / "run",
            match="lies inside the input")
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", dataset_dir.parent,
            match="contains the input")
    assert snapshot(dataset_dir) == data_before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "final").mkdir()
    (foreign / "final" / "keep.txt").write_text("mine")
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", foreign,
            match="tokenformer did not write")
    assert snapshot(foreign) == {"final/keep.txt": b"mine"}

    pytest.importorskip("matplotlib")
    png = tmp_path / "loss.png"
    png.write_bytes(b"not mine")
    refused(capsys, "plot", reference, "--out", png, match="already exists")
    assert png.read_bytes() == b"not mine"
    refused(capsys, "plot", reference, "--out", reference / "metrics.jsonl", "--overwrite",
            match="lies inside the input")
    assert run(capsys, "plot", reference, "--out", png, "--overwrite")[0] == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------- part 3: one writer per folder
def test_second_trainer_is_refused_naming_the_holders_pid(capsys, tmp_path, dataset_dir):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen(
        [sys.executable, "-m", "tokenformer", "train", *TRAIN, "--steps", "100000",
         "--checkpoint-interval", "0", "--data", str(dataset_dir), "--out", str(run_dir)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and holder.poll() is None and not (
                (run_dir / "metrics.jsonl").is_file()
                and (run_dir / "metrics.jsonl").read_text().count("\n") >= 1):
            time.sleep(0.05)
        assert holder.poll() is None, holder.stderr.read()
        assert (run_dir / LOCK_PID).read_text().strip() == str(holder.pid)
        config = (run_dir / "config.json").read_bytes()
        line = refused(capsys, "train", "--resume", run_dir, "--no-progress",
                       match=f"pid {holder.pid}")
        assert "in use" in line
        refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir,
                match=f"pid {holder.pid}")
        assert (run_dir / "config.json").read_bytes() == config
    finally:
        holder.kill()  # kill -9: the OS drops its lock
        holder.wait()
    # The killed run had no checkpoint yet: --resume starts over from step 0 with its config.
    code, out, err = run(capsys, "train", "--resume", run_dir, "--steps", "4", "--no-progress")
    assert code == 0, err
    assert "no checkpoint yet: starting from step 0" in out
    assert train_steps(run_dir) == [1, 2, 3, 4]  # the killed run's records are gone
    assert not (run_dir / LOCK_PID).exists()


# ------------------------------------------------------------ part 4: leftovers, crash, signals
def test_crash_leftovers_are_cleaned_and_never_block(capsys, tmp_path, dataset_dir, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    final = snapshot(run_dir / "final")
    ckpts = run_dir / "checkpoints"
    # kill -9 during a checkpoint write, during a prune, while final/ was being replaced
    (ckpts / ".step-000008.x1y2.tmp").mkdir()
    (ckpts / ".step-000008.x1y2.tmp" / "model.safetensors").write_bytes(b"half")
    (ckpts / "step-000001").mkdir()
    (ckpts / "step-000001" / "config.json").write_text("{}")
    shutil.copytree(run_dir / "final", run_dir / ".final.old")
    (run_dir / ".metrics.jsonl.abc.tmp").write_text("partial")
    # ... and the run continues: 6 more steps, so final/ is replaced past the stale .final.old
    code, _, err = run(capsys, "train", "--resume", run_dir, "--steps", "8", "--no-progress")
    assert code == 0, err
    assert leftovers(run_dir) == []
    assert not (ckpts / "step-000001").exists()
    assert json.loads((run_dir / "final" / "trainer_state.json").read_text())["step"] == 8
    assert train_steps(run_dir) == list(range(1, 9))

    # kill -9 between the two renames of a replacement: final/ is gone, .final.old is complete
    os.replace(run_dir / "final", run_dir / ".final.old")
    from tokenformer.io.run_folders import clean_leftovers

    clean_leftovers(run_dir)
    assert leftovers(run_dir) == []
    assert json.loads((run_dir / "final" / "trainer_state.json").read_text())["step"] == 8
    assert snapshot(run_dir / "final") != final  # the step-8 final, put back


def test_crash_before_the_first_checkpoint_resumes_from_step_0(capsys, tmp_path, dataset_dir,
                                                               reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    shutil.rmtree(run_dir / "final")  # config.json and metrics.jsonl only, as a crash leaves
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir,
            match="already holds a run")
    code, out, err = run(capsys, "train", "--resume", run_dir, "--no-progress")
    assert code == 0, err
    assert "starting from step 0" in out
    assert losses(run_dir) == losses(reference)  # every step once, as uninterrupted


def _signal_at(monkeypatch, step: int, *signals: int, pause: float = 0.0) -> None:
    """Deliver ``signals`` to this process while step ``step`` is being computed, ``pause``
    seconds apart."""
    import tokenformer.training.loop as train_module

    lr_at = train_module.lr_at

    def patched(s, *args, **kwargs):
        if s == step:
            for i, sig in enumerate(signals):
                if i:
                    time.sleep(pause)
                signal.raise_signal(sig)
        return lr_at(s, *args, **kwargs)

    monkeypatch.setattr(train_module, "lr_at", patched)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_finishes_the_step_and_writes_a_checkpoint(capsys, tmp_path, dataset_dir,
                                                          reference, monkeypatch, sig, code):
    run_dir = tmp_path / "run"
    _signal_at(monkeypatch, 2, sig)  # during the third step (0-based 2): a checkpoint at 3
    line = refused_code(capsys, code, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir)
    assert f"{signal.Signals(sig).name} after step 3 of 6" in line
    assert f"--resume {run_dir}" in line
    assert (run_dir / "checkpoints" / "step-000003" / "trainer_state.json").is_file()
    assert leftovers(run_dir) == []
    monkeypatch.undo()
    assert run(capsys, "train", "--resume", run_dir, "--no-progress")[0] == 0
    assert losses(run_dir) == losses(reference)


def refused_code(capsys, code: int, *argv) -> str:
    got, _, err = run(capsys, *argv)
    assert got == code, err
    errors = [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "Traceback" not in err
    return errors[0]


def test_second_ctrl_c_stops_at_once(capsys, tmp_path, dataset_dir, monkeypatch):
    from tokenformer.training.signals import StopOnSignal

    run_dir = tmp_path / "run"
    _signal_at(monkeypatch, 2, signal.SIGINT, signal.SIGINT, pause=StopOnSignal.ECHO + 0.1)
    line = refused_code(capsys, 130, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir)
    assert line == "error: interrupted"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]
    assert train_steps(run_dir) == [1, 2]  # step 3 never finished


def test_an_echoed_signal_is_the_same_ctrl_c(capsys, tmp_path, dataset_dir, monkeypatch):
    """torchrun forwards the terminal's Ctrl-C to workers that got it already: one request."""
    run_dir = tmp_path / "run"
    _signal_at(monkeypatch, 2, signal.SIGINT, signal.SIGINT)
    line = refused_code(capsys, 130, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir)
    assert "SIGINT after step 3 of 6" in line
    assert (run_dir / "checkpoints" / "step-000003" / "trainer_state.json").is_file()


def test_sigint_in_a_subprocess_saves_and_resume_continues(tmp_path, dataset_dir):
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [*TRAIN, "--steps", "400", "--checkpoint-interval", "0", "--data", str(dataset_dir)]
    proc = subprocess.Popen([sys.executable, "-m", "tokenformer", "train", *args, "--out",
                             str(run_dir)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (
            metrics.is_file() and '"type": "train"' in metrics.read_text()):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("error: interrupted by SIGINT after step ")
    assert "Traceback" not in err
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").is_file()
    step = json.loads((saved[0] / "trainer_state.json").read_text())["step"]
    assert train_steps(run_dir)[-1] == step
    resumed = subprocess.run([sys.executable, "-m", "tokenformer", "train", "--resume",
                              str(run_dir), "--steps", str(step + 2), "--no-progress"],
                             env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert train_steps(run_dir) == list(range(1, step + 3))


def test_disk_full_keeps_the_previous_checkpoint(capsys, tmp_path, dataset_dir, reference,
                                                 monkeypatch):
    import safetensors.torch

    run_dir = tmp_path / "run"
    save_file = safetensors.torch.save_file

    def full_disk(tensors, filename, *args, **kwargs):
        if "step-000004" in str(filename):  # the first checkpoint fits, the second does not
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save_file(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir,
            match="no space left on device")
    kept = run_dir / "checkpoints" / "step-000002"
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-000002"]
    assert leftovers(run_dir) == []
    before = snapshot(kept)
    assert TokenFormerLM.load(kept) is not None
    monkeypatch.undo()
    assert run(capsys, "train", "--resume", run_dir, "--no-progress")[0] == 0
    assert losses(run_dir) == losses(reference)
    assert not kept.exists() or snapshot(kept) == before  # pruned or untouched, never altered


# ------------------------------------------------------- part 5: validation, one line per failure
@pytest.mark.parametrize("spec, match", [
    ("3:ffn=0.5x", "would shrink"),
    ("3:ffn=2x,recipe=nope", "unknown recipe 'nope'"),
    ("3:ffn=16", "cannot shrink"),  # tiny has more ffn tokens: only the model config says so
    ("3:ffn=1000000000000", "GiB"),
])
def test_growth_specs_are_checked_before_anything_is_written(capsys, tmp_path, dataset_dir,
                                                             spec, match):
    run_dir = tmp_path / "run"
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir, "--grow-at", spec,
            match=match)
    assert not run_dir.exists()


@pytest.mark.parametrize("option, value, match", [
    ("--temperature", "-1", "temperature must be >= 0"),
    ("--temperature", "nan", "temperature must be finite"),
    ("--device", "cuda", "CUDA is not available"),
])
def test_config_values_are_checked_before_anything_is_written(capsys, tmp_path, dataset_dir,
                                                               option, value, match):
    if option == "--device" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    run_dir = tmp_path / "run"
    refused(capsys, "train", *TRAIN, "--data", dataset_dir, "--out", run_dir, option, value,
            match=match)
    assert not run_dir.exists()


def test_token_ids_beyond_the_vocabulary_are_refused_when_opened(capsys, tmp_path, dataset_dir,
                                                                 reference):
    import numpy as np

    data = tmp_path / "data"
    shutil.copytree(dataset_dir, data)
    meta = json.loads((data / "meta.json").read_text())
    for split in ("train", "val"):
        ids = np.memmap(data / f"{split}.bin", dtype=meta["dtype"], mode="r+")
        ids[100] = 300  # beyond the 257 byte-level ids (what an edited file holds)
        ids.flush()
        del ids
    refused(capsys, "train", *TRAIN, "--data", data, "--out", tmp_path / "run",
            match="the train split of " + str(data) + " holds token id 300")
    assert not (tmp_path / "run").exists()
    refused(capsys, "eval", reference / "final", "--data", data,
            match="val split of")


def test_any_failure_is_one_line_exit_2(capsys, monkeypatch):
    from torch.distributed.checkpoint.api import CheckpointException

    import tokenformer.cli.commands.model as model_commands

    def fail(*args, **kwargs):
        raise CheckpointException("shard 3 is corrupt\n" + "detail\n" * 150, {})

    monkeypatch.setattr(model_commands, "info", fail)
    refused(capsys, "info", "tiny", match="CheckpointException")
    monkeypatch.setattr(model_commands, "info",
                        lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "x")))
    refused(capsys, "info", "tiny", match="no space left on device")


def test_broken_model_files_are_one_clear_line(capsys, tmp_path, model_dir):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "no-hidden"
    shutil.copytree(model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    del config["hidden_size"]
    (broken / "config.json").write_text(json.dumps(config))
    refused(capsys, "generate", broken, "--prompt", "x", match="does not name hidden_size")

    state = load_file(str(model_dir / "model.safetensors"))
    for name, change in (("nan", lambda t: t.fill_(float("nan"))),
                         ("int", lambda t: t.to(torch.int64))):
        folder = tmp_path / name
        shutil.copytree(model_dir, folder)
        key = next(iter(state))
        save_file({**state, key: change(state[key].clone())}, str(folder / "model.safetensors"))
        refused(capsys, "generate", folder, "--prompt", "x",
                match="NaN" if name == "nan" else "not floating point")


def test_official_config_with_fractional_heads(capsys, tmp_path, model_dir):
    release = tmp_path / "release"
    assert run(capsys, "convert", "to-official", model_dir, release)[0] == 0
    (release / "config.json").write_text(json.dumps({"num_attention_heads": 2.5}))
    refused(capsys, "info", release, match="num_attention_heads must be a positive integer")


@pytest.mark.parametrize("vocab", [{"vocab_size": 400}, {"vocab_size": 257, "vocab_multiple": 1}])
def test_official_config_vocabulary_must_fit_the_embedding(capsys, tmp_path, model_dir, vocab):
    """257 tokens in 384 rows (multiple 128): 400 pads to 512 rows, 257 unpadded is 257 rows."""
    release = tmp_path / "release"
    assert run(capsys, "convert", "to-official", model_dir, release)[0] == 0
    (release / "config.json").write_text(json.dumps(vocab))
    refused(capsys, "info", release, match="does not match the embedding's 384 rows")


def test_generate_arguments(capsys, tmp_path, reference):
    refused(capsys, "generate", "tiny", "--prompt", "x", "--temperature", "-1",
            match="--temperature")
    refused(capsys, "generate", "tiny", "--prompt", "x", "--temperature", "nan",
            match="--temperature")
    if not torch.cuda.is_available():
        refused(capsys, "generate", "tiny", "--prompt", "x", "--device", "cuda",
                match="CUDA is not available")
    refused(capsys, "generate", reference, "--prompt", "x",
            match=f"training run folder, not a model: use {reference / 'final'}")
    context = TokenFormerLM.load(reference / "final").config.max_seq_len
    code, out, err = run(capsys, "generate", reference / "final", "--prompt", "And",
                         "--max-new-tokens", str(context * 10), "--temperature", "0")
    assert code == 0 and out.startswith("And")
    assert err.strip() == (f"note: the model's context is {context} tokens and the prompt has 3:"
                           f" generating at most {context - 3} new tokens, not {context * 10}")


def test_grow_refuses_sizes_that_cannot_fit_in_memory(capsys, tmp_path, model_dir):
    out = tmp_path / "grown"
    refused(capsys, "grow", model_dir, "--ffn", "1000000000000", "--out", out,
            match="GiB are available")
    assert not out.exists()


def test_malformed_metrics_or_trainer_state_on_resume(capsys, tmp_path, reference):
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "[1, 2]", *lines[1:]]) + "\n")
    before = snapshot(run_dir)
    refused(capsys, "train", "--resume", run_dir, "--steps", "8", "--no-progress",
            match="metrics.jsonl line 2 is not a metrics record")
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k != LOCK_PID} == \
        {k: v for k, v in before.items() if k != LOCK_PID}

    metrics.write_text("\n".join(lines) + "\n")
    # A state edited with its manifest rewritten to match (so it verifies) in every checkpoint:
    # nothing to fall back to (one damaged newest checkpoint is skipped: test_hardening_load).
    shutil.rmtree(run_dir / "final")
    for directory in (run_dir / "checkpoints").iterdir():
        state = directory / "trainer_state.json"
        data = json.loads(state.read_text())
        data["step"] = "six"
        state.write_text(json.dumps(data))
        write_manifest(directory)
    refused(capsys, "train", "--resume", run_dir, "--steps", "8", "--no-progress",
            match="trainer_state.json is malformed (step is 'six'")


def test_experiment_and_vision_folders(capsys, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("1,2\n")
    for argv in (["scale", "--out", foreign],
                 ["ablate", "--study", "theta", "--task", "lm", "--out", foreign],
                 ["vision", "train", "--steps", "1", "--out", foreign]):
        refused(capsys, *argv, match="did not write")
    assert snapshot(foreign) == {"data.csv": b"1,2\n"}

    pytest.importorskip("sklearn")
    out = tmp_path / "vision"
    assert run(capsys, "vision", "train", "--steps", "2", "--out", out)[0] == 0
    assert json.loads((out / MARKER).read_text())["command"] == "vision train"
    results = (out / "results.json").read_bytes()
    refused(capsys, "vision", "train", "--steps", "2", "--out", out, match="already holds a run")
    assert (out / "results.json").read_bytes() == results
    png = tmp_path / "confusion.png"
    png.write_bytes(b"mine")
    refused(capsys, "vision", "eval", out / "final", "--confusion-png", png,
            match="already exists")
    assert png.read_bytes() == b"mine"


def test_ddp_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, dataset_dir):
    """torchrun, 2 ranks: SIGINT reaches one worker only; the all-reduced flag makes both save
    the same step and stop; --resume under torchrun continues from it."""
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent
                                                  / "torchrun").exists():
        pytest.skip("torchrun not available")
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m", "tokenformer", "train"]
    args = [*TRAIN, "--steps", "400", "--checkpoint-interval", "0", "--data", str(dataset_dir)]
    agent = subprocess.Popen([*launcher, *args, "--out", str(run_dir)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and agent.poll() is None and not (
            metrics.is_file() and '"type": "train"' in metrics.read_text()):
        time.sleep(0.02)
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    assert len(children) == 2, children
    os.kill(int(children[-1]), signal.SIGINT)  # one rank only
    _, err = agent.communicate(timeout=180)
    assert agent.returncode != 0
    assert "interrupted by SIGINT after step" in err
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 1
    step = json.loads((saved[0] / "trainer_state.json").read_text())["step"]
    assert train_steps(run_dir)[-1] == step < 400
    resumed = subprocess.run([*launcher, "--resume", str(run_dir), "--steps", str(step + 2),
                              "--no-progress"], env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert train_steps(run_dir) == list(range(1, step + 3))
