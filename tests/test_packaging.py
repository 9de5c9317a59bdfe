"""Packaging and the command line's first hour: declared dependencies and version ranges, the
import graph (model.py pulls only the core; ``--help`` does not import torch), the command index,
``train --help`` generated from the config dataclasses, one ``--no-progress`` spelling, plain
progress lines off a terminal, and ``train --resume`` on a finished run."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tokenformer.cli import build_parser, command_index, main
from tokenformer.cli.options import field_docs
from tokenformer.io.progress import inner_progress, progress_bar

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str) -> str:
    """``code`` in a fresh interpreter (same sys.path), its stdout."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout


# ------------------------------------------------------------------------------ dependencies
def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(spec: list[str]) -> dict[str, str]:
    out = {}
    for req in spec:
        name = re.match(r"[A-Za-z0-9_.\-\[\]]+", req).group(0)
        out[name] = req[len(name):]
    return out


def test_extras_use_ranges_with_a_floor_and_a_ceiling():
    """No exact pins in the extras (they would downgrade an existing HF environment): every
    third-party requirement has a lower bound, and the HF stack an upper one (the next major)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    for extra, spec in extras.items():
        for name, constraint in _requirements(spec).items():
            if name.startswith("tokenformer["):
                continue
            assert "==" not in constraint, (extra, name, constraint)
            assert ">=" in constraint, (extra, name, constraint)
    for name in ("transformers", "lm-eval", "accelerate"):
        assert "<" in _requirements(extras["eval"])[name], name


def test_all_is_everything_but_dev_and_vllm_and_datasets_is_declared():
    """``vllm`` stays out of ``all``: vLLM's CPU build pins torch and transformers itself and
    lives in a virtualenv of its own (docs/serving.md)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    (all_,) = extras["all"]
    included = set(re.fullmatch(r"tokenformer\[(.*)\]", all_).group(1).split(","))
    assert included == set(extras) - {"all", "dev", "vllm"}
    assert "tensorboard" in included
    declared = {name for spec in extras.values() for name in _requirements(spec)}
    assert "datasets" in declared  # `prepare` reads saved HF datasets with it


def test_the_vllm_plugin_is_an_entry_point_whose_package_imports_no_vllm():
    """vLLM finds the model through ``vllm.general_plugins``; the package it names imports
    neither vLLM nor transformers until vLLM calls ``register`` (docs/serving.md)."""
    plugins = _pyproject()["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"tokenformer": "tokenformer.serving:register"}
    out = run_python("import sys, tokenformer.serving as s\n"
                     "print(callable(s.register), 'vllm' in sys.modules, "
                     "'transformers' in sys.modules)")
    assert out.split() == ["True", "False", "False"]


def test_torch_floor_has_every_public_api_the_code_imports():
    """``fully_shard`` is public (torch.distributed.fsdp) only from torch 2.6: the floor says so."""
    deps = _requirements(_pyproject()["project"]["dependencies"])
    floor = tuple(int(x) for x in re.search(r">=\s*([\d.]+)", deps["torch"]).group(1).split("."))
    assert floor >= (2, 6)
    from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401


def test_constraints_file_pins_the_lowest_tested_versions():
    """`.ci/lowest.txt` pins each range's floor (what docs/huggingface.md says was tested)."""
    extras = _pyproject()["project"]["optional-dependencies"]
    lines = (ROOT / ".ci" / "lowest.txt").read_text().splitlines()
    pins = dict(line.strip().split("==") for line in lines
                if line.strip() and not line.startswith("#"))
    for name in ("transformers", "lm-eval", "accelerate", "datasets", "peft", "Jinja2"):
        floor = re.search(r">=\s*([\w.]+)", next(
            spec for e in extras.values() for n, spec in _requirements(e).items() if n == name))
        assert pins[name] == floor.group(1) or pins[name].startswith(floor.group(1) + "."), name


# ------------------------------------------------------------------------------ import graph
CORE = {"tokenformer", "tokenformer.errors", "tokenformer.registry", "tokenformer.io",
        "tokenformer.io.files",
        "tokenformer.io.checkpoint", "tokenformer.io.training_state", "tokenformer.io.tree",
        "tokenformer.io.paths", "tokenformer.io.untrusted",
        "tokenformer.models.memory",
        "tokenformer.nn", "tokenformer.nn.pattention", "tokenformer.nn.theta",
        "tokenformer.nn.kernels",
        "tokenformer.nn.kernels.fused", "tokenformer.nn.kernels.cpu_theta",
        "tokenformer.nn.kernels.dispatch", "tokenformer.nn.kernels.backends",
        "tokenformer.nn.kernels.triton_theta",
        "tokenformer.nn.kernels.triton_theta_jit", "tokenformer.nn.grouped",
        "tokenformer.nn.product_keys", "tokenformer.models",
        "tokenformer.models.lm", "tokenformer.models.config", "tokenformer.models.official",
        "tokenformer.models.kv_cache", "tokenformer.models.generation",
        "tokenformer.models.sampling",
        "tokenformer.models.persistence", "tokenformer.models.checks"}


def test_model_py_imports_only_the_core():
    """model.py no longer dispatches load_model: importing it pulls no baseline, HF, official or
    loading module (no import cycle), and never transformers."""
    loaded = json.loads(run_python(
        "import json, sys, tokenformer.models.lm; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('tokenformer', 'transformers', 'lm_eval', 'datasets'))))"))
    assert set(loaded) <= CORE, set(loaded) - CORE


def test_load_model_lives_in_loading_and_reads_every_spec(tmp_path):
    import tokenformer
    from tokenformer.formats.loading import load_model
    from tokenformer.models.baselines import TransformerConfig, TransformerLM

    assert tokenformer.load_model is load_model
    config = tokenformer.TokenFormerConfig.from_name("tiny")
    assert load_model("tiny").config == config  # a preset
    tf = tokenformer.TokenFormerLM(config)
    tf.save(tmp_path / "tf")
    base = TransformerLM(TransformerConfig(hidden_size=16, num_layers=1, num_heads=2,
                                           intermediate_size=8))
    base.save(tmp_path / "base")
    loaded_tf, loaded_base = load_model(tmp_path / "tf"), load_model(tmp_path / "base")
    assert type(loaded_tf) is tokenformer.TokenFormerLM and type(loaded_base) is TransformerLM
    for a, b in ((tf, loaded_tf), (base, loaded_base)):
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all((sa[k] == sb[k]).all() for k in sa)


def test_help_and_version_do_not_import_torch():
    for argv in (["--help"], ["--version"], []):
        out = run_python(
            "import sys\nfrom tokenformer.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')")
        assert out.strip().splitlines()[-1] == "NO-TORCH", (argv, out)


def test_package_attributes_are_lazy_but_complete():
    """``import tokenformer`` is light; every public name still resolves, and ``tokenformer.grow``
    stays the function after its module (``tokenformer.ops.growth``) is imported."""
    out = run_python(
        "import sys, tokenformer\nlight = 'torch' not in sys.modules\n"
        "import tokenformer.ops.growth, tokenformer.ops.pruning\n"
        "names = [n for n in tokenformer.__all__ if getattr(tokenformer, n, None) is None]\n"
        "print(light, callable(tokenformer.grow) and tokenformer.grow.__name__ == 'grow', names)")
    assert out.split() == ["True", "True", "[]"], out


def test_command_index_matches_the_full_registration():
    """The index read from the command modules' source (for a fast --help) names every command
    with the same help line as registering them all."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    registered = {a.dest: a.help for a in sub._choices_actions}
    assert {name: help_ for name, (_, help_) in command_index().items()} == registered


def test_unknown_command_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: tokenformer: argument COMMAND: invalid choice") and \
        err.count("\n") == 1


# ------------------------------------------------------------------------------ train --help
def test_field_docs_reads_attribute_docstrings():
    @dataclasses.dataclass
    class Example:
        a: int = 1
        """the first"""
        b: str = "x"  # a comment is not a doc
        c: float = 2.0
        """spread over
        two lines"""

    assert field_docs(Example) == {"a": "the first", "c": "spread over two lines"}


def test_train_help_lists_every_override_with_type_default_and_doc(capsys):
    from tokenformer.models.config import TokenFormerConfig
    from tokenformer.training.config import TrainConfig

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--lr FLOAT peak learning rate (default: 0.001)" in text
    assert "--steps INT optimizer steps (default: 1000)" in text
    assert "--compile BOOL torch.compile the model (default: False)" in text
    assert "--model.ffn_tokens INT parameter tokens of the FFN Pattention" in text
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        if f.name not in ("model", "baseline", "grow_at"):
            assert f.name in docs, f"TrainConfig.{f.name} has no docstring"
            assert f"--{f.name.replace('_', '-')}" in text
    assert set(field_docs(TokenFormerConfig)) == {
        f.name for f in dataclasses.fields(TokenFormerConfig)}


# ------------------------------------------------------------------------------ progress
def test_no_progress_is_the_one_spelling_and_quiet_a_deprecated_alias(capsys):
    parser = build_parser(["prepare"])
    new = parser.parse_args(["prepare", "--default", "--no-progress"])
    old = parser.parse_args(["prepare", "--default", "--quiet"])
    assert new.no_progress is True and old.no_progress is True
    assert "--quiet is deprecated, use --no-progress" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser(["prepare"]).parse_args(["prepare", "--help"])
    assert "--quiet" not in capsys.readouterr().out  # hidden
    for argv in (["train"], ["prepare"], ["scale"], ["ablate"], ["eval"], ["grow"],
                 ["vision", "train"]):
        with pytest.raises(SystemExit):
            build_parser(argv).parse_args([*argv, "--help"])
        assert "--no-progress" in capsys.readouterr().out, argv


def test_plain_progress_lines_when_not_a_terminal():
    log = io.StringIO()  # isatty() is False, like a log file or CI
    bar = progress_bar(100, "train", unit="step", file=log)
    for i in range(100):
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")
        bar.update(1)
    bar.close()
    lines = log.getvalue().splitlines()
    assert len(lines) == 10  # every 10 steps (total / lines), the last one at 100
    assert [int(re.match(r"train: (\d+)/100 step", line).group(1)) for line in lines] == \
        list(range(10, 101, 10))
    assert lines[-1].endswith("loss 0.010")


def test_plain_progress_every_run_and_resumed_start():
    log = io.StringIO()
    with progress_bar(3, "arms", unit="run", every=1, file=log) as bar:
        for name in "abc":
            bar.set_postfix_str(f"{name} seed 0")
            bar.update(1)
    assert [line.split(",")[0] for line in log.getvalue().splitlines()] == [
        "arms: 1/3 run (33%)", "arms: 2/3 run (67%)", "arms: 3/3 run (100%)"]
    log = io.StringIO()
    bar = progress_bar(100, "train", initial=90, file=log)  # resumed at step 90: ~10 lines left
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert len(log.getvalue().splitlines()) == 10


def test_progress_off_prints_nothing_and_a_terminal_gets_tqdm(capsys):
    log = io.StringIO()
    bar = progress_bar(5, "x", progress=False, file=log)
    for _ in range(5):
        bar.update(1)
    bar.write("eval line")
    bar.close()
    assert log.getvalue() == "" and capsys.readouterr().out == ""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    from tqdm import tqdm

    bar = progress_bar(5, "x", file=Terminal())
    assert isinstance(bar, tqdm)
    bar.close()
    assert inner_progress(False) is False and inner_progress(True) is True


def test_train_in_a_log_prints_progress_lines(dataset_dir, tmp_path):
    """A training run whose stderr is a file (nohup, CI) reports progress as plain lines."""
    out = subprocess.run(
        [sys.executable, "-m", "tokenformer", "train", "--config", "tiny", "--data",
         str(dataset_dir), "--out", str(tmp_path / "run"), "--steps", "20", "--samples", "0",
         "--eval-batches", "1", "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("train: ")]
    assert [int(re.match(r"train: (\d+)/20", line).group(1)) for line in lines] == \
        list(range(2, 21, 2))


# ------------------------------------------------------------------------------ resume
def test_resume_of_a_finished_run_says_it_is_finished(dataset_dir, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["train", "--config", "tiny", "--data", str(dataset_dir), "--out", str(run),
            "--steps", "4", "--samples", "1", "--sample-tokens", "4", "--eval-batches", "1",
            "--threads", "1", "--no-progress"]
    assert main(argv) == 0
    assert "--- sample 1 ---" in capsys.readouterr().out
    metrics = (run / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{run} is finished: 4 of 4 steps done, nothing to resume"), out
    assert "sample" not in out.replace("--prompt", "") and "n/a" not in out
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing was retrained or rewritten


def test_experiment_arms_print_a_line_per_run_off_a_terminal(capsys, tmp_path):
    """`scale` and `ablate` run their arms through run_arms: with stderr not a terminal (pytest
    captures it) each finished run is one line, including runs restored from a partial file."""
    from tokenformer.experiments.common import Arm, Curve, run_arms

    arms = [Arm(name, lambda seed, shared: Curve(points=[])) for name in ("small", "big")]
    settings = {"x": 1}
    run_arms(arms[:1], [0, 1], partial=tmp_path / "partial.json", settings=settings)
    capsys.readouterr()
    run_arms(arms, [0, 1], partial=tmp_path / "partial.json", settings=settings)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "arms: 1/4 run (25%)", "arms: 2/4 run (50%)", "arms: 3/4 run (75%)",
        "arms: 4/4 run (100%)"]
    assert lines[0].endswith("small seed 0 (saved earlier)") and lines[1].endswith("big seed 0")
