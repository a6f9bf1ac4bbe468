"""A fixed level the load generator stopped as saturated (its waiting queue kept growing; the
client cancelled the level's requests: runners/levels.py) is a measured miss at that load, not
failed requests: the trial completes with goodput 0 and the study says that no trial met the
SLO, where a level whose requests failed still fails the trial (held-out check s17, #3b). A
latency objective has no value there (a latency is unbounded at a load the engine cannot keep
up with): the trial fails as `saturated`, never `too_many_errors`, is not retried, and the
sampler is told it as the miss it is (the worst value, the SLO violated)."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import replace

from optuna.trial import TrialState
from rich.console import Console

from optimizer.cli.results import status_rows
from optimizer.cli.table import trial_table
from optimizer.regress.measure import no_figure_failure
from optimizer.report import build_report
from optimizer.report.render import render_markdown
from optimizer.results.recommendation import is_slo_unmet, no_slo_met
from optimizer.results.trial_record import ATTR_DUPLICATE_OF, record_of
from optimizer.search.controller import SearchController
from optimizer.tracking.payload import tracking_payload
from runners.base import FailureReason, RunResult, StepMetrics
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
                  choices: dict[str, list[object]] | None = None,
                  **study: object) -> SearchController:
    cfg, space, optuna_study = make_setup(choices, workload={
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


def test_a_latency_objective_over_saturated_levels_fails_as_saturated_not_errors(
        make_setup: Callable[..., Setup]) -> None:
    controller = _defaults_ran(make_setup, is_saturated=True, objective="tpot")
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "failed", "a latency has no value there"
    assert record.failure_reason == FailureReason.SATURATED == "saturated", \
        "a latency at a saturated load is unbounded, not a count of errors"
    assert record.failure_message is not None and record.failure_message.startswith(
        "saturated at rate=12: the queue kept growing") and \
        "not failed requests" in record.failure_message and \
        "lighten the load (a lower request rate in workload.levels" in \
        record.failure_message, record.failure_message
    # The sampler learns the miss, as goodput's 0 teaches it (a FAIL trial TPE ignores): the
    # worst value and the SLO violated; the config ran, so no `runs` constraint.
    assert trial.state == TrialState.COMPLETE and trial.values is not None and \
        trial.values[0] >= 1e9, (trial.state, trial.values)
    assert trial.constraints == {"slo": 1.0}, trial.constraints
    # Not retried: the defaults' one-off failures (a crash, a hang) are, a miss repeats.
    assert not controller.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)), \
        "a saturated trial is no transient failure: never re-queued"


def test_a_saturated_config_is_not_launched_again(make_setup: Callable[..., Setup]) -> None:
    controller = _defaults_ran(make_setup, is_saturated=True, objective="tpot",
                               choices={"max_num_seqs": [256]})
    assert controller.next_launch(lambda n: not controller.running) is None
    repeat = max(controller.study.get_trials(deepcopy=False), key=lambda t: t.number)
    assert repeat.user_attrs.get(ATTR_DUPLICATE_OF) == 0, \
        "the one config saturated at the study's load: a repeat of it, not a new launch"


def test_status_and_mlflow_say_saturated_where_a_latency_objective_saturated(
        make_setup: Callable[..., Setup]) -> None:
    controller = _defaults_ran(make_setup, is_saturated=True, objective="tpot")
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(trial_table(
        status_rows([trial]), controller.cfg.objectives, 200))
    table = buffer.getvalue()
    assert "failed (saturated)" in table and "too_many_errors" not in table, table
    assert record.conclusion.startswith(
        "vLLM defaults: failed (saturated): saturated at rate=12: the queue kept growing"), \
        record.conclusion
    tags = tracking_payload(record, None, number=0)["tags"]
    assert tags["failure_reason"] == "saturated", tags
    # The report: the reason counted and the row without the worst value the sampler was told.
    report = build_report(controller.study, controller.cfg, with_importances=False)
    assert report.failures == {"saturated": 1}, report.failures
    (row,) = report.rows
    assert row.state == "failed" and row.value is None, row
    assert not report.knob_effects, "no measured defaults: no effect is measured against them"
    md = render_markdown(report)
    assert "- saturated: 1" in md and "e+09" not in md and "1,000,000,000" not in md, md


def test_regress_names_a_saturated_run_saturated_and_failed_requests_errors() -> None:
    saturated = no_figure_failure(RunResult(status="complete",
                                            steps=(_stopped(0, is_saturated=True),)))
    assert saturated.reason == FailureReason.SATURATED, saturated
    assert saturated.message.startswith("saturated at rate=12: the queue kept growing") and \
        "lighten the case's load" in saturated.message, saturated.message
    failed = no_figure_failure(RunResult(status="complete",
                                         steps=(_stopped(0, is_saturated=False),)))
    assert failed.reason == FailureReason.TOO_MANY_ERRORS, failed


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


def test_no_knob_effect_is_measured_against_defaults_that_saturated() -> None:
    import optuna
    from optuna.distributions import CategoricalDistribution

    from optimizer.report import knob_effects

    dist = {"quantization": CategoricalDistribution(["none", "fp8"])}
    # Optuna holds the saturated defaults complete with the worst value (to teach the
    # sampler); their record says they failed and measured nothing.
    defaults = optuna.trial.create_trial(
        params={"quantization": "none"}, distributions=dist, value=1e9,
        user_attrs={"baseline": True, "record": {
            "state": "failed", "params": {"quantization": "none"}, "conclusion": "",
            "failure_reason": "saturated", "failure_message": "saturated at rate=12"}})
    fp8 = optuna.trial.create_trial(
        params={"quantization": "fp8"}, distributions=dist, value=20.0,
        user_attrs={"record": {"state": "complete", "params": {"quantization": "fp8"},
                               "conclusion": "", "values": [20.0]}})
    study = optuna.create_study(direction="minimize")
    study.add_trials([defaults, fp8])
    assert knob_effects(study.trials, study.trials[0], "tpot") == (), \
        "the worst value told to the sampler is no measurement of the defaults"
