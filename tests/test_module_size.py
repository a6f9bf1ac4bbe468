"""No module over 400 lines in optimizer/, runners/ or search_spaces/ (issue 33): past that a
module holds more than one job and hides the house; split it along its seams, each new module
named for what it holds (docs/architecture.md draws the rooms)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("optimizer", "runners", "search_spaces")
MAX_LINES = 400


def modules_over(root: Path, package: str, max_lines: int = MAX_LINES) -> list[str]:
    """`path (N lines)` for each Python file under `root/package` longer than `max_lines`."""
    found = []
    for path in sorted((root / package).rglob("*.py")):
        num_lines = len(path.read_text(encoding="utf-8").splitlines())
        if num_lines > max_lines:
            found.append(f"{path.relative_to(root).as_posix()} ({num_lines} lines)")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_over_400_lines(package: str) -> None:
    assert list((REPO_ROOT / package).rglob("*.py")), \
        f"the size check found no module in {package}/"
    over = modules_over(REPO_ROOT, package)
    assert not over, (f"{len(over)} module(s) of {package}/ over {MAX_LINES} lines; split each "
                      f"along its seams: {', '.join(over)}")


def test_the_size_check_names_every_module_over_the_limit_and_none_at_it(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "at_limit.py").write_text("x = 1\n" * MAX_LINES, encoding="utf-8")
    (package / "over.py").write_text("x = 1\n" * (MAX_LINES + 1), encoding="utf-8")
    (package / "sub" / "deep.py").write_text("x = 1\n" * 500, encoding="utf-8")
    (package / "notes.txt").write_text("x\n" * 500, encoding="utf-8")
    assert modules_over(tmp_path, "pkg") == ["pkg/over.py (401 lines)",
                                             "pkg/sub/deep.py (500 lines)"]
