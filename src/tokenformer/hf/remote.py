"""Self-contained remote code for saved Hugging Face folders, generated from the package source.

``trust_remote_code=True`` imports a folder's ``modeling_tokenformer.py`` and
``configuration_tokenformer.py``. So that a folder pushed to a hub works for anyone with torch
and transformers (not our package), :func:`write_remote_code` writes them by inlining
:mod:`tokenformer.hf.modeling` and every package module it imports (errors, the file helpers,
the nn layers, the configs, the LM with its caches, generation, persistence and checks, the
released layout, the baselines) into one file: there is still one copy of the model code, the
package's.

The rules a bundled module follows (checked while generating: a module that breaks one stops the
generation with an error naming the module, the line and what it does):

1. **The bundle** is ``hf/modeling.py`` and every package module it imports at top level,
   transitively, dependencies first (:func:`bundle_order`).
2. **Package imports** are relative ``from .module import name`` statements at the top of the
   module; they are dropped (the names are defined above, in the same file; ``name as alias``
   becomes ``alias = name``). A package module is imported as an object (``from . import x``)
   only when :data:`STUBS` stands in for it (the C++ and Triton Θ kernels: classes named
   ``cpu_theta``/``triton_theta`` whose ``usable``/``supports``/``available`` say no, so
   ``impl="kernel"`` or ``"triton"`` falls back to the fused PyTorch path, exactly as wherever a
   kernel is unavailable). From the package itself only ``__version__`` is imported; it becomes the
   constant.
3. **One namespace**: no two bundled modules define the same top-level name.
4. **Deferred package imports** (a relative import inside a function or an ``if TYPE_CHECKING:``
   block) become ``pass`` when that module is bundled, else ``raise ImportError("needs the
   tokenformer package ...")``.
5. **Other imports**, anywhere in a bundled module, are of the standard library or of
   :data:`ALLOWED_PACKAGES`: torch, transformers and the packages transformers itself requires
   (so whoever can load the folder has them).

The remote model therefore computes exactly what the package does with the ``auto``/``fused``/
``reference`` implementations. docs/huggingface.md, "Remote code".
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

from .. import __version__
from ..io.files import atomic_write_text
from .modeling import REMOTE_CONFIG_MODULE, REMOTE_MODULE

ROOT = "hf.modeling"
# What a bundled module may import besides the standard library and the package itself (rule 5):
# torch, transformers, and the packages transformers requires.
ALLOWED_PACKAGES = ("torch", "transformers", "safetensors", "yaml", "numpy", "tokenizers",
                    "huggingface_hub", "packaging", "regex", "tqdm")
PACKAGE = "tokenformer"
STUBS = {
    "nn.kernels.cpu_theta": (
        "class cpu_theta:  # noqa: N801  stands in for tokenformer.nn.kernels.cpu_theta (the C++\n"
        "    # Θ kernel, compiled by the package): impl='kernel' runs the fused PyTorch path here\n"
        "    @staticmethod\n"
        "    def supports(device, dtype, norm):\n"
        "        return False\n\n"
        "    @staticmethod\n"
        "    def usable(device, dtype, norm):  # impl='auto': the PyTorch paths\n"
        "        return False\n\n"
        "    @staticmethod\n"
        "    def available():  # nothing to build\n"
        "        return False\n"),
    "nn.kernels.triton_theta": (
        "class triton_theta:  # noqa: N801  stands in for tokenformer.nn.kernels.triton_theta\n"
        "    # (Triton kernels, the package's): impl='triton' runs the fused PyTorch path here\n"
        "    @staticmethod\n"
        "    def supports(device, dtype, norm):\n"
        "        return False\n\n"
        "    @staticmethod\n"
        "    def available():\n"
        "        return False\n\n"
        "    @staticmethod\n"
        "    def prepare():\n"
        "        pass\n"),
}


PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _file(module: str) -> Path:
    """The source file of a package module named relative to the package (``nn.pattention``)."""
    return PACKAGE_DIR.joinpath(*module.split(".")).with_suffix(".py")


def _source(module: str) -> str:
    return _file(module).read_text(encoding="utf-8")


def _resolve(node: ast.ImportFrom, importer: str) -> tuple[list[str], bool]:
    """The package modules a relative import in ``importer`` names, and whether it imports them
    as objects (``from . import x``, ``from .pkg import x``) rather than names from one module."""
    package = importer.split(".")[:-1]
    if node.level - 1 > len(package):
        raise RuntimeError(f"remote code: tokenformer.{importer} imports beyond the package")
    base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module
                                                          else [])
    if not base:  # the package itself: only its version (rule 2), written as a constant
        return [], False
    if _file(".".join(base)).is_file():
        return [".".join(base)], False
    return [".".join([*base, alias.name]) for alias in node.names], True


def _imported_modules(node: ast.ImportFrom, importer: str) -> list[str]:
    """The package modules a relative import in ``importer`` names."""
    return _resolve(node, importer)[0]


def _top_level_imports(module: str) -> list[str]:
    if module in STUBS:
        return []
    tree = ast.parse(_source(module))
    return [m for node in tree.body if isinstance(node, ast.ImportFrom) and node.level
            for m in _imported_modules(node, module)]


def bundle_order(root: str = ROOT) -> list[str]:
    """``root`` and the package modules it imports at top level, dependencies first."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(module: str) -> None:
        if module in order:
            return
        if module in visiting:
            raise RuntimeError(f"remote code: import cycle through tokenformer.{module}")
        visiting.add(module)
        for dep in _top_level_imports(module):
            visit(dep)
        visiting.discard(module)
        order.append(module)

    visit(root)
    return order


def disallowed_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute import in ``tree`` of neither the standard library
    nor :data:`ALLOWED_PACKAGES` (rule 5)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            root = name.split(".")[0]
            if root not in sys.stdlib_module_names and root not in ALLOWED_PACKAGES:
                found.append((node.lineno, name))
    return found


def _check_imports(module: str, tree: ast.Module) -> None:
    bad = disallowed_imports(tree)
    if bad:
        line, name = bad[0]
        raise RuntimeError(f"remote code: tokenformer/{module.replace('.', '/')}.py line {line} "
                           f"imports {name}, which {REMOTE_MODULE}.py may not import: only the "
                           f"standard library and {', '.join(ALLOWED_PACKAGES)} (rule 5 of "
                           f"tokenformer.hf.remote; docs/huggingface.md, 'Remote code')")


def _defined_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _inline(module: str, bundled: set[str]) -> tuple[str, set[str]]:
    """``module``'s source, rewritten to live in the bundle (module docstring), and the names it
    defines at top level."""
    source = _source(module)
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line) 1-based, replacement

    def replace(node: ast.stmt, text: str) -> None:
        indent = lines[node.lineno - 1][: node.col_offset]
        edits.append((node.lineno, node.end_lineno or node.lineno,
                      indent + text + "\n" if text else ""))

    _check_imports(module, tree)
    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        replace(body[0], "")  # the module docstring
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            replace(node, "")
        elif isinstance(node, ast.ImportFrom) and node.level and not _resolve(node, module)[0]:
            names = [a.name for a in node.names]
            if names != ["__version__"]:
                raise RuntimeError(f"remote code: tokenformer.{module} imports {names} from the "
                                   f"package itself; only __version__ can be (rule 2)")
            replace(node, f"__version__ = {__version__!r}")
        elif isinstance(node, ast.ImportFrom) and node.level:
            modules, as_objects = _resolve(node, module)
            objects = [m for m in modules if as_objects and m not in STUBS]
            if objects:
                raise RuntimeError(f"remote code: tokenformer.{module} imports the module "
                                   f"tokenformer.{objects[0]} as an object; import names from it "
                                   f"(rule 2 of tokenformer.hf.remote)")
            missing = [m for m in modules if m not in bundled]
            if missing:
                raise RuntimeError(f"remote code: tokenformer.{module} imports "
                                   f"tokenformer.{missing[0]} at top level, which is not inlined")
            aliases = [f"{a.asname} = {a.name}" for a in node.names
                       if a.asname and a.asname != a.name and not as_objects]
            replace(node, "; ".join(aliases))
    top = set(map(id, body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and id(node) not in top:
            modules = _imported_modules(node, module)
            if all(m in bundled for m in modules):
                replace(node, "pass  # inlined above")
            else:
                replace(node, f"raise ImportError('needs the {PACKAGE} package "
                              f"({PACKAGE}.{modules[0]} is not part of this generated file): "
                              f"pip install {PACKAGE}')")
    for first, last, text in sorted(edits, reverse=True):
        lines[first - 1:last] = [text]
    return "".join(lines).strip("\n") + "\n", _defined_names(tree)


@functools.lru_cache(maxsize=1)
def generate() -> dict[str, str]:
    """``{file name: text}`` of the two remote-code files."""
    order = bundle_order()
    bundled = set(order)
    owner: dict[str, str] = {}
    files = ",".join(m.replace(".", "/") for m in order)
    parts = [f'"""TokenFormer for transformers\' trust_remote_code=True: needs only torch and '
             f'transformers.\n\nGenerated by {PACKAGE} {__version__} from {PACKAGE}/'
             f'{{{files}}}.py; do not edit (one copy of the model code: the '
             f'package\'s).\n"""\n\nfrom __future__ import annotations\n']
    for module in order:
        if module in STUBS:
            text, names = STUBS[module], {module.rsplit(".", 1)[-1]}
        else:
            text, names = _inline(module, bundled)
        for name in names:
            if name in owner:
                raise RuntimeError(f"remote code: {name!r} is defined in both "
                                   f"tokenformer.{owner[name]} and tokenformer.{module}")
            owner[name] = module
        parts.append(f"\n\n# {'=' * 30} {PACKAGE}/{module.replace('.', '/')}.py {'=' * 30}\n{text}")
    config = (f'"""The configuration class of {REMOTE_MODULE}.py (generated by {PACKAGE} '
              f'{__version__}; do not edit).\n\nIt lives with the model code because it is '
              f'built from the core config dataclasses.\n"""\n\n'
              f"from .{REMOTE_MODULE} import TokenFormerHFConfig\n\n"
              f'__all__ = ["TokenFormerHFConfig"]\n')
    return {f"{REMOTE_MODULE}.py": "".join(parts), f"{REMOTE_CONFIG_MODULE}.py": config}


def write_remote_code(directory: str | Path) -> None:
    """Write the remote-code files into ``directory`` (each atomically)."""
    for name, text in generate().items():
        atomic_write_text(Path(directory) / name, text)
