"""The search's one controller (Ray Tune's `TuneController`): it drives the `Searcher` (what to
try next), the `PruningScheduler` (when to stop a trial), the `Placement` (where and when a trial
runs) and the `RetryPolicy` (what runs again), and writes what Optuna is told of each finished
trial (`tell.record_result`). Pure policy over an Optuna study: no processes, GPUs, Ray or MLflow.
The daemon drives it with real engines; `bench/replay.py` drives it with a table of measured
configs.

How a trial goes through it: `next_launch` starts a waiting trial whose GPUs are free, or asks
the searcher for another while GPUs stay free and the budget lasts; `on_step` hands each load
level to the scheduler (prune or go on); `on_result` writes the record, tells Optuna (the one
state mapping: `study.state_of`) and re-queues what infrastructure lost. Everything told is
passed to the `TrialLog` (the daemon logs it to MLflow).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer import bottleneck
from optimizer.config import StudyConfig
from optimizer.results.trial_record import (
    ATTR_NOT_LAUNCHED,
    confirm_label,
    is_baseline,
    retries_of,
    retry_of,
)
from optimizer.search.placement import Placement
from optimizer.search.retries import RetryPolicy
from optimizer.search.scheduler import PruningScheduler
from optimizer.search.searcher import Searcher
from optimizer.search.tell import record_result, tell_without_run
from optimizer.search.trials import Running, Told, TrialLog, Waiting
from optimizer.storage.study import is_search_trial, requeue
from runners.base import EngineConfig, Failure, FailureReason, RunResult, StepMetrics
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.workload import Workload
from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)


class SearchController:
    """One study's search. Not thread-safe: one caller drives it."""

    def __init__(self, cfg: StudyConfig, space: ResolvedSpace, study: optuna.Study, *,
                 workload: Workload, total_gpus: int, max_gpus_per_node: int | None = None,
                 hardware: HardwareProfile | None = None, model: ModelInfo | None = None,
                 log: TrialLog | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 storage: optuna.storages.BaseStorage | None = None,
                 compiled_elsewhere: Callable[[], Collection[str]] | None = None) -> None:
        self.cfg = cfg
        self.space = space
        self.study = study
        self.workload = workload
        self.hardware = hardware
        self.model = model
        self.searcher = Searcher(cfg, space, study, workload=workload, hardware=hardware,
                                 model=model, log=log, storage=storage)
        self.scheduler = PruningScheduler(cfg, study, workload=workload, hardware=hardware,
                                          model=model)
        self.placement = Placement(cfg, total_gpus=total_gpus,
                                   max_gpus_per_node=max_gpus_per_node, clock=clock,
                                   compiled_elsewhere=compiled_elsewhere)
        self.retries = RetryPolicy(study, cfg.spec.retries)
        self.clock = clock
        self.started = clock()
        self.running: list[Running] = []
        # Measured before the defaults were: recorded once the defaults are, so that every
        # conclusion compares its trial with them.
        self.deferred: list[tuple[Running, RunResult]] = []
        self.finished_here = 0

    @property
    def log(self) -> TrialLog:
        return self.searcher.log

    @property
    def waiting(self) -> list[Waiting]:
        """The trials asked and waiting for their GPUs, in the order asked."""
        return self.placement.waiting

    @property
    def total_gpus(self) -> int:
        return self.placement.total_gpus

    @total_gpus.setter
    def total_gpus(self, value: int) -> None:  # lowered by the caller when a cluster node dies
        self.placement.total_gpus = value

    @property
    def has_slo(self) -> bool:
        return self.searcher.has_slo

    def verdict(self, steps: Sequence[StepMetrics], config: EngineConfig,
                result: RunResult | None = None) -> bottleneck.Verdict:
        """The bottleneck verdict of a trial's steps (or its whole result)."""
        return self.scheduler.verdict(steps, config, result)

    # -- the queue ----------------------------------------------------------------------------

    def prepare(self, seed_trials: Sequence[Mapping[str, Any]] = (),
                warm_seeds: Sequence[tuple[Mapping[str, Any], str]] = (),
                template_trials: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = (),
                ) -> None:
        """Learn what the study holds (its configs, its compiled keys) and queue the defaults,
        warm seeds, templates and seeds (`Searcher.prepare`)."""
        trials = self.study.get_trials(deepcopy=False)
        self.placement.learn(trials)
        self.searcher.prepare(trials, seed_trials, warm_seeds, template_trials)

    def budget_left(self) -> bool:
        if self.searcher.is_exhausted:
            return False
        budget = self.cfg.spec.budget
        if budget.wall_hours is not None and \
                self.clock() - self.started >= budget.wall_hours * 3600:
            return False
        if budget.trials is not None:
            trials = self.study.get_trials(deepcopy=False)
            # A failure lost to infrastructure and re-queued does not count: its re-run does;
            # nor does a repeat of a measured config, which cost nothing.
            requeued = {retry_of(t) for t in trials}
            done = sum(1 for t in trials if t.state.is_finished() and t.number not in requeued
                       and is_search_trial(t))
            return done + len(self.running) + len(self.waiting) + len(self.deferred) < \
                budget.trials
        return True

    def next_launch(self, can_start: Callable[[int], bool]) -> Running | None:
        """The next trial to launch now, or None. Starts waiting trials whose GPUs are free,
        in the order asked, and asks for more while GPUs stay free: a trial that needs more
        GPUs than are free does not hold back one that fits. One overtaken MAX_OVERTAKEN times
        reserves the GPUs: nothing behind it starts, nothing more is asked, until it has."""
        while len(self.running) < self.placement.max_parallel():
            ready = self.placement.take_ready(can_start, self._drop)
            if ready is not None:
                return self._launch(ready)
            if not can_start(1) or not self.placement.has_room() or not self.budget_left():
                return None
            # None: rejected before launch or a repeat; ask again
            asked = self.searcher.ask(self._unfinished(), self.placement.problem)
            if asked is not None:
                self.placement.waiting.append(asked)
            elif self.placement.is_waiting_for_a_compile():
                # GPUs are free only because a trial waits for its key's compile: one ask a
                # round, not a run of repeats (which would end the study as exhausted).
                return None
        return None

    def ask_confirm(self, params: Mapping[str, Any], label: str) -> Running:
        """A final re-measurement of `params` ("defaults" or "best"), launched at once
        (`Searcher.ask_confirm`)."""
        self.placement.hear_compiled_elsewhere()
        return self._launch(self.searcher.ask_confirm(params, label))

    def _launch(self, waiting: Waiting) -> Running:
        running = self.placement.launch(waiting)
        self.running.append(running)
        return running

    def _unfinished(self) -> Iterator[Running | Waiting]:
        """The trials that hold a config and have not finished: in flight, held for the
        defaults, waiting for GPUs."""
        yield from self.running
        yield from (held for held, _ in self.deferred)
        yield from self.placement.waiting

    def _drop(self, waiting: Waiting, failure: Failure) -> None:
        tell_without_run(self.searcher, waiting.trial, waiting.params, failure)

    # -- steps ----------------------------------------------------------------------------------

    def on_step(self, running: Running, step: StepMetrics) -> bool:
        """Judge one load level of a running trial; True stops it there (pruned)."""
        running.steps.append(step)
        if len(running.steps) == 1:
            self.placement.started(running)
        stop = self.scheduler.should_prune(running, step)
        if stop:
            running.pruned_at = step.step
        return stop

    # -- results --------------------------------------------------------------------------------

    def on_result(self, running: Running, result: RunResult) -> None:
        """Record a finished trial and tell Optuna, or hold it until the defaults are measured
        (trials run beside the defaults and may end first: its conclusion compares it with
        them)."""
        if running in self.running:
            self.running.remove(running)
        self.placement.ended(running,
                             result.engine.compile_cache or ("cold" if result.steps else None))
        if not running.is_baseline and confirm_label(running.trial) is None and \
                self.baseline_pending():
            logger.info("trial %d measured; recorded once the defaults are",
                        running.trial.number)
            self.deferred.append((running, result))
            return
        self._record(running, result)
        self.record_deferred()

    def baseline_pending(self) -> bool:
        """Whether this run is still to measure the defaults: in flight, waiting for GPUs, or
        queued (a retry included)."""
        from optimizer.results.conclusion import baseline_trial

        if baseline_trial(self.study) is not None:
            return False
        return any(i.is_baseline for i in self.running) or \
            any(is_baseline(w.trial) for w in self.waiting) or \
            any(is_baseline(t)
                for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def record_deferred(self, *, force: bool = False) -> None:
        """Record the trials held for the defaults once they are measured (or can no longer
        be: then their conclusions say there is no defaults measurement); `force` when the
        run ends with the defaults still queued."""
        if not self.deferred or (self.baseline_pending() and not force):
            return
        held, self.deferred = self.deferred, []
        for item, result in held:
            self._record(item, result)

    def interrupted(self, running: Running) -> None:
        """A trial stopped in flight (the daemon is stopping now): failed, re-queued unless it
        is a confirmation run."""
        if running in self.running:
            self.running.remove(running)
        self.placement.ended(running, "cold" if running.steps else None)
        self._record(running, RunResult(status="failed", steps=tuple(running.steps),
                                        failure=Failure(
            FailureReason.INTERRUPTED, "the daemon was stopped with this trial in flight.")))

    def _record(self, item: Running, result: RunResult) -> None:
        result = self.retries.settle(item, result)
        record = record_result(self, item, result)
        self.searcher.remember(item.trial.number, record)
        self.finished_here += 1
        self.log.told(Told("measured", item.trial.number, record, run_id=item.run_id,
                           result=result, running=item))

    def release_waiting(self) -> None:
        """Trials asked but never launched (they waited for GPUs) must not stay RUNNING: fail
        them without a run and queue their params again for the resume."""
        for item in self.placement.release():
            failure = Failure(FailureReason.INTERRUPTED,
                              "the daemon stopped before this trial was launched; re-queued.")
            item.trial.set_user_attr(ATTR_NOT_LAUNCHED, True)  # counted apart, not failed
            tell_without_run(self.searcher, item.trial, item.params, failure)
            requeue(self.study, item.trial, item.params, retries_of(item.trial))
