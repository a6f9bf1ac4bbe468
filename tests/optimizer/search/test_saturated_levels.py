"""A fixed level the load generator stopped as saturated (its waiting queue kept growing; the
client cancelled the level's requests: runners/levels.py) is a measured miss at that load, not
failed requests: the trial completes with goodput 0 and the study says that no trial met the
SLO, where a level whose requests failed still fails the trial (held-out check s17, #3b)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from optimizer.results.recommendation import is_slo_unmet, no_slo_met
from optimizer.results.trial_record import record_of
from optimizer.search.controller import SearchController
from runners.base import RunResult, StepMetrics
from runners.load_level import LoadLevel
from tests.builders import benchmark_metrics
from tests.optimizer.search.conftest import Setup

RATE = LoadLevel(request_rate_rps=12.0)


def _stopped(index: int, *, is_saturated: bool) -> StepMetrics:
    """A level at 12 req/s none of whose 47 requests completed (the s17 study's step)."""
    return StepMetrics(step=index, level=RATE,
                       metrics=benchmark_metrics(None, completed=0, failed=47, duration_s=4.0),
                       server_metrics={"is_saturated": 1.0 if is_saturated else 0.0})


def _defaults_ran(make_setup: Callable[..., Setup], *, is_saturated: bool,
                  **study: object) -> SearchController:
    cfg, space, optuna_study = make_setup(None, workload={
        "input_len": 3000, "output_len": 64, "levels": [{"request_rate": 12}],
        "num_requests": 60, "warmup_requests": 2}, **study)
    controller = SearchController(cfg, space, optuna_study, workload=cfg.workload,
                                  total_gpus=1, clock=lambda: 0.0)
    controller.prepare()
    defaults = controller.next_launch(lambda n: not controller.running)
    assert defaults is not None
    step = _stopped(0, is_saturated=is_saturated)
    assert not controller.on_step(defaults, step)
    controller.on_result(defaults, RunResult(status="complete", steps=(step,)))
    return controller


def test_a_level_stopped_as_saturated_is_a_miss_at_that_load_not_errors(
        make_setup: Callable[..., Setup]) -> None:
    controller = _defaults_ran(make_setup, is_saturated=True)
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "complete", record
    assert record.failure_reason is None and trial.values == [0.0], \
        "goodput 0 at that load: nothing was served within the SLO"
    assert "Saturated at rate=12: the queue kept growing" in record.conclusion, \
        record.conclusion
    assert "not failed requests" in record.conclusion
    assert is_slo_unmet(controller.study)
    line = no_slo_met(controller.study, controller.cfg.spec.slo.model_dump())
    assert line is not None and line.startswith(
        "no trial met the SLO (no level missed on a p99 bound: the engine saturated (its queue "
        "kept growing) at 12 req/s (trial 0), the lightest such load): nothing to recommend") \
        and \
        line.endswith("relax the SLO or lighten the load (fewer concurrent requests, a lower "
                      "rate, shorter requests)"), line


def test_a_level_whose_requests_failed_still_fails_the_trial(
        make_setup: Callable[..., Setup]) -> None:
    controller = _defaults_ran(make_setup, is_saturated=False)
    record = record_of(controller.study.get_trials(deepcopy=False)[0])
    assert record is not None and record.state == "failed"
    assert record.failure_reason == "too_many_errors"
    assert record.failure_message == "no load level completed a request."


def test_a_latency_objective_over_saturated_levels_names_the_saturation(
        make_setup: Callable[..., Setup]) -> None:
    controller = _defaults_ran(make_setup, is_saturated=True, objective="tpot")
    record = record_of(controller.study.get_trials(deepcopy=False)[0])
    assert record is not None and record.state == "failed", "a latency has no value there"
    assert record.failure_message is not None and \
        "saturated at rate=12: the queue kept growing" in record.failure_message and \
        "not failed requests" in record.failure_message, record.failure_message


def test_a_saturated_level_beside_a_measured_one_is_named_in_the_conclusion(
        make_setup: Callable[..., Setup]) -> None:
    cfg, space, study = make_setup(None, workload={
        "input_len": 3000, "output_len": 64,
        "levels": [{"request_rate": 2}, {"request_rate": 12}],
        "num_requests": 60, "warmup_requests": 2})
    controller = SearchController(cfg, space, study, workload=cfg.workload, total_gpus=1,
                                  clock=lambda: 0.0)
    controller.prepare()
    defaults = controller.next_launch(lambda n: not controller.running)
    assert defaults is not None
    served = StepMetrics(step=0, level=LoadLevel(request_rate_rps=2.0), metrics=replace(
        benchmark_metrics(100.0, completed=60, request_throughput=2.0, request_goodput=2.0)))
    steps = (served, _stopped(1, is_saturated=True))
    for step in steps:
        controller.on_step(defaults, step)
    controller.on_result(defaults, RunResult(status="complete", steps=steps))
    (trial,) = study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "complete" and trial.values == [2.0]
    assert "Saturated at rate=12: the queue kept growing" in record.conclusion
