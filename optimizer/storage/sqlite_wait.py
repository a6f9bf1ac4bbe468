"""The Optuna SQLite storage waits through a lock another process holds (an open `sqlite3`
shell, a backup, a reader that stalls) for a bounded, stated time, saying what it waits for,
rather than stopping the study at SQLite's first "database is locked"."""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import optuna

from optimizer.errors import StorageError, translate

logger = logging.getLogger(__name__)

# How long one read or write of the storage waits in all for a lock another process holds.
LOCK_WAIT_S = 600.0
# SQLite's own busy wait within one attempt (the driver's `timeout`); the attempts repeat until
# LOCK_WAIT_S, each failed one logged at most every _LOG_EVERY_S.
ATTEMPT_TIMEOUT_S = 15.0
_LOG_EVERY_S = 30.0
_MAX_PAUSE_S = 5.0  # between attempts (SQLite answers a deadlock at once, without waiting)

T = TypeVar("T")


class StoreLocked(StorageError, optuna.exceptions.StorageInternalError):
    """The storage stayed locked by another process past the bound: a command's one line (exit
    1), and to the daemon a storage failure like any other (it stops; resume)."""


def is_locked(exc: BaseException) -> bool:
    """Whether SQLite refused because another connection holds the database locked (what
    Optuna wraps as StorageInternalError and SQLAlchemy as OperationalError)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, sqlite3.OperationalError) and "locked" in str(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


@dataclass
class LockWait:
    """Runs a storage call again while another process holds the database locked, up to
    `bound_s` in all from the call's start; `what` names the store in the log. A nested call
    (a storage method calling another) is retried once, by the outermost."""

    what: str
    bound_s: float = LOCK_WAIT_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _depth: threading.local = field(default_factory=threading.local, repr=False)

    def __getstate__(self) -> dict[str, Any]:  # a thread-local does not pickle
        return {k: v for k, v in vars(self).items() if k != "_depth"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state, _depth=threading.local())

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if getattr(self._depth, "n", 0):
            return fn(*args, **kwargs)
        self._depth.n = 1
        try:
            return self._call(fn, *args, **kwargs)
        finally:
            self._depth.n = 0

    def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        start = self.clock()
        logged_at: float | None = None
        attempt = 0
        while True:
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                if not is_locked(exc):
                    raise
                waited = self.clock() - start
                if waited >= self.bound_s:
                    raise translate(
                        exc, f"{self.what} stayed locked by another process for {waited:.0f} s "
                        f"(nightshift waits {self.bound_s:.0f} s at most); close what holds "
                        "it, such as an open sqlite3 shell", into=StoreLocked) from exc
                if logged_at is None or waited - logged_at >= _LOG_EVERY_S:
                    logger.warning("%s is locked by another process (an open sqlite3 shell, a "
                                   "backup, a stalled reader?): waited %.0f s, waiting up to "
                                   "%.0f s in all", self.what, waited, self.bound_s)
                    logged_at = waited
                self.sleep(min(0.1 * 2 ** attempt, _MAX_PAUSE_S, self.bound_s - waited))
                attempt += 1
                continue
            if logged_at is not None:
                logger.warning("%s: the other process let go of its lock after %.0f s; going "
                               "on", self.what, self.clock() - start)
            return result


class LockWaitingStorage(optuna.storages.RDBStorage):
    """Optuna's RDBStorage over SQLite whose every read and write waits through another
    process's lock (`LockWait`). Safe to repeat: a call SQLite refused committed nothing."""

    def __init__(self, url: str, engine_kwargs: dict[str, Any] | None = None, *,
                 wait: LockWait) -> None:
        self._lock_wait = wait
        wait.call(super().__init__, url, engine_kwargs=engine_kwargs)


# RDBStorage's methods that open a session, as optuna 5.0 names them (`_CachedStorage` calls
# the private ones); tests/optimizer/test_storage_wait.py checks the list against the source.
SESSION_METHODS = (
    "create_new_study", "delete_study", "set_study_user_attr", "set_study_system_attr",
    "get_study_id_from_name", "get_study_name_from_id", "get_study_directions",
    "get_study_user_attrs", "get_study_system_attrs", "get_trial_user_attrs",
    "get_trial_system_attrs", "get_all_studies", "create_new_trial", "_create_new_trial",
    "set_trial_param", "_set_trial_param", "get_trial_param", "set_trial_state_values",
    "set_trial_intermediate_value", "set_trial_user_attr", "set_trial_system_attr",
    "get_trial_id_from_study_id_trial_number", "get_trial", "get_all_trials", "_get_trials",
    "get_best_trial", "_get_best_trial_id", "record_heartbeat", "_get_stale_trial_ids",
    "get_n_trials",
)


def _waiting(name: str) -> Callable[..., Any]:
    method = getattr(optuna.storages.RDBStorage, name)

    @functools.wraps(method)
    def wrapper(self: LockWaitingStorage, *args: Any, **kwargs: Any) -> Any:
        return self._lock_wait.call(method, self, *args, **kwargs)

    return wrapper


for _name in SESSION_METHODS:
    setattr(LockWaitingStorage, _name, _waiting(_name))
