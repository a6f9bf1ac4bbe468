"""Opening an Optuna SQLite store another process is creating at that moment (the eleventh
session's open fault): the open waits for the creator and succeeds, or says in one line that
the study is being created; never an empty-file, missing-study or alembic error. Real processes
on real SQLite files; no clock: a process's state is read from its answers, its pipe or
/proc/locks, never from time passing."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import optuna
import pytest
from alembic.runtime.migration import HeadMaintainer

from optimizer.cli import main
from optimizer.config import StudyConfig, load_study
from optimizer.errors import NightshiftError
from optimizer.storage.creation_lock import creating_store
from optimizer.storage.lock import StudyLock, study_lock_path
from optimizer.storage.study import existing_storage, make_storage, open_study
from tests.builders import write_study

ROUNDS = 20  # fresh stores per race; each round's open meets the creation at some step of it
BEING_CREATED = "is being created"


def _round_config(study_file: str, root: str, i: int) -> StudyConfig:
    return load_study(Path(study_file)).with_overrides(storage=f"sqlite:///{root}/{i}/optuna.db")


def _create_like_the_daemon(study_file: str, root: str, rounds: int, conn: Connection) -> None:
    """Each round, what `nightshift start` does to a fresh store: take the study's lock, then
    create the store and the study in it; the lock is let go when the reader says so."""
    try:
        for i in range(rounds):
            cfg = _round_config(study_file, root, i)
            conn.recv()
            lock = StudyLock(study_lock_path(cfg))
            lock.acquire(cfg.name, cfg.storage_url)
            conn.send("locked")
            open_study(cfg, storage=make_storage(cfg.storage_url))
            conn.send("made")
            conn.recv()
            lock.release()
    except Exception as exc:  # the reader's recv then says what went wrong here
        conn.send(f"creator failed: {type(exc).__name__}: {exc}")
    finally:
        conn.close()


def _read_like_status(cfg: StudyConfig) -> str:
    """What `status` does to open the study: "ok", or the error it would print."""
    try:
        open_study(cfg, create=False, storage=existing_storage(cfg))
    except NightshiftError as exc:
        return str(exc)
    except Exception as exc:  # what `status` would show as a traceback
        return f"traceback: {type(exc).__name__}: {exc}"
    return "ok"


def test_a_store_its_daemon_is_creating_opens_once_made_or_says_it_is_being_created(
        tmp_path: Path) -> None:
    # The eleventh session's fault: `status` in the second the daemon creates its store read
    # the empty file as a store cut to nothing ("restore it from a backup"), or the store
    # without the study yet as a study never started ("start it with nightshift start").
    study_file = str(write_study(tmp_path))
    root = str(tmp_path / "stores")
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    creator = context.Process(target=_create_like_the_daemon,
                              args=(study_file, root, ROUNDS, child_conn))
    creator.start()
    child_conn.close()  # so that a creator gone without a word is an EOFError here, not a hang
    answers: list[str] = []
    finals: list[str] = []
    try:
        for i in range(ROUNDS):
            cfg = _round_config(study_file, root, i)
            conn.send("go")
            assert conn.recv() == "locked"
            answers.append(_read_like_status(cfg))  # before the store: its daemon is starting
            while not conn.poll():  # as often as it can while the daemon creates the store
                answers.append(_read_like_status(cfg))
            made = conn.recv()
            assert made == "made", made
            finals.append(_read_like_status(cfg))
            conn.send("release")
    finally:
        conn.close()
        creator.join()
    wrong = sorted({a for a in answers if a != "ok" and BEING_CREATED not in a})
    assert not wrong, f"a store being created opens or says so, never: {wrong}"
    assert all("\n" not in a for a in answers), "the study being created is said in one line"
    assert finals == ["ok"] * ROUNDS, f"once made, the store opens: {finals}"
    assert creator.exitcode == 0


def _open_fresh_stores(root: str, rounds: int, barrier: Any, results: Any) -> None:
    """Each round, open the round's fresh store at the moment the other process does."""
    outcomes = []
    for i in range(rounds):
        barrier.wait()
        try:
            make_storage(f"sqlite:///{root}/{i}/optuna.db").get_all_studies()
            outcomes.append("ok")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    results.put(outcomes)


def test_two_processes_creating_one_fresh_store_at_once_both_open_it(tmp_path: Path) -> None:
    # Optuna creates a store's tables and stamps its schema version unguarded: two processes
    # at once collide (IntegrityError from alembic, "table already exists"). One creates it
    # while the other waits for its lock, then finds it made: no retry, no sleep.
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    results = context.Queue()
    openers = [context.Process(target=_open_fresh_stores,
                               args=(str(tmp_path), ROUNDS, barrier, results))
               for _ in range(2)]
    for opener in openers:
        opener.start()
    outcomes = [results.get(), results.get()]
    for opener in openers:
        opener.join()
    failed = sorted({o for run in outcomes for o in run if o != "ok"})
    assert not failed, f"both open every fresh store: {failed}"
    stamps = []
    for i in range(ROUNDS):
        with contextlib.closing(sqlite3.connect(tmp_path / str(i) / "optuna.db")) as db:
            stamps.append(db.execute("SELECT version_num FROM alembic_version").fetchall())
    assert all(len(rows) == 1 for rows in stamps) and len({*map(tuple, stamps)}) == 1, \
        f"every store is stamped once, with one schema version: {stamps}"


def test_an_opener_without_the_lock_stamping_the_schema_first_is_met_by_a_second_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An opener that is not nightshift's (optuna-dashboard, a script's `optuna.load_study`, a
    # test's poller) takes no creation lock: it can stamp alembic's schema version between this
    # open's look and its own stamp. CI saw a daemon exit so ("cannot be opened
    # (IntegrityError)"). That interleaving, made on purpose on a real SQLite file: the open
    # collides once, then finds the store made and opens it.
    db = tmp_path / "optuna.db"
    insert = HeadMaintainer._insert_version
    foreign: list[str] = []

    def stamped_first_by_another(self: HeadMaintainer, version: str) -> None:
        if not foreign:  # this open has read no stamp; the other commits its own now
            foreign.append(version)
            with contextlib.closing(sqlite3.connect(db, timeout=0)) as conn, conn:
                conn.execute("INSERT INTO alembic_version VALUES (?)", (version,))
        insert(self, version)

    monkeypatch.setattr(HeadMaintainer, "_insert_version", stamped_first_by_another)
    storage = make_storage(f"sqlite:///{db}")
    assert foreign, "the other opener stamped first"
    study = optuna.create_study(study_name="s", storage=storage)
    assert [s.study_name for s in optuna.get_all_study_summaries(storage)] == [study.study_name]
    with contextlib.closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == \
            [(foreign[0],)], "stamped once, by the other opener"


def _waits_on(folder: Path, proc: subprocess.Popen[str]) -> bool:
    """Whether `proc` has ended or a process waits for the flock on `folder` (/proc/locks
    lists a waiter as `N: -> FLOCK ...` with the folder's inode)."""
    if proc.poll() is not None:
        return True
    inode = f":{folder.stat().st_ino} "
    return any("->" in line and inode in line
               for line in Path("/proc/locks").read_text().splitlines())


def test_status_while_the_daemon_creates_the_store_waits_for_it_and_shows_the_study(
        tmp_path: Path) -> None:
    # `nightshift status` run the moment the daemon's SQLite has made the file (0 bytes) and
    # not yet the schema: it read "an empty file (0 bytes) ... restore it from a backup".
    path = write_study(tmp_path)
    cfg = load_study(path)
    db = Path(cfg.storage_url.removeprefix("sqlite:///"))
    db.parent.mkdir(parents=True)
    daemon_lock = StudyLock(study_lock_path(cfg))
    daemon_lock.acquire(cfg.name, cfg.storage_url)  # this process plays the starting daemon
    try:
        with creating_store(cfg.storage_url):
            db.touch()  # SQLite's file, before its first page
            status = subprocess.Popen(
                [sys.executable, "-m", "optimizer.cli", "status", str(path)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"})
            while not _waits_on(db.parent, status):
                time.sleep(0.05)  # a poll, not a bound: it ends when `status` waits or ends
            optuna.create_study(study_name=cfg.name, directions=cfg.directions,
                                storage=optuna.storages.RDBStorage(cfg.storage_url))
        out, err = status.communicate()
    finally:
        daemon_lock.release()
    assert status.returncode == 0, err
    assert f"study {cfg.name}: daemon running (pid {os.getpid()}); 0 trials" in out, out


@pytest.mark.parametrize("has_store", [False, True], ids=["before-the-file", "before-the-study"])
def test_status_of_a_study_its_daemon_is_creating_says_so_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], has_store: bool) -> None:
    # Between the daemon's lock and its study in the store, `status` said "no study named
    # 'e2e' ...; start it with `nightshift start`" of a study that was starting.
    path = write_study(tmp_path)
    cfg = load_study(path)
    if has_store:
        make_storage(cfg.storage_url)  # the store made, the study not yet in it
    daemon_lock = StudyLock(study_lock_path(cfg))
    daemon_lock.acquire(cfg.name, cfg.storage_url)
    try:
        code = main(["status", str(path)])
    finally:
        daemon_lock.release()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1, err
    assert len(lines) == 1 and f"study 'e2e' {BEING_CREATED}: its daemon (pid {os.getpid()})" \
        in lines[0], err


def _make_tracking_store(url: str) -> None:
    from optimizer.tracking.store import TrackingStore

    TrackingStore(url)


@pytest.mark.parametrize(("field", "name", "make"), [
    ("storage", "optuna.db", make_storage),
    ("tracking_uri", "mlflow.db", _make_tracking_store),
], ids=["optuna", "mlflow"])
def test_the_check_before_a_start_waits_for_a_store_another_start_is_creating(
        tmp_path: Path, field: str, name: str, make: Callable[[str], object]) -> None:
    # Two studies in one storage (or one tracking store), started together: the second
    # `start`'s check of the file, run while the first's SQLite had made it (0 bytes) and not
    # yet its first page, read "an empty file (0 bytes) ... restore it from a backup" and
    # refused to start (exit 2).
    db = tmp_path / "store" / name
    db.parent.mkdir()
    url = f"sqlite:///{db}"
    with creating_store(url):
        db.touch()  # SQLite's file, before its first page
        check = subprocess.Popen(
            [sys.executable, "-c", "import sys; from optimizer.config.store_checks import "
             "sqlite_file_problem; print(sqlite_file_problem(sys.argv[1], sys.argv[2]))",
             field, url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not _waits_on(db.parent, check):
            time.sleep(0.05)  # a poll, not a bound: it ends when the check waits or ends
        make(url)  # the first start's store, made under the lock it already holds
    out, err = check.communicate()
    assert check.returncode == 0, err
    assert out.strip() == "None", out


def test_a_tracking_store_is_opened_under_the_same_creation_lock(tmp_path: Path) -> None:
    # MLflow's store is created and read under the lock the Optuna store and the check before
    # a start take: a process holding it (creating a store in that folder) makes the open wait.
    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir()
    url = f"sqlite:///{db}"
    with creating_store(url):
        opener = subprocess.Popen(
            [sys.executable, "-c", "import sys; from optimizer.tracking.store import "
             "TrackingStore; TrackingStore(sys.argv[1]); print('opened')", url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while not _waits_on(db.parent, opener):
            time.sleep(0.05)  # a poll, not a bound: it ends when the open waits or ends
        assert opener.poll() is None, "the open went ahead while another held the lock"
    out, err = opener.communicate()
    assert opener.returncode == 0 and out.strip() == "opened", err


def test_the_creation_lock_is_re_entrant_in_one_thread(tmp_path: Path) -> None:
    # `existing_storage` looks at the file under the lock and asks `sqlite_file_problem`, which
    # takes it too: a second flock of the same folder through another descriptor would wait on
    # the first forever.
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    with creating_store(url) as outer, creating_store(url) as inner:
        assert outer and inner
    with creating_store(url):  # let go: taken again
        pass
