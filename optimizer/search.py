"""The search policy: which config runs next, when a trial is pruned, and what Optuna is told of
each trial. Pure policy over an Optuna study: no processes, GPUs, Ray or MLflow. The daemon
drives it with real engines; `bench/replay.py` drives it with a table of measured configs.

How a trial goes through it: `next_launch` asks Optuna (or takes the queue: the defaults,
seeds, retries), refuses a config measured before (its outcome is reused) or one that cannot
run here (told as a config failure), and hands out a `Running` once its GPUs are free;
`on_step` judges each load level (prune or go on); `on_result` writes the record, tells Optuna
(the one state mapping: `study.state_of`) and re-queues what infrastructure lost. Everything
told is passed to the `TrialLog` (the daemon logs it to MLflow).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer import bottleneck
from optimizer.config import StudyConfig
from optimizer.objectives import described_step, objective_values
from optimizer.outcomes import (
    NoLog,
    Running,
    Told,
    TrialLog,
    Waiting,
    config_key,
    record_result,
    tell_duplicate,
    tell_without_run,
)
from optimizer.records import TrialRecord, record_of
from optimizer.startup import CompileCaches, launch_order, trial_env
from optimizer.study import (
    ATTR_BASELINE,
    ATTR_CONFIRM,
    ATTR_NOT_LAUNCHED,
    ATTR_RETRIES,
    ATTR_RETRY_OF,
    ATTR_SEED_SOURCE,
    ATTR_SEEDED,
    CONFIG_FAILURES,
    engine_config,
    is_search_trial,
    requeue,
    requeueable,
    running_trial,
)
from runners.base import EngineConfig, Failure, FailureReason, RunResult, StepMetrics
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.vllm.compile_cache import compile_key
from runners.workload import Workload
from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

# A trial waiting for GPUs that later, smaller trials have overtaken this many times holds the
# next free GPUs: nothing behind it starts until it has (no starving a 2-GPU trial by 1-GPU ones).
MAX_OVERTAKEN = 2
# The informed start (`sampler: screen`): configs of the space the analytic model ranks, and
# how many trials it picks before the model-based sampler takes over.
SCREEN_CANDIDATES = 1500
SCREEN_TRIALS = 5


class SearchPolicy:
    """One study's policy. Not thread-safe: one caller drives it."""

    def __init__(self, cfg: StudyConfig, space: ResolvedSpace, study: optuna.Study, *,
                 workload: Workload, total_gpus: int, max_gpus_per_node: int | None = None,
                 hardware: HardwareProfile | None = None, model: ModelInfo | None = None,
                 log: TrialLog | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 storage: optuna.storages.BaseStorage | None = None,
                 compiled_elsewhere: Callable[[], Collection[str]] | None = None) -> None:
        self.cfg = cfg
        # The study's storage, for a confirmation trial that must not take a queued one.
        self.storage = storage
        self.space = space
        self.study = study
        self.workload = workload
        self.total_gpus = total_gpus  # lowered by the caller when a cluster node dies
        self.max_gpus_per_node = max_gpus_per_node or total_gpus  # a trial's GPUs share a node
        self.hardware = hardware  # for the roofline of the bottleneck classifier
        self.model = model
        self.log: TrialLog = log or NoLog()
        self.clock = clock
        self.started = clock()
        self.running: list[Running] = []
        self.waiting: list[Waiting] = []  # asked, in order, waiting for their GPUs
        # Measured before the defaults were: recorded once the defaults are, so that every
        # conclusion compares its trial with them.
        self.deferred: list[tuple[Running, RunResult]] = []
        self.finished_here = 0
        self._measured: dict[str, int] = {}  # config key -> the finished trial that holds it
        self.duplicates_in_a_row = 0
        self.is_exhausted = False
        # The compile caches this study filled and is filling (optimizer/startup.py).
        self.caches = CompileCaches()
        # The keys other processes compiled on this cache root (the compile ledger's reader,
        # runners/vllm/compile_ledger.py), asked before each launch; never under per_trial.
        self.compiled_elsewhere = compiled_elsewhere

    # -- the queue ----------------------------------------------------------------------------

    def prepare(self, seed_trials: Sequence[Mapping[str, Any]] = (),
                warm_seeds: Sequence[tuple[Mapping[str, Any], str]] = (),
                template_trials: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = (),
                ) -> None:
        """Learn the configs the study holds and queue the defaults (unless there), then the
        warm seeds (an earlier study's best, with its `seed_source`: `warm_start:<study>`), then
        the hardware templates (config, tags), then the seeds. On every start, not just the
        first: a daemon killed between these writes left some seeds out, and a seed added to the
        study file since runs on resume. A config the study holds already (queued or finished)
        is not queued again."""
        trials = self.study.get_trials(deepcopy=False)
        startup = self.cfg.spec.startup
        # Where a compile ledger is read, it alone says what the cache root holds: it lives in
        # that root, so a study resumed on another machine, or after the root was cleared, finds
        # its earlier trials' keys cold (and predicting them warm would send VLLM_FORCE_AOT_LOAD
        # into a start that must compile). Without a ledger, the records are all there is.
        learn_from_records = startup.compile_cache == "shared" and self.compiled_elsewhere is None
        for frozen in trials:
            record = record_of(frozen)
            self.remember(frozen.number, record)
            if record is not None and learn_from_records:
                self.caches.learn(record.startup)
        self._hear_compiled_elsewhere()
        if self.cfg.spec.sampler.name == "screen":
            self._start_screen()
        if not any(ATTR_BASELINE in t.user_attrs for t in trials):
            self.study.enqueue_trial(self.space.defaults(), user_attrs={ATTR_BASELINE: True})
        for params, source in warm_seeds:
            self.study.enqueue_trial(dict(params), user_attrs={
                ATTR_SEEDED: True, ATTR_SEED_SOURCE: source}, skip_if_exists=True)
        for params, tags in template_trials:
            self.study.enqueue_trial(dict(params), user_attrs={ATTR_SEEDED: True, **tags},
                                     skip_if_exists=True)
        for params in seed_trials:
            self.study.enqueue_trial(dict(params), user_attrs={ATTR_SEEDED: True},
                                     skip_if_exists=True)

    def _start_screen(self) -> None:
        """The informed start (`sampler: screen`): after the queued trials, SCREEN_TRIALS
        configs ranked by the analytic model over SCREEN_CANDIDATES of the space, refitted to
        each measurement, then the study's TPE (optimizer/samplers.py `ScreenSampler`)."""
        from optimizer.samplers import ScreenSampler
        from optimizer.screen import load_of, sample_candidates, screen

        load = load_of(self.workload)
        hw = self.hardware
        if load is None or hw is None or self.model is None or hw.memory_bandwidth_gbps <= 0 \
                or hw.bf16_tflops <= 0 or self.cfg.is_multi_objective or \
                not self.cfg.objectives[0].startswith("goodput"):
            # It predicts goodput from the card's bandwidth and FLOP/s: for another objective,
            # or a card without those figures, its ranking says nothing.
            logger.info("sampler screen: no prediction for this study (a capacity search, an "
                        "objective other than goodput, no model shape, or no bandwidth and "
                        "FLOP/s in the hardware profile); TPE alone")
            return
        candidates = sample_candidates(self.space.sample, SCREEN_CANDIDATES,
                                       seed=self.cfg.spec.sampler.seed or 0)
        base = engine_config(self.cfg, {})
        try:
            predicted = screen([self.space.to_flags(c) for c in candidates], model=base.model,
                               hardware=hw, load=load, model_info=self.model,
                               fixed_flags=base.flags)
        except (ArithmeticError, ValueError, TypeError) as exc:  # a shape the model lacks
            logger.warning("sampler screen: the analytic model could not rank this space "
                           "(%s: %s); TPE alone", type(exc).__name__, exc)
            return
        if not any(math.isfinite(p) and p > 0 for p in predicted):
            logger.info("sampler screen: the model predicts nothing within the SLO; TPE alone")
            return
        self.study.sampler = ScreenSampler(candidates, predicted, fallback=self.study.sampler,
                                           n_screen=SCREEN_TRIALS)

    def remember(self, number: int, record: TrialRecord | None) -> None:
        """Keep a finished trial's config if its outcome would repeat: a measurement, a prune,
        or a failure the config causes (not one lost to infrastructure)."""
        if record is None or not record.params:
            return
        if record.state in ("complete", "pruned") or (
                record.state == "failed" and record.failure_reason in CONFIG_FAILURES):
            self._measured.setdefault(config_key(record.params), number)

    def budget_left(self) -> bool:
        if self.is_exhausted:
            return False
        budget = self.cfg.spec.budget
        if budget.wall_hours is not None and \
                self.clock() - self.started >= budget.wall_hours * 3600:
            return False
        if budget.trials is not None:
            trials = self.study.get_trials(deepcopy=False)
            # A failure lost to infrastructure and re-queued does not count: its re-run does;
            # nor does a repeat of a measured config, which cost nothing.
            requeued = {t.user_attrs.get(ATTR_RETRY_OF) for t in trials}
            done = sum(1 for t in trials if t.state.is_finished() and t.number not in requeued
                       and is_search_trial(t))
            return done + len(self.running) + len(self.waiting) + len(self.deferred) < \
                budget.trials
        return True

    def max_parallel(self) -> int:
        return self.cfg.spec.max_parallel_trials or self.total_gpus

    def _max_waiting(self) -> int:
        """How many asked trials may wait for GPUs at once: enough to find one that fits the
        GPUs left free (on 2 GPUs most configs of a space need both), few enough that the
        sampler is not asked far ahead of what it has learnt."""
        return 2 * self.max_parallel()

    def next_launch(self, can_start: Callable[[int], bool]) -> Running | None:
        """The next trial to launch now, or None. Starts waiting trials whose GPUs are free,
        in the order asked, and asks for more while GPUs stay free: a trial that needs more
        GPUs than are free does not hold back one that fits. One overtaken MAX_OVERTAKEN times
        reserves the GPUs: nothing behind it starts, nothing more is asked, until it has."""
        while len(self.running) < self.max_parallel():
            started = self._start_waiting(can_start)
            if started is not None:
                return started
            if not can_start(1) or len(self.waiting) >= self._max_waiting() or \
                    any(w.overtaken >= MAX_OVERTAKEN for w in self.waiting) or \
                    not self.budget_left():
                return None
            asked = self._ask()  # None: rejected before launch or a repeat; ask again
            if asked is not None:
                self.waiting.append(asked)
            elif any(self.caches.is_compiling(compile_key(w.config)) for w in self.waiting):
                # GPUs are free only because a trial waits for its key's compile: one ask a
                # round, not a run of repeats (which would end the study as exhausted).
                return None
        return None

    def _hear_compiled_elsewhere(self) -> None:
        if self.compiled_elsewhere is not None and \
                self.cfg.spec.startup.compile_cache == "shared":
            self.caches.elsewhere = frozenset(self.compiled_elsewhere())

    def _start_waiting(self, can_start: Callable[[int], bool]) -> Running | None:
        if self.waiting:
            self._hear_compiled_elsewhere()
        order: Sequence[int] = range(len(self.waiting))
        if self.cfg.spec.startup.order_by_compile_key and \
                self.cfg.spec.startup.compile_cache == "shared":
            # Warm keys first; a key being compiled waits for that compile (optimizer/startup.py).
            order = launch_order(self.waiting, lambda w: compile_key(w.config), self.caches,
                                 is_reserved=lambda w: w.overtaken >= MAX_OVERTAKEN)
        for index in order:
            waiting = self.waiting[index]
            if waiting.config.num_gpus > self.total_gpus:  # a node died while it waited
                del self.waiting[index]
                tell_without_run(self, waiting.trial, waiting.params, Failure(
                    FailureReason.NODE_LOST,
                    f"it needs {waiting.config.num_gpus} GPUs but the cluster has "
                    f"{self.total_gpus} left after a node died; not re-queued."))
                return self._start_waiting(can_start)
            if can_start(waiting.config.num_gpus):
                del self.waiting[index]
                for earlier in self.waiting[:index]:
                    earlier.overtaken += 1
                return self._running(waiting.trial, waiting.params, waiting.config)
            if waiting.overtaken >= MAX_OVERTAKEN:
                return None  # it holds the next free GPUs
        return None

    def _running(self, trial: optuna.Trial, params: dict[str, Any],
                 config: EngineConfig) -> Running:
        attrs = trial.user_attrs
        key = compile_key(config)
        startup = self.cfg.spec.startup
        prediction = self.caches.predict(key) if startup.compile_cache == "shared" else \
            ("none" if key is None else "cold")
        if startup.compile_cache == "shared":
            self.caches.launched(trial.number, key, prediction)
        running = Running(trial, params, trial_env(config, startup, prediction),
                          bool(attrs.get(ATTR_BASELINE)), int(attrs.get(ATTR_RETRIES, 0)),
                          started=self.clock(), compile_key=key, prediction=prediction)
        self.running.append(running)
        return running

    def _ask(self) -> Waiting | None:
        trial = self.study.ask()
        params = self.space.sample(trial)
        key = config_key(params)
        earlier = self._measured.get(key)
        if earlier is None:
            earlier = self._unfinished_with(key, trial.number)
        if earlier is not None and ATTR_CONFIRM not in trial.user_attrs:
            tell_duplicate(self, trial, params, earlier)
            return None
        self.duplicates_in_a_row = 0
        config = engine_config(self.cfg, self.space.to_flags(params))
        problems = list(self.space.check(params))
        if config.num_gpus > self.total_gpus:
            problems.append(f"needs {config.num_gpus} GPUs but the cluster has "
                            f"{self.total_gpus}")
        elif config.num_gpus > self.max_gpus_per_node:
            problems.append(f"needs {config.num_gpus} GPUs on one node but the largest node of "
                            f"the cluster has {self.max_gpus_per_node}")
        memory = bottleneck.memory_problem(config, self.hardware, self.model)
        if memory is not None:
            problems.append(memory)
        if problems:
            failure = Failure(FailureReason.INFEASIBLE, "; ".join(problems))
            tell_without_run(self, trial, params, failure)
            return None
        return Waiting(trial, params, config)

    def ask_confirm(self, params: Mapping[str, Any], label: str) -> Running:
        """A final re-measurement of `params` ("defaults" or "best"), launched at once. Seeds
        or retries still queued (beyond the budget) stay queued for a later resume: the
        confirmation is a trial of its own, never the oldest waiting one."""
        self._hear_compiled_elsewhere()
        if self.storage is not None:
            trial = running_trial(self.study, self.storage, params, {ATTR_CONFIRM: label})
        else:
            if any(ATTR_CONFIRM not in t.user_attrs for t in
                   self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
                raise RuntimeError("a confirmation needs the study's storage while trials are "
                                   "queued: pass storage= to SearchPolicy.")
            self.study.enqueue_trial(dict(params), user_attrs={ATTR_CONFIRM: label})
            trial = self.study.ask()
        sampled = self.space.sample(trial)
        return self._running(trial, sampled,
                             engine_config(self.cfg, self.space.to_flags(sampled)))

    def _unfinished_with(self, key: str, asking: int) -> int | None:
        """The trial that already holds this config and has not finished: in flight, asked and
        waiting for GPUs, or queued in the storage (a retry, a seed, the defaults). A config is
        launched at most once per study, whatever stage its first trial is at."""
        for item in [*self.running, *(held for held, _ in self.deferred)]:
            if config_key(item.params) == key:
                return item.trial.number
        for waiting in self.waiting:
            if config_key(waiting.params) == key:
                return waiting.trial.number
        for queued in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            fixed = queued.system_attrs.get("fixed_params")
            if queued.number != asking and fixed and config_key(fixed) == key and \
                    ATTR_CONFIRM not in queued.user_attrs:
                return queued.number
        return None

    def on_step(self, running: Running, step: StepMetrics) -> bool:
        """Judge one load level of a running trial; True stops it there (pruned)."""
        running.steps.append(step)
        if len(running.steps) == 1:
            self.caches.started(running.trial.number, running.compile_key)
        stop = self._should_prune(running, step)
        if stop:
            running.pruned_at = step.step
        return stop

    def _should_prune(self, item: Running, step: StepMetrics) -> bool:
        if self.cfg.is_multi_objective or item.is_baseline or \
                ATTR_CONFIRM in item.trial.user_attrs:
            return False  # Optuna prunes single-objective only; these always complete
        values = objective_values(self.cfg.objectives, item.steps, item.config.num_gpus)
        if values is None:
            return False
        item.trial.report(values[0], step.step)
        if step.step >= len(self.workload.levels) - 1 or self.workload.capacity is not None:
            # The last level: stopping now saves nothing. A capacity search's probes are at
            # loads of its own, not comparable between trials.
            return False
        m = step.metrics
        if m.request_goodput is not None and m.request_throughput > 0 and \
                m.request_goodput >= 0.95 * m.request_throughput:
            # Every request met the SLO: this load is below the trial's capacity, where configs
            # differ by latency, not by what they can serve (two replicas look like one at a
            # light load). Judge it where it saturates.
            return False
        # The pruner reads the verdict the trial stores (BottleneckPruner): classify first.
        verdict = self.verdict(item.steps, item.config)
        item.trial.set_user_attr(bottleneck.ATTR_VERDICT, verdict.as_user_attr(
            tensor_parallel_size=item.config.tensor_parallel_size,
            objective_value=values[0], step=step.step))
        if not item.trial.should_prune():
            return False
        frozen = next(t for t in self.study.get_trials(deepcopy=False,
                                                       states=(TrialState.RUNNING,))
                      if t.number == item.trial.number)
        explain = getattr(self.study.pruner, "explain", None)
        item.prune_reason = (explain(self.study, frozen) if explain else None) or \
            f"{self.cfg.objectives[0]} {values[0]:.3g} below the median of earlier trials"
        logger.info("trial %d pruned at step %d: %s params=%s", item.trial.number, step.step,
                    item.prune_reason, item.params)
        return True

    def verdict(self, steps: Sequence[StepMetrics], config: EngineConfig,
                result: RunResult | None = None) -> bottleneck.Verdict:
        """Classify a trial from what it has measured so far (or its whole result)."""
        # The TP=1 reference at the level the verdict describes (its operating point).
        described = described_step(self.cfg.objectives[0],
                                   result.steps if result is not None else steps)
        tp1 = self._tp1_tpot_ms(described.step) if described is not None and \
            config.tensor_parallel_size > 1 else None
        evidence = bottleneck.evidence_from(result if result is not None else steps, config,
                                            self.hardware, self.model, tp1_tpot_ms=tp1,
                                            objective=self.cfg.objectives[0])
        return bottleneck.classify(evidence)

    def _tp1_tpot_ms(self, step_index: int) -> float | None:
        """The best median TPOT at this load level among finished TP=1 trials: what a TP>1
        trial must beat for its split to be worth the communication."""
        best: float | None = None
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            record = record_of(t)
            if record is None or int(record.flags.get("tensor_parallel_size") or 1) != 1:
                continue
            for s in record.steps:
                tpot = (s.get("metrics") or {}).get("median_tpot_ms")
                if s.get("step") == step_index and tpot and (best is None or tpot < best):
                    best = float(tpot)
        return best

    # -- results --------------------------------------------------------------------------------

    def on_result(self, running: Running, result: RunResult) -> None:
        """Record a finished trial and tell Optuna, or hold it until the defaults are measured
        (trials run beside the defaults and may end first: its conclusion compares it with
        them)."""
        if running in self.running:
            self.running.remove(running)
        self.caches.ended(running.trial.number, running.compile_key,
                          result.engine.compile_cache or ("cold" if result.steps else None))
        if not running.is_baseline and ATTR_CONFIRM not in running.trial.user_attrs and \
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
        from optimizer.conclusions import baseline_trial

        if baseline_trial(self.study) is not None:
            return False
        return any(i.is_baseline for i in self.running) or \
            any(ATTR_BASELINE in w.trial.user_attrs for w in self.waiting) or \
            any(ATTR_BASELINE in t.user_attrs
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
        self.caches.ended(running.trial.number, running.compile_key,
                          "cold" if running.steps else None)
        self._record(running, RunResult(status="failed", steps=tuple(running.steps),
                                        failure=Failure(
            FailureReason.INTERRUPTED, "the daemon was stopped with this trial in flight.")))

    def _record(self, item: Running, result: RunResult) -> None:
        failure = result.failure
        again = failure is not None and self._is_requeued(item, failure)
        if failure is not None and (failure.is_retryable or again):
            # What became of the trial is decided here: its record says so, not its failure's
            # source, which cannot know the retries left.
            result = replace(result, failure=replace(
                failure, message=f"{failure.message.rstrip().rstrip('.')}; "
                                 f"{self._fate(item, again)}."))
        if failure is not None and again:
            # Queued before the trial is told (as `Recovery` does). A stop (`stop --now`, a
            # second Ctrl-C) is nobody's fault: it spends no retry.
            requeue(self.study, item.trial.number, item.params, item.trial.user_attrs,
                    item.retries + (failure.reason != FailureReason.INTERRUPTED))
            logger.info("trial %d re-queued after %s%s", item.trial.number, failure.reason,
                        " (the defaults: every gain is measured against them)"
                        if item.is_baseline and not failure.is_retryable else "")
        record = record_result(self, item, result)
        self.remember(item.trial.number, record)
        self.finished_here += 1
        self.log.told(Told("measured", item.trial.number, record, run_id=item.run_id,
                           result=result, running=item))

    def _is_requeued(self, item: Running, failure: Failure) -> bool:
        """Whether a failed trial goes back in the queue: always after a stop; after a failure
        lost to infrastructure (or a one-off of the defaults) while it has retries left; never
        a confirmation run (its round is measured again on the next start)."""
        is_retried = item.retries < self.cfg.spec.retries and (
            failure.is_retryable or (item.is_baseline and failure.reason in ONE_OFF_FAILURES))
        return (failure.reason == FailureReason.INTERRUPTED or is_retried) and \
            requeueable(item.trial.user_attrs)

    def _fate(self, item: Running, again: bool) -> str:
        if again:
            return "re-queued"
        if not requeueable(item.trial.user_attrs):
            return "its confirmation round is measured again on the next start"
        return f"not re-queued (retried {item.retries} times already)"

    def release_waiting(self) -> None:
        """Trials asked but never launched (they waited for GPUs) must not stay RUNNING: fail
        them without a run and queue their params again for the resume."""
        waiting, self.waiting = self.waiting, []
        for item in waiting:
            failure = Failure(FailureReason.INTERRUPTED,
                              "the daemon stopped before this trial was launched; re-queued.")
            attrs = dict(item.trial.user_attrs)
            item.trial.set_user_attr(ATTR_NOT_LAUNCHED, True)  # counted apart, not failed
            tell_without_run(self, item.trial, item.params, failure)
            requeue(self.study, item.trial.number, item.params, attrs,
                    int(attrs.get(ATTR_RETRIES, 0)))

    @property
    def has_slo(self) -> bool:
        slo = self.workload.slo
        return any(v is not None for v in (slo.ttft_p99_ms, slo.tpot_p99_ms, slo.e2el_ms))


# A lost baseline is worth another try when it failed for one of these: they can be one-off
# (a crash, a hang, a slow start on a busy host), and every gain is measured against the
# defaults. Config failures repeat; other trials are not retried for these, as a crash there
# is as likely the config's own doing and a retry costs a whole trial.
ONE_OFF_FAILURES = frozenset({
    FailureReason.CRASH_MID_RUN, FailureReason.HANG, FailureReason.STARTUP_TIMEOUT,
    FailureReason.STARTUP_CRASH})
