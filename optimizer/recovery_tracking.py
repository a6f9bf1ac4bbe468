"""MLflow catch-up on a daemon's start: Optuna holds the truth, and every finished trial's run is
brought up to date with it, once, without logging anything twice (`Tracker.catch_up`).

Called by `Daemon._recover` after the dead daemon's trials were failed in Optuna. A store that
fails now is a warning, as it is mid-study: the trials are safe in Optuna and the next start
logs them (the store's writability was checked before anything was written, in
`runtime.build_daemon`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna

from optimizer.study import ATTR_CUT_SHORT, ATTR_DUPLICATE_OF, ATTR_MLFLOW_RUN, ATTR_RECORD
from optimizer.tracking import Tracker, TrialLog

logger = logging.getLogger(__name__)


def trial_workdir(results_dir: Path, number: int) -> Path:
    """Where a trial's engine wrote its server log and trace (the daemon's `_launch`)."""
    return (results_dir / "trials" / f"{number:04d}").resolve()


def catch_up(tracker: Tracker, parent_run_id: str, study: optuna.Study, results_dir: Path,
             payload_of: Callable[[Mapping[str, Any], None], Mapping[str, Any]]) -> None:
    """Log to MLflow what it missed of the study's finished trials and close the runs a dead
    daemon left RUNNING. `payload_of(record, None)` gives `finish_trial`'s arguments from a
    trial's record (the daemon's `tracking_payload`)."""
    trials = []
    for frozen in study.get_trials(deepcopy=False):
        record = frozen.user_attrs.get(ATTR_RECORD)
        if not (record and frozen.state.is_finished()):
            continue
        if ATTR_DUPLICATE_OF in frozen.user_attrs or ATTR_CUT_SHORT in frozen.user_attrs:
            continue  # launched nothing and has no run (a repeat: its original's stands)
        trials.append(TrialLog(
            number=frozen.number, run_id=frozen.user_attrs.get(ATTR_MLFLOW_RUN) or None,
            params=frozen.params, payload=payload_of(record, None),
            workdir=trial_workdir(results_dir, frozen.number)))
    try:
        done = tracker.catch_up(study.study_name, parent_run_id, trials)
    except Exception as exc:  # any store error: the trials are safe in Optuna
        logger.warning("MLflow catch-up failed (%s: %s); every trial is kept in Optuna and the "
                       "next start logs what MLflow lacks", type(exc).__name__, str(exc)[:200])
        return
    if done.left_running:
        logger.info("closed %d MLflow runs left RUNNING by a dead daemon", done.left_running)
    if done.created:
        logger.info("logged %d finished trials the MLflow store had missed", done.created)
