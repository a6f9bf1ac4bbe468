"""What `nightshift start` checks against the file system, the stores and the environment before
it writes or starts anything, then the workload (`optimizer.config.workload_checks`); each
problem is one line (`ConfigError`)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from optimizer.config.flag_checks import OWNED_FLAGS
from optimizer.config.store_checks import (
    server_storage_problem,
    sqlite_file_problem,
    storage_problem,
    tracking_uri_problem,
)
from optimizer.config.workload_checks import check_workload, unreached_concurrency_problem
from optimizer.errors import ConfigError, cause_of, translate

if TYPE_CHECKING:
    from optimizer.config.loading import StudyConfig


def check_before_start(cfg: StudyConfig) -> None:
    """What `nightshift start` checks before it writes or starts anything: the stores can be
    made where they are named (without making them), the prompts file reads as the load
    generator reads it, and the workload fits the model. Raises ConfigError (one line)."""
    for problem in (storage_problem(cfg.storage_url), tracking_uri_problem(cfg.tracking_uri),
                    sqlite_file_problem("storage", cfg.storage_url),
                    sqlite_file_problem("tracking_uri", cfg.tracking_uri),
                    directory_problem("results_dir", cfg.results_dir),
                    directory_problem("vllm.cache_root", cfg.spec.vllm.cache_root)):
        if problem is not None:
            raise ConfigError(f"{cfg.source_name}: {problem}.") from cause_of(problem)
    problem = server_storage_problem(cfg.storage_url)
    if problem is not None:
        raise ConfigError(f"{cfg.source_name}: {problem}.") from cause_of(problem)
    if _same_sqlite_file(cfg.storage_url, cfg.tracking_uri):
        # Optuna would create its tables there, then MLflow fail on Optuna's schema version:
        # a new file neither can open again.
        raise ConfigError(f"{cfg.source_name}: tracking_uri: {cfg.tracking_uri} is the same "
                          "SQLite file as storage; the Optuna and MLflow stores need a file "
                          "each: use sqlite:///mlruns/mlflow.db (the default) or another file.")
    made_by_us = [cfg.results_dir, Path("mlruns")]
    if cfg.storage_url.startswith("sqlite:///"):
        _check_parent("storage", Path(cfg.storage_url.removeprefix("sqlite:///")), made_by_us,
                      cfg.source_name)
        _check_writable("storage", Path(cfg.storage_url.removeprefix("sqlite:///")),
                        cfg.source_name)
    if cfg.tracking_uri.startswith("sqlite:///"):
        _check_parent("tracking_uri", Path(cfg.tracking_uri.removeprefix("sqlite:///")),
                      made_by_us, cfg.source_name)
    for problem in (ignored_env_problem(cfg.spec.env),
                    unreached_concurrency_problem(cfg.spec.workload)):
        if problem is not None:
            raise ConfigError(f"{cfg.source_name}: {problem}.")
    check_workload(cfg)


def ignored_env_problem(env: Mapping[str, str]) -> str | None:
    """Why a variable of the study's `env` would set nothing, or None: one vLLM removed and now
    ignores (audit's table, `REMOVED_ENV`, whose finding fails the export's audit), with the
    study key that sets what it was meant to."""
    # optimizer.export's package imports optimizer.config: imported once config is whole.
    from optimizer.export.audit import REMOVED_ENV
    from runners.vllm.flags import flag_table

    for name in sorted(env):
        if name not in REMOVED_ENV:
            continue
        found = re.fullmatch(r"(.*?)\s*(?:\(([^()]*)\))?", REMOVED_ENV[name])
        instead, when = (found.group(1), found.group(2)) if found else (REMOVED_ENV[name], None)
        if instead.startswith("--"):
            kebab = instead.split()[0].removeprefix("--")
            fix = f"remove it and {OWNED_FLAGS[kebab]}" if kebab in OWNED_FLAGS else \
                f"remove it and set fixed_flags.{kebab.replace('-', '_')} instead"
        else:
            fix = f"remove it ({instead})"
        return (f"env.{name}: vLLM {flag_table().version} ignores it"
                f"{f' ({when})' if when else ''}, so it would set nothing; {fix}")
    return None


def _same_sqlite_file(storage: str, tracking_uri: str) -> bool:
    """Whether both URLs name one SQLite file (after `~` and relative paths are resolved)."""
    if not (storage.startswith("sqlite:///") and tracking_uri.startswith("sqlite:///")):
        return False
    paths = [Path(u.removeprefix("sqlite:///")).expanduser().absolute() for u in
             (storage, tracking_uri)]
    if os.path.normpath(paths[0]) == os.path.normpath(paths[1]):
        return True
    try:  # two names of one existing file (a link)
        return paths[0].exists() and paths[1].exists() and paths[0].samefile(paths[1])
    except OSError:
        return False


def directory_problem(field: str, path: Path | None) -> str | None:
    """Why nightshift could not make or use `path` as a directory, or None: it, or a folder
    above it, is a file."""
    if path is None:
        return None
    path = path.expanduser().absolute()
    for folder in (path, *path.parents):
        if folder.exists():
            if folder.is_dir():
                return None
            what = "is a file" if folder == path else f"lies under the file {str(folder)!r:.120}"
            return f"{field}: {str(path)!r:.120} {what}, not a directory; name a directory"
    return None


def _check_parent(field: str, path: Path, made_by_us: list[Path], source: str) -> None:
    parent = path.expanduser().absolute().parent
    # nightshift makes the store's own directory (`.../mlruns/`), never a missing path above
    # it: a typo there would otherwise become a new directory tree.
    if parent.is_dir() or parent.parent.is_dir():
        return
    for ours in made_by_us:
        ours = ours.expanduser().absolute()
        if parent == ours or ours in parent.parents:
            return  # nightshift makes its own results and mlruns directories
    raise ConfigError(f"{source}: {field}: neither directory {str(parent)!r:.120} nor its "
                      "parent exists; create it or name a file in an existing directory.")


def _check_writable(field: str, path: Path, source: str) -> None:
    """An existing SQLite file the daemon could read but not write would fail its first
    write after Ray and the trials' recovery had started: refuse it now. Opening it for
    writing writes nothing (root is refused too where the file is immutable)."""
    try:
        fd = os.open(path.expanduser(), os.O_RDWR)
    except FileNotFoundError:
        return  # made on the first start
    except OSError as exc:
        raise translate(exc, f"{source}: {field}: {str(path)!r:.120} cannot be written "
                        f"({exc.strerror or type(exc).__name__}); make it writable and start "
                        "again.", into=ConfigError) from exc
    os.close(fd)
