"""The daemon's two stores: its MLflow side (`StudyRuns`: a trial's run opened and closed, the
study run's close; a write the store refuses is logged and the trial kept in Optuna, and the next
resume catches MLflow up) and what an Optuna storage failure says (`is_storage_error`,
`storage_file_note`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna

from optimizer.config import StudyConfig
from optimizer.errors import describe
from optimizer.results.recommendation import best_trial, no_baseline_reason, recommended_trial
from optimizer.results.tail_samples import basis_of
from optimizer.results.trial_record import ATTR_MLFLOW_RUN, confirm_label
from optimizer.run.events import DaemonSummary, TrialEvent, confirm_of, first_value
from optimizer.search.controller import SearchController
from optimizer.search.trials import Told
from optimizer.storage.lock import is_local_file_storage
from optimizer.storage.study import is_search_trial
from optimizer.tracking.payload import tracking_payload
from optimizer.tracking.study_summary import trial_figures
from optimizer.tracking.tracker import Tracker
from runners.base import EngineConfig

logger = logging.getLogger(__name__)

# The study run's closing figures and tags (the best against the defaults), from the report:
# given by the composition root so that the loop does not depend on the report's module.
StudySummary = Callable[[optuna.Study, StudyConfig], tuple[dict[str, float], dict[str, str]]]


class StudyRuns:
    """The MLflow side of `optimizer.run.daemon.Daemon`, its base: MLflow may fail; Optuna
    keeps the truth and a resume catches MLflow up. Reads and writes the daemon's state
    declared here."""

    cfg: StudyConfig
    tracker: Tracker
    resume: str
    summarize: StudySummary
    learn_facts: Callable[[optuna.Study], Sequence[str]] | None
    on_event: Callable[[TrialEvent], None]
    policy: SearchController | None
    _parent_run: str
    _tracking_misses: set[int]  # trials whose MLflow writes failed

    @property
    def stopping(self) -> bool:
        raise NotImplementedError  # the daemon's

    # -- tracking: MLflow may fail; Optuna keeps the truth and a resume catches MLflow up --

    def _open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        try:
            run_id = self.tracker.start_trial(self._parent_run, self.cfg.name, trial.number,
                                              params,
                                              confirm=confirm_label(trial))
        except Exception as exc:  # any store error: the study must go on
            self._tracking_failed("start_trial", trial.number, exc)
            return None
        trial.set_user_attr(ATTR_MLFLOW_RUN, run_id)
        return run_id

    def _close_run(self, number: int, run_id: str | None, payload: Mapping[str, Any]) -> None:
        """Log a finished trial. A failure leaves its run RUNNING (or absent), which the next
        resume's catch-up replays from the record in Optuna."""
        if run_id is None:
            return
        try:
            self.tracker.finish_trial(run_id, **payload)
        except Exception as exc:  # any store error: the study must go on
            self._tracking_failed("finish_trial", number, exc)

    def _tracking_failed(self, action: str, number: int, exc: Exception) -> None:
        self._tracking_misses.add(number)
        logger.warning("trial %d: MLflow %s failed (%s); the trial is kept in Optuna and "
                       "logged to MLflow at the study's end (or at the next start, if it stops "
                       "first)", number, action, describe(exc))

    def _told(self, told: Told) -> None:
        """A trial the policy told Optuna about: its run closed, a log line and an event."""
        if told.kind == "duplicate":
            return  # launched nothing, has no run: its original's stands
        record = told.record
        confirm = confirm_label(told.running.trial) if told.running else None
        self._close_run(told.number, told.run_id, tracking_payload(
            record, told.result, number=told.number, fixed_flags=self.cfg.engine_fixed_flags,
            confirm=confirm))
        if told.kind == "rejected":
            self.on_event(TrialEvent("finished", told.number, dict(record.params), "failed",
                                     None, None, record.conclusion_short or record.conclusion))
            return
        running = told.running
        assert running is not None  # a measured trial ran
        primary = record.values[0] if record.values else None
        if record.state == "pruned":
            primary = first_value(self.policy, running) if self.policy else None
        logger.info("trial %d %s: %s params=%s", told.number, record.state, record.conclusion,
                    running.params)
        tpot_basis = basis_of(record.metrics, "num_tpot_samples")
        ttft_basis = basis_of(record.metrics, "completed")
        self.on_event(TrialEvent("finished", told.number, self._changed(running.config),
                                 record.state, primary, record.metrics.get("p99_tpot_ms"),
                                 record.conclusion_short,
                                 time.monotonic() - running.started,
                                 str((record.verdict or {}).get("label") or ""),
                                 confirm_of(running),
                                 tpot_p99_num_requests=tpot_basis.num_requests
                                 if tpot_basis is not None else None,
                                 ttft_p99_ms=record.metrics.get("p99_ttft_ms"),
                                 ttft_p99_num_requests=ttft_basis.num_requests
                                 if ttft_basis is not None else None))

    def _changed(self, config: EngineConfig) -> dict[str, Any]:
        """The flags a trial sets beyond vLLM's defaults and the study's fixed flags."""
        return {k: v for k, v in config.flags.items() if k not in self.cfg.engine_fixed_flags}

    def _finish(self, study: optuna.Study, policy: SearchController, *,
                is_confirmed: bool = True) -> DaemonSummary:
        trials = study.get_trials(deepcopy=False)
        # The search's trials: not a repeat that launched nothing, nor a confirmation run.
        finished = [t for t in trials if t.state.is_finished() and is_search_trial(t)]
        best = best_trial(study)
        done = not policy.budget_left() and is_confirmed
        metrics, tags = self.summarize(study, self.cfg)
        if self.learn_facts is not None:
            try:
                for fact in self.learn_facts(study):
                    logger.info("known fact written: %s", fact)
            except Exception as exc:  # the facts file is a convenience: never fail the study
                logger.warning("the measured facts could not be written (%s)", describe(exc))
        no_baseline = no_baseline_reason(study) or ""
        if no_baseline:
            the = self.cfg.baseline_words.the
            logger.warning("no baseline: %s could not be measured (%s); no gain over it can be "
                           "stated", the, no_baseline)
        missed = [f"trial{'s' if len(self._tracking_misses) > 1 else ''} "
                  f"{numbers_text(self._tracking_misses)}"] if self._tracking_misses else []
        try:
            self.tracker.finish_study(self._parent_run, metrics, tags, is_done=done)
            pick = recommended_trial(study)
            self.tracker.mark_trials(self._parent_run, pick.number if pick else None,
                                     trial_figures(study, self.cfg))
        except Exception as exc:  # any store error: the results are safe in Optuna
            missed.append("the study's own run")
            logger.warning("MLflow finish_study failed (%s); rerun `%s` to bring MLflow up "
                           "to date", describe(exc), self.resume)
        self.on_event(TrialEvent("study", message="done" if done else "stopped"))
        return DaemonSummary(policy.finished_here, len(finished), self.stopping and not done,
                             best.number if best else None, list(best.values)
                             if best and best.values else None, no_baseline,
                             " and ".join(missed))


class MlflowLog:
    """The policy's `TrialLog`: the daemon's MLflow runs and progress events."""

    def __init__(self, daemon: StudyRuns) -> None:
        self.daemon = daemon

    def open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        return self.daemon._open_run(trial, params)

    def told(self, told: Told) -> None:
        self.daemon._told(told)


def numbers_text(numbers: set[int]) -> str:
    return ", ".join(str(n) for n in sorted(numbers))


def is_storage_error(exc: BaseException) -> bool:
    """Whether the Optuna storage raised it (SQLAlchemy's errors, or Optuna's wrapper of a
    failed commit); MLflow's wrap SQLAlchemy's too, but never escape as one."""
    import sqlalchemy.exc

    return isinstance(exc, optuna.exceptions.StorageInternalError | sqlalchemy.exc.SQLAlchemyError)


def storage_file_note(url: str) -> str:
    """", and its file ... is gone" where a local SQLite storage's file was removed."""
    if not is_local_file_storage(url):
        return ""
    from sqlalchemy.engine import make_url

    path = Path(str(make_url(url).database)).expanduser()
    return "" if path.exists() else \
        f", and its file {path} is gone (a resume starts the study anew)"
