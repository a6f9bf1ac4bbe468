"""The scheduler alone (when to stop a trial): which levels it judges, and a prune with its
reason, against earlier trials' values in a real in-memory Optuna study."""

from __future__ import annotations

from collections.abc import Callable

import optuna
import pytest

from optimizer.search.scheduler import PruningScheduler
from optimizer.search.trials import Running
from optimizer.storage.study import engine_config
from tests.optimizer.search.conftest import Setup, step

# Earlier trials enough for the margin pruner to judge (its n_startup_trials).
_PRUNER = {"name": "median", "n_startup_trials": 2, "min_relative_gap": 0.1}


def _scheduler(make_setup: Callable[..., Setup]) -> PruningScheduler:
    cfg, _, study = make_setup(pruner=_PRUNER)
    for value in (10.0, 12.0):  # two earlier trials, at the first level
        trial = study.ask()
        trial.report(value, 0)
        study.tell(trial, value)
    return PruningScheduler(cfg, study, workload=cfg.workload)


def _running(scheduler: PruningScheduler, *, is_baseline: bool = False) -> Running:
    trial = scheduler.study.ask()
    return Running(trial, {"max_num_seqs": 64}, engine_config(scheduler.cfg, {}),
                   is_baseline=is_baseline, retries=0)


def _judge(scheduler: PruningScheduler, item: Running, index: int, goodput: float,
           throughput: float) -> bool:
    level = scheduler.workload.levels[index]
    item.steps.append(step(index, level, goodput, throughput))
    return scheduler.should_prune(item, item.steps[-1])


def test_a_trial_far_below_earlier_ones_where_it_saturates_is_pruned_with_a_reason(
        make_setup: Callable[..., Setup]) -> None:
    scheduler = _scheduler(make_setup)
    item = _running(scheduler)
    assert _judge(scheduler, item, 0, goodput=1.0, throughput=4.0), \
        "1 req/s per GPU where earlier trials served 10-12: pruned"
    assert item.prune_reason, "the log line and the record say why"
    frozen = scheduler.study.get_trials(deepcopy=False)[item.trial.number]
    assert frozen.intermediate_values == {0: pytest.approx(1.0)}, \
        "the value is reported to Optuna at the level's step"


def test_a_level_where_every_request_met_the_slo_is_not_judged(
        make_setup: Callable[..., Setup]) -> None:
    scheduler = _scheduler(make_setup)
    item = _running(scheduler)
    assert not _judge(scheduler, item, 0, goodput=1.0, throughput=1.0), \
        "below the trial's capacity configs differ by latency, not by what they serve"


def test_the_last_level_and_the_defaults_are_never_pruned(
        make_setup: Callable[..., Setup]) -> None:
    scheduler = _scheduler(make_setup)
    defaults = _running(scheduler, is_baseline=True)
    assert not _judge(scheduler, defaults, 0, goodput=1.0, throughput=4.0), \
        "every gain is measured against the defaults: they always complete"
    last = len(scheduler.workload.levels) - 1
    item = _running(scheduler)
    item.steps.append(step(0, scheduler.workload.levels[0], 20.0, 40.0))
    assert not _judge(scheduler, item, last, goodput=1.0, throughput=4.0), \
        "stopping at the last level saves nothing"


def test_a_multi_objective_study_is_never_pruned(make_setup: Callable[..., Setup]) -> None:
    cfg, _, _ = make_setup(objective=["goodput", "tpot"])
    study = optuna.create_study(directions=cfg.directions)
    scheduler = PruningScheduler(cfg, study, workload=cfg.workload)
    item = _running(scheduler)
    assert not _judge(scheduler, item, 0, goodput=0.1, throughput=4.0), \
        "Optuna prunes single-objective studies only"
