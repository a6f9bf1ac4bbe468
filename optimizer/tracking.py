"""MLflow tracking: one parent run per study, one nested child run per trial.

The daemon is the only writer. Optuna's storage is the source of truth; MLflow is brought into
agreement with it on every start (`catch_up`), so a crash between the two never leaves a run
RUNNING or a finished trial unlogged, and a replay never logs a value twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from optimizer.errors import TrackingError
from optimizer.objectives import OBJECTIVES

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

TAG_STUDY = "nightshift.study"
TAG_KIND = "nightshift.kind"  # "study", "trial" or "confirmation"
KIND_TRIAL, KIND_CONFIRMATION = "trial", "confirmation"  # a trial's run: search or re-measure
TAG_CONFIRM = "nightshift.confirm"  # a confirmation run's side: "defaults" or "best"
# MLflow 3's experiment kind (the UI reads it: mlflow/server/js, 3.17.2): a GenAI experiment
# opens on an Overview of traces, a custom-model one on its runs table, which is what a study is.
# MLflow 3.17's UI reads it only where its GenAI / Model training selector is off, and that
# selector is on by default: the page opens on runs with `?workflowType=machine_learning`, or
# after one click on "Model training" (remembered by the browser); `runs_page` builds that URL.
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_RUNS = "custom_model_development"
# A saved view of the runs table (MLflow 3.17: the experiment tag `mlflow.sharedViewState.<key>`
# holding `{name, createdAt, updatedAt, state}`, opened by `?viewStateShareKey=<key>` or from the
# page's Views menu): the trials without the parent, best first, with the columns that matter.
VIEW_KEY = "nightshift"
_VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# The headline figures a view shows after the review columns (`view_keys`: the objective and
# the gain vs the defaults, 3 significant digits, then the bottleneck).
VIEW_METRICS = ("headline.p99_ttft_ms", "headline.p99_tpot_ms", "headline.output_throughput")
VIEW_TAGS = ("state",)
# MLflow 3.17's runs table groups columns (attributes, metrics, tags) and sorts each group by
# name; the view's `columnOrder` (ag-grid column ids, as `selectedColumns` names them) puts the
# review columns first. Metric names allow no brackets.
# A trial's first objective over the defaults' (> 1 better), per GPU for a rate.
VIEW_GAIN = "gain vs defaults x"


def view_key(objective: str) -> str:
    """The review column of `objective`: its value in its unit, 3 significant digits
    (`goodput in req per s`)."""
    from optimizer.objectives import OBJECTIVES

    unit = OBJECTIVES[objective].unit if objective in OBJECTIVES else ""
    # A rate is told per GPU (objectives.per_gpu), as the value Optuna holds.
    if objective in OBJECTIVES and OBJECTIVES[objective].is_per_gpu:
        unit += " per GPU"
    # "/" would make MLflow's charts file it in a section of its own ("goodput in req").
    unit = unit.replace("/", " per ")
    return f"{objective} in {unit}" if unit else objective


def three_digits(value: float) -> float:
    """`value` to 3 significant digits, as the review columns show it."""
    return float(f"{value:.3g}")


# The chart view's cards (MLflow 3.17's RunsChartsCardConfig, as its UI serializes them): a
# parallel-coordinates chart of the searched params against the objective (MLflow's own
# default plots the first metric by name, `headline.completed`), then each load level's
# figures as lines over the level (step).
VIEW_SECTION = "nightshift-review"
VIEW_LEVEL_METRICS = ("request_goodput", "output_throughput", "p99_tpot_ms", "p99_ttft_ms")


def _chart_cards(objectives: Sequence[str], params: Sequence[str]) -> list[dict[str, Any]]:
    base = {"runsCountToCompare": 50, "metricSectionId": VIEW_SECTION, "deleted": False,
            "isGenerated": False}
    cards: list[dict[str, Any]] = [{
        **base, "uuid": "nightshift-parallel", "type": "PARALLEL",
        "displayName": "searched flags vs the objective",
        "selectedParams": list(params)[:8],
        "selectedMetrics": [view_key(o) for o in objectives][:2], "showAllRuns": False}]
    for key in VIEW_LEVEL_METRICS:
        cards.append({
            **base, "uuid": f"nightshift-level-{key}", "type": "LINE", "metricKey": key,
            "selectedMetricKeys": [key], "displayName": f"{key} by load level",
            "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
            "range": {}, "xAxisKey": "step", "selectedXAxisMetricKey": "",
            "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False,
            "useGlobalXaxisKey": False, "useGlobalLineSmoothing": True})
    return cards


def runs_view(objectives: Mapping[str, str], params: Sequence[str] = ()) -> dict[str, Any]:
    """The runs table's state for a study with `objectives` (name -> "maximize"/"minimize"):
    the trials without the parent run, best first; the columns the objectives' review figures,
    the gain vs the defaults, the bottleneck, whether it is the recommended trial, the
    description (its figure first), then the headline latencies and throughput; sorted by
    the first objective's exact value. Its chart view: `params` (the searched ones) against
    the objectives in parallel coordinates, and the load levels' figures as lines."""
    first = next(iter(objectives), None)
    state: dict[str, Any] = {
        "searchFilter": f"tags.`{TAG_KIND}` != 'study'",
        "selectedColumns": [*(f"metrics.`{view_key(o)}`" for o in objectives),
                            f"metrics.`{VIEW_GAIN}`", "tags.`bottleneck`",
                            "tags.`nightshift.recommended`", "attributes.`Description`",
                            *(f"metrics.`{m}`" for m in VIEW_METRICS),
                            *(f"tags.`{t}`" for t in VIEW_TAGS)],
    }
    # The review columns before the description, which is given less room: it is cut anyway,
    # and its figure comes first.
    state["compareRunCharts"] = _chart_cards(list(objectives), params)
    state["compareRunSections"] = [{"uuid": VIEW_SECTION, "name": "nightshift review",
                                    "display": True, "isReordered": False, "deleted": False,
                                    "isGenerated": False}]
    review = state["selectedColumns"][:len(objectives) + 3]
    state["columnOrder"] = [*review, "attributes.`Description`"]
    state["columnWidths"] = {**{c: 150 for c in review}, "attributes.`Description`": 240}
    if first is not None:
        # Sorted by the value Optuna holds: per GPU for a rate (objectives.per_gpu).
        told = "per_gpu" if first in OBJECTIVES and OBJECTIVES[first].is_per_gpu else ""
        state.update(orderByKey=f"metrics.`objective.{first}{'.' + told if told else ''}`",
                     orderByAsc=objectives[first] == "minimize")
    return state


def runs_page(server_url: str, experiment_id: str) -> str:
    """The study's runs table in the MLflow UI at `server_url` (`mlflow ui` prints it), with
    nightshift's view: the trials, best first, their conclusions and headline figures."""
    return (f"{server_url.rstrip('/')}/#/experiments/{experiment_id}/runs?"
            f"viewStateShareKey={VIEW_KEY}&workflowType=machine_learning")
TAG_TRIAL = "nightshift.trial"
# The recommended trial's run (study.recommended_trial, what `export` writes): this tag, "true",
# and its name starting with RECOMMENDED_MARK.
TAG_RECOMMENDED = "nightshift.recommended"
RECOMMENDED_MARK = "★ recommended: "
TAG_PARENT = "mlflow.parentRunId"
# On a study's parent run: the key of the Optuna study it records (its `mlflow_study_key`
# attribute). A study started anew under the same name (its Optuna storage deleted or moved)
# gets a parent run of its own, so its trials never mix with the earlier ones' numbers.
TAG_STUDY_KEY = "nightshift.study_key"
TAG_STATE = "state"  # complete | pruned | failed | running
TAG_FAILURE = "failure_reason"
TAG_CONCLUSION = "conclusion"
_STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED"}
_MAX_PARAM_LEN = 6000  # MLflow 3 param value limit is 6000 characters
_PROBE_TAG = "nightshift.write_probe"
SERVER_LOG = "server.log"  # a trial's engine log, in its workdir and as its run's artifact
TRACE_FILE = "trace.trimmed.pt.trace.json.gz"  # runners.engine writes it beside server.log


@dataclass(frozen=True)
class TrialLog:
    """A finished trial, as `Tracker.catch_up` brings its MLflow run up to date."""

    number: int
    run_id: str | None  # the run Optuna recorded for it; None if the store refused it then
    params: Mapping[str, Any]
    payload: Mapping[str, Any]  # `Tracker.finish_trial`'s arguments, from the trial's record
    workdir: Path | None = None  # its server log and trace, when it ran on this machine


@dataclass(frozen=True)
class CatchUp:
    """What `Tracker.catch_up` did."""

    left_running: int  # trial runs found RUNNING (a dead daemon's), all closed now
    created: int  # finished trials the store had no run for, logged now


def artifact_root_for(tracking_uri: str) -> Path | None:
    """`sqlite:///mlruns/mlflow.db` keeps its artifacts beside it, in `mlruns/artifacts`."""
    parsed = urlparse(tracking_uri)
    if parsed.scheme != "sqlite":
        return None
    db_path = Path(tracking_uri.removeprefix("sqlite:///"))
    return db_path.parent / "artifacts"


@contextlib.contextmanager
def _creating(tracking_uri: str) -> Iterator[None]:
    """Held while MLflow opens a SQLite store: the first open creates its tables and runs its
    migrations, and two daemons doing that at once on a fresh file make one of them fail. An
    exclusive lock on a file beside the store lets one create it and the other open it after."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    db_path = Path(tracking_uri.removeprefix("sqlite:///"))
    fd = os.open(db_path.with_name(db_path.name + ".create-lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


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

        try:
            with _quiet("mlflow"), _creating(tracking_uri):
                self.client: MlflowClient = MlflowClient(tracking_uri)
        except Exception as exc:  # MLflow raises many types; all mean "cannot open the store"
            first = (str(exc).splitlines() or [""])[0][:160]
            if "MLFLOW_ALLOW_FILE_STORE" in str(exc):
                raise TrackingError(f"MLflow 3 opens no file store ({tracking_uri}) unless "
                                    "MLFLOW_ALLOW_FILE_STORE=true is set; give "
                                    "sqlite:///mlruns/mlflow.db") from exc
            raise TrackingError(f"MLflow cannot open the store {tracking_uri} "
                                f"({type(exc).__name__}: {first}); pass another "
                                "--tracking-uri.") from exc

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
            first = (str(exc).splitlines() or [""])[0][:160]
            raise TrackingError(f"MLflow store {self.tracking_uri} refused the study "
                                f"({type(exc).__name__}: {first}); check --tracking-uri or "
                                "the study's tracking_uri.") from exc

    def check_writable(self, study_name: str) -> str:
        """The study's experiment id, once the store has taken a write: a probe tag set on the
        experiment and deleted, and, for a local artifact location, a probe file written and
        removed there (a folder it had to create is removed too). Reading alone would pass a
        store that refuses writes, and the daemon would then fail in its first write.
        Raises `TrackingError` naming what refused."""
        exp_id = self.experiment_id(study_name)
        try:
            with _quiet("mlflow"):  # it logs the refusal with a traceback; ours is one line
                self.client.set_experiment_tag(exp_id, _PROBE_TAG, str(os.getpid()))
                self.client.delete_experiment_tag(exp_id, _PROBE_TAG)
                location = self.client.get_experiment(exp_id).artifact_location
        except Exception as exc:  # MLflow raises many types; all mean "store read-only"
            first = (str(exc).splitlines() or [""])[0][:160]
            raise TrackingError(f"MLflow store {self.tracking_uri} can be read but refused a "
                                f"write ({type(exc).__name__}: {first}); make it writable or "
                                "pass another --tracking-uri.") from exc
        folder = _local_path(location)
        if folder is not None:
            _probe_folder(folder)
        return exp_id

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
            previous = json.loads(tags.get(_VIEW_TAG) or "{}")
        except ValueError:
            previous = {}
        if previous.get("state") != state:
            now_ms = int(time.time() * 1000)
            created_ms = previous.get("createdAt") if isinstance(
                previous.get("createdAt"), int) else now_ms
            self.client.set_experiment_tag(exp_id, _VIEW_TAG, json.dumps(
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
        (study.recommended_trial: what `export` writes) marked by the tag
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
        side) until `finish_trial` gives it the name that says what it changed."""
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
        """Log a trial's outcome and close its run. Idempotent: what the run holds already (a
        param, a metric's value at its step, an artifact of the same size) is not logged again,
        so `catch_up` replaying a call that failed halfway logs only the rest."""
        from mlflow.entities import Metric

        run = self.client.get_run(run_id)
        self._log_missing_params(run_id, params, run.data.params)
        logged = self._metric_points(run_id, run.data.metrics)
        now = int(time.time() * 1000)
        points = [(k, v, 0) for k, v in metrics.items()]
        for step, values in step_metrics:
            points.extend((k, v, step) for k, v in values.items())
        batch = [Metric(k, float(v), now, step) for k, v, step in points
                 if _finite(v) and (k, step, float(v)) not in logged]
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
        Runs already closed are not touched. Only runs found RUNNING count as left running."""
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
                run_id = self.start_trial(
                    parent_run_id, study_name, trial.number, trial.params,
                    confirm=(trial.payload.get("tags") or {}).get(TAG_CONFIRM))
                created += 1
            seen.add(run_id)
            if is_new or run_id in running:
                self.finish_trial(run_id, **_with_workdir_files(trial))
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

    # -- helpers ----------------------------------------------------------------------------

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
        batch = [Metric(k, float(v), now, 0) for k, v in metrics.items() if _finite(v)]
        if batch:
            self.client.log_batch(run_id, metrics=batch)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_PARAM_LEN]


def _with_workdir_files(trial: TrialLog) -> dict[str, Any]:
    """`finish_trial`'s arguments for a catch-up: the record's, plus the server log's tail and
    the trimmed trace from the trial's workdir where they are on this machine (a trial that ran
    on another node of a cluster left them there)."""
    from runners.process import tail
    from runners.session import LOG_TAIL_BYTES

    payload = dict(trial.payload)
    if trial.workdir is None:
        return payload
    texts = dict(payload.get("texts") or {})
    log = trial.workdir / SERVER_LOG
    if SERVER_LOG not in texts and log.is_file():
        texts[SERVER_LOG] = tail(log, LOG_TAIL_BYTES)
    files = list(payload.get("files") or [])
    trace = trial.workdir / TRACE_FILE
    if trace.is_file() and all(f.name != TRACE_FILE for f in files):
        files.append(trace)
    return {**payload, "texts": texts, "files": files}


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Nothing below CRITICAL from logger `name` (and its children that set no level)."""
    target = logging.getLogger(name)
    level = target.level
    target.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        target.setLevel(level)


def _local_path(location: str | None) -> Path | None:
    """The folder of a `file:` (or plain path) artifact location; None for a remote one."""
    if not location:
        return None
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a path (or a Windows drive letter)
        return Path(location)
    return None


def _probe_folder(folder: Path) -> None:
    """Write and remove a file in `folder`, creating it (and removing what was created) if it
    is missing; raises `TrackingError` if the file system refuses."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    probe = folder / f".nightshift-write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TrackingError(f"the MLflow artifact location {folder} is not writable "
                            f"({exc.strerror or exc}); make it writable or pass another "
                            "--tracking-uri.") from exc
    finally:
        for path in missing:  # deepest first
            with contextlib.suppress(OSError):
                path.rmdir()
