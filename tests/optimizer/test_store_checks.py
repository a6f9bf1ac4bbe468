"""A study's SQLite stores found empty, garbled or cut short: refused in one line naming the
field and the fix, before anything starts (exit 2), by `start`, `status`, `report`, `export`."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from optimizer.cli import main
from optimizer.config.flag_checks import fixed_flag_problem
from optimizer.config.store_checks import (
    server_storage_problem,
    sqlite_file_problem,
    storage_problem,
    tracking_uri_problem,
)
from optimizer.errors import ConfigError, cause_of
from tests.builders import write_study


def _real_study_db(path: Path) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{path}")
    study = optuna.create_study(study_name="s", storage=storage)
    for _ in range(40):
        trial = study.ask()
        trial.set_user_attr("record", {"padding": "x" * 2000})
        study.tell(trial, 1.0)
    storage.engine.dispose()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "optuna.db"
    _real_study_db(path)
    assert path.stat().st_size > 64_000
    return path


def test_a_sound_store_passes(db: Path) -> None:
    assert sqlite_file_problem("storage", f"sqlite:///{db}") is None


def test_an_empty_store_is_refused_not_taken_for_a_new_study(db: Path) -> None:
    db.write_bytes(b"")
    problem = sqlite_file_problem("storage", f"sqlite:///{db}")
    assert problem is not None and "0 bytes" in problem and "backup" in problem


def test_a_store_cut_short_is_refused_as_damaged(db: Path) -> None:
    with db.open("r+b") as f:
        f.truncate(db.stat().st_size // 2)
    problem = sqlite_file_problem("storage", f"sqlite:///{db}")
    assert problem is not None and "damaged" in problem, problem


def test_a_store_with_garbled_pages_is_refused_as_damaged(db: Path) -> None:
    data = bytearray(db.read_bytes())
    for offset in range(4096, len(data) - 4096, 8192):  # every other page after the first
        data[offset:offset + 4096] = b"\xa5" * 4096
    db.write_bytes(bytes(data))
    problem = sqlite_file_problem("storage", f"sqlite:///{db}")
    assert problem is not None and "damaged" in problem, problem


@pytest.mark.parametrize("command", ["status", "report", "export", "start"])
def test_reading_commands_refuse_a_garbled_store_in_one_line_with_exit_2(
        db: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    damaged = tmp_path / "damaged.db"
    shutil.copy(db, damaged)
    with damaged.open("r+b") as f:
        f.truncate(damaged.stat().st_size // 3)
    study = write_study(tmp_path, name="s", trials=1, file_name="s.yaml",
                        storage=f"sqlite:///{damaged}",
                        tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    code = main([command, str(study)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{command}: exit 2 for a damaged store, got {code}: {err[-400:]}"
    assert len(lines) == 1 and "storage:" in lines[0] and "damaged" in lines[0], lines[:5]
    assert "Traceback" not in err
    # `start` (issue 35, item 7: it looped on "resume with", then refused after Ray started).
    assert not (tmp_path / "results").exists() and not (tmp_path / "m.db").exists(), \
        "refused before anything is written"


def _garbled(tmp_path: Path) -> str:
    path = tmp_path / "garbled.db"
    path.write_bytes(b"SQLite format 3\x00" + b"\xa5" * 5000)  # a header, then no database
    return f"sqlite:///{path}"


@pytest.mark.parametrize(("check", "line", "foreign"), [
    (lambda _: storage_problem("not a url"), "storage: 'not a url' is not a database URL; give "
     "one such as sqlite:///results/optuna.db", "ArgumentError"),
    (lambda _: storage_problem("mysql+nosuchdriver://u@h/db"), "storage: the "
     "mysql+nosuchdriver driver is not installed here (NoSuchModuleError); install it or use "
     "sqlite:///results/optuna.db", "NoSuchModuleError"),
    # Port 9 on loopback refuses; pymysql is a real, pure-Python driver.
    (lambda _: server_storage_problem("mysql+pymysql://u@127.0.0.1:9/db"), "storage: cannot "
     "connect to mysql+pymysql://u@127.0.0.1:9/db ((2003, \"Can't connect to MySQL server on "
     "'127.0.0.1' ([Errno 111] Connection refused)\")); start the database server or use "
     "sqlite:///results/optuna.db", "OperationalError"),
    # /proc/self/mem opens, even for root, but its first bytes are no one's to read.
    (lambda _: sqlite_file_problem("storage", "sqlite:////proc/self/mem"), "storage: cannot "
     "read '/proc/self/mem' (OSError); check its permissions", "OSError"),
    (lambda tmp_path: sqlite_file_problem("tracking_uri", _garbled(tmp_path)), "tracking_uri: "
     "'{tmp_path}/garbled.db' is damaged (SQLite: file is not a database); restore it from a "
     "backup, or move it away to start afresh", "DatabaseError"),
    (lambda _: tracking_uri_problem("http://[::1"), "tracking_uri: 'http://[::1' is not a URI; "
     "give sqlite:///mlruns/mlflow.db", "ValueError"),
    (lambda _: fixed_flag_problem("sim_error_rate", 2), "fixed_flags.sim_error_rate: "
     "sim_error_rate must be in [0, 1] but got 2", "ValueError"),
], ids=["storage URL", "storage driver", "storage server", "unreadable file", "damaged file",
        "tracking URI", "fault value"])
def test_a_checks_line_keeps_the_foreign_error_it_caught_as_its_cause(
        tmp_path: Path, check: Callable[[Path], str | None], line: str, foreign: str) -> None:
    """The six checks that return their line caught a foreign error and dropped it: the line
    is unchanged, and the error raised from it can chain what SQLAlchemy, SQLite, the OS or
    the simulated engine said."""
    problem = check(tmp_path)
    assert problem == line.format(tmp_path=tmp_path), "the line a user reads is unchanged"
    cause = cause_of(problem)
    assert cause is not None and type(cause).__name__ == foreign, \
        f"the foreign error is kept: {cause!r}"


def test_a_start_refused_by_a_check_chains_the_foreign_error(tmp_path: Path) -> None:
    """Before the study starts (`check_before_start`) and while the file is read (the schema's
    checks, through pydantic): the ConfigError leads to what SQLite or SQLAlchemy raised."""
    import sqlite3

    from pydantic import ValidationError
    from sqlalchemy.exc import ArgumentError

    from optimizer.config import load_study
    from optimizer.config.prestart import check_before_start

    cfg = load_study(write_study(tmp_path, storage=_garbled(tmp_path)))
    with pytest.raises(ConfigError, match="is damaged") as start:
        check_before_start(cfg)
    assert isinstance(start.value.__cause__, sqlite3.DatabaseError)

    with pytest.raises(ConfigError, match="is not a database URL") as read:
        load_study(write_study(tmp_path, storage="not a url"))
    assert isinstance(read.value.__cause__, ValidationError)
    wrapped = read.value.__cause__.errors()[0]["ctx"]["error"]  # the check's ValueError
    assert isinstance(wrapped.__cause__, ArgumentError), "the schema's check chains it too"


def _tables(path: Path) -> set[str]:
    connection = sqlite3.connect(path)
    try:
        return {row[0] for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        connection.close()


def _application_db(path: Path) -> Path:
    """Another application's SQLite database: its own tables, a row in one."""
    connection = sqlite3.connect(path)
    connection.executescript("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT);"
                             "CREATE TABLE orders (id INTEGER PRIMARY KEY, total REAL);"
                             "INSERT INTO users (name) VALUES ('ada');")
    connection.close()
    return path


def _mlflow_store(path: Path) -> Path:
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # makes the store
    return path


@pytest.mark.parametrize("field", ["storage", "tracking_uri"])
def test_another_applications_database_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], field: str) -> None:
    """`storage` (or `tracking_uri`) naming another application's SQLite database got Optuna's
    tables (MLflow 3.17's: 65 of them) added to it: one line naming the field, the tables and
    the fix, exit 2, the database untouched and nothing written."""
    monkeypatch.chdir(tmp_path)
    app_db = _application_db(tmp_path / "app.db")
    before = app_db.read_bytes()
    stores = {"storage": f"sqlite:///{tmp_path / 'optuna.db'}",
              "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
              field: f"sqlite:///{app_db}"}
    study = write_study(tmp_path, name="s", trials=1, file_name="s.yaml", **stores)
    code = main(["start", str(study), "--dry-run", "--no-progress"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit 2 for bad input, got {code}: {err[-400:]}"
    library, example = {"storage": ("Optuna", "sqlite:///results/optuna.db"),
                        "tracking_uri": ("MLflow", "sqlite:///mlruns/mlflow.db")}[field]
    assert lines == [f"error: s.yaml: {field}: {str(app_db)!r} holds another application's "
                     f"tables (orders, users), none of them {library}'s, and {library} would "
                     f"add its own to them; point {field} at a new file, such as {example}."], \
        lines
    assert app_db.read_bytes() == before, "the application's database is untouched"
    assert _tables(app_db) == {"users", "orders"}
    assert not (tmp_path / "results").exists() and not (tmp_path / "optuna.db").exists() and \
        not (tmp_path / "mlflow.db").exists(), "refused before anything is written"


def test_each_store_named_in_the_others_field_is_refused(db: Path, tmp_path: Path) -> None:
    """An MLflow store named as `storage` got Optuna's tables, then Optuna refused its alembic
    version; an Optuna store named as `tracking_uri` got MLflow's, then MLflow refused: each is
    refused first, named as the other's store."""
    mlflow_db = _mlflow_store(tmp_path / "mlflow.db")
    mlflow_tables, optuna_tables = _tables(mlflow_db), _tables(db)
    assert sqlite_file_problem("storage", f"sqlite:///{mlflow_db}") == (
        f"storage: {str(mlflow_db)!r} is MLflow's store (experiments, runs), not Optuna's, and "
        "Optuna would add its tables to it; point storage at a new file, such as "
        "sqlite:///results/optuna.db")
    assert sqlite_file_problem("tracking_uri", f"sqlite:///{db}") == (
        f"tracking_uri: {str(db)!r} is Optuna's store (studies, trials), not MLflow's, and "
        "MLflow would add its tables to it; point tracking_uri at a new file, such as "
        "sqlite:///mlruns/mlflow.db")
    assert (_tables(mlflow_db), _tables(db)) == (mlflow_tables, optuna_tables), "read only"


def test_a_stores_own_database_and_one_without_tables_pass_as_before(
        db: Path, tmp_path: Path) -> None:
    """The tables each field takes as its store's are tables the installed Optuna and MLflow
    make (a rename upstream would refuse every store: this fails first); a SQLite file with no
    table yet is a new database, as SQLite takes it."""
    from optimizer.config.store_checks import _STORE_TABLES

    mlflow_db = _mlflow_store(tmp_path / "mlflow.db")
    for field, store in (("storage", db), ("tracking_uri", mlflow_db)):
        library, own, _ = _STORE_TABLES[field]
        missing = set(own) - _tables(store)
        assert not missing, f"{library} makes no table {missing}"
        assert sqlite_file_problem(field, f"sqlite:///{store}") is None, f"{library}'s own store"
    blank = tmp_path / "blank.db"
    connection = sqlite3.connect(blank)
    connection.execute("PRAGMA user_version = 3")  # a header and a page, no table
    connection.close()
    assert blank.stat().st_size > 0
    for field in ("storage", "tracking_uri"):
        assert sqlite_file_problem(field, f"sqlite:///{blank}") is None
