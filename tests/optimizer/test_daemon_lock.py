"""One daemon per Optuna study: the lock is keyed by the storage and the study name (a file
beside a SQLite database; a lease in the storage for a server RDB), not by the directory a
daemon is started from. Fast: no Ray, no engine."""

from __future__ import annotations

import time
from pathlib import Path

import optuna
import pytest
from optuna.storages import BaseStorage

from optimizer.config import load_study
from optimizer.errors import StudyLockedError
from optimizer.storage import lock as lock_module
from optimizer.storage.lock import (
    LEASE_ATTR,
    LEASE_TTL_S,
    StorageLease,
    read_lease,
    study_lock_path,
)
from tests.builders import write_study


def test_the_lock_follows_the_storage_and_study_name_not_the_directory(
        tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path}/shared/optuna.db"
    paths = []
    for where in ("a", "b"):
        (tmp_path / where).mkdir()
        cfg = load_study(write_study(tmp_path / where, storage=storage,
                                     results_dir=str(tmp_path / where / "results")))
        paths.append(study_lock_path(cfg))
    assert paths[0] == paths[1], "two results dirs, one storage and study: one lock"
    assert paths[0].parent == tmp_path / "shared", "beside the SQLite database"
    other = load_study(write_study(tmp_path / "a", name="other", storage=storage))
    assert study_lock_path(other) != paths[0], "another study in the storage: another lock"
    # A server URL: the study file check refuses one whose driver is not installed here, so the
    # loaded config is pointed at it afterwards (only the lock's path is under test).
    server = load_study(write_study(tmp_path / "a"))
    server.storage_url = "postgresql://u:pw@db:5432/optuna"
    assert study_lock_path(server).parent == lock_module.LOCK_DIR
    assert "pw" not in study_lock_path(server).name


@pytest.fixture
def study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[BaseStorage, int]:
    """The study's storage and id: the lease speaks to the storage's own API."""
    monkeypatch.setattr(lock_module, "LEASE_SETTLE_S", 0.01)  # the race window, shortened
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path}/optuna.db")
    optuna.create_study(study_name="s", storage=storage)
    return storage, storage.get_study_id_from_name("s")


def test_a_live_lease_refuses_a_second_daemon_and_release_frees_it(
        study: tuple[BaseStorage, int]) -> None:
    first = StorageLease(*study, "s")
    first.acquire()
    try:
        holder = read_lease(*study)
        assert holder is not None and holder["token"] == first.token
        with pytest.raises(StudyLockedError, match="already run by pid"):
            StorageLease(*study, "s").acquire()
    finally:
        first.release()
    assert read_lease(*study) is None, "released: no holder"
    second = StorageLease(*study, "s")
    second.acquire()
    second.release()


def test_a_dead_daemons_lease_runs_out_and_is_taken_over(study: tuple[BaseStorage, int]) -> None:
    study[0].set_study_system_attr(study[1], LEASE_ATTR, {
        "token": "dead", "pid": 1, "host": "elsewhere",
        "heartbeat": time.time() - LEASE_TTL_S - 1})
    assert read_lease(*study) is None, "a lease not renewed for the TTL holds nothing"
    lease = StorageLease(*study, "s")
    lease.acquire()
    try:
        assert read_lease(*study)["token"] == lease.token  # type: ignore[index]
    finally:
        lease.release()
