"""The generated remote code (tokenformer.hf.remote): what ``modeling_tokenformer.py`` may import,
and that a bundled module breaking the rule stops the generation with a message naming it."""

from __future__ import annotations

import ast
import sys

import pytest

pytest.importorskip("transformers")

from tokenformer.hf import remote

# Whoever loads a saved folder with trust_remote_code has torch and transformers, hence the
# packages transformers itself requires; nothing else may be imported (written out here, not
# read from the generator, so the test does not agree with the code by construction).
ALLOWED = {"torch", "transformers", "safetensors", "yaml", "numpy", "tokenizers",
           "huggingface_hub", "packaging", "regex", "tqdm"}


def imported_roots(text: str) -> list[tuple[int, str, int]]:
    """(line, top-level package, relative level) of every import in ``text``."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0], 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, (node.module or "").split(".")[0], node.level))
    return out


def test_generated_modeling_file_imports_only_torch_transformers_and_the_stdlib():
    text = remote.generate()[f"{remote.REMOTE_MODULE}.py"]
    offenders = [(line, root) for line, root, level in imported_roots(text)
                 if level or (root not in sys.stdlib_module_names and root not in ALLOWED)]
    assert offenders == []
    roots = {root for _, root, _ in imported_roots(text)}
    assert {"torch", "transformers"} <= roots and "tokenformer" not in roots


@pytest.fixture
def fresh_generate():
    remote.generate.cache_clear()
    yield remote.generate
    remote.generate.cache_clear()


def test_a_module_importing_what_remote_code_cannot_have_stops_generation(
        monkeypatch, fresh_generate):
    """Adding ``import filelock`` (a tokenformer dependency, not a transformers one) to the LM's
    module makes the generator refuse, naming the module, its line and the import."""
    real = remote._source

    def source(module: str) -> str:
        text = real(module)
        if module == "models.lm":
            text = text.replace("import torch\n", "import torch\nimport filelock\n", 1)
        return text

    monkeypatch.setattr(remote, "_source", source)
    with pytest.raises(RuntimeError) as error:
        fresh_generate()
    message = str(error.value)
    assert "tokenformer/models/lm.py" in message and "imports filelock" in message
    assert "line " in message


def test_a_module_imported_as_an_object_stops_generation(monkeypatch, fresh_generate):
    """Rule 2: a bundled module imports names from package modules; only a stubbed module (the
    C++ kernel) may be imported as an object."""
    real = remote._source

    def source(module: str) -> str:
        text = real(module)
        if module == "models.lm":
            text = text.replace("from .config import TokenFormerConfig\n",
                                "from .config import TokenFormerConfig\nfrom . import official\n",
                                1)
        return text

    monkeypatch.setattr(remote, "_source", source)
    with pytest.raises(RuntimeError, match=r"imports the module tokenformer\.models\.official "
                                           r"as an object"):
        fresh_generate()


def test_two_modules_defining_one_name_stop_generation(monkeypatch, fresh_generate):
    """Rule 3: the bundle is one namespace."""
    real = remote._source

    def source(module: str) -> str:
        text = real(module)
        if module == "models.baselines":
            text += "\n\ndef check_impl():\n    pass\n"  # nn/kernels/dispatch.py defines it
        return text

    monkeypatch.setattr(remote, "_source", source)
    with pytest.raises(RuntimeError, match=r"'check_impl' is defined in both tokenformer\.nn\."
                                           r"kernels\.dispatch and tokenformer\.models\."
                                           r"baselines"):
        fresh_generate()
