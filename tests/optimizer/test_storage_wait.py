"""The Optuna SQLite storage waits through a lock another process holds, for a bounded and
stated time (issue 35, item 2): a real SQLite file, a second connection holding it as an open
`sqlite3` shell does, a scripted clock."""

from __future__ import annotations

import inspect
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from optimizer.errors import StorageError
from optimizer.storage.sqlite_wait import SESSION_METHODS, LockWait, StoreLocked, is_locked
from optimizer.storage.study import make_storage


class ScriptedClock:
    """Time moves only when the wait sleeps (and by 1 s per reading: the attempts' own waits)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "optuna.db"
    study = optuna.create_study(study_name="s", storage=make_storage(f"sqlite:///{path}"))
    study.enqueue_trial({"x": 1})
    return path


@pytest.fixture
def reader(db: Path) -> Iterator[sqlite3.Connection]:
    """A reader holding the database as an open `sqlite3` shell in a transaction does: its
    shared lock keeps any writer from committing."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("BEGIN")
    conn.execute("SELECT count(*) FROM trials").fetchall()
    yield conn
    if conn.in_transaction:
        conn.execute("COMMIT")
    conn.close()


def test_a_write_waits_through_a_reader_holding_the_database_and_says_what_it_waited_for(
        db: Path, reader: sqlite3.Connection, caplog: pytest.LogCaptureFixture) -> None:
    clock = ScriptedClock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if len(clock.sleeps) == 4:  # the reader lets go after the writer's fourth attempt
            reader.execute("COMMIT")

    wait = LockWait("the Optuna storage optuna.db", bound_s=600.0, clock=clock, sleep=sleep)
    storage = make_storage(f"sqlite:///{db}", lock_wait=wait, attempt_timeout_s=0.05)
    study = optuna.load_study(study_name="s", storage=storage)
    with caplog.at_level(logging.WARNING, logger="optimizer.storage.sqlite_wait"):
        study.set_user_attr("written", True)
    assert len(clock.sleeps) == 4, "the write was tried again until the reader let go"
    assert optuna.load_study(study_name="s", storage=f"sqlite:///{db}").user_attrs == {
        "written": True}, "the write landed once the lock was released"
    text = caplog.text
    assert "the Optuna storage optuna.db is locked by another process" in text, text
    assert "waiting up to 600 s in all" in text, "the log states the bound"
    assert "let go of its lock after" in text, "the log says when the wait ended"


def test_a_lock_held_past_the_bound_stops_with_one_line_naming_the_store_and_the_bound(
        db: Path, reader: sqlite3.Connection) -> None:
    clock = ScriptedClock()
    wait = LockWait("the Optuna storage optuna.db", bound_s=30.0, clock=clock,
                    sleep=clock.sleep)
    storage = make_storage(f"sqlite:///{db}", lock_wait=wait, attempt_timeout_s=0.05)
    study = optuna.load_study(study_name="s", storage=storage)
    with pytest.raises(StoreLocked) as caught:
        study.tell(study.ask(), 1.0)  # the ask's write (a new trial) waits, then gives up
    message = str(caught.value)
    assert "optuna.db stayed locked by another process" in message
    assert "(nightshift waits 30 s at most)" in message, "the message states the bound"
    assert "\n" not in message, "one line"
    assert clock.now >= 30.0 and clock.sleeps, "it waited the bound, not SQLite's one timeout"
    # A command prints it as its one line, exit 1; the daemon sees a storage failure (resume).
    assert isinstance(caught.value, StorageError)
    assert isinstance(caught.value, optuna.exceptions.StorageInternalError)


def test_an_error_other_than_a_lock_is_raised_at_once(db: Path) -> None:
    clock = ScriptedClock()
    wait = LockWait("optuna.db", clock=clock, sleep=clock.sleep)
    storage = make_storage(f"sqlite:///{db}", lock_wait=wait, attempt_timeout_s=0.05)
    with pytest.raises(KeyError):
        storage.get_study_id_from_name("no such study")
    assert not clock.sleeps, "nothing but a lock is waited for"


def test_a_lock_only_is_recognised_through_optuna_and_sqlalchemy_wrappers(
        db: Path, reader: sqlite3.Connection) -> None:
    storage = optuna.storages.RDBStorage(f"sqlite:///{db}",
                                         engine_kwargs={"connect_args": {"timeout": 0.05}})
    with pytest.raises(optuna.exceptions.StorageInternalError) as caught:
        storage.set_study_user_attr(storage.get_study_id_from_name("s"), "k", 1)
    assert is_locked(caught.value), "Optuna's wrapper of SQLAlchemy's 'database is locked'"
    assert not is_locked(sqlite3.OperationalError("no such table: trials"))


def test_every_rdb_storage_method_that_opens_a_session_waits_through_a_lock() -> None:
    # Against an Optuna upgrade that adds a method: an unwrapped one would stop the study.
    opening = {name for name, value in vars(optuna.storages.RDBStorage).items()
               if callable(value) and "_create_scoped_session" in inspect.getsource(value)}
    assert opening <= set(SESSION_METHODS), sorted(opening - set(SESSION_METHODS))
