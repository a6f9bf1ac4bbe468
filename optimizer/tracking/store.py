"""Opening an MLflow store and proving it writable: where a SQLite store keeps its artifacts,
one creator at a time for a fresh store, MLflow's own logging quietened, a probe file; and the
bounded wait of a trial's writes on a SQLite store another process holds locked
(`TrackingStore.trial_write`)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from optimizer.errors import TrackingError, headline, translate
from optimizer.storage.creation_lock import creating_store
from optimizer.storage.sqlite_wait import is_locked
from optimizer.tracking.tags import EXPERIMENT_KIND_RUNS, TAG_EXPERIMENT_KIND

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000  # MLflow 3 param value limit is 6000 characters
_PROBE_TAG = "nightshift.write_probe"

# How long a trial's write (its run opened or closed, from the daemon's loop) waits for a lock
# another process holds on a SQLite store (the MLflow UI, another study writing) before it is
# left to the catch-up: MLflow waits 20 s a call (its `PRAGMA busy_timeout = 20000` per
# session), and a trial makes several, all the while no other trial is collected or launched.
TRIAL_LOCK_WAIT_S = 2.0
# Once a trial's write found the store locked, trial writes are left to the catch-up for this
# long without a try: each try would stall the loop TRIAL_LOCK_WAIT_S again.
LOCKED_RETRY_S = 60.0
# The busy timeout (ms) the SQLite sessions opened in this context get instead of MLflow's
# (`_bounded_busy_timeout`); None: MLflow's own.
_LOCK_WAIT_MS: ContextVar[int | None] = ContextVar("mlflow_lock_wait_ms", default=None)


def artifact_root_for(tracking_uri: str) -> Path | None:
    """`sqlite:///mlruns/mlflow.db` keeps its artifacts beside it, in `mlruns/artifacts`."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme != "sqlite":
        return None
    db_path = Path(tracking_uri.removeprefix("sqlite:///"))
    return db_path.parent / "artifacts"


@contextlib.contextmanager
def quiet(name: str) -> Iterator[None]:
    """Nothing below CRITICAL from logger `name` (and its children that set no level)."""
    target = logging.getLogger(name)
    level = target.level
    target.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        target.setLevel(level)


def _bounded_busy_timeout(conn: Any, cursor: Any, statement: str, parameters: Any,
                          context: Any, executemany: bool) -> tuple[str, Any]:
    """SQLAlchemy's `before_cursor_execute` on an MLflow SQLite store's engine: MLflow's
    `PRAGMA busy_timeout` at the start of each session set to `_LOCK_WAIT_MS` where a
    `TrackingStore.trial_write` asks for it."""
    wait_ms = _LOCK_WAIT_MS.get()
    if wait_ms is not None and statement.lstrip().upper().startswith("PRAGMA BUSY_TIMEOUT"):
        return f"PRAGMA busy_timeout = {wait_ms};", parameters
    return statement, parameters


def _bound_lock_waits(client: MlflowClient) -> bool:
    """Let `trial_write` bound the lock waits of the client's SQLite store; whether it could
    (MLflow keeps the engine on its store: `client._tracking_client.store.engine`; one store,
    cached by MLflow, serves every client of a URI, so the listener is added once)."""
    from sqlalchemy import event

    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    engine = getattr(store, "engine", None)
    if engine is None or engine.url.get_backend_name() != "sqlite":
        return False
    if not event.contains(engine, "before_cursor_execute", _bounded_busy_timeout):
        event.listen(engine, "before_cursor_execute", _bounded_busy_timeout, retval=True)
    return True


def local_path(location: str | None) -> Path | None:
    """The folder of a `file:` (or plain path) artifact location; None for a remote one."""
    if not location:
        return None
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a path (or a Windows drive letter)
        return Path(location)
    return None


def probe_folder(folder: Path) -> None:
    """Write and remove a file in `folder`, creating it (and removing what was created) if it
    is missing; raises `TrackingError` if the file system refuses."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    probe = folder / f".nightshift-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise translate(exc, f"the MLflow artifact location {folder} is not writable "
                        f"({exc.strerror or exc}); make it writable or pass another "
                        "--tracking-uri.", into=TrackingError) from exc
    finally:
        for path in missing:  # deepest first
            with contextlib.suppress(OSError):
                path.rmdir()


class TrackingStore:
    """An MLflow store opened through `MlflowClient` (no global active run): its experiments,
    proof that it takes writes, and the idempotent logging every run write goes through
    (`Tracker` builds the study's and trials' runs on it). `trial_lock_wait_s`,
    `locked_retry_s` and `clock` (monotonic s) bound a trial's writes on a locked store
    (`trial_write`)."""

    def __init__(self, tracking_uri: str, *, trial_lock_wait_s: float = TRIAL_LOCK_WAIT_S,
                 locked_retry_s: float = LOCKED_RETRY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tracking_uri = tracking_uri
        self.trial_lock_wait_s = trial_lock_wait_s
        self.locked_retry_s = locked_retry_s
        self.clock = clock
        self._locked_at: float | None = None  # when a trial's write last found it locked
        parsed = urlparse(tracking_uri)
        if parsed.scheme == "sqlite":
            db_path = Path(tracking_uri.removeprefix("sqlite:///"))
            try:
                db_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise translate(exc, f"cannot create the tracking directory {db_path.parent} "
                                f"({exc.strerror}); pass a writable --tracking-uri.",
                                into=TrackingError) from exc
        from mlflow import MlflowClient

        try:
            with quiet("mlflow"), creating_store(tracking_uri):
                self.client: MlflowClient = MlflowClient(tracking_uri)
        except Exception as exc:  # MLflow raises many types; all mean "cannot open the store"
            if "MLFLOW_ALLOW_FILE_STORE" in str(exc):
                raise translate(exc, f"MLflow 3 opens no file store ({tracking_uri}) unless "
                                "MLFLOW_ALLOW_FILE_STORE=true is set; give "
                                "sqlite:///mlruns/mlflow.db", into=TrackingError) from exc
            raise translate(exc, f"MLflow cannot open the store {tracking_uri} "
                            f"({headline(exc)}); pass another --tracking-uri.",
                            into=TrackingError) from exc
        self.is_lock_wait_bounded = parsed.scheme == "sqlite" and _bound_lock_waits(self.client)

    @contextlib.contextmanager
    def trial_write(self) -> Iterator[None]:
        """A trial's writes, made from the daemon's loop: on a SQLite store another process
        holds locked, each waits `trial_lock_wait_s` at most (not MLflow's 20 s) and the block
        raises `TrackingError`; for `locked_retry_s` after that, the block raises at once,
        without a try. The caller keeps the trial in Optuna and the catch-up (at the study's
        end, or its next start) logs what was refused: nothing is queued in memory, so a crash
        loses nothing. One warning when the store is found locked, one line when it takes
        writes again. Any other failure is raised as it was."""
        since = None if self._locked_at is None else self.clock() - self._locked_at
        if since is not None and since < self.locked_retry_s:
            raise TrackingError(
                f"the MLflow store was locked by another process {since:.0f} s ago: trial "
                f"writes wait {self.locked_retry_s:.0f} s before a try ({self.tracking_uri})")
        token = _LOCK_WAIT_MS.set(max(1, round(self.trial_lock_wait_s * 1000)))
        try:
            with quiet("mlflow"):  # it logs a locked store's refusal with a traceback
                yield
        except Exception as exc:
            if not is_locked(exc):
                raise
            if self._locked_at is None:
                logger.warning(
                    "MLflow store %s is locked by another process (the MLflow UI or another "
                    "study writing?): a trial's run waits %g s at most for it, then is left to "
                    "the catch-up (at the study's end, or its next start); tried again every "
                    "%.0f s", self.tracking_uri,
                    self.trial_lock_wait_s, self.locked_retry_s)
            self._locked_at = self.clock()
            raise translate(exc, "another process held the MLflow store locked past "
                            f"{self.trial_lock_wait_s:g} s ({self.tracking_uri})",
                            into=TrackingError) from exc
        finally:
            _LOCK_WAIT_MS.reset(token)
        if self._locked_at is not None:
            logger.warning("MLflow store %s takes writes again", self.tracking_uri)
            self._locked_at = None

    # -- study ------------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        try:
            exp = self.client.get_experiment_by_name(name)
            if exp is not None:
                return str(exp.experiment_id)
            root = artifact_root_for(self.tracking_uri)
            location = (root / name).resolve().as_uri() if root is not None else None
            return str(self.client.create_experiment(
                name, artifact_location=location,
                tags={TAG_EXPERIMENT_KIND: EXPERIMENT_KIND_RUNS}))
        except Exception as exc:  # MLflow raises many types; all mean "store unusable"
            raise translate(exc, f"MLflow store {self.tracking_uri} refused the study "
                            f"({headline(exc)}); check --tracking-uri or the "
                            "study's tracking_uri.", into=TrackingError) from exc

    def check_writable(self, study_name: str) -> str:
        """The study's experiment id, once the store has taken a write: a probe tag set on the
        experiment and deleted, and, for a local artifact location, a probe file written and
        removed there (a folder it had to create is removed too). Reading alone would pass a
        store that refuses writes, and the daemon would then fail in its first write.
        Raises `TrackingError` naming what refused."""
        exp_id = self.experiment_id(study_name)
        try:
            with quiet("mlflow"):  # it logs the refusal with a traceback; ours is one line
                self.client.set_experiment_tag(exp_id, _PROBE_TAG, str(os.getpid()))
                self.client.delete_experiment_tag(exp_id, _PROBE_TAG)
                location = self.client.get_experiment(exp_id).artifact_location
        except Exception as exc:  # MLflow raises many types; all mean "store read-only"
            raise translate(exc, f"MLflow store {self.tracking_uri} can be read but refused "
                            f"a write ({headline(exc)}); make it writable or "
                            "pass another --tracking-uri.", into=TrackingError) from exc
        folder = local_path(location)
        if folder is not None:
            probe_folder(folder)
        return exp_id

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        if not params:
            return
        self._log_missing_params(run_id, params, self.client.get_run(run_id).data.params)

    def _log_missing_params(self, run_id: str, params: Mapping[str, Any],
                            existing: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_text(v)) for k, v in params.items() if k not in existing]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def _metric_points(self, run_id: str, latest: Mapping[str, float]
                       ) -> set[tuple[str, int, float]]:
        """(key, step, value) of every metric value the run holds (none on a fresh run)."""
        return {(key, int(m.step), float(m.value)) for key in latest
                for m in self.client.get_metric_history(run_id, key)}

    def log_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, 0) for k, v in metrics.items() if is_finite_number(v)]
        if batch:
            self.client.log_batch(run_id, metrics=batch)


def is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_PARAM_LEN]
