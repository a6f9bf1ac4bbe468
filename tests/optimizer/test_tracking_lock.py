"""A trial's MLflow writes on a SQLite store another process holds locked (the MLflow UI or a
second study writing) wait a bounded time, not MLflow's 20 s a call, and what the store refused
lands with the catch-up: a real MLflow store in tmp_path, a second process holding its write
lock, a scripted clock for the retry window, the daemon loop on the inline executor."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from optimizer.config import load_study
from optimizer.errors import TrackingError
from optimizer.results.trial_record import TrialRecord, is_repeat
from optimizer.run.daemon import Daemon
from optimizer.run.executor import InlineExecutor
from optimizer.tracking.payload import TrialLog, tracking_payload
from optimizer.tracking.study_summary import study_summary
from optimizer.tracking.tracker import Tracker
from search_spaces import load_space
from tests.builders import categorical_space, load, trial_runs, write_study
from tests.optimizer.test_search_policy import ScriptedRunner

MLFLOW_WAIT_S = 20.0  # MLflow's own busy wait a call (`PRAGMA busy_timeout = 20000`)
_HOLD = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN " + sys.argv[2])
print("held", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
"""


class Clock:
    """Monotonic seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LockHolder:
    """A second process holding the store's write lock (`BEGIN IMMEDIATE`, as a writer in the
    middle of its transaction; `EXCLUSIVE` keeps readers out too) until `release`."""

    def __init__(self, db: Path, mode: str = "IMMEDIATE") -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _HOLD, str(db), mode],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "held", "the lock is taken"

    def release(self) -> None:
        """Let go of the lock: the process commits and ends (killed if it does not)."""
        if self.process.returncode is not None:
            return
        try:
            self.process.communicate("\n", timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()


@contextmanager
def locked(db: Path, mode: str = "IMMEDIATE") -> Iterator[LockHolder]:
    holder = LockHolder(db, mode)
    try:
        yield holder
    finally:
        holder.release()


def _tracker(tmp_path: Path, clock: Clock) -> tuple[Tracker, Path, str]:
    db = tmp_path / "mlruns" / "mlflow.db"
    tracker = Tracker(f"sqlite:///{db}", trial_lock_wait_s=0.2, locked_retry_s=60.0,
                      clock=clock)
    assert tracker.is_lock_wait_bounded, "MLflow's SQLite engine was found"
    parent = tracker.start_study("s", key="k", params={}, artifacts={})
    return tracker, db, parent


def _payload(value: float) -> dict[str, Any]:
    record = TrialRecord(state="complete", params={"max_num_seqs": 64}, conclusion="measured",
                         metrics={"request_goodput": value}, values=(value,))
    return tracking_payload(record, None, number=0)


def _trial_numbers(db: Path) -> list[int]:
    client = MlflowClient(f"sqlite:///{db}")
    runs = client.search_runs([client.get_experiment_by_name("s").experiment_id],
                              filter_string="tags.`nightshift.kind` != 'study'")
    return sorted(int(r.data.tags["nightshift.trial"]) for r in runs)


@pytest.mark.parametrize("mode", ["IMMEDIATE", "EXCLUSIVE"])
def test_a_trial_write_on_a_store_another_process_holds_locked_fails_within_its_bound(
        tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    tracker, db, parent = _tracker(tmp_path, Clock())
    run = tracker.start_trial(parent, "s", 0, {"max_num_seqs": 64})
    with locked(db, mode), caplog.at_level(logging.WARNING):
        start = time.monotonic()
        with pytest.raises(TrackingError,
                           match=r"another process held the MLflow store locked past 0\.2 s"):
            tracker.finish_trial(run, **_payload(3.0))
        waited_s = time.monotonic() - start
    assert waited_s < MLFLOW_WAIT_S / 2, \
        f"the write gave up after its bound, not MLflow's {MLFLOW_WAIT_S:.0f} s ({waited_s:.1f} s)"
    assert "is locked by another process" in caplog.text, "one warning says what happened"
    assert "Traceback" not in caplog.text, "MLflow's own traceback is kept out of the log"


def test_after_a_locked_write_trial_writes_wait_for_the_retry_time_without_a_try(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    tracker, db, parent = _tracker(tmp_path, clock)
    with locked(db), pytest.raises(TrackingError, match="locked past"):
        tracker.start_trial(parent, "s", 0, {"max_num_seqs": 64})
    clock.now += 59.0  # the lock is gone, but the retry time has not come
    with pytest.raises(TrackingError,
                       match="was locked by another process 59 s ago: trial writes wait 60 s"):
        tracker.start_trial(parent, "s", 1, {"max_num_seqs": 64})
    assert _trial_numbers(db) == [], "within the retry time the store is not written to"
    clock.now += 2.0
    with caplog.at_level(logging.WARNING):
        tracker.start_trial(parent, "s", 2, {"max_num_seqs": 64})
    assert _trial_numbers(db) == [2], "past it, the next trial's write is tried, and lands"
    assert "takes writes again" in caplog.text


def test_what_a_locked_store_refused_lands_with_the_catch_up_even_within_the_retry_time(
        tmp_path: Path) -> None:
    tracker, db, parent = _tracker(tmp_path, Clock())
    run0 = tracker.start_trial(parent, "s", 0, {"max_num_seqs": 64})
    with locked(db), pytest.raises(TrackingError):
        tracker.finish_trial(run0, **_payload(3.0))  # left RUNNING
    with pytest.raises(TrackingError, match="before a try"):
        tracker.start_trial(parent, "s", 1, {"max_num_seqs": 64})  # never made
    done = tracker.catch_up("s", parent, [
        TrialLog(0, run0, {"max_num_seqs": 64}, _payload(3.0)),
        TrialLog(1, None, {"max_num_seqs": 64}, _payload(4.0))])
    assert (done.left_running, done.created) == (1, 1), \
        "the catch-up (off the loop) is not held back by the trials' retry time"
    client = MlflowClient(f"sqlite:///{db}")
    runs = {int(r.data.tags["nightshift.trial"]): r for r in client.search_runs(
        [client.get_experiment_by_name("s").experiment_id],
        filter_string="tags.`nightshift.kind` != 'study'")}
    assert sorted(runs) == [0, 1] and all(r.info.status == "FINISHED" for r in runs.values())
    assert runs[1].data.metrics["headline.request_goodput"] == 4.0, "the refused run, logged whole"


def test_a_study_goes_on_while_its_mlflow_store_is_locked_and_every_trial_run_lands(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    space_path = categorical_space(tmp_path, max_num_seqs=[256, 32, 64, 128, 512])
    cfg = load_study(write_study(tmp_path, trials=5, search_space=str(space_path)))
    db = tmp_path / "mlruns" / "mlflow.db"
    clock = Clock()
    holders: list[LockHolder] = []
    launched: list[dict[str, Any]] = []

    def script(flags: Mapping[str, Any]) -> float:
        # Trial 1 runs: another process takes the lock (trial 1's run is open). Trial 2: past
        # the retry time. Trial 3: the lock is let go, and the retry time passes again.
        if len(launched) == 2:
            holders.append(LockHolder(db))
        elif len(launched) in (3, 4):
            clock.now += 61.0
            if len(launched) == 4:
                holders[0].release()
        return 10.0

    tracker = Tracker(cfg.tracking_uri, trial_lock_wait_s=0.2, clock=clock)
    daemon = Daemon(cfg, space=load_space(space_path).resolve({}), executor=InlineExecutor(
        lambda: ScriptedRunner(script, launched), total_gpus=1),
        registry_dir=tmp_path / "engines", tracker=tracker, workload=cfg.workload,
        study_params={}, study_artifacts={}, summarize=study_summary, poll_s=0.01)
    try:
        with caplog.at_level(logging.INFO):
            summary = daemon.run()
    finally:
        for holder in holders:
            holder.release()
    assert len(launched) == 5 and summary.mlflow_incomplete == "", "the study ran to its end"
    text = caplog.text
    assert "trial 1: MLflow finish_trial failed (TrackingError: another process held the " \
        "MLflow store locked past 0.2 s" in text, text
    assert "trial 2: MLflow start_trial failed (TrackingError: the MLflow store was locked by " \
        "another process 0 s ago: trial writes wait 60 s before a try" in text, \
        "within the retry time: no try, no wait"
    assert text.count("is locked by another process (the MLflow UI") == 1, "one warning"
    assert "takes writes again" in text
    assert "MLflow caught up at the end: trials 1, 2, " in text, "what was refused, logged"
    runs = trial_runs(tmp_path)
    assert sorted(int(r.data.tags["nightshift.trial"]) for r in runs) == \
        [t.number for t in load(tmp_path).trials if not is_repeat(t)], \
        "every trial that launched has its one run (a repeat has none: its original's stands)"
    assert all(r.info.status == "FINISHED" for r in runs), "none left RUNNING"
