"""Results land in git (issue 43): a lease's runs were once lost to a ``runs/`` pattern that also
matched ``docs/results/frontier-gpu/runs/``. Two checks on this checkout:

* no path a results folder may hold (run records, states, plots, logs, archives) under
  ``docs/results/`` or ``benchmarks/results/`` is matched by ``.gitignore``;
* every results folder or file the docs cite in prose (README, docs/, benchmarks/RESULTS.md;
  not in fenced commands, which may name outputs to come) exists, and a cited folder holds at
  least one result file besides a ``scale`` folder's own markers.

Skipped outside a git checkout (an installed sdist has neither the docs nor ``.gitignore``)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS_ROOTS = ("docs/results", "benchmarks/results")
# the names a results folder may hold, as a lease or `scale` writes them
PROBES = ("x.json", "x.md", "x.png", "x.log", "x.txt", "x.csv", "x.tar.gz", "x.pt",
          "runs/x.json", "state/x.pt", "sweep/x.json", "f/runs/x.json", "f/state/x.pt")
# files that say a folder is a `scale` experiment, not that it holds any result
MARKERS = {"experiment.json", ".tokenformer-output", ".lock"}
CITED = re.compile(r"(?<![\w/.-])((?:docs/results|benchmarks/results)/[\w./-]*[\w/])")

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")


def _ignored(paths: list[str]) -> list[str]:
    """The paths .gitignore matches (``--no-index``: whether or not they are tracked)."""
    out = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT,
                         input="\n".join(paths), capture_output=True, text=True, check=False)
    assert out.returncode in (0, 1), out.stderr  # 1: nothing matched
    return out.stdout.split()


def test_nothing_under_the_results_folders_is_ignored() -> None:
    folders = [ROOT / r for r in RESULTS_ROOTS]
    folders += [d for r in folders if r.is_dir() for d in r.rglob("*") if d.is_dir()]
    paths = [f"{d.relative_to(ROOT).as_posix()}/{probe}" for d in folders for probe in PROBES]
    assert _ignored(paths) == []


def test_the_check_sees_an_ignoring_pattern(tmp_path) -> None:
    """The check above can fail: the pattern that lost the lease's runs is caught."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("runs/\n")
    out = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=tmp_path,
                         input="docs/results/frontier-gpu/runs/x.json", capture_output=True,
                         text=True, check=False)
    assert out.stdout.split() == ["docs/results/frontier-gpu/runs/x.json"]


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks: a command there may name an output it will create."""
    return "".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M))
                   if i % 2 == 0)


def _cited() -> dict[str, Path]:
    """Each results path cited from the project root in a doc's prose → the first doc citing it."""
    cited: dict[str, Path] = {}
    for doc in _docs():
        for match in CITED.finditer(_prose(doc.read_text(encoding="utf-8"))):
            cited.setdefault(match.group(1).rstrip("/."), doc)
    return cited


def test_the_docs_cite_results_folders() -> None:
    """The scan finds what it should (else the next test would pass on nothing)."""
    assert {"docs/results/frontier-v4", "docs/results/frontier-v5/reuse.png"} <= set(_cited())


@pytest.mark.parametrize("path", sorted(_cited()) if (ROOT / ".git").exists() else [])
def test_a_cited_result_exists_and_holds_results(path: str) -> None:
    target = ROOT / path
    doc = _cited()[path].relative_to(ROOT)
    assert target.exists(), f"{doc} cites {path}, which is not in the repository"
    if target.is_dir():
        results = [f for f in target.rglob("*") if f.is_file() and f.name not in MARKERS]
        assert results, f"{doc} cites {path}, which holds no result file (only markers)"
