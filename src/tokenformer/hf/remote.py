"""Self-contained remote code for saved Hugging Face folders, generated from the package source.

``trust_remote_code=True`` imports a folder's ``modeling_tokenformer.py`` and
``configuration_tokenformer.py``. So that a folder pushed to a hub works for anyone with torch
and transformers (not our package), :func:`write_remote_code` writes them by inlining
:mod:`tokenformer.hf_modeling` and every package module it imports (the core: errors, fused,
pattention, config, model, baselines) into one file: there is still one copy of the model code,
the package's.

How a module is inlined (:func:`_inline`): its docstring and ``from __future__`` line go (one
``from __future__ import annotations`` heads the file); a top-level relative import is dropped,
since the names it imports are already defined above it in the same file; a relative import
inside a function becomes ``pass`` when that module is inlined too, and otherwise ``raise
ImportError(...)`` (e.g. ``TokenFormerLM.save`` needs ``tokenformer.io``: the package's file
I/O is not part of the remote code). :data:`STUBS` replaces the modules that cannot be inlined:
the C++ Θ kernel (``impl="kernel"`` falls back to the fused PyTorch path there, exactly as it does
wherever the kernel cannot be built). The remote model therefore computes exactly what the
package does with the ``auto``/``fused``/``reference`` implementations.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from .. import __version__
from ..io.files import atomic_write_text
from .modeling import REMOTE_CONFIG_MODULE, REMOTE_MODULE

ROOT = "hf.modeling"
PACKAGE = "tokenformer"
STUBS = {
    "nn.kernels": (
        "class kernels:  # noqa: N801  stands in for tokenformer.kernels (the C++ Θ kernel, which\n"
        "    # is compiled by the package): impl='kernel' runs the fused PyTorch path here\n"
        "    @staticmethod\n"
        "    def supports(x, norm):\n"
        "        return False\n\n"
        "    @staticmethod\n"
        "    def usable(x, norm):  # impl='auto': the PyTorch paths\n"
        "        return False\n"),
}


PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _file(module: str) -> Path:
    """The source file of a package module named relative to the package (``nn.pattention``)."""
    return PACKAGE_DIR.joinpath(*module.split(".")).with_suffix(".py")


def _source(module: str) -> str:
    return _file(module).read_text(encoding="utf-8")


def _imported_modules(node: ast.ImportFrom, importer: str) -> list[str]:
    """The package modules a relative import in ``importer`` names (``from . import a`` and
    ``from .pkg import a`` name modules when ``a`` is one)."""
    package = importer.split(".")[:-1]
    if node.level - 1 > len(package):
        raise RuntimeError(f"remote code: tokenformer.{importer} imports beyond the package")
    base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module
                                                          else [])
    if base and _file(".".join(base)).is_file():
        return [".".join(base)]
    return [".".join([*base, alias.name]) for alias in node.names]


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

    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        replace(body[0], "")  # the module docstring
    for node in body:
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            replace(node, "")
        elif isinstance(node, ast.ImportFrom) and node.level:
            missing = [m for m in _imported_modules(node, module) if m not in bundled]
            if missing:
                raise RuntimeError(f"remote code: tokenformer.{module} imports "
                                   f"tokenformer.{missing[0]} at top level, which is not inlined")
            aliases = [f"{a.asname} = {a.name}" for a in node.names
                       if a.asname and a.asname != a.name and node.module is not None]
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
