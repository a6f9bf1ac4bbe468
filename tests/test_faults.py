"""A night of faults, each on real processes: the study goes on or resumes, the affected trial
is failed (or retried) with its reason, Optuna and MLflow agree, and no engine outlives its trial.

Each engine fault is classified by the runner contract (tests/runners/test_runner_contract.py)
and its reason handled by the search policy (tests/optimizer/test_search_policy.py::test_an_
engine_fault_fails_its_trial_and_only_a_one_off_of_the_defaults_is_retried); one study per
class runs end to end: a one-off (a crash, D4 below) and a config failure (an OOM, here).

| fault                          | injected by                    | outcome                      |
|--------------------------------|--------------------------------|------------------------------|
| engine crash mid-trial         | sim_crash_after_requests       | failed crash_mid_run; the    |
|                                |                                | defaults retried once (D4)   |
| engine hang (no tokens)        | sim_hang_after_requests        | failed hang (contract)       |
| engine never healthy           | sim_slow_start_s, sim_hang_at_ | failed startup_timeout       |
|                                | start (contract, sim. server)  |                              |
| OOM at start                   | sim_oom_at_start               | failed oom_at_start; no retry|
| CUDA graph capture failure     | sim_graph_capture_fail         | failed cuda_graph_capture    |
|                                |                                | (contract)                   |
| port taken before engine binds | a socket held on that port     | relaunched; completes        |
| healthy, then no token at all  | sim_hang_after_requests: 0     | failed hang within the stall |
|                                |                                | timeout, not 3 request waits |
| first request compiles (busy)  | sim_slow_first_request_s       | waited for; completes        |
| host refuses the trial's files | a file where its workdir goes  | failed host_error, retryable |
|                                |                                | (not internal)               |
| socket error from the runner   | a runner raising it            | failed internal (not host's) |
| stopped, teardown raises       | cancel, then PermissionError   | failed interrupted           |
| daemon SIGKILLed, restarted    | kill -9 (optimizer/test_daemon)| daemon_lost, re-queued; no   |
|                                |                                | retry spent (<= 5 deaths)    |
| daemon killed mid-sampling     | half-asked trial (recovery,    | daemon_lost, no run; only an |
|                                | test_faults_daemon)            | enqueued config re-queued    |
| daemon stopped / stop --now    | nightshift stop (test_faults_  | finished / failed+re-queued  |
|                                | daemon D2 / D1)                |                              |
| Ray worker process killed      | SIGKILL to the actor process   | worker_lost, re-queued once  |
| tracking store fails mid-study | mlflow.db overwritten in place | goes on; resume logs the rest|
|                                |                                | (T2)                         |
| tracking store unreachable     | tracking_uri 127.0.0.1:9       | one line, exit 2, no writes  |
| bad study / space / flags      | see the last test              | one line, exit 2, no writes  |

Issue 19's faults, each held by a test of its own module:

| fault                    | injected by              | outcome                    | test   |
|--------------------------|--------------------------|----------------------------|--------|
| stop --now, restart      | nightshift stop --now    | no config twice, no replay | D1     |
| 2nd daemon, other dir    | same storage and study   | one line, exit 2           | D2     |
| defaults crash once      | a scripted crash         | retried once, measured     | D3     |
| defaults always crash    | sim_crash_after_requests | 'No baseline' named        | D4     |
| RAY_ADDRESS: no cluster  | RAY_ADDRESS=127.0.0.1:9  | its own Ray                | R1     |
| RAY_ADDRESS: live Ray    | a second Ray             | its own Ray, loopback      | R2     |
| socket beyond loopback   | every socket listed      | all on 127/8 or ::1        | R2     |
| restart, store read-only | chattr +i db / artifacts | one line, exit 2           | T1     |
| start, optuna.db r/o     | chattr +i optuna.db      | one line, exit 2           | T3     |
| finish cut halfway       | run reset, store zeroed  | caught up once             | T2     |
| bad store on CLI / env   | --storage, env var       | one line, exit 2           | V1, V2 |
| database server refuses  | mysql+pymysql://...:9    | one line, exit 2           | C1     |
| prompts file unreadable  | not UTF-8                | one line, exit 2           | V3     |
| extra_args --host        | 0.0.0.0 in extra_args    | one line, exit 2           | V4     |
| fixed vs sampled flag    | fixed max_num_seqs 64    | every trial runs 64        | V5     |
| malformed study files    | fixtures/bad_studies     | one line, exit 2           | B      |

D1, D2, D4: tests/test_faults_daemon.py (test_stop_now_fails_and_requeues_the_trials_in_flight_
and_a_restart_measures_no_config_twice,
test_a_second_daemon_on_the_same_study_from_another_directory_is_refused,
test_defaults_that_cannot_be_measured_are_named_at_the_end_and_in_the_report); D3:
tests/optimizer/test_search_policy.py::test_a_one_off_crash_of_the_defaults_is_retried_and_the_
retry_is_every_gains_reference (the class's end-to-end study is D4's: its crash is one-off
each time, the defaults retried once);
R1-R2: tests/test_faults_ray.py (test_a_local_ray_starts_whatever_the_ray_address_in_the_
environment_names,
test_a_local_study_runs_its_own_ray_on_loopback_only_beside_another_cluster);
T1-T3: tests/test_faults_tracking.py (test_a_restart_with_a_read_only_store_is_refused_up_front_
and_writes_nothing, test_the_catch_up_logs_what_mlflow_missed_once_with_server_logs,
test_a_start_on_a_read_only_optuna_database_is_refused_up_front_and_writes_nothing);
V1-V5: tests/test_faults_validation.py (test_bad_store_on_the_command_line_is_refused_before_
anything_is_written, test_bad_tracking_uri_from_the_environment_is_refused,
test_a_prompts_file_the_load_generator_cannot_read_is_refused_up_front,
test_extra_args_cannot_move_the_engine_off_loopback,
test_a_fixed_flag_is_what_every_trial_and_the_baseline_run);
C1: tests/optimizer/test_config.py::test_a_database_server_that_refuses_is_named_before_anything_
is_written; B: tests/test_bad_study_files.py (about 80 files: one line naming the field, exit 2,
no writes, bounded time and memory).

Issue 35's faults, each with what happens now and the test that holds it: docs/reliability.md.

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
from tests.builders import load, trial_runs, write_study
from tests.runners.contract import small_workload


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


# One study per class of engine fault; the runner contract (tests/runners/
# test_runner_contract.py) classifies each fault, and the search policy's tests
# (test_an_engine_fault_fails_its_trial_and_only_a_one_off_of_the_defaults_is_retried) hold
# what the study does with each reason. The one-off class (a crash: the defaults retried once)
# is tests/test_faults_daemon.py's study of defaults that always crash; the config class is
# this one.
@pytest.mark.slow
def test_a_config_failure_of_every_engine_fails_each_trial_and_the_study_goes_on(
        tmp_path: Path, ray_cluster: None) -> None:
    path = write_study(tmp_path, trials=2, fixed_flags={"sim_oom_at_start": True}, workload={
        "input_len": 64, "output_len": 16, "levels": [{"concurrency": 4}],
        "num_requests": 8, "warmup_requests": 0, "stall_timeout_s": 2, "startup_timeout_s": 5})
    assert main(["start", str(path), "--no-progress"]) == 0, "a failing engine never stops it"
    records = _records(tmp_path)
    # A config failure repeats: not retried, the defaults' included.
    assert len(records) == 2 and {r["state"] for r in records} == {"failed"}
    assert sum(bool(r["is_baseline"]) for r in records) == 1
    assert {r["failure_reason"] for r in records} == {FailureReason.OOM_AT_START.value}
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


def test_an_engine_healthy_but_silent_at_readiness_fails_as_hung_within_the_stall_timeout(
        tmp_path: Path) -> None:
    from dataclasses import replace

    from runners.base import EngineConfig

    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", stall_timeout_s=1.0)
    config = EngineConfig(model="qwen2.5-7b", load_format="dummy",
                          flags={"sim_hang_after_requests": 0})
    started = time.monotonic()
    result = runner.run(config, replace(small_workload(), request_timeout_s=600.0,
                                        startup_timeout_s=15.0), tmp_path / "trial")
    assert result.failure is not None and result.failure.reason == FailureReason.HANG, \
        result.failure
    assert "readiness completion" in result.failure.message and \
        "startup_timeout_s" in result.failure.message, \
        "an idle engine that is not stopped gets the rest of startup_timeout_s"
    assert time.monotonic() - started < 60, "the start-up bound, not request_timeout_s"
    assert list((tmp_path / "engines").glob("*.json")) == [], "no engine left"


def test_an_engine_stopped_after_health_fails_as_hung_at_the_stall_timeout(
        tmp_path: Path) -> None:
    """A SIGSTOPped engine (its /health answered) is cut at stall_timeout_s, not at the rest of
    startup_timeout_s, and ends (SIGCONT after SIGTERM)."""
    import json
    import os
    import signal
    import threading
    from dataclasses import replace

    from runners.base import EngineConfig

    engines = tmp_path / "engines"

    def stop_once_asked() -> None:
        """SIGSTOP the engine once its readiness completion has reached it."""
        log = tmp_path / "trial" / "server.log"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if log.is_file() and "hangs after 0 requests" in log.read_text():
                record = json.loads(next(engines.glob("*.json")).read_text())
                os.killpg(record["pgid"], signal.SIGSTOP)
                return
            time.sleep(0.05)

    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001), engines,
                          stall_timeout_s=1.0)
    config = EngineConfig(model="qwen2.5-7b", load_format="dummy",
                          flags={"sim_hang_after_requests": 0})
    stopper = threading.Thread(target=stop_once_asked, daemon=True)
    stopper.start()
    started = time.monotonic()
    result = runner.run(config, replace(small_workload(), request_timeout_s=600.0,
                                        startup_timeout_s=120.0), tmp_path / "trial")
    stopper.join(5)
    assert result.failure is not None and result.failure.reason == FailureReason.HANG, \
        result.failure
    assert "was stopped" in result.failure.message, result.failure.message
    assert time.monotonic() - started < 60, "the stall timeout, not startup_timeout_s"
    assert list(engines.glob("*.json")) == [], "no engine left"


def test_an_engine_busy_compiling_on_its_first_request_is_not_cut_at_the_stall_timeout(
        tmp_path: Path) -> None:
    from dataclasses import replace

    from runners.base import EngineConfig

    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", stall_timeout_s=1.0)
    config = EngineConfig(model="qwen2.5-7b", load_format="dummy",
                          flags={"sim_slow_first_request_s": 3.0})  # 3 stall timeouts
    result = runner.run(config, replace(small_workload(), startup_timeout_s=120.0),
                        tmp_path / "trial")
    assert result.failure is None and result.status == "complete", \
        f"a first completion slow while the engine works is no hang: {result.failure}"
    assert list((tmp_path / "engines").glob("*.json")) == [], "no engine left"


def test_a_host_that_refuses_a_trials_files_fails_it_as_the_hosts_fault(tmp_path: Path) -> None:
    from optimizer.run.executor import TrialSession
    from runners.base import EngineConfig

    (tmp_path / "trial").write_text("a file where the trial's directory goes")  # as EEXIST,
    session = TrialSession(EngineRunner(SimulatedLauncher("h200"), tmp_path / "engines"))
    result = session.run(EngineConfig(model="qwen2.5-7b", load_format="dummy"),  # ENOSPC,
                         small_workload(), str(tmp_path / "trial"))  # EACCES would
    assert result.failure is not None and result.failure.reason == FailureReason.HOST_ERROR, \
        "an OSError of the host is neither the config's failure nor a bug of ours"
    assert result.failure.is_retryable and "FileExistsError" in result.failure.message


class _RaisingRunner:
    """A runner whose run raises `exc`, after `before_raise` (a stop arriving mid-teardown)."""

    def __init__(self, exc: BaseException, before_raise: Any = None) -> None:
        self.exc, self.before_raise = exc, before_raise

    def run(self, *args: Any) -> Any:
        if self.before_raise is not None:
            self.before_raise()
        raise self.exc

    def close(self) -> None:
        pass


@pytest.mark.parametrize(("exc", "reason"), [
    (PermissionError(13, "Permission denied"), FailureReason.HOST_ERROR),
    (OSError(28, "No space left on device"), FailureReason.HOST_ERROR),
    (OSError(24, "Too many open files"), FailureReason.HOST_ERROR),
    (TimeoutError("timed out"), FailureReason.INTERNAL),
    (ConnectionResetError(104, "Connection reset by peer"), FailureReason.INTERNAL),
    (BrokenPipeError(32, "Broken pipe"), FailureReason.INTERNAL),
    (FileNotFoundError(2, "No such file or directory"), FailureReason.INTERNAL),
])
def test_only_the_hosts_own_oserrors_are_blamed_on_the_host(
        exc: OSError, reason: FailureReason) -> None:
    from optimizer.run.executor import InlineExecutor
    from runners.base import EngineConfig

    executor = InlineExecutor(lambda: _RaisingRunner(exc), total_gpus=1)  # type: ignore[arg-type]
    handle = executor.submit(EngineConfig(model="m"), small_workload(), Path("unused"))
    failure = handle.result().failure
    executor.release(handle, healthy=False)
    assert failure is not None and failure.reason == reason, \
        f"{type(exc).__name__} {exc.errno}: a socket error is a bug of ours, not the host's"


def test_a_trial_stopped_while_its_teardown_raises_reads_interrupted() -> None:
    from optimizer.run.executor import TrialSession
    from runners.base import EngineConfig

    session: Any = None
    runner = _RaisingRunner(PermissionError(13, "Permission denied"),
                            before_raise=lambda: session.cancel())
    session = TrialSession(runner)  # type: ignore[arg-type]
    result = session.run(EngineConfig(model="m"), small_workload(), "unused")
    assert result.failure is not None and result.failure.reason == FailureReason.INTERRUPTED, \
        "a stop comes first: the error of the teardown it caused is no host error"


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


@pytest.mark.slow
def test_killed_ray_worker_fails_the_trial_requeues_it_and_reaps_its_engine(
        tmp_path: Path, ray_cluster: None) -> None:
    path = write_study(tmp_path, trials=2, simulated={
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


def break_store_when_trial_1_starts(tmp_path: Path) -> tuple[threading.Thread, Path, Path]:
    """A thread that, once trial 0 is logged and trial 1 has its run, saves the MLflow store
    and zeroes it in place (open connections see it too); returns it (started), the store and
    the saved copy."""
    db = tmp_path / "mlruns" / "mlflow.db"
    saved = tmp_path / "mlflow.db.saved"

    def break_store() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (tmp_path / "results" / "trials" / "0001").is_dir():
                shutil.copyfile(db, saved)
                with open(db, "r+b") as f:
                    f.write(b"\0" * 4096)
                return
            time.sleep(0.05)

    breaker = threading.Thread(target=break_store)
    breaker.start()
    return breaker, db, saved


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
