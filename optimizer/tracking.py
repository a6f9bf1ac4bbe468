"""MLflow tracking: one parent run per study, one nested child run per trial.

The daemon is the only writer. Optuna's storage is the source of truth; MLflow is brought into
agreement with it on every resume (`reconcile`), so a crash between the two never leaves a run
RUNNING or a finished trial unlogged.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from optimizer.errors import TrackingError

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

TAG_STUDY = "nightshift.study"
TAG_KIND = "nightshift.kind"  # "study" or "trial"
TAG_TRIAL = "nightshift.trial"
TAG_STATE = "state"  # complete | pruned | failed | running
TAG_FAILURE = "failure_reason"
TAG_CONCLUSION = "conclusion"
_STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}
_MAX_PARAM_LEN = 6000  # MLflow 3 param value limit is 6000 characters


def artifact_root_for(tracking_uri: str) -> Path | None:
    """`sqlite:///mlruns/mlflow.db` keeps its artifacts beside it, in `mlruns/artifacts`."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme != "sqlite":
        return None
    db_path = Path(tracking_uri.removeprefix("sqlite:///"))
    return db_path.parent / "artifacts"


class Tracker:
    """Writes studies and trials to MLflow through `MlflowClient` (no global active run)."""

    def __init__(self, tracking_uri: str) -> None:
        self.tracking_uri = tracking_uri
        parsed = urlparse(tracking_uri)
        if parsed.scheme == "sqlite":
            db_path = Path(tracking_uri.removeprefix("sqlite:///"))
            try:
                db_path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise TrackingError(f"cannot create the tracking directory {db_path.parent} "
                                    f"({exc.strerror}); pass a writable --tracking-uri.") from exc
        from mlflow import MlflowClient

        self.client: MlflowClient = MlflowClient(tracking_uri)

    # -- study ------------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        try:
            exp = self.client.get_experiment_by_name(name)
            if exp is not None:
                return str(exp.experiment_id)
            root = artifact_root_for(self.tracking_uri)
            location = (root / name).resolve().as_uri() if root is not None else None
            return str(self.client.create_experiment(name, artifact_location=location))
        except Exception as exc:  # MLflow raises many types; all mean "store unusable"
            first = (str(exc).splitlines() or [""])[0][:160]
            raise TrackingError(f"MLflow store {self.tracking_uri} refused the study "
                                f"({type(exc).__name__}: {first}); check --tracking-uri or "
                                "the study's tracking_uri.") from exc

    def start_study(self, study_name: str, *, params: Mapping[str, Any],
                    artifacts: Mapping[str, Any]) -> str:
        """The parent run of a study: reused when the study resumes."""
        exp_id = self.experiment_id(study_name)
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`{TAG_KIND}` = 'study'", max_results=1)
        if found:
            run_id = str(found[0].info.run_id)
            if found[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            return run_id
        run = self.client.create_run(exp_id, run_name=study_name,
                                     tags={TAG_STUDY: study_name, TAG_KIND: "study"})
        run_id = str(run.info.run_id)
        self.log_params(run_id, params)
        for name, data in artifacts.items():
            self.client.log_dict(run_id, data, name)
        return run_id

    def log_study_event(self, parent_run_id: str, key: str, value: str) -> None:
        self.client.set_tag(parent_run_id, key, value[:5000])

    def finish_study(self, parent_run_id: str, metrics: Mapping[str, float],
                     tags: Mapping[str, str], *, is_done: bool) -> None:
        self.log_metrics(parent_run_id, metrics)
        for k, v in tags.items():
            self.client.set_tag(parent_run_id, k, v)
        # A study stopped before its budget stays visibly unfinished (KILLED), not FAILED.
        self.client.set_terminated(parent_run_id, "FINISHED" if is_done else "KILLED")

    # -- trials -----------------------------------------------------------------------------

    def start_trial(self, parent_run_id: str, study_name: str, trial_number: int,
                    params: Mapping[str, Any]) -> str:
        exp_id = self.client.get_run(parent_run_id).info.experiment_id
        run = self.client.create_run(
            exp_id, run_name=f"trial-{trial_number:03d}",
            tags={"mlflow.parentRunId": parent_run_id, TAG_STUDY: study_name,
                  TAG_KIND: "trial", TAG_TRIAL: str(trial_number), TAG_STATE: "running"})
        run_id = str(run.info.run_id)
        self.log_params(run_id, params)
        return run_id

    def finish_trial(self, run_id: str, *, state: str, metrics: Mapping[str, float],
                     step_metrics: Iterable[tuple[int, Mapping[str, float]]] = (),
                     tags: Mapping[str, str] = {}, params: Mapping[str, Any] = {},
                     texts: Mapping[str, str] = {}, dicts: Mapping[str, Any] = {},
                     files: Iterable[Path] = ()) -> None:
        """Log a trial's outcome and close its run. Idempotent enough to be replayed by
        `reconcile`: params already logged with the same value are skipped."""
        self.log_params(run_id, params)
        now = int(time.time() * 1000)
        from mlflow.entities import Metric

        batch = [Metric(k, float(v), now, 0) for k, v in metrics.items() if _finite(v)]
        for step, values in step_metrics:
            batch.extend(Metric(k, float(v), now, step) for k, v in values.items()
                         if _finite(v))
        for i in range(0, len(batch), 1000):
            self.client.log_batch(run_id, metrics=batch[i:i + 1000])
        for name, text in texts.items():
            self.client.log_text(run_id, text, name)
        for name, data in dicts.items():
            self.client.log_dict(run_id, data, name)
        for path in files:
            if path.is_file():
                self.client.log_artifact(run_id, str(path))
        for k, v in {**tags, TAG_STATE: state}.items():
            self.client.set_tag(run_id, k, str(v)[:5000])
        self.client.set_terminated(run_id, _STATUS[state])

    def find_study_run(self, study_name: str) -> str | None:
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            return None
        found = self.client.search_runs([exp.experiment_id], max_results=1,
                                        filter_string=f"tags.`{TAG_KIND}` = 'study'")
        return str(found[0].info.run_id) if found else None

    def log_study_files(self, study_name: str, paths: Iterable[Path],
                        artifact_path: str) -> str:
        """Attach files (the report) to the study's parent run; returns its run id."""
        run_id = self.find_study_run(study_name)
        if run_id is None:
            raise TrackingError(f"MLflow store {self.tracking_uri} has no run for study "
                                f"{study_name!r}; run `nightshift start` on it first.")
        for path in paths:
            self.client.log_artifact(run_id, str(path), artifact_path)
        return run_id

    def find_trial_run(self, study_name: str, trial_number: int) -> str | None:
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            return None
        found = self.client.search_runs(
            [exp.experiment_id], max_results=1,
            filter_string=f"tags.`{TAG_KIND}` = 'trial' and tags.`{TAG_TRIAL}` = "
                          f"'{trial_number}'")
        return str(found[0].info.run_id) if found else None

    def reconcile(self, study_name: str, trials: Mapping[str, Mapping[str, Any]]) -> int:
        """Close every RUNNING trial run whose trial is no longer in flight.

        `trials` maps MLflow run id -> the trial's record (as `record_for_tracking` builds it)
        for finished trials; runs not in it are marked FAILED with `daemon_lost`."""
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            return 0
        stale = self.client.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.`{TAG_KIND}` = 'trial' and attributes.status = 'RUNNING'",
            max_results=10000)
        for run in stale:
            run_id = str(run.info.run_id)
            record = trials.get(run_id)
            if record is not None:
                self.finish_trial(run_id, **record)
            else:
                self.client.set_tag(run_id, TAG_FAILURE, "daemon_lost")
                self.client.set_tag(run_id, TAG_CONCLUSION,
                                    "the daemon died with this trial in flight; re-queued.")
                self.client.set_tag(run_id, TAG_STATE, "failed")
                self.client.set_terminated(run_id, "FAILED")
        return len(stale)

    # -- helpers ----------------------------------------------------------------------------

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        if not params:
            return
        from mlflow.entities import Param

        existing = self.client.get_run(run_id).data.params
        items = [Param(k, _param_text(v)) for k, v in params.items() if k not in existing]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, 0) for k, v in metrics.items() if _finite(v)]
        if batch:
            self.client.log_batch(run_id, metrics=batch)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_PARAM_LEN]
