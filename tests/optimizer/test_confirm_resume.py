"""A confirmation round cut by a stop goes on from the rounds measured whole when the study
resumes (issue 35, item 3): the daemon loop on the inline executor with a scripted runner, a
real Optuna storage and a real MLflow store."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import load_study
from optimizer.results.confirmation import measured_rounds
from optimizer.results.trial_record import (
    ATTR_CONFIRM,
    ATTR_RECORD,
    STUDY_ATTR_CONFIRM,
    TrialRecord,
)
from optimizer.run.daemon import Daemon
from optimizer.run.executor import InlineExecutor
from optimizer.tracking.study_summary import study_summary
from optimizer.tracking.tracker import Tracker
from search_spaces import load_space
from tests.optimizer.test_daemon import categorical_space, load, trial_runs, write_study
from tests.optimizer.test_search_policy import ScriptedRunner

_DEFAULTS = {"max_num_seqs": 256}
_BEST = {"max_num_seqs": 512}


def _trial(number: int, label: str | None, params: Mapping[str, Any],
           state: TrialState = TrialState.COMPLETE, value: float = 1.0) -> FrozenTrial:
    return FrozenTrial(
        number=number, state=state, value=value if state == TrialState.COMPLETE else None,
        values=None, datetime_start=datetime.datetime.now(),
        datetime_complete=datetime.datetime.now(), params=dict(params),
        distributions={k: CategoricalDistribution([256, 512]) for k in params},
        user_attrs={ATTR_CONFIRM: label} if label else {}, system_attrs={},
        intermediate_values={}, trial_id=number)


def test_a_round_is_a_defaults_run_followed_by_its_best_run_both_complete() -> None:
    trials = [_trial(0, None, _DEFAULTS), _trial(1, None, _BEST),
              _trial(2, "defaults", _DEFAULTS), _trial(3, "best", _BEST),  # a round
              _trial(4, "defaults", _DEFAULTS),  # its best was stopped: no round
              _trial(5, "best", _BEST, TrialState.FAIL),
              _trial(6, "defaults", _DEFAULTS), _trial(7, "best", {"max_num_seqs": 64}),
              _trial(8, "defaults", _DEFAULTS, TrialState.FAIL), _trial(9, "best", _BEST),
              _trial(10, "defaults", _DEFAULTS), _trial(11, "best", _BEST)]  # a round
    rounds = measured_rounds(trials, _DEFAULTS, _BEST)
    assert [(d.number, b.number) for d, b in rounds] == [(2, 3), (10, 11)], \
        "a run of another comparison (7) is no partner; a failed run (8) parts 6 from 9"


def test_a_run_held_complete_to_teach_the_sampler_is_in_no_round() -> None:
    # A confirmation run of the defaults that saturated (a latency objective): Optuna holds it
    # complete with the worst value, its record says failed; it measured nothing.
    saturated = _trial(2, "defaults", _DEFAULTS, value=1e9)
    saturated.set_user_attr(ATTR_RECORD, TrialRecord.failed(
        _DEFAULTS, "saturated", "saturated at rate=12", "failed (saturated)").to_user_attr())
    trials = [_trial(0, None, _DEFAULTS), _trial(1, None, _BEST), saturated,
              _trial(3, "best", _BEST), _trial(4, "defaults", _DEFAULTS),
              _trial(5, "best", _BEST)]
    rounds = measured_rounds(trials, _DEFAULTS, _BEST)
    assert [(d.number, b.number) for d, b in rounds] == [(4, 5)], \
        "a failure's worst value is no measurement to compare"


def _daemon(tmp_path: Path, launched: list[dict[str, Any]], stop_at: int | None,
            holder: list[Daemon], *, now: bool = False) -> Daemon:
    space_path = categorical_space(tmp_path, max_num_seqs=[256, 512])
    cfg = load_study(write_study(tmp_path, trials=2, search_space=str(space_path),
                                 confirm_rounds=3))

    def script(flags: Mapping[str, Any]) -> float:
        if stop_at is not None and len(launched) == stop_at:
            holder[0].request_stop(now)  # as SIGTERM does: this run ends, none starts
        return 20.0 if flags.get("max_num_seqs") == 512 else 10.0

    daemon = Daemon(cfg, space=load_space(space_path).resolve({}), executor=InlineExecutor(
        lambda: ScriptedRunner(script, launched), total_gpus=2),
        registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01)
    holder[:] = [daemon]
    return daemon


def test_a_stop_in_the_confirmation_round_resumes_from_the_rounds_measured_whole(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    launched: list[dict[str, Any]] = []
    holder: list[Daemon] = []
    # Launches 0-1 search, 2-3 the first round, 4 the second round's defaults: stopped there.
    first = _daemon(tmp_path, launched, stop_at=5, holder=holder).run()
    assert first.stopped_early, "a stop in the confirmation round is no finished study"
    assert STUDY_ATTR_CONFIRM not in load(tmp_path).user_attrs
    assert len(launched) == 5

    resumed: list[dict[str, Any]] = []
    caplog.set_level("INFO", logger="optimizer.results.confirmation")
    summary = _daemon(tmp_path, resumed, stop_at=None, holder=holder).run()
    assert not summary.stopped_early
    assert len(resumed) == 4, "two rounds measured on resume, not three: the first is kept"
    study = load(tmp_path)
    confirmed = study.user_attrs[STUDY_ATTR_CONFIRM]
    assert len(confirmed["rounds"]) == 3 and confirmed["rounds"][0] == {
        "defaults": 10.0, "best": 20.0}
    assert confirmed["round_trials"] == [[2, 3], [5, 6], [7, 8]] and \
        confirmed["cut_trials"] == [4], "the runs used and the one not"
    assert "1 of 3 rounds were measured whole before this start (trials 2+3)" in caplog.text
    assert "trials 4 are in no round" in caplog.text, "the cut round's run is named"
    runs = trial_runs(tmp_path)
    assert not [r for r in runs if r.info.status == "RUNNING"], "no MLflow run left RUNNING"
    numbers = sorted(int(r.data.tags["nightshift.trial"]) for r in runs)
    assert numbers == [t.number for t in study.trials], "one run per trial, no orphan"


def test_a_stop_now_in_the_confirmation_round_leaves_no_mlflow_run_running(
        tmp_path: Path) -> None:
    # `nightshift stop --now` (a second SIGTERM) cuts the run in flight; whichever way the
    # race between the run's end and the cut goes, each trial has its one run, closed.
    holder: list[Daemon] = []
    assert _daemon(tmp_path, [], stop_at=4, holder=holder, now=True).run().stopped_early
    assert not [r for r in trial_runs(tmp_path) if r.info.status == "RUNNING"]
    assert not _daemon(tmp_path, [], stop_at=None, holder=holder).run().stopped_early
    study = load(tmp_path)
    assert len(study.user_attrs[STUDY_ATTR_CONFIRM]["rounds"]) == 3
    runs = trial_runs(tmp_path)
    assert not [r for r in runs if r.info.status == "RUNNING"], "no MLflow run left RUNNING"
    assert sorted(int(r.data.tags["nightshift.trial"]) for r in runs) == \
        [t.number for t in study.trials], "one run per trial, no orphan"
