"""``tokenformer scale --compile MODE``: every training step of every run (sweeps, from-scratch
runs, chains across their growths) goes through ``torch.compile`` in that mode, the mode is part
of the experiment's fingerprint (a folder started eager is not resumed compiled), and worker
processes (``--jobs``) train in it too; dynamo may compile one graph per (family, size) of the
whole experiment in one process.

``torch.compile`` is replaced by a recording identity here: a real compile of every run takes
minutes on a CPU, and the compiled training step itself is checked against eager on CUDA
(tests/test_device.py::test_compiled_training_step_matches_eager, both modes, with a growth
and evaluations in the run)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch._dynamo.config as dynamo
from test_frontier import TINY  # rootdir-relative, as the other test folders import helpers

from tokenformer.errors import ConfigError
from tokenformer.experiments.frontier import one_run as one_run_
from tokenformer.experiments.frontier import run as run_
from tokenformer.training.config import COMPILE_MODES, TrainConfig

# one family, two sizes, one chain growing S0 → S1: a few seconds on a CPU
SMALL = dataclasses.replace(TINY, families=("tokenformer",), num_sizes=2, seeds=1,
                            recipes=("chain-exact",), questions=())


@pytest.fixture(autouse=True)
def dynamo_defaults():
    """dynamo's defaults during each test, set back after it (a compiled experiment raises its
    recompile limit for the whole process)."""
    with dynamo.patch(recompile_limit=8, fail_on_recompile_limit_hit=False):
        yield


@pytest.fixture()
def compiled_modules(monkeypatch):
    """Every ``torch.compile`` call's mode; the module is returned as it is."""
    modes: list[str | None] = []

    def record(module, *, mode=None, **kwargs):
        modes.append(mode)
        return module

    monkeypatch.setattr(torch, "compile", record)
    return modes


def test_every_training_step_is_compiled_in_the_mode_and_it_is_recorded(
        dataset_dir, tmp_path, compiled_modules, monkeypatch):
    fits = []
    real_fit = one_run_.fit

    def counting_fit(model, batch_fn, cfg, **kwargs):
        fits.append((cfg.compile, cfg.compile_mode, bool(cfg.grow_at)))
        return real_fit(model, batch_fn, cfg, **kwargs)

    out = tmp_path / "compiled"
    monkeypatch.setattr(one_run_, "fit", counting_fit)
    results = run_.run_frontier(SMALL, data=dataset_dir, out=out, print_fn=lambda line: None,
                                plots=False, compile="reduce-overhead")
    # a worker trains every (family, size) of the experiment: one graph each, more than 8 in
    # all, and never a quiet fall back to eager
    assert dynamo.recompile_limit == dynamo.accumulated_recompile_limit > 8
    assert dynamo.fail_on_recompile_limit_hit is True
    assert fits and all(f[:2] == (True, "reduce-overhead") for f in fits)
    assert any(grows for *_, grows in fits)  # the chain's growth segment is compiled too
    # one compile per fit call (a growth inside fit recompiles: it wraps the grown model anew)
    assert compiled_modules.count("reduce-overhead") >= len(fits)
    assert set(compiled_modules) == {"reduce-overhead"}
    assert results["compile"] == "reduce-overhead"
    settings = json.loads((out / "experiment.json").read_text())["settings"]
    assert settings["compile"] == "reduce-overhead"


def test_eager_fingerprint_is_unchanged_and_modes_never_mix(dataset_dir, tmp_path,
                                                            compiled_modules):
    quiet = dict(data=dataset_dir, print_fn=lambda line: None, plots=False)
    run_.run_frontier(SMALL, out=tmp_path / "eager", **quiet)
    assert not compiled_modules  # off: nothing compiled
    settings = json.loads((tmp_path / "eager" / "experiment.json").read_text())["settings"]
    assert "compile" not in settings  # so the committed eager experiments still resume
    with pytest.raises(ConfigError, match=r'another experiment: compile is "off" there, '
                                          r'"default" in this call \(--compile\); '):
        run_.run_frontier(SMALL, out=tmp_path / "eager", compile="default", **quiet)
    with pytest.raises(ConfigError, match="unknown compile mode 'graphs'"):
        run_.run_frontier(SMALL, out=tmp_path / "other", compile="graphs", **quiet)


def test_a_worker_trains_in_the_experiments_compile_mode(monkeypatch, tmp_path):
    """``--jobs``: a worker process rebuilds the context from the experiment's source, the
    compile mode included."""
    seen = {}

    def fake_context(preset, data, device, dtype, **kwargs):
        seen.update(data=data, device=device, dtype=dtype, **kwargs)
        return "ctx"

    monkeypatch.setattr(one_run_, "context", fake_context)
    monkeypatch.setattr(one_run_, "execute", lambda ctx, run, lr: {"ctx": ctx, "lr": lr})
    one_run_._WORKER.clear()
    try:
        result = one_run_._work(SMALL, ("data", "cpu", None, "reduce-overhead"), str(tmp_path),
                                "run", (1e-3,))
    finally:
        one_run_._WORKER.clear()
    assert result == {"ctx": "ctx", "lr": (1e-3,)}
    assert seen["compile"] == "reduce-overhead" and seen["data"] == "data"
    assert seen["out"] == Path(tmp_path)


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_train_config_accepts_torch_compile_modes_only(mode):
    assert TrainConfig(compile=True, compile_mode=mode).compile_mode == mode
    with pytest.raises(ConfigError, match="compile_mode must be one of"):
        TrainConfig(compile=True, compile_mode="graphs")
