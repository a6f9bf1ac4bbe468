"""The architecture as the tree draws it: importing a package pulls in no GPU stack (`torch`,
`vllm`, `pynvml`; `ray` only for the daemon's modules), `search_spaces` (with vLLM's engine
facts, `search_spaces.engine`) imports nothing of ours, `runners` may import `search_spaces`,
`optimizer` imports both and nothing imports it, there is no cycle, and no process is ever
started through a shell."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("search_spaces", "runners", "optimizer")
HEAVY = frozenset({"torch", "vllm", "ray", "pynvml"})
# The daemon side runs on Ray by design; the GPU stack stays out of it all the same.
# The composition root builds the Ray executor; the loop and the policy never load Ray.
RAY_MODULES = ("optimizer/run/ray_cluster.py", "optimizer/run/ray_executor.py")
RAY_ALLOWED = frozenset({"optimizer.run.ray_cluster", "optimizer.run.ray_executor",
                         "optimizer.run.runtime", "optimizer.cli.run"})
# Named in the house style: each must import light, whatever else discovery finds.
REQUIRED_MODULES = (
    "search_spaces", "runners", "runners.base", "runners.engine", "runners.loadgen",
    "runners.hardware", "runners.telemetry", "runners.vllm.launcher",
    "runners.simulated.launcher", "optimizer", "optimizer.config", "optimizer.cli",
    "optimizer.storage.study", "optimizer.export", "optimizer.tracking",
    "optimizer.results.trial_record",
    "optimizer.run.daemon", "optimizer.search.controller", "optimizer.run.executor",
    *sorted(RAY_ALLOWED),
)
SEARCH_SPACES_THIRD_PARTY = frozenset({"yaml", "optuna"})
_SHELL_TRUE = re.compile(r"\bshell\s*=\s*True\b")
_IMPORT_TIMEOUT_S = 60.0


def _source_files(*packages: str) -> list[Path]:
    return sorted(path for package in packages for path in (REPO_ROOT / package).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _all_modules() -> list[str]:
    discovered = {_module_name(path) for path in _source_files(*PACKAGES)}
    return sorted(discovered | set(REQUIRED_MODULES))


def _imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in a file, at any depth (function bodies
    and `TYPE_CHECKING` blocks included: a cycle is a cycle wherever the import sits)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path.parent)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def _imports_of(packages: tuple[str, ...], forbidden: str) -> list[str]:
    """`file:line module` for every import of `forbidden` (or a submodule) under `packages`."""
    return [f"{path.relative_to(REPO_ROOT)}:{line} {module}"
            for path in _source_files(*packages)
            for line, module in _imported_modules(path)
            if module == forbidden or module.startswith(forbidden + ".")]


def _heavy_loaded_by(module: str) -> frozenset[str]:
    """The heavy top-level names in `sys.modules` after importing `module` in a fresh
    interpreter (this test process may have loaded anything already)."""
    code = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", code, module], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=_IMPORT_TIMEOUT_S,
                          check=False)
    assert proc.returncode == 0, f"`import {module}` fails in a fresh interpreter:\n{proc.stderr}"
    loaded: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return HEAVY & set(loaded)


@pytest.mark.parametrize("module", _all_modules())
def test_importing_module_loads_no_gpu_stack(module: str) -> None:
    allowed = frozenset({"ray"}) if module in RAY_ALLOWED else frozenset()
    heavy = _heavy_loaded_by(module) - allowed
    assert not heavy, (
        f"`import {module}` loads {sorted(heavy)}: heavy imports belong inside the function "
        "that needs them (ray only in optimizer.run.ray_* and the modules built on them)")


def test_layering_scan_sees_every_package() -> None:
    for package in PACKAGES:
        files = _source_files(package)
        assert files, f"the layering tests scan {package}/ but found no source there"
        assert REPO_ROOT / package / "__init__.py" in files, f"{package} is a package"


def test_runners_never_import_optimizer() -> None:
    offenders = _imports_of(("runners",), "optimizer")
    assert not offenders, f"runners/ is usable without the optimizer; it imports: {offenders}"


def test_search_spaces_never_import_optimizer_or_runners() -> None:
    """The bottom layer: the spaces and vLLM's engine facts beneath them, which `runners` and
    `optimizer` both ask (one fact, one place)."""
    offenders = [*_imports_of(("search_spaces",), "optimizer"),
                 *_imports_of(("search_spaces",), "runners")]
    assert not offenders, f"search_spaces/ is pure data + its loader; it imports: {offenders}"


def test_vllms_engine_facts_have_one_home_that_runners_and_optimizer_ask() -> None:
    """The flag tables and the facts derived from them live in `search_spaces.engine`; the
    runners and the optimizer import them from there (no copy kept where they are needed)."""
    engine = REPO_ROOT / "search_spaces" / "engine"
    assert sorted(p.name for p in engine.glob("flags_*.json")), \
        "the per-release flag tables are bundled with search_spaces.engine"
    assert not list((REPO_ROOT / "runners").rglob("flags_*.json")), \
        "no second copy of a flag table under runners/"
    for package in ("runners", "optimizer"):
        assert _imports_of((package,), "search_spaces.engine"), \
            f"{package}/ reads vLLM's flags and facts from search_spaces.engine"


def test_search_spaces_import_only_stdlib_yaml_and_optuna() -> None:
    allowed = set(sys.stdlib_module_names) | SEARCH_SPACES_THIRD_PARTY | {"search_spaces"}
    offenders = [f"{path.relative_to(REPO_ROOT)}:{line} {module}"
                 for path in _source_files("search_spaces")
                 for line, module in _imported_modules(path)
                 if module.split(".")[0] not in allowed]
    assert not offenders, f"search_spaces/ imports stdlib, yaml and optuna only, got {offenders}"


def test_no_source_starts_a_process_through_a_shell() -> None:
    offenders = [f"{path.relative_to(REPO_ROOT)}:{number}"
                 for path in _source_files(*PACKAGES)
                 for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if _SHELL_TRUE.search(text)]
    assert not offenders, f"argv lists only, never shell=True (quoting, injection): {offenders}"


def _module_files() -> dict[str, Path]:
    return {_module_name(path): path for path in _source_files(*PACKAGES)}


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports, at any depth (function bodies and
    `TYPE_CHECKING` blocks too). `from a.b import c` names the module `a.b.c` when there is
    one, else `a.b`; a package's `__init__` is an edge only when it is the module named."""
    files = _module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - (node.level - 1)])
                    module = ".".join(filter(None, [base, node.module]))
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in files
                           else module for alias in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, f"modules that import each other (directly or round a loop): {cycles}"


def test_cycle_check_finds_a_loop() -> None:
    """The check itself: a loop of three modules is one cycle; a chain is none."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_only_the_ray_executor_imports_ray() -> None:
    """Ray is one implementation of the executor: the policy, the loop and everything else in
    optimizer/ reach it through `optimizer.run.executor.Executor`."""
    offenders = sorted({line.split(":")[0] for line in _imports_of(("optimizer",), "ray")})
    assert offenders == list(RAY_MODULES), \
        f"optimizer imports Ray only in {', '.join(RAY_MODULES)}; also in {offenders}"
