"""A restarted daemon's first step: the trials a dead daemon left RUNNING are failed (and
re-queued once), a trial whose sampling it cut short is dropped, and MLflow is caught up with
Optuna, which holds the truth: every finished trial's run brought up to date once, without
logging anything twice (`Tracker.catch_up`). A store that fails now is a warning, as it is
mid-study: the trials are safe in Optuna and the next start logs them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage
from optuna.trial import FrozenTrial, TrialState

from optimizer.errors import describe
from optimizer.results.trial_record import (
    ATTR_CUT_SHORT,
    ATTR_MLFLOW_RUN,
    ATTR_RECORD,
    TrialRecord,
    confirm_label,
    daemon_losses_of,
    is_baseline,
    is_cut_short,
    is_repeat,
    mlflow_run_of,
    record_of,
    retries_of,
)
from optimizer.storage.study import MAX_DAEMON_LOSSES, requeue, requeueable
from optimizer.tracking.payload import TrialLog, tracking_payload
from optimizer.tracking.tags import SERVER_LOG
from optimizer.tracking.tracker import Tracker
from runners.base import FailureReason
from runners.credentials import launch_secrets, scrub_file
from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)


def trial_workdir(results_dir: Path, number: int) -> Path:
    """Where a trial's engine writes its server log and trace."""
    return (results_dir / "trials" / f"{number:04d}").resolve()


@dataclass(frozen=True)
class Recovery:
    """What a restart needs: the study, its storage's own API (to write a dead trial's
    attributes), the space (to tell a half-sampled config), and the tracker."""

    study: optuna.Study
    storage: BaseStorage
    space: ResolvedSpace
    tracker: Tracker
    parent_run: str
    study_name: str
    results_dir: Path
    max_retries: int
    fixed_flags: Mapping[str, Any] = field(default_factory=dict)  # the study's: not in run names
    # The study file's `env`: with this process's environment, the secrets a dead daemon's
    # engines held (runners.credentials.launch_secrets), scrubbed from their logs before
    # MLflow takes their tails.
    study_env: Mapping[str, str] = field(default_factory=dict)

    def _set_attr(self, trial: FrozenTrial, key: str, value: Any) -> None:
        study_id = self.storage.get_study_id_from_name(self.study_name)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        self.storage.set_trial_user_attr(trial_id, key, value)

    def _record_lost(self, trial: FrozenTrial, message: str, conclusion: str, *,
                     has_launched: bool) -> None:
        """Store `trial`'s record as one the daemon's death failed (daemon_lost); one that
        launched nothing is also cut short: it counts for no budget and has no run."""
        record = TrialRecord.failed(trial.params, FailureReason.DAEMON_LOST.value, message,
                                    conclusion, is_baseline=is_baseline(trial))
        self._set_attr(trial, ATTR_RECORD, record.to_user_attr())
        if not has_launched:
            self._set_attr(trial, ATTR_CUT_SHORT, True)

    def run(self) -> None:
        """Trials a dead daemon left RUNNING become FAIL (daemon_lost) and are re-queued once
        (a confirmation run is not: its round is measured again on this start); MLflow is
        then caught up with Optuna."""
        study = self.study
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if is_repeat(trial):  # died between marking a repeat and
                study.tell(trial.number, state=TrialState.FAIL)  # telling it: it launched
                continue  # nothing and has no run
            unsampled = self.space.unsampled(trial.params)
            if unsampled and mlflow_run_of(trial) is None:
                self._drop_cut_short(trial, unsampled)
                continue
            if mlflow_run_of(trial) is None and not self._has_run(trial):
                self._drop_never_launched(trial)
                continue
            # A log written before runners/log_pump.py scrubbed as it writes was scrubbed only
            # when its engine ended, which a runner dead with the daemon never saw (the
            # engine's own API key is not known here).
            scrub_file(trial_workdir(self.results_dir, trial.number) / SERVER_LOG,
                       launch_secrets((), {**os.environ, **self.study_env}))
            retries = retries_of(trial)
            # The daemon's death is the infrastructure's loss, not the config's failure: it
            # spends no retry of the config's, only one of the losses allowed on their own.
            losses = daemon_losses_of(trial) + 1
            if not requeueable(trial):
                fate = "its confirmation round is measured again on this start"
            elif losses <= MAX_DAEMON_LOSSES:
                fate = "re-queued"
            else:
                fate = f"not re-queued (the daemon died under it {losses} times)"
            self._record_lost(
                trial,
                "the daemon exited with this trial in flight (killed, or stopped by an error).",
                f"the daemon exited with this trial in flight; {fate}.", has_launched=True)
            if mlflow_run_of(trial) is None:
                # Asked but never launched (it waited for GPUs): give it its run now, while the
                # trial can still take the run's id, so every Optuna trial names its one run.
                # Or launched, with a run the dead daemon could not name in Optuna (the
                # storage failed right after MLflow made it): that run, never a second one.
                try:
                    run_id = self.tracker.find_trial_run(self.study_name, self.parent_run,
                                                         trial.number) or \
                        self.tracker.start_trial(
                            self.parent_run, self.study_name, trial.number, trial.params,
                            confirm=confirm_label(trial))
                    self._set_attr(trial, ATTR_MLFLOW_RUN, run_id)
                except Exception as exc:  # any store error: the catch-up finds it by its tag
                    logger.warning("trial %d: MLflow start_trial failed (%s); logged on the "
                                   "next resume", trial.number, describe(exc))
            # Queued before the trial is told: a daemon killed in between leaves a trial
            # RUNNING, never one failed as "re-queued" with no copy queued. The next start
            # recovers it again and queues a second copy of the same config; the copy asked
            # first launches nothing only because `Searcher.ask` finds the other one
            # queued (`_unfinished_with`) and `outcomes.tell_duplicate` fails it as a repeat.
            # Change that dedupe and this order would run the config twice.
            if fate == "re-queued":
                requeue(study, trial, trial.params, retries, daemon_losses=losses)
            study.tell(trial.number, state=TrialState.FAIL)
            logger.warning("trial %d was in flight when the daemon exited: failed, %s",
                           trial.number, fate)
        self.catch_up()

    def _has_run(self, trial: FrozenTrial) -> bool:
        """Whether the trial was launched: its work directory was made (on this machine), or
        MLflow holds its run (made by a dead daemon that could not name it in Optuna). A store
        that cannot say counts as launched."""
        if trial_workdir(self.results_dir, trial.number).exists():
            return True
        try:
            return self.tracker.find_trial_run(self.study_name, self.parent_run,
                                               trial.number) is not None
        except Exception as exc:  # any store error: the daemon_lost path keeps the trial
            logger.warning("trial %d: MLflow could not be searched (%s)", trial.number,
                           describe(exc))
            return True

    def _drop_never_launched(self, trial: FrozenTrial) -> None:
        """A dead daemon's trial asked whole but never launched (it waited for GPUs): nothing
        ran, so it is not a failure of its config; it counts for no budget, as a cut-short
        trial does, and its config goes back in the queue with its retries unspent."""
        fate = "re-queued" if requeueable(trial) else \
            "its confirmation round is measured again on this start"
        self._record_lost(
            trial, "the daemon died before this trial was launched.",
            f"the daemon died before launching this trial: nothing ran, {fate}.",
            has_launched=False)
        if requeueable(trial):
            requeue(self.study, trial, trial.params, retries_of(trial))
        self.study.tell(trial.number, state=TrialState.FAIL)
        logger.warning("trial %d was queued for GPUs when the daemon died: nothing was "
                       "launched; %s", trial.number, fate)

    def _drop_cut_short(self, trial: FrozenTrial, unsampled: list[str]) -> None:
        """A dead daemon's trial still being sampled has half a config and never launched: it
        fails without a run and counts for no budget. One the sampler proposed is not
        re-queued (pinning half a config would retry nothing; the sampler asks again); one
        enqueued whole (the defaults, a seed, a retry) goes back in the queue as it was."""
        enqueued = trial.system_attrs.get("fixed_params")
        again = enqueued if enqueued and requeueable(trial) else None  # what goes back
        fate = "re-queued as enqueued" if again else "not re-queued"
        self._record_lost(
            trial, "the daemon died while this trial's config was being sampled.",
            f"the daemon died before sampling {', '.join(unsampled)}: nothing launched, "
            f"{fate}.", has_launched=False)
        self.study.tell(trial.number, state=TrialState.FAIL)
        if again:
            requeue(self.study, trial, again, retries_of(trial))
        logger.warning("trial %d was being sampled when the daemon died (no %s yet): failed, "
                       "%s", trial.number, ", ".join(unsampled), fate)

    def catch_up(self) -> bool:
        """Log to MLflow what it missed of the study's finished trials and close the runs a
        dead daemon left RUNNING; whether MLflow took it all."""
        trials = []
        for frozen in self.study.get_trials(deepcopy=False):
            record = record_of(frozen)
            if record is None or not frozen.state.is_finished():
                continue
            if is_repeat(frozen) or is_cut_short(frozen):
                continue  # launched nothing and has no run (a repeat: its original's stands)
            trials.append(TrialLog(
                number=frozen.number, run_id=mlflow_run_of(frozen),
                params=frozen.params, payload=tracking_payload(
                    record, None, number=frozen.number, fixed_flags=self.fixed_flags,
                    confirm=confirm_label(frozen)),
                workdir=trial_workdir(self.results_dir, frozen.number)))
        try:
            done = self.tracker.catch_up(self.study_name, self.parent_run, trials)
        except Exception as exc:  # any store error: the trials are safe in Optuna
            logger.warning("MLflow catch-up failed (%s); every trial is kept in Optuna and "
                           "the next start logs what MLflow lacks", describe(exc))
            return False
        if done.left_running:
            logger.info("closed %d MLflow runs left RUNNING by a dead daemon", done.left_running)
        if done.created:
            logger.info("logged %d finished trials the MLflow store had missed", done.created)
        return True

