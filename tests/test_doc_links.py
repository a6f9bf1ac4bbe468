"""The README and docs/ point at what exists: every relative Markdown link resolves from its file,
and every repository path a page names (docs/..., tests/..., optimizer/..., ...) resolves from
the repository root. A module or fixture that moves without its docs fails here, naming both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
         ROOT / "tests" / "fixtures" / "h200" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TOP = "docs|tests|bench|examples|scripts|optimizer|runners|search_spaces"
NAMED_PATH = re.compile(rf"(?<![\w/.:-])((?:{TOP})/[\w./{{}},*<>-]*)")
# A pattern or placeholder rather than a path: `bench/h200/*.yaml`, `trials/NNNN/`, `X.yaml`.
PLACEHOLDER = re.compile(r"[*<>{}]|/X\.|NNNN|/N/|PATH|\.\.\.")


def _missing(page: Path) -> list[str]:
    text = page.read_text()
    missing = []
    for match in LINK.finditer(text):
        target = match.group(1).split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
            missing.append(f"link {match.group(1)}")
    for match in NAMED_PATH.finditer(text):
        path = match.group(1).rstrip(".,;:)")
        if not PLACEHOLDER.search(path) and not (ROOT / path).exists():
            missing.append(f"path {path}")
    return missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_path_of_a_doc_page_exists(page: Path) -> None:
    assert _missing(page) == [], f"{page.relative_to(ROOT)} names what does not exist"
