"""Checks of where a study stores: the Optuna `storage` URL and the MLflow `tracking_uri` (parse,
scheme and driver; `server_storage_problem` alone opens one connection)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Final

from optimizer.errors import Problem, cause_of
from optimizer.storage.creation_lock import creating_store

_TRACKING_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https",
                     "databricks", "databricks-uc", "uc")
_STORAGE_BACKENDS = ("sqlite", "postgresql", "mysql", "mariadb", "oracle", "mssql")


def refuse_problem(value: str | None, problem_of: Callable[[str], str | None]) -> str | None:
    """`value` as a pydantic validator of a `storage` or `tracking_uri` field keeps it (None,
    the default, is not checked); a ValueError with the problem `problem_of` finds in it,
    chained to the problem's cause, where it is not one nightshift can use."""
    problem = None if value is None else problem_of(value)
    if problem is not None:
        raise ValueError(problem) from cause_of(problem)
    return value


def storage_problem(url: str) -> str | None:
    """Why `storage` is not an Optuna RDB URL nightshift can use, or None (parse, scheme and
    driver only: nothing is created or connected to)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        return Problem(f"storage: {url!r:.80} is not a database URL; give one such as "
                       "sqlite:///results/optuna.db", exc)
    backend = parsed.get_backend_name()
    if backend not in _STORAGE_BACKENDS:
        return (f"storage: {backend!r} is not a database Optuna stores to (valid: "
                f"{', '.join(_STORAGE_BACKENDS)}); give one such as sqlite:///results/optuna.db")
    if backend == "sqlite" and (not parsed.database or parsed.database == ":memory:"):
        return ("storage: an in-memory SQLite database loses the study when the daemon ends; "
                "give a file such as sqlite:///results/optuna.db")
    if backend == "sqlite" and parsed.database:
        problem = sqlite_path_problem("storage", parsed.database)
        if problem is not None:
            return problem
    try:
        parsed.get_dialect().import_dbapi()
    except Exception as exc:  # NoSuchModuleError, ImportError: per dialect
        return Problem(f"storage: the {parsed.drivername} driver is not installed here "
                       f"({type(exc).__name__}); install it or use sqlite:///results/optuna.db",
                       exc)
    return None


_CONNECT_TIMEOUT_S: Final = 10  # a database server that does not answer in this long is down


def server_storage_problem(url: str) -> str | None:
    """Why a database server named by `storage` cannot be used, or None: one connection is
    opened and closed (nothing is created). A SQLite file is left alone here: connecting would
    create it, and `_check_parent` covers it."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return None
    timeout = {"postgresql": "connect_timeout", "mysql": "connect_timeout",
               "mariadb": "connect_timeout"}.get(parsed.get_backend_name())
    engine = create_engine(parsed, connect_args={timeout: _CONNECT_TIMEOUT_S} if timeout else {})
    try:
        with engine.connect():
            return None
    except Exception as exc:  # OperationalError, InterfaceError, ...: per driver
        detail = " ".join(str(getattr(exc, "orig", None) or exc).split())[:120]
        return Problem(f"storage: cannot connect to "
                       f"{parsed.render_as_string(hide_password=True)} ({detail}); start the "
                       "database server or use sqlite:///results/optuna.db", exc)
    finally:
        engine.dispose()


_SQLITE_HEADER = b"SQLite format 3\x00"


def sqlite_file_problem(field: str, uri: str) -> str | None:
    """Why the file a `sqlite:///` URI names cannot be the store it is meant to be, or None
    (nothing is created): a directory, or an existing file that is not a SQLite database (SQLite
    would refuse it only once opened, MLflow after a minute of retries), an empty one, a
    damaged one, or one holding another application's tables (`_foreign_tables_problem`). An
    absent file is fine: SQLite makes it a database."""
    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///")).expanduser()
    shown = f"{str(path)!r:.120}"
    if path.is_dir():
        return f"{field}: {shown} is a directory; name a database file such as {path / 'x.db'}"
    # Read under the store's creation lock: a store another process is creating at this moment
    # (two studies in one storage, started together) is an empty file until its first page.
    with creating_store(uri):
        if not path.exists():
            return None
        try:
            with path.open("rb") as f:
                header = f.read(len(_SQLITE_HEADER))
        except OSError as exc:
            return Problem(f"{field}: cannot read {shown} ({type(exc).__name__}); check its "
                           "permissions", exc)
    if not header:
        # SQLite would take it as a new database, and the study would start again from
        # nothing where the user meant to resume: a store is never 0 bytes once written.
        return (f"{field}: {shown} is an empty file (0 bytes), not a database (a store cut "
                "to nothing?); restore it from a backup, or delete it to start afresh")
    if header != _SQLITE_HEADER:
        return (f"{field}: {shown} exists and is not a SQLite database; name a new file or "
                "the store's own database")
    return _damage_problem(field, path, shown) or _foreign_tables_problem(field, path, shown)


def _damage_problem(field: str, path: Path, shown: str) -> str | None:
    """Why a SQLite file cannot be read as a database (garbled pages, cut short), or None; read
    only, and a file locked by a running study is left to the study."""
    import sqlite3

    try:
        connection = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True,
                                     timeout=5.0)
    except sqlite3.Error:
        return None  # cannot be opened here at all: the store's own error says why
    cause: sqlite3.Error | None = None
    try:
        rows = connection.execute("PRAGMA quick_check").fetchall()
        damage = "; ".join(str(r[0]) for r in rows if r and r[0] != "ok")
    except sqlite3.OperationalError as exc:
        if "locked" in str(exc) or "busy" in str(exc):
            return None
        damage, cause = str(exc), exc
    except sqlite3.DatabaseError as exc:  # "database disk image is malformed", ...
        damage, cause = str(exc), exc
    finally:
        connection.close()
    if not damage:
        return None
    return Problem(f"{field}: {shown} is damaged (SQLite: {' '.join(damage.split())[:100]}); "
                   "restore it from a backup, or move it away to start afresh", cause)


# Each store's own tables, by the field that names its file: the tables of Optuna 5.0's RDB
# storage and the core of MLflow 3's tracking store (both have kept these names since their
# 2.x releases); alembic's `alembic_version`, which both keep, is neither's alone.
# tests/optimizer/test_store_checks.py holds them to the stores the installed libraries make.
_STORE_TABLES: Final[dict[str, tuple[str, tuple[str, ...], str]]] = {
    "storage": ("Optuna", (
        "studies", "trials", "study_directions", "study_user_attributes",
        "study_system_attributes", "trial_params", "trial_values", "trial_intermediate_values",
        "trial_user_attributes", "trial_system_attributes", "trial_heartbeats",
        "version_info"), "sqlite:///results/optuna.db"),
    "tracking_uri": ("MLflow", (
        "experiments", "runs", "experiment_tags", "latest_metrics", "registered_models",
        "model_versions"), "sqlite:///mlruns/mlflow.db"),
}


def _foreign_tables_problem(field: str, path: Path, shown: str) -> str | None:
    """Why a SQLite file holding tables, none of them the store's the field names, cannot be
    that store, or None: Optuna and MLflow would each add their tables to another
    application's database (MLflow 3.17 adds its 65 without a word), or to each other's store
    and then fail on its alembic version. Read only; a file locked by a writer is left be."""
    import sqlite3

    if field not in _STORE_TABLES:
        return None
    library, own, example = _STORE_TABLES[field]
    try:
        connection = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True,
                                     timeout=5.0)
    except sqlite3.Error:
        return None  # cannot be opened here at all: the store's own error says why
    try:
        tables = {str(row[0]) for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error:
        return None  # locked by a writer, or damaged: `_damage_problem` looked already
    finally:
        connection.close()
    tables = {name for name in tables if not name.startswith("sqlite_")}
    if not tables or tables.intersection(own):
        return None  # a new database, or the store's own (whole or being made)
    fix = f"point {field} at a new file, such as {example}"
    for key, (other, theirs, _) in _STORE_TABLES.items():
        found = [name for name in theirs if name in tables]
        if key != field and found:
            return (f"{field}: {shown} is {other}'s store ({', '.join(found[:2])}), not "
                    f"{library}'s, and {library} would add its tables to it; {fix}")
    # alembic's table last: the application's own tables say whose the file is.
    ordered = sorted(tables, key=lambda name: (name == "alembic_version", name))
    named = ", ".join(name if name.isidentifier() and len(name) <= 40 else repr(name[:40])
                      for name in ordered[:2])
    more = f" and {len(ordered) - 2} more" if len(ordered) > 2 else ""
    return (f"{field}: {shown} holds another application's tables ({named}{more}), none of "
            f"them {library}'s, and {library} would add its own to them; {fix}")


_SYSTEM_ROOTS: Final = ("/proc", "/sys", "/dev")


def sqlite_path_problem(field: str, database: str) -> str | None:
    """Why a SQLite file path cannot hold a store, or None: a `~` (SQLite does not expand it:
    the store would land in a directory named `~`) or a kernel file system."""
    if database.startswith("~"):
        return (f"{field}: SQLite does not expand ~ (it would make a directory named '~' "
                f"here); write the full path, such as sqlite:///{Path(database).expanduser()}")
    resolved = str(Path(database).absolute())
    if any(resolved == root or resolved.startswith(root + "/") for root in _SYSTEM_ROOTS):
        return (f"{field}: {database!r:.80} is under a kernel file system, which holds no "
                "database; give a file such as sqlite:///results/optuna.db")
    return None


def tracking_uri_problem(uri: str) -> str | None:
    """Why `tracking_uri` is not an MLflow store, or None (parse and scheme only)."""
    from urllib.parse import urlparse

    if not uri.strip():
        return "tracking_uri: it is empty; give sqlite:///mlruns/mlflow.db or leave it out"
    try:
        parsed = urlparse(uri)
    except ValueError as exc:
        return Problem(f"tracking_uri: {uri!r:.80} is not a URI; give "
                       "sqlite:///mlruns/mlflow.db", exc)
    scheme = parsed.scheme.split("+")[0]
    if scheme not in _TRACKING_SCHEMES:
        return (f"tracking_uri: MLflow does not store to scheme {parsed.scheme!r:.40}; give "
                "sqlite:///mlruns/mlflow.db or an http(s):// tracking server")
    if scheme == "sqlite" and not uri.startswith("sqlite:///"):
        return ("tracking_uri: a SQLite URI is sqlite:///relative/path.db or "
                "sqlite:////absolute/path.db (three or four slashes)")
    if scheme == "sqlite" and not uri.removeprefix("sqlite:///").strip():
        return "tracking_uri: the SQLite URI names no file; give sqlite:///mlruns/mlflow.db"
    if scheme == "sqlite":
        problem = sqlite_path_problem("tracking_uri", uri.removeprefix("sqlite:///"))
        if problem is not None:
            return problem
    if scheme in ("http", "https") and not parsed.hostname:
        return f"tracking_uri: {uri!r:.80} names no host; give http://HOST:PORT"
    return None
