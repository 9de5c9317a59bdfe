"""Issue 14, part 1 and the corrupt-checkpoint item of part 4: no load path runs pickled code.

Every payload is a pickle whose ``__reduce__`` calls ``os.system("touch MARKER")`` (harmless: it
creates an empty file in the test's temporary folder). Each is written with pickle protocols 2 and
4, as a raw pickle, inside a legacy ``torch.save`` and inside a zip ``torch.save``, and driven
through every way a file reaches the loaders: the Python API, the CLI in-process, and the CLI in a
subprocess. The marker must never appear; the CLI must answer with one ``error:`` line, exit 2.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import tokenformer
from tokenformer import TokenFormerConfig, TokenFormerLM
from tokenformer.cli import main as cli
from tokenformer.errors import CheckpointError
from tokenformer.io import checkpoint as ckpt
from tokenformer.io.checkpoint import MANIFEST_NAME, verify_checkpoint
from tokenformer.io.metrics import read_metrics
from tokenformer.io.process_group import World
from tokenformer.io.run_folders import latest_checkpoint
from tokenformer.io.training_state import (
    LEGACY_OPTIMIZER_NAME,
    LEGACY_RNG_NAME,
    OPTIMIZER_NAME,
    RNG_NAME,
    load_optimizer_state,
    read_rng_state,
    rng_state,
    set_rng_state,
)
from tokenformer.io.tree import load_tree, save_tree
from tokenformer.models.official import save_official
from tokenformer.training.config import load_config
from tokenformer.training.distributed import load_sharded, load_sharded_model, save_sharded
from tokenformer.training.lm import train

FAST = {"threads": 1, "samples": 0, "eval_batches": 1, "eval_interval": 0}


class Payload:
    """Unpickling this calls os.system: the attack of issue 14, made harmless."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.marker))}",))


def payloads(marker: Path) -> dict[str, bytes]:
    """Six files' bytes: protocols 2 and 4 × raw pickle, legacy torch.save, zip torch.save."""
    out = {}
    for protocol in (2, 4):
        out[f"raw-p{protocol}"] = pickle.dumps(Payload(marker), protocol=protocol)
        for zipped in (False, True):
            # a plausible state dict around the payload: the tensor must not smuggle it through
            obj = {"sequential.0.word_embeddings.weight": torch.zeros(4, 2),
                   "payload": Payload(marker)}
            buffer = io.BytesIO()
            torch.save(obj, buffer, pickle_protocol=protocol,
                       _use_new_zipfile_serialization=zipped)
            out[f"{'zip' if zipped else 'legacy'}-p{protocol}"] = buffer.getvalue()
    return out


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "pickled code was executed"


def assert_one_error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def tiny_config() -> TokenFormerConfig:
    return TokenFormerConfig(vocab_size=256, hidden_size=32, num_layers=2, num_heads=2,
                             qkv_tokens=8, proj_tokens=8, ffn_tokens=16, max_seq_len=32)


# ------------------------------------------------------------------ the restricted loader itself
def test_restricted_loader_stubs_foreign_objects_and_keeps_tensors(tmp_path, marker):
    """What a DeepSpeed file needs still loads (tensors, views, parameters, bytes, OrderedDict,
    an argparse namespace as an inert stub); the payload beside them is a stub too."""
    import argparse

    from tokenformer.io.untrusted import safe_torch_load

    base = torch.arange(12.0).reshape(3, 4)
    obj = OrderedDict(view=base[:, 1:3], param=torch.nn.Parameter(torch.ones(2)),
                      half=torch.full((2,), 0.5, dtype=torch.float16), raw=b"\x00\xff",
                      args=argparse.Namespace(lr=1), evil=Payload(marker))
    for protocol in (2, 4):
        for zipped in (False, True):
            path = tmp_path / f"f{protocol}{zipped}.pt"
            torch.save(obj, path, pickle_protocol=protocol,
                       _use_new_zipfile_serialization=zipped)
            loaded = safe_torch_load(path)
            assert torch.equal(loaded["view"], torch.tensor([[1.0, 2], [5, 6], [9, 10]]))
            assert torch.equal(loaded["param"], torch.ones(2))
            assert loaded["half"].dtype == torch.float16 and loaded["raw"] == b"\x00\xff"
            assert type(loaded["args"]).__name__ == "_Stub"
            assert type(loaded["evil"]).__name__ == "_Stub"
            with pytest.raises(CheckpointError, match="not a readable"):
                safe_torch_load(path, foreign=False)  # our own files: weights_only, no fallback


def test_torchscript_and_tar_archives_are_refused(tmp_path):
    """torch.load(weights_only=False) would hand these to torch.jit.load / tarfile."""
    import tarfile

    from tokenformer.io.untrusted import safe_torch_load

    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "script.pt")
    with pytest.raises(CheckpointError, match="TorchScript"):
        safe_torch_load(tmp_path / "script.pt")
    with tarfile.open(tmp_path / "old.tar", "w") as tar:
        info = tarfile.TarInfo("storages")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(CheckpointError, match="tar"):
        safe_torch_load(tmp_path / "old.tar")


# ------------------------------------------------------------------ official-checkpoint paths
def _plant(kind: str, root: Path, data: bytes) -> Path:
    """Put ``data`` where a loader of ``kind`` reads a released checkpoint; return the argument."""
    if kind == "file":
        (root / "model.bin").write_bytes(data)
        return root / "model.bin"
    if kind == "folder":
        (root / "pytorch_model.bin").write_bytes(data)
        return root
    (root / "global_step7").mkdir()
    (root / "latest").write_text("global_step7\n")
    (root / "global_step7" / "mp_rank_00_model_states.pt").write_bytes(data)
    return root if kind == "deepspeed" else root / "global_step7" / "mp_rank_00_model_states.pt"


API = {"from_official": TokenFormerLM.from_official, "load_model": tokenformer.load_model}


@pytest.mark.parametrize("kind", ["file", "folder", "deepspeed", "deepspeed-file"])
@pytest.mark.parametrize("api", sorted(API))
def test_python_api_never_runs_a_payload(tmp_path, marker, api, kind):
    for name, data in payloads(marker).items():
        root = tmp_path / name
        root.mkdir()
        with pytest.raises(CheckpointError):
            API[api](_plant(kind, root, data))
        assert not marker.exists(), name


def _cli_args(command: str, target: Path, out: Path, text: Path) -> list[str]:
    return {
        "generate": ["generate", str(target), "--prompt", "hi", "--max-new-tokens", "2",
                     "--tokenizer", "bytes"],
        "info": ["info", str(target)],
        "eval": ["eval", str(target), "--data", str(text), "--tokenizer", "bytes"],
        "convert": ["convert", "official", str(target), str(out), "--tokenizer", "bytes"],
        "grow": ["grow", str(target), "--ffn", "2x", "--out", str(out)],
    }[command]


@pytest.mark.parametrize("kind", ["folder", "deepspeed", "file"])
@pytest.mark.parametrize("command", ["generate", "info", "eval", "convert", "grow"])
def test_cli_never_runs_a_payload(tmp_path, marker, capsys, command, kind):
    text = tmp_path / "text.txt"
    text.write_text("some text to evaluate on. " * 20)
    for name, data in payloads(marker).items():
        root, out = tmp_path / name, tmp_path / f"{name}-out"
        root.mkdir()
        line = assert_one_error_line(capsys, cli(_cli_args(command, _plant(kind, root, data),
                                                           out, text)))
        assert not marker.exists(), (command, name)
        assert not out.exists()
        if name.startswith("raw"):  # the message says what was refused
            assert "system" in line and "not run" in line


def test_deepspeed_latest_cannot_point_outside(tmp_path):
    (tmp_path / "ds").mkdir()
    save_official(TokenFormerLM(tiny_config()), tmp_path / "mp_rank_00_model_states.pt")
    (tmp_path / "ds" / "latest").write_text("..\n")
    with pytest.raises(CheckpointError, match="latest"):
        TokenFormerLM.from_official(tmp_path / "ds")


# ------------------------------------------------------------------ our own checkpoints
@pytest.fixture(scope="module")
def run(dataset_dir, tmp_path_factory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4 (final)."""
    out = tmp_path_factory.mktemp("run") / "run"
    cfg = load_config("tiny", {"data": str(dataset_dir), "out": str(out), "steps": 4,
                               "checkpoint_interval": 2, **FAST})
    train(cfg, progress=False, print_fn=lambda s: None)
    return out


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _to_legacy(directory: Path) -> None:
    """Rewrite a checkpoint as an earlier version wrote it: optimizer.pt, rng.pt, no manifest."""
    torch.save(load_optimizer_state(directory), directory / LEGACY_OPTIMIZER_NAME)
    torch.save(read_rng_state(directory), directory / LEGACY_RNG_NAME)
    for name in (OPTIMIZER_NAME, RNG_NAME, MANIFEST_NAME):
        (directory / name).unlink()


def test_our_checkpoints_hold_no_pickle(run):
    final = run / "final"
    names = sorted(p.name for p in final.iterdir())
    assert "optimizer.safetensors" in names and "rng.safetensors" in names
    assert not [n for n in names if n.endswith((".pt", ".bin", ".pkl"))]
    for path in final.iterdir():  # no file starts like a pickle (0x80) or a zip torch.save
        assert path.read_bytes()[:2] not in (b"\x80\x02", b"\x80\x04", b"PK")
    assert verify_checkpoint(final) and verify_checkpoint(run / "checkpoints" / "step-000002")


@pytest.mark.parametrize("target", ["optimizer", "rng", "legacy-optimizer", "legacy-rng"])
@pytest.mark.parametrize("command", ["resume", "grow", "init-from"])
def test_payload_in_our_checkpoint_never_runs(run, dataset_dir, tmp_path, marker, capsys,
                                              target, command):
    for name, data in payloads(marker).items():
        work = tmp_path / name
        work.mkdir()
        folder = _copy(run, work)
        checkpoints = [folder / "final", folder / "checkpoints" / "step-000002"]
        for directory in checkpoints:  # every checkpoint, so resume has nothing to fall back to
            if target.startswith("legacy"):
                _to_legacy(directory)
            file = {"optimizer": OPTIMIZER_NAME, "rng": RNG_NAME,
                    "legacy-optimizer": LEGACY_OPTIMIZER_NAME,
                    "legacy-rng": LEGACY_RNG_NAME}[target]
            (directory / file).write_bytes(data)
            if not target.startswith("legacy"):
                # a manifest rewritten to match: what keeps loading safe is the reader, not it
                ckpt.write_manifest(directory)
        out = work / "out"
        args = {"resume": ["train", "--resume", str(folder), "--steps", "6", "--no-progress"],
                "grow": ["grow", str(folder / "final"), "--ffn", "2x", "--out", str(out)],
                "init-from": ["train", "--config", "tiny", "--data", str(dataset_dir),
                              "--out", str(out), "--init-from", str(folder / "final"),
                              "--steps", "1", "--no-progress",
                              *[f"--{k}={v}" for k, v in FAST.items()]]}[command]
        code = cli(args)
        assert not marker.exists(), (target, command, name)
        if command == "init-from" and target.endswith("rng"):
            assert code == 0  # --init-from reads weights and optimizer only, never the RNG file
            capsys.readouterr()
            continue
        assert_one_error_line(capsys, code)
        assert not out.exists()


def test_legacy_checkpoint_still_resumes(run, dataset_dir, tmp_path, capsys):
    """Checkpoints of earlier versions (optimizer.pt / rng.pt via torch.save, no manifest) resume
    through torch.load(weights_only=True), to the same losses."""
    folder = _copy(run, tmp_path)
    shutil.rmtree(folder / "final")
    _to_legacy(folder / "checkpoints" / "step-000002")
    assert verify_checkpoint(folder / "checkpoints" / "step-000002") is False  # unverified
    assert cli(["train", "--resume", str(folder), "--no-progress"]) == 0
    assert [r["loss"] for r in read_metrics(folder) if r["type"] == "train"] == \
        [r["loss"] for r in read_metrics(run) if r["type"] == "train"]
    capsys.readouterr()


@pytest.mark.parametrize("command", [["generate", "{run}/final.bin", "--prompt", "x",
                                      "--tokenizer", "bytes"],
                                     ["train", "--resume", "{run}", "--no-progress"]])
def test_subprocess_cli_never_runs_a_payload(run, tmp_path, marker, command):
    folder = _copy(run, tmp_path)
    data = payloads(marker)["legacy-p2"]
    (folder / "final.bin").write_bytes(data)
    for directory in (folder / "final", folder / "checkpoints" / "step-000002"):
        (directory / OPTIMIZER_NAME).write_bytes(data)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "tokenformer",
                             *[a.format(run=folder) for a in command]],
                            env=env, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        result.stderr
    assert not marker.exists()


# ------------------------------------------------------------------ tensors + JSON round trip
def test_tree_round_trip_is_exact(tmp_path):
    base = torch.randn(6, generator=torch.Generator().manual_seed(0))
    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": base[:3], "v": base[3:]},
                      7: {"shared": base}},
            "param_groups": [{"params": [0, 7], "betas": (0.9, 0.95), "lr": 1e-3,
                              "eps": float("inf"), "foreach": None, "amsgrad": False,
                              "param_names": ["a", "b"]}],
            "__tricky": {"__tensor__": "not a tensor"}, (1, "x"): [1, (2, 3)]}
    save_tree(tmp_path / "t.safetensors", tree)
    back = load_tree(tmp_path / "t.safetensors")
    assert back.keys() == tree.keys()
    assert set(back["state"]) == {0, 7}  # integer keys stay integers
    for key in ("step", "exp_avg", "v"):
        assert torch.equal(back["state"][0][key], tree["state"][0][key])
    assert torch.equal(back["state"][7]["shared"], base)
    back["state"][0]["exp_avg"].add_(1)  # read back, views of one tensor no longer share memory
    assert torch.equal(back["state"][7]["shared"], base)
    assert back["param_groups"] == tree["param_groups"]  # (0.9, 0.95) is still a tuple
    assert back["__tricky"] == tree["__tricky"] and back[(1, "x")] == [1, (2, 3)]
    (tmp_path / "t.safetensors").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match="not a readable checkpoint file"):
        load_tree(tmp_path / "t.safetensors")


def test_rng_state_round_trip(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    save_tree(tmp_path / "rng.safetensors", rng_state())
    expected = (torch.rand(3), random.random(), np.random.rand())
    set_rng_state(load_tree(tmp_path / "rng.safetensors"))
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


# ------------------------------------------------------------------ manifests
def _flip(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip model", "flip state", "truncate optimizer",
                                    "delete rng", "no manifest", "manifest not JSON"])
def test_manifest_refuses_a_damaged_checkpoint(run, tmp_path, damage):
    final = _copy(run, tmp_path) / "final"
    if damage == "flip model":
        _flip(final / "model.safetensors")
    elif damage == "flip state":
        _flip(final / "trainer_state.json", 5)
    elif damage == "truncate optimizer":
        (final / OPTIMIZER_NAME).write_bytes((final / OPTIMIZER_NAME).read_bytes()[:-1])
    elif damage == "delete rng":
        (final / RNG_NAME).unlink()
    elif damage == "no manifest":
        (final / MANIFEST_NAME).unlink()
    else:
        (final / MANIFEST_NAME).write_text("{")
    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(final)
    assert "\n" not in str(info.value) and str(final) in str(info.value)


# ------------------------------------------------------------------ corrupt newest checkpoint
def test_resume_falls_back_past_a_corrupt_newest_checkpoint(run, tmp_path, capsys):
    """final (step 4) is damaged: --resume says so in one line, continues from step 2, and
    the rerun steps 3-4 give the uninterrupted run's losses exactly."""
    folder = _copy(run, tmp_path)
    _flip(folder / "final" / "model.safetensors")
    assert latest_checkpoint(folder) == folder / "checkpoints" / "step-000002"
    capsys.readouterr()
    assert cli(["train", "--resume", str(folder), "--no-progress"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "final" in err[0] and "resuming from" in err[0] \
        and "step-000002" in err[0], err
    assert [r["loss"] for r in read_metrics(folder) if r["type"] == "train"] == \
        [r["loss"] for r in read_metrics(run) if r["type"] == "train"]
    a, b = TokenFormerLM.load(run / "final"), TokenFormerLM.load(folder / "final")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert verify_checkpoint(folder / "final")  # rewritten whole


def test_resume_with_no_usable_checkpoint_is_one_line(run, tmp_path, capsys):
    folder = _copy(run, tmp_path)
    _flip(folder / "final" / "model.safetensors")
    (folder / "checkpoints" / "step-000002" / MANIFEST_NAME).unlink()
    capsys.readouterr()
    line = assert_one_error_line(capsys, cli(["train", "--resume", str(folder), "--no-progress"]))
    assert "no usable checkpoint" in line


# ------------------------------------------------------------------ sharded (DCP) checkpoints
@pytest.fixture
def sharded(tmp_path) -> tuple[Path, TokenFormerLM, torch.optim.Optimizer]:
    """A sharded checkpoint written by the trainer's own save_sharded, in one process."""
    torch.manual_seed(0)
    model = TokenFormerLM(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randint(0, 256, (1, 8))).logits.sum().backward()
    optimizer.step()
    path = tmp_path / "ckpt"
    save_sharded(path, model, optimizer, World(),
                 lambda tmp: model.config.save(tmp / "config.json"))
    return path, model, optimizer


def test_sharded_checkpoint_round_trip(sharded):
    path, model, _ = sharded
    assert verify_checkpoint(path)
    loaded = load_sharded_model(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), model.parameters(),
                                                 strict=True))
    fresh = TokenFormerLM(tiny_config())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load_sharded(path, fresh, fresh_opt)  # the non-tensor values (lr) come back too
    assert fresh_opt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("damage", [".metadata", "shard", "config.json", "no manifest",
                                    "extra shard"])
def test_tampered_sharded_checkpoint_is_refused(sharded, capsys, damage):
    path = sharded[0]
    if damage == ".metadata":
        _flip(path / "sharded" / ".metadata", 40)
    elif damage == "shard":
        _flip(next((path / "sharded").glob("*.distcp")), 200)
    elif damage == "config.json":
        _flip(path / "config.json", 3)
    elif damage == "no manifest":
        (path / MANIFEST_NAME).unlink()
    else:
        (path / "sharded" / "__1_0.distcp").write_bytes(b"x")
    with pytest.raises(CheckpointError) as info:
        load_sharded_model(path)
    assert "\n" not in str(info.value)


def test_forged_manifest_still_runs_no_code(sharded, tmp_path, marker):
    """Even with the manifest rewritten to match, DCP's pickles cannot run code: .metadata may
    name DCP's metadata classes only, non-tensor values are read with weights_only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path, model, optimizer = sharded
    for data in payloads(marker).values():
        if data.startswith(b"PK"):
            continue  # .metadata is a raw pickle; zip containers are the shard case below
        (path / "sharded" / ".metadata").write_bytes(data)
        ckpt.write_manifest(path)
        with pytest.raises(CheckpointError, match="not DCP metadata"):
            load_sharded_model(path)
    # a payload as a non-tensor optimizer value (param_groups' lr), written by DCP itself
    forged = tmp_path / "forged"
    model_state, optim_state = get_state_dict(model, optimizer)
    optim_state["param_groups"][0]["lr"] = Payload(marker)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(forged / "sharded"))
    model.config.save(forged / "config.json")
    ckpt.write_manifest(forged)
    fresh = TokenFormerLM(tiny_config())
    with pytest.raises(CheckpointError, match="cannot read the sharded checkpoint"):
        load_sharded(forged, fresh, torch.optim.AdamW(fresh.parameters()))
