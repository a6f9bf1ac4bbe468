"""Store faults at a restart, on a real MLflow sqlite store and real studies: a store (MLflow's
or the Optuna database) that reads but refuses writes is refused up front, and the catch-up on
a restart logs what MLflow missed exactly once, server logs included.

| fault                          | injected by                    | outcome                      |
|--------------------------------|--------------------------------|------------------------------|
| restart, mlflow.db read-only   | chattr +i (chmod if not root)  | one line, exit 2, nothing    |
|                                |                                | written; resumes once fixed  |
| restart, artifact folder       | chattr +i mlruns/artifacts/e2e | one line, exit 2, nothing    |
| read-only                      |                                | written; resumes once fixed  |
| finish_trial cut halfway; store| run set back to RUNNING, its   | caught up once: no value     |
| fails mid-study; restart       | artifacts gone; mlflow.db      | twice, every run has its     |
|                                | zeroed in place, restored      | server.log; only runs found  |
|                                |                                | RUNNING counted as left so   |
| start, optuna.db read-only     | chattr +i (chmod if not root)  | one line, exit 2, no Ray     |
|                                |                                | started, nothing written     |

(Rows of tests/test_faults.py's table.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow import MlflowClient

from optimizer.cli import main
from tests.builders import load, trial_runs, write_study
from tests.test_faults import assert_consistent, break_store_when_trial_1_starts


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """`path` refuses writes for the block, root included (`chattr +i`; `chmod` otherwise)."""
    if os.geteuid() == 0:
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", str(path)],
                                            capture_output=True).returncode != 0:
            pytest.skip("needs chattr +i on the test's file system to make a file read-only "
                        "for root")
        try:
            yield
        finally:
            subprocess.run([chattr, "-i", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)


def _mark_running_as_a_kill_leaves_it(tmp_path: Path, number: int) -> str:
    """The run of trial `number` as a daemon killed halfway through its `finish_trial` leaves
    it: params and metrics logged, no artifacts, still RUNNING; its Optuna trial finished."""
    run = next(r for r in trial_runs(tmp_path) if r.data.tags["nightshift.trial"] == str(number))
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    client.update_run(run.info.run_id, status="RUNNING")
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    shutil.rmtree(artifacts)
    return str(run.info.run_id)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["database", "artifact folder"])
def test_a_restart_with_a_read_only_store_is_refused_up_front_and_writes_nothing(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str],
        what: str) -> None:
    path = write_study(tmp_path, trials=2, workload={
        "input_len": 64, "output_len": 16, "levels": [{"concurrency": 4}],
        "num_requests": 8, "warmup_requests": 0})
    assert main(["start", str(path), "--no-progress"]) == 0
    lost = _mark_running_as_a_kill_leaves_it(tmp_path, 1)  # recovery has a run to close
    capsys.readouterr()
    log = tmp_path / "results" / "daemon.log"
    before = (log.read_bytes(), [(t.number, t.state) for t in load(tmp_path).trials])
    target = tmp_path / "mlruns" / ("mlflow.db" if what == "database" else "artifacts/e2e")

    with read_only(target):
        code = main(["start", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: study.yaml: tracking_uri:"), err
    assert ("refused a write" if what == "database" else "not writable") in lines[0]
    assert "Traceback" not in err
    assert (log.read_bytes(), [(t.number, t.state) for t in load(tmp_path).trials]) == \
        before, "nothing was written: no log line, Optuna as it was"
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert client.get_run(lost).info.status == "RUNNING", "MLflow as it was"

    assert main(["start", str(path), "--no-progress"]) == 0, "writable again: it resumes"
    assert client.get_run(lost).info.status == "FINISHED"
    assert_consistent(tmp_path)


@pytest.mark.slow
def test_the_catch_up_logs_what_mlflow_missed_once_with_server_logs(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_study(tmp_path, trials=4, workload={
        "input_len": 64, "output_len": 32, "levels": [{"concurrency": 4}],
        "num_requests": 8, "warmup_requests": 0}, max_parallel_trials=1)
    breaker, db, saved = break_store_when_trial_1_starts(tmp_path)
    assert main(["start", str(path), "--no-progress"]) == 0, "a failing store never stops it"
    breaker.join()
    first = capsys.readouterr().err
    incomplete = [line for line in first.splitlines() if "MLflow is incomplete" in line]
    assert incomplete and "trial" in incomplete[0], \
        "the end says MLflow lacks what it refused, before pointing the user to it"
    assert first.index("MLflow is incomplete") < first.index("review in MLflow") \
        if "review in MLflow" in first else True
    shutil.copyfile(saved, db)  # the store is back, missing what came after the break

    client = MlflowClient(f"sqlite:///{db}")
    halfway = _mark_running_as_a_kill_leaves_it(tmp_path, 0)
    points = {key: len(client.get_metric_history(halfway, key))
              for key in client.get_run(halfway).data.metrics}
    left_running = sum(1 for r in trial_runs(tmp_path) if r.info.status == "RUNNING")
    had_run = {r.data.tags["nightshift.trial"] for r in trial_runs(tmp_path)}
    assert left_running >= 2 and len(had_run) < 4, "runs left RUNNING and trials without one"
    capsys.readouterr()

    assert main(["start", str(path), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"closed {left_running} MLflow runs left RUNNING by a dead daemon" in err, \
        "only the runs found RUNNING are counted, not those the catch-up created"
    assert f"logged {4 - len(had_run)} finished trials the MLflow store had missed" in err
    after = {key: len(client.get_metric_history(halfway, key))
             for key in client.get_run(halfway).data.metrics}
    assert {key: after[key] for key in points} == points, \
        "a finish_trial replayed after a halfway failure logs no metric value twice"
    from optimizer.tracking.view import VIEW_GAIN, view_key
    assert set(after) - set(points) <= {view_key("goodput"), VIEW_GAIN}, \
        "only the review columns, written when the study ends, are new"
    for run in trial_runs(tmp_path):
        names = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"server.log", "record.json", "launch.json"} <= names, \
            f"trial {run.data.tags['nightshift.trial']}: its run is complete"
        history = Counter((m.step, m.value) for m in
                          client.get_metric_history(run.info.run_id, "request_goodput"))
        assert history and max(history.values()) <= 2, "logged once (summary + its level)"
    assert_consistent(tmp_path)

    again = {r.info.run_id: (r.data.metrics, r.info.end_time) for r in trial_runs(tmp_path)}
    assert main(["start", str(path), "--no-progress"]) == 0
    assert {r.info.run_id: (r.data.metrics, r.info.end_time)
            for r in trial_runs(tmp_path)} == again, "a second catch-up changes nothing"


def test_a_start_on_a_read_only_optuna_database_is_refused_up_front_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import optuna

    path = write_study(tmp_path, trials=1)
    db = tmp_path / "results" / "optuna.db"
    db.parent.mkdir()
    optuna.create_study(study_name="e2e", storage=f"sqlite:///{db}")  # an earlier start's
    with read_only(db):
        code = main(["start", str(path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "storage:" in lines[0] and \
        "cannot be written" in lines[0], err
    assert not (tmp_path / "results" / "daemon.log").exists() and \
        not (tmp_path / "mlruns").exists(), "nothing started, nothing written"


def _open_store(uri: str) -> str:
    from optimizer.tracking.tracker import Tracker

    try:
        Tracker(uri).client.search_experiments()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


@pytest.mark.slow  # two processes importing MLflow: most of a minute
def test_two_studies_opening_a_fresh_mlflow_store_at_once_both_open_it(tmp_path: Path) -> None:
    # Issue 35: two daemons started together in a fresh directory; the second was refused
    # ("MLflow cannot open the store") as both created the store's tables.
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    uri = f"sqlite:///{tmp_path}/fresh/mlflow.db"
    with context.Pool(2) as pool:  # without the lock this failed 2 tries of 2
        outcomes = pool.map(_open_store, [uri, uri])
    assert outcomes == ["ok", "ok"], f"both open the store: {outcomes}"
