"""The daemon loop: take the study's lock, recover what a dead daemon left, then launch what the
search policy hands out on the executor as GPUs allow, route each load level and result back to
the policy, and log every trial to MLflow, until the budget ends or a stop.

Policy (what runs, pruning, what Optuna is told) is `optimizer.search` (its controller); where
trials run is `optimizer.run.executor` (Ray: `optimizer.run.ray_executor`); the MLflow side is
`optimizer.run.study_runs`; a lost worker, node or infrastructure is `optimizer.run.worker_loss`;
the record of a trial is `optimizer.results.trial_record`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.trial import FrozenTrial

from optimizer.config import StudyConfig, resume_command
from optimizer.errors import (
    StorageError,
    TrackingError,
    WorkerLost,
    describe,
    translate,
)
from optimizer.results import quality_gate
from optimizer.results.confirmation import confirm
from optimizer.results.trial_record import STUDY_ATTR_MLFLOW_KEY, mlflow_study_key
from optimizer.run.events import (
    DaemonSummary,
    TrialEvent,
    confirm_of,
    first_value,
    operating_metrics,
)
from optimizer.run.executor import Executor
from optimizer.run.recovery import Recovery, trial_workdir
from optimizer.run.strays import reap_left_by_dead_daemon, reap_orphans
from optimizer.run.study_runs import (
    MlflowLog,
    StudyRuns,
    StudySummary,
    is_storage_error,
    numbers_text,
    storage_file_note,
)
from optimizer.run.worker_loss import InFlight, WorkerLoss
from optimizer.search.controller import SearchController
from optimizer.search.trials import Running
from optimizer.storage.lock import StorageLease, StudyLock, is_local_file_storage, study_lock_path
from optimizer.storage.study import make_storage, open_study
from optimizer.tracking.tracker import Tracker
from runners.atomic import write_atomic
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.workload import Workload
from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

class Daemon(StudyRuns, WorkerLoss):
    """Runs one study to its budget. Not thread-safe: `request_stop` is the only method another
    thread (or a signal handler) may call."""

    def __init__(self, cfg: StudyConfig, *, space: ResolvedSpace, executor: Executor,
                 registry_dir: Path, tracker: Tracker, workload: Workload,
                 study_params: Mapping[str, Any], study_artifacts: Mapping[str, Any],
                 summarize: StudySummary,
                 on_event: Callable[[TrialEvent], None] | None = None,
                 hardware: HardwareProfile | None = None, model: ModelInfo | None = None,
                 poll_s: float = 0.25,
                 seed_trials: Sequence[Mapping[str, Any]] = (),
                 template_trials: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = (),
                 max_gpus_per_node: int | None = None,
                 warm_seeds: Sequence[tuple[Mapping[str, Any], str]] = (),
                 study_tags: Mapping[str, str] = {},
                 study_attrs: Mapping[str, Any] = {},
                 compiled_elsewhere: Callable[[], Collection[str]] | None = None,
                 resume: str | None = None,
                 learn_facts: Callable[[optuna.Study], Sequence[str]] | None = None) -> None:
        self.cfg = cfg
        # The tuning memory's writer of measured facts (`learn_facts`,
        # optimizer/tuning_memory/learned_facts.py), called at the study's end; None for a
        # simulated study (its figures are a model's).
        self.learn_facts = learn_facts
        # The command that resumes this study with the options it was started with (the CLI
        # renders it); without one, the study file alone.
        self.resume = resume or resume_command(cfg.source)
        # The compile ledger's reader (optimizer/run/engine_choice.py compile_ledger_of), or None.
        self.compiled_elsewhere = compiled_elsewhere
        self.space = space
        self.executor = executor
        self.registry_dir = registry_dir  # engine pid records, for reaping strays
        self.tracker = tracker
        self.workload = workload
        self.study_params = study_params
        self.study_artifacts = study_artifacts
        self.summarize = summarize
        self.on_event = on_event or (lambda event: None)
        self.hardware = hardware
        self.model = model
        self.poll_s = poll_s
        self.seed_trials = list(seed_trials)  # full configs, enqueued after the baseline
        self.template_trials = list(template_trials)  # (config, tags), before the seeds
        self.max_gpus_per_node = max_gpus_per_node
        # The tuning memory's (optimizer/tuning_memory/earlier_studies.py): earlier studies' bests
        # as (config, `warm_start:<study>`), queued right after the defaults; the fingerprint and
        # what the warm start did, as tags of the study run and user attrs of the Optuna study.
        self.warm_seeds = list(warm_seeds)
        self.study_tags = dict(study_tags)
        self.study_attrs = dict(study_attrs)
        self._stop: Literal["no", "finish", "now"] = "no"
        self._inflight: list[InFlight] = []
        self._tracking_misses: set[int] = set()  # trials whose MLflow writes failed
        self._parent_run = ""
        self._lease: StorageLease | None = None  # the study's lock in a server RDB
        self._placement_checked_at: float | None = None  # monotonic s (_watch_placement)
        self.policy: SearchController | None = None

    # -- control ----------------------------------------------------------------------------

    def request_stop(self, now: bool = False) -> None:
        """First call: finish the trials in flight, start none. `now=True` (or a second call):
        fail the trials in flight at once (they are re-queued on resume)."""
        self._stop = "now" if now or self._stop != "no" else "finish"

    @property
    def stopping(self) -> bool:
        return self._stop != "no"

    # -- main loop --------------------------------------------------------------------------

    def run(self) -> DaemonSummary:
        lock = StudyLock(study_lock_path(self.cfg))
        lock.acquire(self.cfg.name, self.cfg.storage_url)
        try:
            return self._run_locked()
        except Exception as exc:
            if is_storage_error(exc):  # the source of truth failed: nothing can be recorded
                raise translate(
                    exc, f"the Optuna storage {self.cfg.storage_url} failed mid-study "
                    f"({describe(exc)}){storage_file_note(self.cfg.storage_url)}; the trials in "
                    "flight were stopped and their engines ended; fix the storage, then resume: "
                    "it recovers what could not be recorded.", into=StorageError) from exc
            raise
        finally:
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            lock.release()

    def _run_locked(self) -> DaemonSummary:
        storage = make_storage(self.cfg.storage_url)
        study = open_study(self.cfg, storage=storage)
        for key, value in self.study_attrs.items():  # as of this start
            study.set_user_attr(key, value)
        if not is_local_file_storage(self.cfg.storage_url):  # daemons on other hosts
            lease = StorageLease(storage, storage.get_study_id_from_name(self.cfg.name),
                                 self.cfg.name)
            lease.acquire()
            self._lease = lease
        reap_left_by_dead_daemon(self.registry_dir, self.executor)
        known = mlflow_study_key(study)
        key = known or uuid.uuid4().hex
        if known is None:
            study.set_user_attr(STUDY_ATTR_MLFLOW_KEY, key)
        # A study with trials may have begun before keys, or have written its key and then
        # died before MLflow took it: its one unkeyed parent run is its own.
        has_trials = bool(study.get_trials(deepcopy=False))
        try:
            self._parent_run = self.tracker.start_study(
                self.cfg.name, key=key, params=self.study_params,
                artifacts=self.study_artifacts, adopt_unkeyed=has_trials,
                objectives=dict(zip(self.cfg.objectives, self.cfg.directions, strict=True)),
                searched=[p.name for p in self.space.params if not p.is_fixed])
        except Exception as exc:  # the store broke since the start-up check: start nothing
            raise translate(
                exc, f"MLflow refused the study's run at {self.cfg.tracking_uri} "
                f"({describe(exc)}); nothing was launched; fix the "
                f"store and run `{self.resume}` again.", into=TrackingError) from exc
        if self.study_tags:
            self.tracker.set_study_tags(self._parent_run, self.study_tags)
        recovery = Recovery(study, storage, self.space, self.tracker, self._parent_run,
                            self.cfg.name, self.cfg.results_dir, self.cfg.spec.retries,
                            fixed_flags=self.cfg.engine_fixed_flags,
                            study_env=self.cfg.spec.env)
        recovery.run()
        policy = SearchController(self.cfg, self.space, study, workload=self.workload,
                              total_gpus=self.executor.total_gpus,
                              max_gpus_per_node=self.max_gpus_per_node,
                              hardware=self.hardware, model=self.model, log=MlflowLog(self),
                              storage=storage,
                              compiled_elsewhere=self.compiled_elsewhere)
        self.policy = policy
        policy.prepare(self.seed_trials, self.warm_seeds, self.template_trials)
        is_confirmed = False
        try:
            self._loop(policy)
            if not self.stopping:
                confirm(study, self.cfg, lambda params, label: self._measure_alone(
                    policy, params, label), lambda: self.stopping)
                # A stop during the confirmation round leaves it unfinished: not done.
                is_confirmed = not self.stopping
        finally:
            self._wind_down(policy)
        if self._tracking_misses and recovery.catch_up():
            # The store took writes again: what it refused mid-study is logged now, and no run
            # of this daemon's is left RUNNING.
            logger.info("MLflow caught up at the end: trials %s are logged",
                        numbers_text(self._tracking_misses))
            self._tracking_misses.clear()
        return self._finish(study, policy, is_confirmed=is_confirmed)

    def _wind_down(self, policy: SearchController) -> None:
        """End every trial and process of this run, on any way out. Each step runs even when
        one before it failed: a storage that refuses the records (the reason an exception may
        be escaping) must never leave an engine or a worker behind."""
        steps: list[tuple[str, Callable[[], object]]] = [
            (f"stopping trial {item.running.trial.number}", partial(self._cancel, policy, item))
            for item in list(self._inflight)]  # an exception escaped: fail, never orphan
        steps += [("recording the trials held for the defaults",
                   lambda: policy.record_deferred(force=True)),
                  ("re-queuing the trials that waited for GPUs", policy.release_waiting),
                  ("shutting the workers down", self.executor.shutdown),
                  ("ending engines left without a worker",
                   partial(reap_orphans, self.registry_dir))]
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # logged; the next step must still run
                logger.warning("while stopping: %s failed (%s)", what, describe(exc))

    def _loop(self, policy: SearchController) -> None:
        while True:
            if self._lease is not None and self._lease.is_lost:
                self.request_stop(now=True)  # another daemon runs the study now
            self._watch_infrastructure(policy)
            self._cut_on_stop(policy)
            if not self.stopping:
                while (running := policy.next_launch(self.executor.can_start)) is not None:
                    self._launch(running)
            if not self._inflight and (self.stopping or not policy.budget_left()):
                policy.record_deferred(force=True)
                return
            self._wait_and_collect(policy)
            self._watch_placement()

    def _wait_and_collect(self, policy: SearchController) -> None:
        """Relay the steps measured since the last call, then collect the trials that ended
        within `poll_s`."""
        self._watch_infrastructure(policy)
        self._poll_steps(policy)
        if not self._inflight:
            time.sleep(self.poll_s)
            return
        ended = self.executor.wait_any([item.handle for item in self._inflight], self.poll_s)
        for item in [i for i in self._inflight if i.handle in ended]:
            self._poll_steps(policy)  # steps that arrived just before the result
            self._collect(policy, item)

    def _measure_alone(self, policy: SearchController, params: Mapping[str, Any],
                       label: str) -> FrozenTrial | None:
        """One confirmation run, alone on the GPUs (the interleaving is the point)."""
        running = policy.ask_confirm(params, label)
        self._launch(running)
        while self._inflight:
            self._wait_and_collect(policy)
            self._cut_on_stop(policy)
            self._watch_placement()
        return policy.study.get_trials(deepcopy=False)[running.trial.number]

    def _cut_on_stop(self, policy: SearchController) -> None:
        """A stop `now` cuts every trial in flight; any stop cuts one whose worker Ray never
        placed (it launched nothing, and a placement no node offers would hold the stop for
        ever)."""
        for item in list(self._inflight):
            if self._stop == "now" or (self.stopping and not item.handle.is_placed()):
                self._cancel(policy, item)

    def _launch(self, running: Running) -> None:
        trial, config = running.trial, running.config
        running.run_id = self._open_run(trial, {**running.params, "launch.model": config.model})
        workdir = trial_workdir(self.cfg.results_dir, trial.number)
        # The defaults trial also measures the quality reference and its noise floor.
        workload = quality_gate.workload_for(self.workload, running.is_baseline)
        handle = self.executor.submit(config, workload, workdir)
        self._inflight.append(InFlight(running, handle, workdir))
        logger.info("trial %d started: params=%s", trial.number, running.params)
        self.on_event(TrialEvent("started", trial.number, self._changed(config),
                                 confirm=confirm_of(running)))

    def _poll_steps(self, policy: SearchController) -> None:
        for item in list(self._inflight):
            try:
                steps = item.handle.poll()
            except WorkerLost:
                continue  # the result will tell what happened
            for step in steps:
                stop = policy.on_step(item.running, step)
                item.handle.decide(step.step, stop)
                at = operating_metrics(policy, item.running)
                self.on_event(TrialEvent(
                    "step", item.running.trial.number, self._changed(item.running.config),
                    "pruning" if stop else "running", first_value(policy, item.running),
                    at.p99_tpot_ms if at is not None else None,
                    f"level {step.step} ({step.level.label})",
                    time.monotonic() - item.running.started, confirm=confirm_of(item.running),
                    ttft_p99_ms=at.p99_ttft_ms if at is not None else None))

    def _collect(self, policy: SearchController, item: InFlight) -> None:
        self._inflight.remove(item)
        result = self._release(policy, item, item.handle.result())
        if result.trace_data is not None and result.trace_path is not None and \
                not result.trace_path.is_file():
            # The worker ran on another machine: its trimmed trace came back through Ray.
            local = item.workdir / result.trace_path.name
            local.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(local, result.trace_data)
            result = replace(result, trace_path=local)
        policy.on_result(item.running, result)

    def _cancel(self, policy: SearchController, item: InFlight) -> None:
        if self.executor.lost() is None:  # else its worker is gone; its engine is reaped
            item.handle.cancel()
        self.executor.release(item.handle, healthy=False)
        self._inflight.remove(item)
        policy.interrupted(item.running)
