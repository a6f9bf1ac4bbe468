"""Opening an MLflow store and proving it writable: where a SQLite store keeps its artifacts,
one creator at a time for a fresh store, MLflow's own logging quietened, a probe file."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from optimizer.errors import TrackingError, headline, translate
from optimizer.storage.creation_lock import creating_store
from optimizer.tracking.tags import EXPERIMENT_KIND_RUNS, TAG_EXPERIMENT_KIND

if TYPE_CHECKING:
    from mlflow import MlflowClient

_MAX_PARAM_LEN = 6000  # MLflow 3 param value limit is 6000 characters
_PROBE_TAG = "nightshift.write_probe"


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
    (`Tracker` builds the study's and trials' runs on it)."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
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
