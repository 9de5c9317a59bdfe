"""The README is a front door and the docs say what they cover (issue 44): limits a newcomer
feels, checked on the files themselves.

* README: ≤ 250 lines, ≤ 16k characters, ≤ 60 lines before ``## Contents``, no prose paragraph
  over 120 words, the verdict in ≤ 5 lines with a link;
* CHANGELOG: sections are versions with dates (``## 0.4.0 — 2026-11-27``) or one ``## Unreleased``
  on top, no heading twice, no bullet over 60 words;
* every page under docs/ opens (after its title) with a paragraph of ≤ 3 lines on what it covers
  (not the reports ``scale`` and the other experiments write into docs/results/).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"
# the pages people write; a results folder's report.md is `scale`'s output, written by its code
DOCS = sorted(d for d in (ROOT / "docs").rglob("*.md") if d.name != "report.md")

pytestmark = pytest.mark.skipif(not README.exists(), reason="no README (an installed package)")


def _blocks(text: str) -> list[str]:
    """The text's blocks separated by blank lines, fenced code blocks removed."""
    prose = "".join(p for i, p in enumerate(re.split(r"(?m)^```.*$", text)) if i % 2 == 0)
    return [b.strip() for b in re.split(r"\n\s*\n", prose) if b.strip()]


def _is_paragraph(block: str) -> bool:
    """Prose: not a heading, table, list, quote, image or HTML."""
    return not re.match(r"[#|\-*>!<]|\d+\. ", block)


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"(?m)^## (.*)$", text)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_readme_is_short() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250, f"README has {len(lines)} lines"
    assert len(text) <= 16_000, f"README has {len(text)} characters"
    assert lines.index("## Contents") < 60, "≤ 60 lines before ## Contents"


def test_no_readme_paragraph_over_120_words() -> None:
    long = [b[:60] for b in _blocks(README.read_text(encoding="utf-8"))
            if _is_paragraph(b) and len(b.split()) > 120]
    assert not long, f"paragraphs over 120 words: {long}"


def test_the_verdict_is_short_and_linked() -> None:
    verdict = _sections(README.read_text(encoding="utf-8"))["What the experiments say"]
    prose = [b for b in _blocks(verdict) if _is_paragraph(b)]
    assert len(prose) == 1 and len(prose[0].splitlines()) <= 5, prose
    assert "](docs/results.md" in prose[0]


def test_changelog_sections_are_dated_versions() -> None:
    headings = re.findall(r"(?m)^## (.*)$", CHANGELOG.read_text(encoding="utf-8"))
    assert headings and len(headings) == len(set(headings)), "a heading appears twice"
    dated = re.compile(r"\d+\.\d+\.\d+ — \d{4}-\d{2}-\d{2}(: .*)?$")
    bad = [h for i, h in enumerate(headings) if not (dated.match(h) or (
        i == 0 and h.startswith("Unreleased")))]
    assert not bad, f"not a version with a date: {bad}"
    dates = [re.search(r"\d{4}-\d{2}-\d{2}", h).group() for h in headings if dated.match(h)]
    assert dates == sorted(dates, reverse=True), "versions newest first"


def test_changelog_bullets_are_short() -> None:
    text = CHANGELOG.read_text(encoding="utf-8")
    bullets = re.split(r"(?m)^\s*[-*] ", text)[1:]
    long = [b.split("\n")[0][:60] for b in bullets
            if len(re.split(r"\n\s*\n|\n(?=#)", b)[0].split()) > 60]
    assert not long, f"bullets over 60 words: {long}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_each_doc_opens_with_what_it_covers(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    blocks = _blocks(text)
    assert blocks[0].startswith("# "), "a title first"
    # _blocks drops fenced code, so a page that opens with a code block is seen on the text
    assert not text.split("\n", 1)[1].lstrip().startswith("```"), "opens with a code block"
    opening = blocks[1]
    assert _is_paragraph(opening) or opening.startswith(">"), (
        f"no opening paragraph: {opening[:60]}")
    assert len(opening.splitlines()) <= 3, f"opening of {len(opening.splitlines())} lines"
