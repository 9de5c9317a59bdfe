"""Rules of the package's modules that import-linter cannot hold (issue 44), read from the source
with ``ast``: no import cycle among the modules of a folder even counting the imports made only
for type checking (import-linter is told to skip those, ``exclude_type_checking_imports``); no
module imports a private name of another (a name two modules share is an interface, and says so
by having no underscore); and each registry's name means one thing across the package."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tokenformer"


def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(encoding="utf-8")))
            for path in sorted(PACKAGE.rglob("*.py"))]


def _name(rel: str) -> str:
    """``training/config.py`` → ``tokenformer.training.config`` (a package: its ``__init__``)."""
    parts = ["tokenformer", *rel.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(modules: list[tuple[str, ast.Module]]) -> dict[str, set[str]]:
    """Module → the package's modules it imports anywhere in its text: at the top, in functions
    and under ``if TYPE_CHECKING:`` alike (``from .x import y`` imports ``x.y`` when that is a
    module, else ``x``)."""
    known = {_name(rel) for rel, _ in modules}
    graph: dict[str, set[str]] = defaultdict(set)
    for rel, tree in modules:
        name = _name(rel)
        package = name.split(".") if rel.endswith("__init__.py") else name.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in known and t != name}
    return graph


def sibling_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles among the modules of one folder (strongly connected components of more
    than one module, the edges between siblings only)."""
    def folder(name: str) -> str:
        return name.rsplit(".", 1)[0]

    order, low, stack, cycles = {}, {}, [], []

    def visit(v: str) -> None:  # Tarjan's algorithm
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if folder(w) != folder(v):
                continue
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return cycles


def test_no_folder_has_an_import_cycle_counting_type_checking_imports() -> None:
    """training/config.py once imported anneal, execution, growth_events and schedule, each of
    which imported it back for its type hints."""
    graph = imports(_modules())
    assert "tokenformer.training.config" in graph["tokenformer.training.loop"]  # the scan reads
    assert sibling_cycles(graph) == []


def test_the_scan_sees_a_cycle_made_for_type_checking() -> None:
    config = ast.parse("from .schedule import SCHEDULES\n")
    schedule = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from .config import TrainConfig\n")
    graph = imports([("training/config.py", config), ("training/schedule.py", schedule)])
    assert sibling_cycles(graph) == [["tokenformer.training.config",
                                      "tokenformer.training.schedule"]]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(node: ast.ImportFrom) -> bool:
    """An import of the package's own modules (relative, or by the package's name)."""
    return node.level > 0 or (node.module or "").split(".")[0] == "tokenformer"


def private_imports(modules: list[tuple[str, ast.Module]]) -> list[str]:
    """Every ``from <own module> import _name``, ``import tokenformer.x._y`` and
    ``alias._name`` where ``alias`` is an own module imported into the file."""
    found = []
    for rel, tree in modules:
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _own(node):
                found += [f"{rel}:{node.lineno}: {a.name}" for a in node.names if _private(a.name)]
                if node.module is None or node.level == 0:  # `from . import schedule as s_`
                    aliases |= {a.asname or a.name for a in node.names}
                elif node.level:
                    aliases |= {a.asname or a.name for a in node.names if a.name.islower()}
            elif isinstance(node, ast.Import):
                for a in node.names:
                    parts = a.name.split(".")
                    if parts[0] == "tokenformer":
                        found += [f"{rel}:{node.lineno}: {a.name}" for p in parts if _private(p)]
                        aliases.add(a.asname or parts[0])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr)
                    and isinstance(node.value, ast.Name) and node.value.id in aliases):
                found.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another() -> None:
    assert private_imports(_modules()) == []


def test_the_scan_sees_a_private_import() -> None:
    """The rule can fail: each form it reads is caught in a module written to break it."""
    code = ("from .state import _build\nfrom . import schedule as schedule_\n"
            "import tokenformer.io._files\nx = schedule_._wsd\n")
    assert private_imports([("frontier/x.py", ast.parse(code))]) == [
        "frontier/x.py:1: _build", "frontier/x.py:3: tokenformer.io._files",
        "frontier/x.py:4: schedule_._wsd"]


# What a registry (a table of named entries that options and code look names up in) is called
# must mean one thing: "STRATEGIES" once named the data-parallel modes and the growth recipes,
# "RECIPES" a tuple of recipe names and the frontier's dict of arms. Besides these, every table
# a tokenformer.registry.Registry checks.
NAMED_TABLES = ("STRATEGIES", "RECIPES", "GROWING_ARMS")


def _defined(modules: list[tuple[str, ast.Module]]) -> dict[str, set[str]]:
    """Module-level names → the modules that bind them."""
    defined: dict[str, set[str]] = defaultdict(set)
    for rel, tree in modules:
        for node in tree.body:
            targets = (node.targets if isinstance(node, ast.Assign) else
                       [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                if isinstance(target, ast.Name):
                    defined[target.id].add(rel)
    return defined


def _registry_tables(modules: list[tuple[str, ast.Module]]) -> set[str]:
    return {call.args[1].id for _, tree in modules for call in ast.walk(tree)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
            and call.func.id == "Registry" and len(call.args) > 1
            and isinstance(call.args[1], ast.Name)}


def test_each_registry_name_means_one_thing() -> None:
    modules = _modules()
    tables = _registry_tables(modules)
    assert len(tables) >= 3  # the scan finds the registries (Θ, growth, widening)
    defined = _defined(modules)
    shared = {name: sorted(defined[name]) for name in (*NAMED_TABLES, *sorted(tables))
              if len(defined[name]) != 1}
    assert shared == {}
