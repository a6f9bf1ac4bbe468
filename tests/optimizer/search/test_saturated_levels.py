"""A fixed level the load generator stopped as saturated (its waiting queue kept growing; the
client cancelled the level's requests: runners/levels.py) is a measured miss at that load, not
failed requests: the trial completes with goodput 0 and the study says that no trial met the
SLO, where a level whose requests failed still fails the trial (held-out check s17, #3b). A
latency objective has no value there (a latency is unbounded at a load the engine cannot keep
up with): where it would be read at or over a saturated level (a latency first is the worst
level's, so any), the trial fails as `saturated`, never `too_many_errors`, naming what it
served, is not retried, and the sampler is told it as the miss it is (the worst value, the SLO
violated); a capacity search that met the SLO at no load fails a latency as `slo_unmet`."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import replace

import pytest
from optuna.trial import TrialState
from rich.console import Console

from optimizer.cli.results import status_rows
from optimizer.cli.table import trial_table
from optimizer.regress.measure import no_figure_failure
from optimizer.report import build_report
from optimizer.report.render import render_markdown
from optimizer.results.recommendation import is_slo_unmet, no_baseline_reason, no_slo_met
from optimizer.results.trial_record import ATTR_DUPLICATE_OF, record_of
from optimizer.search.controller import SearchController
from optimizer.search.notes import unbounded_latency_levels
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


def _served(index: int, *, tpot_p99_ms: float = 35.0) -> StepMetrics:
    """A level at 2 req/s that served its 60 requests (goodput 2 req/s)."""
    return StepMetrics(step=index, level=LoadLevel(request_rate_rps=2.0),
                       metrics=benchmark_metrics(tpot_p99_ms, completed=60,
                                                 request_throughput=2.0, request_goodput=2.0))


def _cut(index: int, *, completed: int, p99_ms: float | None = None,
         goodput: float = 0.0) -> StepMetrics:
    """The 12 req/s level stopped as saturated after `completed` of its 47 requests finished
    (their p99s `p99_ms`: only those that finished before the stop)."""
    return StepMetrics(step=index, level=RATE, metrics=benchmark_metrics(
        p99_ms, completed=completed, failed=47 - completed, duration_s=4.0,
        request_goodput=goodput), server_metrics={"is_saturated": 1.0})


def _ran(make_setup: Callable[..., Setup], steps: tuple[StepMetrics, ...], *,
         choices: dict[str, list[object]] | None = None, **study: object) -> SearchController:
    """The defaults run over `steps` (their levels the study's) and told."""
    cfg, space, optuna_study = make_setup(choices, workload={
        "input_len": 3000, "output_len": 64,
        "levels": [{"request_rate": s.level.request_rate_rps} for s in steps],
        "num_requests": 60, "warmup_requests": 2}, **study)
    controller = SearchController(cfg, space, optuna_study, workload=cfg.workload,
                                  total_gpus=1, clock=lambda: 0.0)
    controller.prepare()
    defaults = controller.next_launch(lambda n: not controller.running)
    assert defaults is not None
    for step in steps:
        assert not controller.on_step(defaults, step)
    controller.on_result(defaults, RunResult(status="complete", steps=steps))
    return controller


def _defaults_ran(make_setup: Callable[..., Setup], *, is_saturated: bool,
                  choices: dict[str, list[object]] | None = None,
                  **study: object) -> SearchController:
    return _ran(make_setup, (_stopped(0, is_saturated=is_saturated),), choices=choices, **study)


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


SATURATED_AT_12 = ("saturated at rate=12: the queue kept growing, so the level was stopped and "
                   "its unfinished requests cancelled (a miss at that load, not failed "
                   "requests); ")
ADVICE = (": lighten the load (a lower request rate in workload.levels, shorter requests) or "
          "let workload.capacity find the heaviest load it serves within the SLO.")


@pytest.mark.parametrize(("completed", "cut_p99_ms", "unbounded"), [
    (0, None, "(unbounded at that load)"),
    # The cut level's p99 over the requests that finished before the stop: below the served
    # level's (the worst level would be the lighter one) or above it (a figure at a load the
    # engine could not serve).
    (20, 30.0, "(unbounded at that load: the p99 of the requests that finished before the "
               "stop reads it low)"),
    (20, 90.0, "(unbounded at that load: the p99 of the requests that finished before the "
               "stop reads it low)"),
])
def test_a_latency_over_a_level_that_saturated_fails_as_saturated_naming_what_it_served(
        make_setup: Callable[..., Setup], completed: int, cut_p99_ms: float | None,
        unbounded: str) -> None:
    controller = _ran(make_setup, (_served(0), _cut(1, completed=completed, p99_ms=cut_p99_ms)),
                      objective="tpot")
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "failed" and \
        record.failure_reason == "saturated", \
        "the worst level's latency is unbounded: no lighter level's p99 stands for it"
    assert record.failure_message == (
        f"{SATURATED_AT_12}it served only rate=2 at 35.0 ms TPOT p99, so the trial has no tpot "
        f"value {unbounded}{ADVICE}"), record.failure_message
    assert trial.state == TrialState.COMPLETE and trial.values is not None and \
        trial.values[0] >= 1e9 and trial.constraints == {"slo": 1.0}, \
        (trial.values, trial.constraints)
    assert not controller.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    # No operating point: no p99 of the trial is stated (the status table, the report row).
    assert "p99_tpot_ms" not in record.metrics and "objective.tpot" not in record.metrics, \
        record.metrics
    (row,) = build_report(controller.study, controller.cfg, with_importances=False).rows
    assert row.value is None and row.p99_tpot_ms is None, row


def test_a_goodput_over_a_level_that_saturated_after_serving_some_still_completes(
        make_setup: Callable[..., Setup]) -> None:
    controller = _ran(make_setup, (_served(0), _cut(1, completed=20, p99_ms=30.0,
                                                    goodput=1.0)))
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "complete" and trial.values == [2.0], \
        "a rate keeps its best level; the saturated one is a miss at its load"
    assert "Saturated at rate=12: the queue kept growing" in record.conclusion


def test_a_saturated_levels_goodput_is_never_the_trials_value(
        make_setup: Callable[..., Setup]) -> None:
    """A level stopped as saturated is a miss at its load: the goodput it completed over its
    cut window (the requests that finished while its queue was still short) is no figure of
    it, even where it reads higher than a level served steadily (5 req/s over a cut window
    beside 2 served would have been the trial's value, at rate=12); where every level
    saturated the trial served nothing steadily: goodput 0, complete, a miss."""
    controller = _ran(make_setup, (_served(0), _cut(1, completed=20, goodput=5.0)))
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "complete" and trial.values == [2.0], \
        (trial.values, record.conclusion)
    controller = _ran(make_setup, (_cut(0, completed=20, goodput=5.0),))
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "complete" and trial.values == [0.0], \
        (trial.values, record.conclusion)


def test_a_latency_after_a_rate_is_unbounded_only_where_the_rate_reads_a_saturated_level(
        ) -> None:
    served = _served(0)
    above, below = _cut(1, completed=20, goodput=5.0), _cut(1, completed=20, goodput=1.0)
    assert unbounded_latency_levels(["goodput", "tpot"], (served, above)) == [], \
        "a saturated level is never goodput's operating point, whatever it completed: the " \
        "TPOT is read at the level it served"
    assert unbounded_latency_levels(["goodput", "tpot"], (above,)) == [above], \
        "no level served: the TPOT would be read at a saturated one"
    assert unbounded_latency_levels(["goodput", "tpot"], (served, below)) == []
    assert unbounded_latency_levels(["goodput", "throughput"], (served, above)) == [], \
        "no latency: a rate at a saturated level is a miss there, as before"
    assert unbounded_latency_levels(["ttft", "goodput"], (served, below)) == [below], \
        "a latency first is the worst level's"
    assert unbounded_latency_levels(["tpot"], (served,)) == []


def test_a_capacity_search_that_met_the_slo_at_no_load_fails_a_latency_as_slo_unmet(
        make_setup: Callable[..., Setup]) -> None:
    probes = tuple(StepMetrics(
        step=i, level=LoadLevel(request_rate_rps=rate), meets_slo=False,
        metrics=benchmark_metrics(p99, completed=40, request_throughput=rate),
        miss_reason=f"TPOT p99 {p99:g} ms against 40 ms")
        for i, (rate, p99) in enumerate(((8.0, 90.0), (4.0, 60.0))))
    controller = _ran(make_setup, probes, objective="tpot", choices={"max_num_seqs": [256]})
    (trial,) = controller.study.get_trials(deepcopy=False)
    record = record_of(trial)
    assert record is not None and record.state == "failed"
    assert record.failure_reason == FailureReason.SLO_UNMET == "slo_unmet", \
        "a miss of the SLO at every load is no count of errors"
    assert record.failure_message == (
        "no probed load met the SLO; the lightest, 4 req/s, missed it (TPOT p99 60 ms against "
        "40 ms), so the trial has no tpot value (it served no load within the SLO): relax the "
        "SLO, lower workload.capacity.low or shorten the requests."), record.failure_message
    assert trial.values is not None and trial.values[0] >= 1e9 and \
        trial.constraints == {"slo": 1.0}, "taught as goodput's 0 teaches the sampler"
    assert controller.next_launch(lambda n: not controller.running) is None, \
        "the one config missed at every load: not launched again"
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(trial_table(
        status_rows([trial]), controller.cfg.objectives, 200))
    assert "failed (slo_unmet)" in buffer.getvalue(), buffer.getvalue()
    assert tracking_payload(record, None, number=0)["tags"]["failure_reason"] == "slo_unmet"
    report = build_report(controller.study, controller.cfg, with_importances=False)
    assert report.failures == {"slo_unmet": 1}, report.failures


def test_no_baseline_reason_says_a_reason_its_message_starts_with_once(
        make_setup: Callable[..., Setup]) -> None:
    saturated = _defaults_ran(make_setup, is_saturated=True, objective="tpot")
    reason = no_baseline_reason(saturated.study)
    assert reason is not None and reason.startswith(SATURATED_AT_12) and \
        reason.endswith("within the SLO") and not reason.startswith("saturated: "), reason
    failed = _defaults_ran(make_setup, is_saturated=False)
    assert no_baseline_reason(failed.study) == \
        "too_many_errors: no load level completed a request.", "a message without it: both"
