"""`Tracker`: the study's parent run and each trial's child run in MLflow, written through
`MlflowClient` (no global active run), and `catch_up`, which brings the runs into agreement with
Optuna's finished trials on every start."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.errors import TrackingError
from optimizer.tracking.payload import TrialLog, with_workdir_files
from optimizer.tracking.store import TrackingStore, is_finite_number
from optimizer.tracking.tags import (
    EXPERIMENT_KIND_RUNS,
    KIND_CONFIRMATION,
    KIND_TRIAL,
    RECOMMENDED_MARK,
    TAG_CONCLUSION,
    TAG_CONFIRM,
    TAG_EXPERIMENT_KIND,
    TAG_FAILURE,
    TAG_KIND,
    TAG_PARENT,
    TAG_RECOMMENDED,
    TAG_STATE,
    TAG_STUDY,
    TAG_STUDY_KEY,
    TAG_TRIAL,
)
from optimizer.tracking.view import VIEW_KEY, VIEW_TAG, runs_view

_STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}


@dataclass(frozen=True)
class CatchUp:
    """What `Tracker.catch_up` did."""

    left_running: int  # trial runs found RUNNING (a dead daemon's), all closed now
    created: int  # finished trials the store had no run for, logged now



class Tracker(TrackingStore):
    """Writes studies and trials to MLflow through `MlflowClient` (no global active run)."""

    # -- study ------------------------------------------------------------------------------

    def start_study(self, study_name: str, *, key: str, params: Mapping[str, Any],
                    artifacts: Mapping[str, Any], objectives: Mapping[str, str] = {},
                    adopt_unkeyed: bool = False, searched: Sequence[str] = ()) -> str:
        """The parent run of the Optuna study `key` names: reused when the study resumes, made
        anew for a new study of the same name (its earlier runs stay as they were). With
        `adopt_unkeyed` (a study begun before parent runs carried keys), its one parent run
        without a key is taken and given this one. The experiment is marked as one of runs
        and given nightshift's view of its runs table (`runs_view`, sorted by the first of
        `objectives`: name -> direction); a store written before gets both now."""
        exp_id = self.experiment_id(study_name)
        self.mark_experiment(exp_id, objectives, searched)
        found: list[Any] = list(self.client.search_runs(
            [exp_id], max_results=1,
            filter_string=f"tags.`{TAG_KIND}` = 'study' and tags.`{TAG_STUDY_KEY}` = '{key}'"))
        if not found and adopt_unkeyed:
            found = [r for r in self._study_runs(exp_id) if TAG_STUDY_KEY not in r.data.tags]
        if found:
            run_id = str(found[0].info.run_id)
            self.client.set_tag(run_id, TAG_STUDY_KEY, key)
            if found[0].info.status != "RUNNING":
                self.client.update_run(run_id, status="RUNNING")
            return run_id
        run = self.client.create_run(exp_id, run_name=study_name,
                                     tags={TAG_STUDY: study_name, TAG_KIND: "study",
                                           TAG_STUDY_KEY: key})
        run_id = str(run.info.run_id)
        self.log_params(run_id, params)
        for name, data in artifacts.items():
            self.client.log_dict(run_id, data, name)
        return run_id

    def mark_experiment(self, exp_id: str, objectives: Mapping[str, str],
                        searched: Sequence[str] = ()) -> None:
        """The experiment-kind tag and the runs view (`runs_view`), each written where it is
        missing or differs (a resume writes nothing)."""
        tags = self.client.get_experiment(exp_id).tags
        if tags.get(TAG_EXPERIMENT_KIND) is None:
            self.client.set_experiment_tag(exp_id, TAG_EXPERIMENT_KIND, EXPERIMENT_KIND_RUNS)
        state = json.dumps(runs_view(objectives, searched), sort_keys=True)
        try:
            previous = json.loads(tags.get(VIEW_TAG) or "{}")
        except ValueError:
            previous = {}
        if previous.get("state") != state:
            now_ms = int(time.time() * 1000)
            created_ms = previous.get("createdAt") if isinstance(
                previous.get("createdAt"), int) else now_ms
            self.client.set_experiment_tag(exp_id, VIEW_TAG, json.dumps(
                {"name": VIEW_KEY, "createdAt": created_ms, "updatedAt": now_ms,
                 "state": state}))

    def log_study_event(self, parent_run_id: str, key: str, value: str) -> None:
        self.client.set_tag(parent_run_id, key, value[:5000])

    def set_study_tags(self, parent_run_id: str, tags: Mapping[str, str]) -> None:
        """Tags of the study run (its fingerprint, what the warm start did), in batches."""
        from mlflow.entities import RunTag

        items = [RunTag(k, str(v)[:5000]) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(parent_run_id, tags=items[i:i + 100])

    def finish_study(self, parent_run_id: str, metrics: Mapping[str, float],
                     tags: Mapping[str, str], *, is_done: bool) -> None:
        self.log_metrics(parent_run_id, metrics)
        for k, v in tags.items():
            self.client.set_tag(parent_run_id, k, v)
        # A study stopped before its budget stays visibly unfinished (KILLED), not FAILED.
        self.client.set_terminated(parent_run_id, "FINISHED" if is_done else "KILLED")

    def mark_trials(self, parent_run_id: str, recommended: int | None,
                    figures: Mapping[int, Mapping[str, float]] = {}) -> None:
        """The review figures of each trial run under the parent (`figures`: trial number ->
        metrics, the runs view's first columns), and the run of trial `recommended`
        (recommendation.recommended_trial: what `export` writes) marked by the tag
        `nightshift.recommended` and its name's RECOMMENDED_MARK; any other trial run is
        unmarked (a later trial may have taken its place)."""
        number = recommended
        exp_id = self.client.get_run(parent_run_id).info.experiment_id
        runs = self.client.search_runs(
            [exp_id], max_results=1000,
            filter_string=f"tags.`{TAG_KIND}` = '{KIND_TRIAL}' and "
                          f"tags.`{TAG_PARENT}` = '{parent_run_id}'")
        for run in runs:
            tags = run.data.tags
            is_it = number is not None and tags.get(TAG_TRIAL) == str(number)
            name = str(run.info.run_name or "").removeprefix(RECOMMENDED_MARK)
            want = RECOMMENDED_MARK + name if is_it else name
            if run.info.run_name != want:
                self.client.set_tag(run.info.run_id, "mlflow.runName", want)
            if is_it and tags.get(TAG_RECOMMENDED) != "true":
                self.client.set_tag(run.info.run_id, TAG_RECOMMENDED, "true")
            elif not is_it and TAG_RECOMMENDED in tags:
                self.client.delete_tag(run.info.run_id, TAG_RECOMMENDED)
            tag = tags.get(TAG_TRIAL, "")
            wanted = figures.get(int(tag), {}) if tag.isdigit() else {}
            missing = {k: v for k, v in wanted.items() if run.data.metrics.get(k) != v}
            if missing:
                self.log_metrics(run.info.run_id, missing)

    # -- trials -----------------------------------------------------------------------------

    def start_trial(self, parent_run_id: str, study_name: str, trial_number: int,
                    params: Mapping[str, Any], *, confirm: str | None = None) -> str:
        """A trial's run, named `t003` (`c014` for a confirmation run, `confirm` naming its
        side) until `finish_trial` gives it the name that says what it changed. On a store
        another process holds locked it raises `TrackingError` within `trial_lock_wait_s`
        (`trial_write`): the catch-up makes the run."""
        with self.trial_write():
            return self._start_trial(parent_run_id, study_name, trial_number, params,
                                     confirm=confirm)

    def _start_trial(self, parent_run_id: str, study_name: str, trial_number: int,
                     params: Mapping[str, Any], *, confirm: str | None = None) -> str:
        exp_id = self.client.get_run(parent_run_id).info.experiment_id
        tags = {TAG_PARENT: parent_run_id, TAG_STUDY: study_name, TAG_KIND: KIND_TRIAL,
                TAG_TRIAL: str(trial_number), TAG_STATE: "running"}
        if confirm:
            tags.update({TAG_KIND: KIND_CONFIRMATION, TAG_CONFIRM: confirm})
        run = self.client.create_run(
            exp_id, run_name=f"{'c' if confirm else 't'}{trial_number:03d}", tags=tags)
        run_id = str(run.info.run_id)
        self.log_params(run_id, params)
        return run_id

    def finish_trial(self, run_id: str, *, state: str, metrics: Mapping[str, float],
                     step_metrics: Iterable[tuple[int, Mapping[str, float]]] = (),
                     tags: Mapping[str, str] = {}, params: Mapping[str, Any] = {},
                     texts: Mapping[str, str] = {}, dicts: Mapping[str, Any] = {},
                     files: Iterable[Path] = ()) -> None:
        """Log a trial's outcome and close its run (`tracking_payload` gives the arguments).
        On a store another process holds locked it raises `TrackingError` within
        `trial_lock_wait_s` (`trial_write`), the run left RUNNING for the catch-up to finish."""
        with self.trial_write():
            self._finish_trial(run_id, state=state, metrics=metrics, step_metrics=step_metrics,
                               tags=tags, params=params, texts=texts, dicts=dicts, files=files)

    def _finish_trial(self, run_id: str, *, state: str, metrics: Mapping[str, float],
                      step_metrics: Iterable[tuple[int, Mapping[str, float]]] = (),
                      tags: Mapping[str, str] = {}, params: Mapping[str, Any] = {},
                      texts: Mapping[str, str] = {}, dicts: Mapping[str, Any] = {},
                      files: Iterable[Path] = ()) -> None:
        """Idempotent: what the run holds already (a param, a metric's value at its step, an
        artifact of the same size) is not logged again, so `catch_up` replaying a call that
        failed halfway logs only the rest."""
        from mlflow.entities import Metric

        run = self.client.get_run(run_id)
        self._log_missing_params(run_id, params, run.data.params)
        logged = self._metric_points(run_id, run.data.metrics)
        now = int(time.time() * 1000)
        points = [(k, v, 0) for k, v in metrics.items()]
        for step, values in step_metrics:
            points.extend((k, v, step) for k, v in values.items())
        batch = [Metric(k, float(v), now, step) for k, v, step in points
                 if is_finite_number(v) and (k, step, float(v)) not in logged]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(run_id, metrics=batch[i:i + 1000])
        artifacts = {a.path: a.file_size for a in self.client.list_artifacts(run_id)
                     if not a.is_dir}
        for name, text in texts.items():
            if artifacts.get(name) != len(text.encode()):
                self.client.log_text(run_id, text, name)
        for name, data in dicts.items():
            if not artifacts.get(name):
                self.client.log_dict(run_id, data, name)
        for path in files:
            if path.is_file() and artifacts.get(path.name) != path.stat().st_size:
                self.client.log_artifact(run_id, str(path))
        for k, v in {**tags, TAG_STATE: state}.items():
            self.client.set_tag(run_id, k, str(v)[:5000])
        self.client.set_terminated(run_id, _STATUS[state])

    def _study_runs(self, exp_id: str) -> list[Any]:
        """The experiment's parent runs, newest first."""
        return list(self.client.search_runs(
            [exp_id], filter_string=f"tags.`{TAG_KIND}` = 'study'", max_results=1000,
            order_by=["attributes.start_time DESC"]))

    def find_study_run(self, study_name: str, key: str | None = None) -> str | None:
        """The parent run of the Optuna study `key` names; without a key (a study begun before
        keys), the newest of the name."""
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            return None
        runs = self._study_runs(str(exp.experiment_id))
        if key is not None:
            runs = [r for r in runs if r.data.tags.get(TAG_STUDY_KEY) == key]
        return str(runs[0].info.run_id) if runs else None

    def log_study_files(self, study_name: str, paths: Iterable[Path],
                        artifact_path: str, key: str | None = None) -> str:
        """Attach files (the report) to the study's parent run; returns its run id."""
        run_id = self.find_study_run(study_name, key)
        if run_id is None:
            raise TrackingError(f"MLflow store {self.tracking_uri} has no run for study "
                                f"{study_name!r}; run `nightshift start` on it first.")
        for path in paths:
            self.client.log_artifact(run_id, str(path), artifact_path)
        return run_id

    def find_trial_run(self, study_name: str, parent_run_id: str,
                       trial_number: int) -> str | None:
        """The run of trial `trial_number` under the parent run `parent_run_id`."""
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            return None
        found = self.client.search_runs(
            [exp.experiment_id], max_results=1,
            filter_string=f"tags.`{TAG_KIND}` != 'study' and tags.`{TAG_TRIAL}` = "
                          f"'{trial_number}' and tags.`{TAG_PARENT}` = '{parent_run_id}'")
        return str(found[0].info.run_id) if found else None

    def catch_up(self, study_name: str, parent_run_id: str,
                 trials: Sequence[TrialLog]) -> CatchUp:
        """Bring the study's trial runs into agreement with Optuna's finished `trials`.

        A trial without a run (the store refused it at the time) gets one, found again by its
        trial tag if it was created after all, else created now, with its server log and trace
        from its workdir. A run left RUNNING is finished from its trial's record, logging only
        what it lacks (`finish_trial` is idempotent), its server log and trace included; a run
        left RUNNING whose trial Optuna does not hold finished is closed FAILED (`daemon_lost`).
        Runs already closed are not touched. Only runs found RUNNING count as left running.
        Off the loop's path (at a start, at the study's end), its writes wait for a locked
        store as MLflow does (20 s a call), not `trial_lock_wait_s`."""
        exp = self.client.get_experiment_by_name(study_name)
        if exp is None:
            return CatchUp(0, 0)
        runs = self._trial_runs(str(exp.experiment_id), parent_run_id)
        running = {rid for rid, (_, status) in runs.items() if status == "RUNNING"}
        by_number: dict[int, str] = {}
        for rid, (number, _) in runs.items():
            # Prefer the run left RUNNING: it is the one to finish.
            if number is not None and (number not in by_number or rid in running):
                by_number[number] = rid
        seen: set[str] = set()
        created = 0
        for trial in trials:
            run_id = trial.run_id if trial.run_id in runs else by_number.get(trial.number)
            is_new = run_id is None
            if run_id is None:
                run_id = self._start_trial(
                    parent_run_id, study_name, trial.number, trial.params,
                    confirm=(trial.payload.get("tags") or {}).get(TAG_CONFIRM))
                created += 1
            seen.add(run_id)
            if is_new or run_id in running:
                self._finish_trial(run_id, **with_workdir_files(trial))
        for run_id in sorted(running - seen):
            self.client.set_tag(run_id, TAG_FAILURE, "daemon_lost")
            self.client.set_tag(run_id, TAG_CONCLUSION,
                                "the daemon exited with this trial in flight.")
            self.client.set_tag(run_id, TAG_STATE, "failed")
            self.client.set_terminated(run_id, "FAILED")
        return CatchUp(left_running=len(running), created=created)

    def _trial_runs(self, exp_id: str, parent_run_id: str) -> dict[str, tuple[int | None, str]]:
        """Every trial run under the parent run (confirmation runs included): run id ->
        (trial number, status)."""
        out: dict[str, tuple[int | None, str]] = {}
        token: str | None = None
        while True:
            page = self.client.search_runs([exp_id],
                                           filter_string=f"tags.`{TAG_KIND}` != 'study' and "
                                                         f"tags.`{TAG_PARENT}` = "
                                                         f"'{parent_run_id}'",
                                           max_results=1000, page_token=token)
            for run in page:
                tag = run.data.tags.get(TAG_TRIAL, "")
                out[str(run.info.run_id)] = (int(tag) if tag.isdigit() else None,
                                             str(run.info.status))
            token = page.token
            if not token:
                return out
