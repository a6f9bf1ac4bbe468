"""What to try next (Ray Tune's `Searcher`): the study's queue (the defaults, warm seeds, hardware
templates, seeds), Optuna's sampler behind it, and the refusals before a launch: a config held
already (its outcome is reused: `tell_duplicate`) or one that cannot run here (told as a config
failure: `tell_without_run`). Knows nothing of GPUs being free, of running trials' steps or of
retries: the controller (`optimizer.search.controller`) hands it what it must know.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer import bottleneck
from optimizer.config import StudyConfig
from optimizer.results.trial_record import (
    ATTR_BASELINE,
    ATTR_CONFIRM,
    ATTR_SEED_SOURCE,
    ATTR_SEEDED,
    TrialRecord,
    confirm_label,
    is_baseline,
    record_of,
)
from optimizer.search.tell import tell_duplicate, tell_without_run
from optimizer.search.trials import NoLog, Running, TrialLog, Waiting, config_key
from optimizer.storage.study import REPEATED_FAILURES, engine_config, running_trial
from runners.base import EngineConfig, Failure, FailureReason
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.workload import Workload
from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

# The informed start (`sampler: screen`): configs of the space the analytic model ranks, and
# how many trials it picks before the model-based sampler takes over.
SCREEN_CANDIDATES = 1500
SCREEN_TRIALS = 5


class Searcher:
    """One study's source of configs. Not thread-safe: one caller drives it."""

    def __init__(self, cfg: StudyConfig, space: ResolvedSpace, study: optuna.Study, *,
                 workload: Workload, hardware: HardwareProfile | None = None,
                 model: ModelInfo | None = None, log: TrialLog | None = None,
                 storage: optuna.storages.BaseStorage | None = None) -> None:
        self.cfg = cfg
        self.space = space
        self.study = study
        self.workload = workload
        self.hardware = hardware  # for the memory check and the screen's analytic model
        self.model = model
        self.log: TrialLog = log or NoLog()
        # The study's storage, for a confirmation trial that must not take a queued one.
        self.storage = storage
        self._measured: dict[str, int] = {}  # config key -> the finished trial that holds it
        self.duplicates_in_a_row = 0
        self.is_exhausted = False

    @property
    def has_slo(self) -> bool:
        return self.workload.slo.is_set

    # -- the queue ----------------------------------------------------------------------------

    def prepare(self, trials: Sequence[FrozenTrial],
                seed_trials: Sequence[Mapping[str, Any]] = (),
                warm_seeds: Sequence[tuple[Mapping[str, Any], str]] = (),
                template_trials: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]] = (),
                ) -> None:
        """Learn the configs the study holds (`trials`) and queue the defaults (unless there),
        then the warm seeds (an earlier study's best, with its `seed_source`:
        `warm_start:<study>`), then the hardware templates (config, tags), then the seeds. On
        every start, not just the first: a daemon killed between these writes left some seeds
        out, and a seed added to the study file since runs on resume. A config the study holds
        already (queued or finished) is not queued again."""
        for frozen in trials:
            self.remember(frozen.number, record_of(frozen))
        if self.cfg.spec.sampler.name == "screen":
            self._start_screen()
        if not any(is_baseline(t) for t in trials):
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
        each measurement, then the study's TPE (optimizer/search/samplers.py `ScreenSampler`)."""
        from optimizer.search.samplers import ScreenSampler
        from optimizer.search.screen import load_of, sample_candidates, screen

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
                record.state == "failed" and record.failure_reason in REPEATED_FAILURES):
            self._measured.setdefault(config_key(record.params), number)

    # -- asking -------------------------------------------------------------------------------

    def ask(self, unfinished: Iterable[Running | Waiting],
            placement_problem: Callable[[EngineConfig], str | None]) -> Waiting | None:
        """The next config to wait for its GPUs, or None when the one asked was refused: a
        config the study holds (measured, or `unfinished`: in flight, held for the defaults,
        waiting for GPUs, queued) is told as a repeat; one the space's rules, the cluster
        (`placement_problem`) or the card's memory refuse is told as a config failure."""
        trial = self.study.ask()
        params = self.space.sample(trial)
        key = config_key(params)
        earlier = self._measured.get(key)
        if earlier is None:
            earlier = self._unfinished_with(key, trial.number, unfinished)
        if earlier is not None and confirm_label(trial) is None:
            tell_duplicate(self, trial, params, earlier)
            return None
        self.duplicates_in_a_row = 0
        config = engine_config(self.cfg, self.space.to_flags(params))
        problems = list(self.space.check(params))
        placement = placement_problem(config)
        if placement is not None:
            problems.append(placement)
        memory = bottleneck.memory_problem(config, self.hardware, self.model)
        if memory is not None:
            problems.append(memory)
        if problems:
            failure = Failure(FailureReason.INFEASIBLE, "; ".join(problems))
            tell_without_run(self, trial, params, failure)
            return None
        return Waiting(trial, params, config)

    def ask_confirm(self, params: Mapping[str, Any], label: str) -> Waiting:
        """A final re-measurement of `params` ("defaults" or "best"), to launch at once. Seeds
        or retries still queued (beyond the budget) stay queued for a later resume: the
        confirmation is a trial of its own, never the oldest waiting one."""
        if self.storage is not None:
            trial = running_trial(self.study, self.storage, params, {ATTR_CONFIRM: label})
        else:
            if any(confirm_label(t) is None for t in
                   self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))):
                raise RuntimeError("a confirmation needs the study's storage while trials are "
                                   "queued: pass storage= to SearchController.")
            self.study.enqueue_trial(dict(params), user_attrs={ATTR_CONFIRM: label})
            trial = self.study.ask()
        sampled = self.space.sample(trial)
        return Waiting(trial, sampled, engine_config(self.cfg, self.space.to_flags(sampled)))

    def _unfinished_with(self, key: str, asking: int,
                         unfinished: Iterable[Running | Waiting]) -> int | None:
        """The trial that already holds this config and has not finished: in flight, asked and
        waiting for GPUs, or queued in the storage (a retry, a seed, the defaults). A config is
        launched at most once per study, whatever stage its first trial is at."""
        for item in unfinished:
            if config_key(item.params) == key:
                return item.trial.number
        for queued in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            fixed = queued.system_attrs.get("fixed_params")
            if queued.number != asking and fixed and config_key(fixed) == key and \
                    confirm_label(queued) is None:
                return queued.number
        return None
