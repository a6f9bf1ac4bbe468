"""A night of faults, each on real processes: the study goes on or resumes, the affected trial
is failed (or retried) with its reason, Optuna and MLflow agree, and no engine outlives its trial.

| fault                          | injected by                    | outcome                      |
|--------------------------------|--------------------------------|------------------------------|
| engine crash mid-trial         | sim_crash_after_requests       | failed crash_mid_run         |
| engine hang (no tokens)        | sim_hang_after_requests        | failed hang (stall timeout)  |
| engine never healthy           | sim_hang_at_start              | failed startup_timeout       |
| OOM at start                   | sim_oom_at_start               | failed oom_at_start          |
| CUDA graph capture failure     | sim_graph_capture_fail         | failed cuda_graph_capture    |
| port taken before engine binds | a socket held on that port     | relaunched; completes        |
| daemon SIGKILLed, restarted    | kill -9 (optimizer/test_daemon)| daemon_lost, re-queued once  |
| daemon killed mid-sampling     | half-asked trial (test_daemon) | daemon_lost, no run; only an |
|                                |                                | enqueued config re-queued    |
| daemon stopped / stop --now    | nightshift stop (test_daemon)  | finished / failed+re-queued  |
| Ray worker process killed      | SIGKILL to the actor process   | worker_lost, re-queued once  |
| tracking store fails mid-study | mlflow.db overwritten in place | goes on; resume logs the rest|
| tracking store unreachable     | tracking_uri 127.0.0.1:9       | one line, exit 2, no writes  |
| bad study / space / flags      | see the last test              | one line, exit 2, no writes  |

Issue 19's faults, each held by a test in the module named (M: module::test):

| fault                          | injected by                    | outcome                      |
|--------------------------------|--------------------------------|------------------------------|
| stop --now, restart            | nightshift stop --now          | no config measured twice; no |
|                                |                                | proposal replayed (D::a_restart_after_stop_now...) |
| second daemon, same storage,   | start from another directory   | one line, exit 2; the first's|
| another directory              |                                | trials untouched (D::a_second_daemon...) |
| defaults crash once            | SIGKILL to the defaults' pid   | retried once (D::a_one_off_crash...) |
| defaults always crash          | sim_crash_after_requests       | "No baseline" at the end and |
|                                |                                | in the report (D::defaults_that_cannot...) |
| RAY_ADDRESS names no cluster   | RAY_ADDRESS=127.0.0.1:9        | its own Ray (R::...naming_no_cluster) |
| RAY_ADDRESS names a live Ray   | a second Ray the test starts   | its own Ray on loopback only |
|                                |                                | (R::...beside_another_cluster) |
| a socket beyond loopback       | every socket of a running study| all on 127.0.0.0/8 or ::1 (R, same test) |
| restart, store read-only       | chattr +i on mlflow.db or the  | one line, exit 2, nothing    |
|                                | artifact folder                | written (T::a_restart_with_a_read_only...) |
| finish_trial cut halfway;      | run set back to RUNNING, store | caught up once, server logs, |
| store fails mid-study          | zeroed in place and restored   | right count (T::the_catch_up...) |
| bad --storage / --tracking-uri | command line, environment      | one line, exit 2, no writes  |
|                                |                                | (V::bad_store..., V::bad_tracking_uri...) |
| database server refuses        | mysql+pymysql://...:9          | one line, exit 2, no writes  |
|                                |                                | (optimizer/test_config.py::test_a_database_server...) |
| prompts file unreadable        | a file that is not UTF-8       | one line, exit 2 (V::a_prompts_file...) |
| extra_args --host 0.0.0.0      | vllm.extra_args                | one line, exit 2 (V::extra_args_cannot...) |
| fixed flag vs sampled value    | fixed_flags: {max_num_seqs: 64}| every trial and the baseline |
|                                |                                | run 64 (V::a_fixed_flag_is...) |
| ~80 malformed/hostile files    | tests/fixtures/bad_studies/    | one line naming the field,   |
|                                |                                | exit 2, no writes, bounded   |
|                                |                                | time and memory (tests/test_bad_study_files.py) |

D: tests/test_faults_daemon.py, R: tests/test_faults_ray.py, T: tests/test_faults_tracking.py,
V: tests/test_faults_validation.py (test names abbreviated: each starts `test_`).

In every case the study goes on (or resumes), Optuna and MLflow agree, and no engine survives.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any
from unittest import mock

import psutil
import pytest
from optuna.trial import TrialState

from optimizer.cli import main
from runners.base import FailureReason
from runners.engine import EngineRunner
from runners.simulated.launcher import SimulatedLauncher
from tests.optimizer.test_daemon import load, trial_runs, write_study
from tests.runners.contract import small_workload

pytestmark = pytest.mark.slow


def _records(tmp_path: Path) -> list[dict[str, Any]]:
    return [t.user_attrs.get("record") or {} for t in load(tmp_path).trials]


def assert_consistent(tmp_path: Path) -> None:
    """Optuna and MLflow agree; no engine survives."""
    study = load(tmp_path)
    assert not [t for t in study.trials if t.state == TrialState.RUNNING], "nothing RUNNING"
    runs = trial_runs(tmp_path)
    assert not [r for r in runs if r.info.status == "RUNNING"], "no MLflow run RUNNING"
    by_trial = {int(r.data.tags["nightshift.trial"]): r for r in runs}
    assert len(by_trial) == len(runs), "one MLflow run per trial"
    for t in study.trials:
        if t.state.is_finished():
            run = by_trial[t.number]
            assert run.data.tags["state"] == t.user_attrs["record"]["state"], \
                f"trial {t.number}: MLflow and Optuna agree on its state"
    assert list((tmp_path / "results" / "engines").glob("*.json")) == [], "no engine left"


@pytest.mark.parametrize(("flags", "reason"), [
    ({"sim_crash_after_requests": 3}, FailureReason.CRASH_MID_RUN),
    ({"sim_hang_after_requests": 3}, FailureReason.HANG),
    ({"sim_hang_at_start": True}, FailureReason.STARTUP_TIMEOUT),
    ({"sim_oom_at_start": True}, FailureReason.OOM_AT_START),
    ({"sim_graph_capture_fail": True}, FailureReason.CUDA_GRAPH_CAPTURE),
])
def test_engine_faults_fail_the_trial_with_its_reason_and_the_study_goes_on(
        tmp_path: Path, ray_cluster: None, flags: dict[str, Any],
        reason: FailureReason) -> None:
    path = write_study(tmp_path, trials=3, fixed_flags=flags, workload={
        "input_len": 64, "output_len": 16, "levels": [{"concurrency": 4}],
        "num_requests": 8, "warmup_requests": 0, "stall_timeout_s": 2,
        "startup_timeout_s": 5})
    assert main(["start", str(path), "--no-progress"]) == 0, "a failing engine never stops it"
    records = _records(tmp_path)
    # A crash, hang or failed start may be one-off: the defaults (every gain's reference) get
    # one retry; a config failure repeats and is not retried.
    is_one_off = reason in (FailureReason.CRASH_MID_RUN, FailureReason.HANG,
                            FailureReason.STARTUP_TIMEOUT)
    assert len(records) == 3 + is_one_off and {r["state"] for r in records} == {"failed"}
    assert sum(bool(r["is_baseline"]) for r in records) == 1 + is_one_off
    assert {r["failure_reason"] for r in records} == {reason.value}
    assert all(r["conclusion"] for r in records)
    assert_consistent(tmp_path)


def test_port_taken_before_the_engine_binds_it_is_relaunched(tmp_path: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    real_free_port = __import__("runners.process", fromlist=["free_port"]).free_port
    ports = iter([busy])
    # mock.patch by path, as a last resort: the race (port free when chosen, taken when the
    # engine binds) cannot be provoked reliably any other way.
    with mock.patch("runners.engine.free_port",
                    side_effect=lambda: next(ports, None) or real_free_port()):
        runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                              tmp_path / "engines")
        from runners.base import EngineConfig

        config = EngineConfig(model="qwen2.5-7b", load_format="dummy")
        result = runner.run(config, small_workload(), tmp_path / "trial")
    held.close()
    assert result.status == "complete", result.failure
    assert f"--port {busy}" not in " ".join(result.argv), "the relaunch took another port"
    assert "Address already in use" in (tmp_path / "trial" / "server.log").read_text()


def _ray_worker_pids() -> list[int]:
    # Only this session's workers (the local Ray's raylet is our child): another study on the
    # same machine, a benchmark say, must not lose a worker to this test.
    ours = psutil.Process().children(recursive=True)
    return [p.pid for p in ours
            if any("TrialWorker" in part for part in (_cmdline(p) or []))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return list(process.cmdline())
    except psutil.Error:  # it ended while we looked
        return []


def test_killed_ray_worker_fails_the_trial_requeues_it_and_reaps_its_engine(
        tmp_path: Path, ray_cluster: None) -> None:
    path = write_study(tmp_path, trials=3, simulated={
        "hardware": "h200", "num_gpus": 1, "startup_time_scale": 0.002}, workload={
        "input_len": 64, "output_len": 200, "levels": [{"concurrency": 4}],
        "num_requests": 16, "warmup_requests": 0})
    registry = tmp_path / "results" / "engines"
    killed: dict[str, Any] = {}

    def kill_first_worker() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            records = list(registry.glob("*.json")) if registry.is_dir() else []
            workers = _ray_worker_pids()
            if records and workers:
                time.sleep(0.5)  # mid-level, not mid-launch
                killed["engine"] = int(records[0].stem)
                killed["worker"] = workers[0]
                os.kill(workers[0], signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_worker)
    killer.start()
    assert main(["start", str(path), "--no-progress"]) == 0
    killer.join()
    assert killed, "a worker was killed mid-trial"
    study = load(tmp_path)
    lost = [t for t in study.trials
            if (t.user_attrs.get("record") or {}).get("failure_reason") == "worker_lost"]
    assert len(lost) == 1, "the killed worker's trial failed with worker_lost"
    retries = [t for t in study.trials if t.user_attrs.get("retry_of") == lost[0].number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE, "re-queued once"
    assert not psutil.pid_exists(killed["engine"]) or \
        psutil.Process(killed["engine"]).status() == psutil.STATUS_ZOMBIE, \
        "the dead worker's engine was reaped"
    assert_consistent(tmp_path)


def test_tracking_store_failing_mid_study_loses_nothing(tmp_path: Path,
                                                        ray_cluster: None) -> None:
    path = write_study(tmp_path, trials=4, workload={
        "input_len": 64, "output_len": 64, "levels": [{"concurrency": 4}],
        "num_requests": 8, "warmup_requests": 0})
    db = tmp_path / "mlruns" / "mlflow.db"
    saved = tmp_path / "mlflow.db.saved"

    def break_store() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (tmp_path / "results" / "trials" / "0001").is_dir():
                shutil.copyfile(db, saved)
                with open(db, "r+b") as f:  # in place: open connections see it too
                    f.write(b"\0" * 4096)
                return
            time.sleep(0.05)

    breaker = threading.Thread(target=break_store)
    breaker.start()
    assert main(["start", str(path), "--no-progress"]) == 0, "a failing store never stops it"
    breaker.join()
    study = load(tmp_path)
    assert sum(1 for t in study.trials if t.state.is_finished()) == 4, \
        "every trial finished and is kept in Optuna"

    shutil.copyfile(saved, db)  # the store comes back; the resume catches MLflow up
    assert main(["start", str(path), "--no-progress"]) == 0
    runs = trial_runs(tmp_path)
    assert len(runs) == 4, "every trial has its MLflow run after the resume"
    assert_consistent(tmp_path)


def test_unreachable_tracking_store_is_refused_before_anything_is_written(
        tmp_path: Path) -> None:
    path = write_study(tmp_path, tracking_uri="http://127.0.0.1:9")
    assert main(["start", str(path), "--no-progress"]) == 2
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(("patch", "space_text", "expected"), [
    ({"fixed_flags": {"max_num_seq": 64}}, None,
     "fixed_flags.max_num_seq: not a vLLM 0.26 engine flag; did you mean 'max_num_seqs'?"),
    ({"fixed_flags": {"tensor_parallel_size": 4}}, None,
     "fixed_flags.tensor_parallel_size: 4 needs 4 GPUs but this host has 2"),
    ({}, "parameters: [unclosed\n", "search_space:"),
    ({}, "parameters:\n  max_num_seqs: {type: int, low: 512, high: 64}\n", "search_space:"),
    ({}, "parameters:\n  max_num_sequences: {type: int, low: 64, high: 512}\n",
     "search_space:"),
    ({}, "parameters:\n  max_num_seqs: {type: int, low: 64, high: 512}\nrules:\n"
         "  - {name: r, reason: x, when: {hardware.num_gpus: {ge: 1}}, "
         "max: {max_num_seqs: 32}}\n", "rule 'r' leaves max_num_seqs with no value"),
    ({"search_space": "absent.yaml"}, None, "search_space:"),
    ({"simulated": {"hardware": "tpu-v9", "num_gpus": 2}}, None,
     "simulated.hardware: unknown preset 'tpu-v9'"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], patch: dict[str, Any],
        space_text: str | None, expected: str) -> None:
    if space_text is not None:
        (tmp_path / "space.yaml").write_text(space_text)
        patch = {**patch, "search_space": "space.yaml"}
    path = write_study(tmp_path, **patch)
    assert main(["start", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], err
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists(), \
        "bad input writes nothing"
