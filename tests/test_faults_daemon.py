"""Faults of the daemon itself (issue 19, items 1, 2, 4), each on real processes; rows for the
table of tests/test_faults.py:

| fault                          | injected by                   | outcome                     |
|--------------------------------|-------------------------------|-----------------------------|
| stop --now, restart (one seed) | nightshift stop --now         | no config measured twice;   |
|                                |                               | no proposal replayed        |
| second daemon on one study,    | start from another dir, same  | one line, exit 2; the       |
| another directory              | storage                       | first's trials untouched;   |
|                                |                               | a graceful stop from there  |
|                                |                               | lets the trials in flight   |
|                                |                               | finish                      |
| defaults crash once            | a scripted crash_mid_run      | retried once; measured; the |
| (test_search_policy.py)        | (inline executor)             | retry is the baseline       |
| defaults always crash          | sim_crash_after_requests      | retried once; "No baseline" |
|                                |                               | at the end and in report    |
| Optuna storage fails mid-study | optuna.db zeroed in place     | engines ended; one line and |
|                                |                               | the resume command, exit 1; |
|                                |                               | the resume finishes it      |
| launched trial's run unnamed   | an MLflow run, no run id in   | the resume adopts that run, |
| in Optuna (storage failed)     | Optuna                        | never makes a second        |
| a seed and a confirmation run  | trials left RUNNING, recovery | the seed re-queued as a     |
| in flight when it died         | run on them                   | seed; the confirmation not  |
| killed between two suggestions | half-asked trials, recovery   | neither launches; only the  |
|                                |                               | enqueued one is re-queued   |

The daemon's own death (kill -9 of a real daemon, then a resume) runs end to end in
tests/optimizer/test_daemon.py; what the resume does with each kind of trial left RUNNING is
held here at the recovery's layer (`Recovery.run` on a real Optuna and MLflow store).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from optimizer.cli import main
from tests.builders import load, trial_runs, write_study
from tests.optimizer.test_daemon import _engine_pids, _start_daemon, _wait_for
from tests.test_faults import assert_consistent

_SHORT = {"input_len": 64, "output_len": 96, "levels": [{"concurrency": 4}],
          "num_requests": 12, "warmup_requests": 0}


def _measured_configs(tmp_path: Path) -> list[tuple[Any, ...]]:
    """The config of every trial that measured (or pruned) one: not a repeat, a confirmation
    run, nor a failure lost to infrastructure."""
    out = []
    for t in load(tmp_path).trials:
        record = t.user_attrs.get("record") or {}
        if record.get("state") in ("complete", "pruned") and \
                not {"duplicate_of", "confirm"} & t.user_attrs.keys():
            out.append(tuple(sorted(record["params"].items())))
    return out


@pytest.mark.slow
def test_stop_now_fails_and_requeues_the_trials_in_flight_and_a_restart_measures_no_config_twice(
        tmp_path: Path, ray_cluster: None) -> None:
    # Stopped during trial 1, a budget of 4 leaves the resumed sampler its re-run and at least
    # two fresh proposals, where a replay of an earlier one would show. (A graceful stop is
    # the next test's, from another directory.)
    path = write_study(tmp_path, trials=4, workload=_SHORT)
    log = tmp_path / "daemon.log"
    daemon = _start_daemon(path, log)
    try:  # stop --now while trial 1 (the sampler's first proposal) runs
        _wait_for(lambda: (tmp_path / "results" / "trials" / "0001").is_dir()
                  and bool(_engine_pids(tmp_path)), daemon, log)
        assert main(["stop", str(path), "--now"]) == 0
        assert daemon.wait(60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(30)  # reaped: no daemon outlives its test
    study = load(tmp_path)
    interrupted = [t for t in study.trials
                   if (t.user_attrs.get("record") or {}).get("failure_reason") == "interrupted"]
    assert interrupted, "stop --now fails the trials in flight"
    retried = {t.user_attrs.get("retry_of") for t in study.trials}
    assert retried >= {t.number for t in interrupted}, "interrupted trials are re-queued"
    assert [t for t in study.trials if t.state == TrialState.WAITING], \
        "the re-queued trials wait for the resume"
    assert not [r for r in trial_runs(tmp_path) if r.info.status == "RUNNING"]
    assert _engine_pids(tmp_path) == [], "no engine outlives a stop --now"

    first = {t.number for t in study.trials}
    assert main(["start", str(path), "--no-progress"]) == 0

    configs = _measured_configs(tmp_path)
    assert len(configs) == len(set(configs)), \
        "a config is measured at most once per study, across a restart"
    study = load(tmp_path)
    replayed = [t.number for t in study.trials if t.number not in first
                and "duplicate_of" in t.user_attrs and "retry_of" not in t.user_attrs]
    assert not replayed, f"the resumed sampler replayed earlier proposals: trials {replayed}"
    counted = [t for t in study.trials if t.state.is_finished() and not
               {"duplicate_of", "sampling_cut_short"} & t.user_attrs.keys()
               and t.number not in {u.user_attrs.get("retry_of") for u in study.trials}]
    assert len(counted) == 4, "the budget counts each config once"
    assert_consistent(tmp_path)


@pytest.mark.slow
def test_a_second_daemon_on_the_same_study_from_another_directory_is_refused(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    shared = {"storage": f"sqlite:///{tmp_path}/shared/optuna.db", "workload": _SHORT}
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir()
    second_dir.mkdir()
    first = write_study(first_dir, trials=40, results_dir=str(first_dir / "results"),
                        tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db", **shared)
    second = write_study(second_dir, trials=40, results_dir=str(second_dir / "results"),
                         tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db", **shared)
    log = tmp_path / "first.log"
    daemon = _start_daemon(first, log)
    try:
        _wait_for(lambda: bool(_engine_pids(first_dir)), daemon, log)
        storage = shared["storage"]
        before = {t.number: t.state for t in _trials(storage)}
        capsys.readouterr()
        assert main(["start", str(second), "--no-progress"]) == 2, "refused as bad input"
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "already run by pid" in lines[0] and \
            str(daemon.pid) in lines[0], err
        after = {t.number: t for t in _trials(storage)}
        for number, state in before.items():
            if state.is_finished():
                assert after[number].state == state, f"finished trial {number} left alone"
        assert not [t for t in after.values() if (t.user_attrs.get("record") or {})
                    .get("failure_reason") == "daemon_lost"], "no live trial failed as lost"
        # status and stop find the daemon by the study's storage, from either directory. The
        # stop is the graceful one (`stop --now` is the test above's): it returns once the
        # daemon is gone, and the trials in flight finish.
        assert main(["status", str(second)]) == 0
        assert f"running (pid {daemon.pid})" in capsys.readouterr().out
        running = [t.number for t in _trials(storage) if t.state == TrialState.RUNNING]
        assert running, "a trial is in flight when the stop comes (or the check is vacuous)"
        assert main(["stop", str(second)]) == 0, "graceful stop returns once the daemon is gone"
        assert daemon.wait(60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait(30)  # reaped: no daemon outlives its test
    text = log.read_text()
    assert "Traceback" not in text and "resume with: nightshift start" in text, text[-3000:]
    trials = _trials(str(shared["storage"]))
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    # (An interrupted record keeps no argv, in flight or not: its conclusion tells them apart.)
    assert not [t for t in trials
                if (t.user_attrs.get("record") or {}).get("failure_reason") == "interrupted"
                and not t.user_attrs["record"]["conclusion"].startswith("not launched")], \
        "a graceful stop lets the trials in flight finish (only never-launched ones fail)"
    finished = [t.number for t in trials if t.number in running
                and t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert finished, f"a trial in flight at the stop ({running}) finished: {trials}"
    assert _engine_pids(first_dir) == []


def _trials(storage: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="e2e", storage=storage).trials


@pytest.mark.slow
def test_defaults_that_cannot_be_measured_are_named_at_the_end_and_in_the_report(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_study(tmp_path, trials=2, max_parallel_trials=1, workload=_SHORT,
                       fixed_flags={"sim_crash_after_requests": 3})
    assert main(["start", str(path), "--no-progress"]) == 0

    trials = load(tmp_path).trials
    baselines = [t for t in trials if t.user_attrs.get("baseline")]
    assert len(baselines) == 2, "the defaults were tried twice: once, and one retry"
    assert {t.user_attrs["record"]["failure_reason"] for t in baselines} == {"crash_mid_run"}
    end = [line for line in capsys.readouterr().err.splitlines() if "no baseline" in line]
    assert end and "the baseline (vLLM defaults + your fixed flags) could not be measured " \
        "(crash_mid_run" in end[-1], "the end of the run says what was not measured, and why"
    report = (tmp_path / "results" / "report" / "report.md").read_text()
    # the study's fixed flag (the simulated crash) is part of what the baseline ran
    assert ("No baseline: the baseline (vLLM defaults + your fixed flags) could not be "
            "measured (crash_mid_run") in report
    assert_consistent(tmp_path)


@pytest.mark.slow
def test_an_optuna_storage_failing_mid_study_stops_the_daemon_cleanly_and_a_resume_finishes(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_study(tmp_path, trials=1, workload={**_SHORT, "output_len": 32,
                                                     "num_requests": 8})
    db, saved = tmp_path / "results" / "optuna.db", tmp_path / "optuna.db.saved"
    engines: list[int] = []

    def break_storage() -> None:  # once the defaults' engine runs: a consistent copy, then
        deadline = time.monotonic() + 120  # the file emptied under the daemon's connections
        while time.monotonic() < deadline:
            if (tmp_path / "results" / "trials" / "0000" / "server.log").is_file() and \
                    _engine_pids(tmp_path):
                engines.extend(_engine_pids(tmp_path))
                with sqlite3.connect(db) as source, sqlite3.connect(saved) as copy:
                    source.backup(copy)
                os.truncate(db, 0)
                return
            time.sleep(0.02)

    breaker = threading.Thread(target=break_storage)
    breaker.start()
    code = main(["start", str(path), "--no-progress"])
    breaker.join()
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the Optuna storage" in errors[0], err
    assert "resume with: nightshift start" in err and "Traceback" not in err, err
    assert engines and not [pid for pid in engines if psutil.pid_exists(pid) and
                            psutil.Process(pid).status() != psutil.STATUS_ZOMBIE], \
        "the engines in flight were ended"
    assert _engine_pids(tmp_path) == [], "and their records cleared"

    shutil.copyfile(saved, db)  # the storage is fixed; the resume recovers and finishes
    assert main(["start", str(path), "--no-progress"]) == 0
    counted = [t for t in load(tmp_path).trials if t.state.is_finished() and
               (t.user_attrs.get("record") or {}).get("failure_reason") != "daemon_lost"]
    assert len(counted) == 1, "the budget is reached on resume"
    assert_consistent(tmp_path)


def _fresh_study(tmp_path: Path) -> tuple[Any, optuna.Study, Any, str]:
    """The hopper space, a study in a fresh Optuna database, its MLflow store and the study's
    run."""
    from optimizer.tracking.tracker import Tracker
    from search_spaces import load_space

    space = load_space("hopper").resolve({})
    study = optuna.create_study(study_name="e2e", storage=f"sqlite:///{tmp_path}/optuna.db")
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db")
    parent = tracker.start_study("e2e", key="k", params={}, artifacts={}, objectives={})
    return space, study, tracker, parent


def _recover(tmp_path: Path, study: optuna.Study, space: Any, tracker: Any,
             parent: str, **options: Any) -> None:
    """What the next start does first: recover the trials a dead daemon left (one retry)."""
    from optimizer.run.recovery import Recovery

    Recovery(study, study._storage, space, tracker, parent, "e2e", tmp_path / "results",
             max_retries=1, **options).run()


def test_a_run_the_dead_daemon_could_not_name_in_optuna_is_adopted_not_duplicated(
        tmp_path: Path) -> None:
    from optimizer.results.trial_record import ATTR_MLFLOW_RUN

    space, study, tracker, parent = _fresh_study(tmp_path)
    study.enqueue_trial(space.defaults())
    trial = study.ask()
    space.sample(trial)
    launched = tracker.start_trial(parent, "e2e", trial.number, trial.params)
    # ... and the storage failed before the trial took the run's id: the daemon exited.
    _recover(tmp_path, study, space, tracker, parent)
    runs = [r for r in tracker.client.search_runs(
        [tracker.experiment_id("e2e")], filter_string="tags.`nightshift.trial` = '0'")]
    assert [r.info.run_id for r in runs] == [launched], "one MLflow run for the trial"
    assert study.trials[0].user_attrs[ATTR_MLFLOW_RUN] == launched
    assert runs[0].info.status == "FAILED" and runs[0].data.tags["state"] == "failed"


def test_repeated_daemon_deaths_under_the_defaults_spend_no_config_retry(
        tmp_path: Path) -> None:
    # Issue 35: two kill -9s of the daemon while the defaults ran used up their retries and
    # the defaults were abandoned ("tried 2 times"); the daemon's death is not the config's.
    from optimizer.results.trial_record import ATTR_BASELINE, ATTR_MLFLOW_RUN, ATTR_RETRIES

    space, study, tracker, parent = _fresh_study(tmp_path)
    study.enqueue_trial(space.defaults(), user_attrs={ATTR_BASELINE: True})
    for kill in range(3):  # launched, then the daemon killed, three times over
        trial = study.ask()
        space.sample(trial)
        run = tracker.start_trial(parent, "e2e", trial.number, trial.params)
        trial.set_user_attr(ATTR_MLFLOW_RUN, run)
        _recover(tmp_path, study, space, tracker, parent)
        lost = study.trials[trial.number]
        assert lost.state == TrialState.FAIL
        again = [t for t in study.trials if t.user_attrs.get("retry_of") == trial.number]
        assert len(again) == 1, f"kill {kill + 1}: the defaults go back in the queue"
        assert again[0].user_attrs[ATTR_BASELINE] is True
        assert again[0].user_attrs[ATTR_RETRIES] == 0, "no retry of the config is spent"
        assert again[0].user_attrs["daemon_losses"] == kill + 1


def test_a_trial_queued_for_gpus_when_the_daemon_died_is_not_a_failed_trial(
        tmp_path: Path) -> None:
    from optimizer.results.trial_record import ATTR_RETRIES
    from optimizer.storage.study import count_trials

    space, study, tracker, parent = _fresh_study(tmp_path)
    study.enqueue_trial(space.defaults(), user_attrs={"seeded": True})
    waiting = study.ask()  # asked whole, waiting for GPUs: no run, no work directory
    space.sample(waiting)
    _recover(tmp_path, study, space, tracker, parent)
    trials = study.get_trials(deepcopy=False)
    assert trials[waiting.number].state == TrialState.FAIL
    assert count_trials(trials).by_state["failed"] == 0, "nothing ran: not a failed trial"
    again = [t for t in trials if t.user_attrs.get("retry_of") == waiting.number]
    assert len(again) == 1 and again[0].system_attrs["fixed_params"] == waiting.params
    assert again[0].user_attrs[ATTR_RETRIES] == 0 and again[0].user_attrs["seeded"] is True
    assert not tracker.client.search_runs([tracker.experiment_id("e2e")],
                                          filter_string="tags.`nightshift.trial` = '0'"), \
        "no MLflow run for a trial that never launched"


def test_a_dead_daemons_seed_is_re_queued_as_a_seed_and_its_confirmation_run_is_not(
        tmp_path: Path) -> None:
    space, study, tracker, parent = _fresh_study(tmp_path)
    # What a kill -9 leaves: a seed and a confirmation run asked whole, both RUNNING.
    seed = {**space.defaults(), "kv_cache_dtype": "fp8"}
    study.enqueue_trial(seed, user_attrs={"seeded": True})
    study.enqueue_trial(space.defaults(), user_attrs={"confirm": "best"})
    seeded, confirm = study.ask(), study.ask()
    for trial in (seeded, confirm):
        space.sample(trial)
    _recover(tmp_path, study, space, tracker, parent)
    trials = study.get_trials(deepcopy=False)
    assert trials[seeded.number].state == trials[confirm.number].state == TrialState.FAIL
    again = [t for t in trials if t.user_attrs.get("retry_of") == seeded.number]
    assert len(again) == 1 and again[0].user_attrs.get("seeded") is True, \
        "a seed is re-queued as a seed"
    assert again[0].system_attrs["fixed_params"] == trials[seeded.number].params, \
        "the config it ran, whole"
    assert not [t for t in trials if t.user_attrs.get("retry_of") == confirm.number], \
        "a confirmation run is not re-queued: its round is measured again"
    assert "confirmation round is measured again" in \
        trials[confirm.number].user_attrs["record"]["conclusion"]


def test_a_trial_whose_sampling_the_dead_daemon_cut_short_is_re_queued_only_if_enqueued(
        tmp_path: Path) -> None:
    space, study, tracker, parent = _fresh_study(tmp_path)
    # A daemon killed between two suggestions leaves a RUNNING trial with half a config: one
    # enqueued whole (a seed) and one the sampler was proposing.
    seed = {**space.defaults(), "kv_cache_dtype": "fp8"}
    study.enqueue_trial(seed, user_attrs={"seeded": True})
    enqueued, proposed = study.ask(), study.ask()
    tp = space.distributions()["tensor_parallel_size"]
    for trial in (enqueued, proposed):
        trial._suggest("tensor_parallel_size", tp)
    _recover(tmp_path, study, space, tracker, parent)
    trials = study.get_trials(deepcopy=False)
    for number in (enqueued.number, proposed.number):
        cut = trials[number]
        assert cut.state == TrialState.FAIL and cut.user_attrs["sampling_cut_short"] is True
        assert cut.user_attrs["record"]["failure_reason"] == "daemon_lost"
        assert "mlflow_run_id" not in cut.user_attrs, "it launched nothing: no MLflow run"
    assert "not re-queued" in trials[proposed.number].user_attrs["record"]["conclusion"]
    assert not [t for t in trials if t.user_attrs.get("retry_of") == proposed.number], \
        "half a config the sampler proposed is not retried: the sampler asks afresh"
    again = [t for t in trials if t.user_attrs.get("retry_of") == enqueued.number]
    assert len(again) == 1 and again[0].system_attrs["fixed_params"] == seed and \
        again[0].user_attrs["seeded"], \
        "an enqueued config goes back in the queue whole, with its attributes"


def test_a_dead_daemons_engine_log_is_scrubbed_of_secrets_before_mlflow_takes_it(
        tmp_path: Path, clean_environ: dict[str, str]) -> None:
    # Issue 35, item 8: a log written before runners/log_pump.py (which scrubs as it writes)
    # was scrubbed when its engine ended; a daemon killed mid-trial never did, and the next
    # start's catch-up sent the log's tail to MLflow. Recovery still scrubs such a log.
    from optimizer.results.trial_record import ATTR_MLFLOW_RUN
    from optimizer.run.recovery import trial_workdir

    os.environ["WANDB_API_KEY"] = "wandb-" + "w" * 24  # the user's shell's
    token = "hf_" + "t" * 32  # the study file's env
    space, study, tracker, parent = _fresh_study(tmp_path)
    study.enqueue_trial(space.defaults())
    trial = study.ask()
    space.sample(trial)
    run = tracker.start_trial(parent, "e2e", trial.number, trial.params)
    trial.set_user_attr(ATTR_MLFLOW_RUN, run)
    log = trial_workdir(tmp_path / "results", trial.number) / "server.log"
    log.parent.mkdir(parents=True)
    log.write_text(f"login with {token}\nwandb {os.environ['WANDB_API_KEY']}\n")
    _recover(tmp_path, study, space, tracker, parent, study_env={"HF_TOKEN": token})
    assert log.read_text() == "login with <redacted>\nwandb <redacted>\n"
    logged = Path(tracker.client.download_artifacts(run, "server.log", str(tmp_path)))
    assert logged.read_text() == log.read_text(), "MLflow took the scrubbed tail"


def test_a_study_whose_stdout_is_closed_runs_to_its_end_with_its_report(
        tmp_path: Path) -> None:
    # Issue 35, item 3: `nightshift start s.yaml | head` ended with exit 1, no report and
    # nothing in daemon.log. Here the reader of stdout is gone before the study starts.
    import subprocess
    import sys

    path = write_study(tmp_path, trials=1, workload=_SHORT)
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "optimizer.cli", "start", str(path),
                                 "--no-progress"], stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert proc.stdout is not None
        proc.stdout.close()  # as `head` exits
        code = proc.wait(240)
    text = (tmp_path / "stderr.txt").read_text()
    assert code == 0, text[-3000:]
    assert "study e2e done" in text and "Traceback" not in text, text[-3000:]
    assert (tmp_path / "results" / "report" / "report.html").is_file()
    assert "trial 0 complete" in (tmp_path / "results" / "daemon.log").read_text()
