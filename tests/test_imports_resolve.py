"""Every import of the project's own modules names a module that exists, function-level imports
included: a module moved without its lazy importers fails here, not in the one test or command
that reaches the import."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("optimizer", "runners", "search_spaces", "tests")
TREES = ("optimizer", "runners", "search_spaces", "tests", "bench", "scripts")


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import of ours in `path`; `from pkg import name` counts as the
    module `pkg.name` where that is a module, else `pkg`."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in OURS]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in OURS:
            found.append((node.lineno, node.module))
    return found


def test_every_import_of_our_modules_names_one_that_exists() -> None:
    missing = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            for line, module in _imported_modules(path):
                try:
                    exists = importlib.util.find_spec(module) is not None
                except ModuleNotFoundError:  # a parent package that does not exist
                    exists = False
                if not exists:
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert missing == [], "imports of modules that do not exist:\n" + "\n".join(missing)
