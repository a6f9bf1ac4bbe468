"""A gain compares two trials at one load: a fixed level whose load was not applied moves a
trial's operating point to a lighter level (the quickstart's trial 11, session 17), and a ratio
across two loads is no gain; `export --max-tpot-ms` judges TPOT and the objective at one level;
a concurrency-capacity ratio is named as one; the export's gain says "per GPU"."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import optuna
import pytest

from optimizer.config import parse_study
from optimizer.export import render, select_trial
from optimizer.export.choice import tpot_note
from optimizer.results import gains
from optimizer.results.at_load import at_loads, at_loads_of_run
from optimizer.results.conclusion import Reference, conclude, reference_of
from optimizer.results.objectives import objective_values
from optimizer.results.trial_record import TrialRecord, step_records, summary_metrics
from runners.base import BenchmarkMetrics, RunResult, StepMetrics
from runners.capacity.bracket import Bracket
from runners.load_level import LoadLevel

QUICKSTART = {"name": "quickstart", "model": {"path": "qwen2.5-7b"},
              "workload": {"input_len": 512, "output_len": 128,
                           "levels": [{"concurrency": 8}, {"concurrency": 32}]},
              "budget": {"trials": 12}, "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 10}}


def _metrics(goodput: float, tpot: float) -> BenchmarkMetrics:
    zero = dict.fromkeys(
        f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
        for m in ("ttft", "tpot", "itl", "e2el")) | {"p99_tpot_ms": tpot}
    return BenchmarkMetrics(completed=64, failed=0, duration_s=1.0, total_input_tokens=1,
                            total_output_tokens=1, request_throughput=goodput,
                            request_goodput=goodput, output_throughput=100 * goodput,
                            total_token_throughput=1.0, **{k: v or 0.0 for k, v in zero.items()})


def _level(i: int, goodput: float, tpot: float, *, applied: bool = True) -> StepMetrics:
    """One fixed level as the runner hands it (concurrency 8, then 32); goodput as measured
    on all the config's GPUs."""
    return StepMetrics(step=i, level=LoadLevel(max_concurrency=(8, 32)[i]),
                       metrics=_metrics(goodput, tpot),
                       server_metrics={} if applied else {"steady.is_load_unapplied": 1.0})


def _record(params: dict[str, Any], steps: list[StepMetrics], *,
            is_baseline: bool = False, objective: str = "goodput") -> tuple[TrialRecord, float]:
    """The record the search writes of a run with these levels, and the value Optuna is told."""
    result = RunResult(status="complete", steps=steps)
    num_gpus = int(params.get("data_parallel_size", 1))
    values = objective_values([objective], steps, num_gpus)
    assert values is not None
    record = TrialRecord(state="complete", params=params, flags=params, conclusion="",
                         values=tuple(values), steps=tuple(step_records(steps)),
                         metrics=summary_metrics(result, [objective], num_gpus),
                         is_baseline=is_baseline)
    return record, values[0]


# The quickstart's figures (session 17): goodput on all GPUs and TPOT p99 at concurrency 8, 32.
DEFAULTS = [_level(0, 11.95, 3.30), _level(1, 32.9, 3.9)]
TRIAL_3 = [_level(0, 16.44, 3.32), _level(1, 42.81, 3.85)]
# 2 replicas; its concurrency 32 held 28.7 of 32 in flight: "load not applied".
TRIAL_11 = [_level(0, 17.86, 3.43), _level(1, 49.76, 3.80, applied=False)]


def _study(study: optuna.Study | None = None,
           defaults: list[StepMetrics] = DEFAULTS) -> optuna.Study:
    """The quickstart's three trials (the defaults, trial 3 as 1, trial 11 as 2), added to
    `study` (else a new one in memory); `defaults`: the defaults' levels."""
    study = study or optuna.create_study(direction="maximize")
    dist = optuna.distributions.IntDistribution(1, 2)
    for params, steps, attrs in (({"data_parallel_size": 1}, defaults, {"baseline": True}),
                                 ({"data_parallel_size": 1, "quantization": "fp8"}, TRIAL_3, {}),
                                 ({"data_parallel_size": 2, "quantization": "fp8"}, TRIAL_11, {})):
        record, value = _record(params, steps, is_baseline="baseline" in attrs)
        study.add_trial(optuna.trial.create_trial(
            params={"data_parallel_size": params["data_parallel_size"]},
            distributions={"data_parallel_size": dist}, value=value,
            user_attrs={"record": record.to_user_attr(), **attrs}))
    return study


def test_a_trial_whose_heavier_level_was_not_applied_is_compared_with_the_defaults_at_its_own_load(
        ) -> None:
    """Trial 11 operates at concurrency 8 (its 32 was not applied), the defaults at 32: its
    8.93 req/s per GPU is 0.75x the defaults' 11.95 at 8, not 0.27x their 32.9 at 32; and
    -46% against the best's 16.4 at 8, not -79% against its 42.8 at 32."""
    study = _study()
    defaults, best = (reference_of(study.trials[n], None, "goodput") for n in (0, 1))
    record, value = _record({"data_parallel_size": 2}, TRIAL_11)
    loads = at_loads_of_run("goodput", TRIAL_11, 2)  # what the search hands `conclude`
    assert loads == at_loads("goodput", record.steps, 2, int(record.metrics["headline_level"]))
    assert value == pytest.approx(8.93) and loads.operating == "concurrency=8"
    told = conclude(params={"data_parallel_size": 2}, state="complete", objective="goodput",
                    value=value, baseline=defaults, best=best, number=11, num_gpus=2,
                    vllm_defaults={"data_parallel_size": 1}, loads=loads)
    assert "= 8.93 req/s per GPU at concurrency=8," in told.text, told.text
    assert "0.75x the vLLM defaults per GPU at concurrency=8, a load both applied (one " \
        "measurement each: no interval); 1.49x as measured" in told.text, told.text
    assert "vs best trial 1 (16.4 req/s per GPU at concurrency=8): -46%, worse" in told.text
    assert "0.27x" not in told.text and "-79%" not in told.text, \
        "no ratio across two loads"
    assert "0.75x (1 run) at concurrency=8" in told.short, told.short


def test_two_operating_points_with_no_common_applied_load_give_no_ratio() -> None:
    mine = at_loads("goodput", step_records([_level(0, 17.86, 3.4),
                                             _level(1, 49.8, 3.8, applied=False)]), 1, 0)
    theirs = at_loads("goodput", step_records([_level(0, 12.0, 3.3, applied=False),
                                               _level(1, 32.9, 3.9)]), 1, 1)
    gain = gains.gain_over(17.86, 32.9, None, None, maximize=True, loads=mine,
                           defaults_loads=theirs)
    assert gain.value is None and gain.not_comparable
    assert gains.format_gain(gain, "the vLLM defaults").startswith(
        "no ratio to the vLLM defaults: not comparable at one load (its operating point is "
        "concurrency=8, theirs concurrency=32")
    assert gains.short_gain(gain) == "n/a (no common load)"
    same = gains.gain_over(3.0, 2.0, None, None, maximize=True, loads=theirs,
                           defaults_loads=theirs)
    assert same.value == pytest.approx(1.5) and same.load is None, \
        "one operating point: the values Optuna holds, as before"


def test_max_tpot_ms_judges_each_trial_at_one_load_for_tpot_and_goodput() -> None:
    """TPOT p99 <= 3.5 ms: trial 1 met it at concurrency 8 with 16.4 req/s/GPU; trial 2 (the
    quickstart's 11) met it there with 8.93. Its headline TPOT (3.43, at 8) against trial 1's
    (3.85, at 32) picked trial 2."""
    study = _study()
    cfg = parse_study(QUICKSTART)
    chosen = select_trial(study, cfg, max_tpot_ms=3.5)
    assert chosen.number == 1, "more goodput per GPU at the same load, within the limit"
    note = tpot_note(study, cfg, 3.5)
    assert "trial 1 at concurrency=8, goodput 16.4 req/s/GPU, TPOT p99 3.32 ms there" in note
    text = render(chosen, cfg, "sh", study=study, note=note)
    assert "trial 1 at concurrency=8" in text
    assert select_trial(study, cfg, max_tpot_ms=3.9).number == 1


def test_the_export_gain_of_a_two_gpu_trial_says_per_gpu_and_as_measured() -> None:
    study = _study()
    cfg = parse_study(QUICKSTART)
    text = render(study.trials[2], cfg, "sh", study=study)
    gain = next(line for line in text.splitlines() if line.startswith("# gain: "))
    assert gain.startswith("# gain: goodput 0.75x the vLLM defaults per GPU at concurrency=8, "
                           "a load both applied (one measurement each: no interval); 1.49x as "
                           "measured, on 2 GPU(s) against 1; not confirmed"), gain


def test_a_concurrency_capacity_ratio_is_named_and_the_goodput_ratio_stands_beside_it(
        ) -> None:
    """The MoE study: defaults [57, 64) concurrent requests at 8.09 req/s, fp8 [83, 96) at
    15.8: "goodput ... more than 1.29x and less than 1.69x" was the concurrency's ratio; the
    goodput's is 1.95x."""
    gain = gains.gain_over(15.8, 8.09, Bracket("concurrency", 83, 96, "unresolved", 6),
                           Bracket("concurrency", 57, 64, "unresolved", 6), maximize=True)
    text = gains.format_gain(gain, "the vLLM defaults")
    assert text == ("capacity in concurrent requests more than 1.29x and less than 1.69x the "
                    "vLLM defaults (capacity brackets; lower ends 1.46x); the objective at the "
                    "two capacities 1.95x the vLLM defaults (one measurement each: no "
                    "interval)"), text
    assert gains.short_gain(gain) == "capacity 1.46x (1.29, 1.69)"
    rate = gains.gain_over(19.0, 9.0, Bracket("request_rate", 19, 20, "resolved", 6),
                           Bracket("request_rate", 9, 10, "resolved", 6), maximize=True)
    assert gains.format_gain(rate, "the vLLM defaults").startswith(
        "more than 1.90x and less than 2.23x the vLLM defaults (capacity brackets"), \
        "on the rate axis capacity and goodput share a unit: the wording stands"


def _pair(defaults: list[StepMetrics], steps: list[StepMetrics],
          params: dict[str, Any]) -> optuna.Study:
    """The defaults (trial 0) and one config of one change (trial 1), with these levels."""
    study = optuna.create_study(direction="maximize")
    dist = optuna.distributions.IntDistribution(1, 2)
    for p, s, is_base in (({"data_parallel_size": 1}, defaults, True), (params, steps, False)):
        record, value = _record(p, s, is_baseline=is_base)
        study.add_trial(optuna.trial.create_trial(
            params={"data_parallel_size": p["data_parallel_size"]},
            distributions={"data_parallel_size": dist}, value=value,
            user_attrs={"record": record.to_user_attr(), **({"baseline": True} if is_base
                                                           else {})}))
    return study


def _moved_best_study() -> optuna.Study:
    """The defaults (best at 32) and a DP-2 trial whose 32 was not applied: its operating
    point is 8, at 35 req/s per GPU against the defaults' 11.95 there (32.9 at 32)."""
    return _pair(DEFAULTS, [_level(0, 70.0, 3.4), _level(1, 80.0, 3.9, applied=False)],
                 {"data_parallel_size": 2})


def test_mlflows_gain_column_is_taken_at_the_load_both_applied() -> None:
    from optimizer.tracking.study_summary import trial_figures
    from optimizer.tracking.view import VIEW_GAIN

    figures = trial_figures(_moved_best_study(), parse_study(QUICKSTART))
    assert figures[1][VIEW_GAIN] == pytest.approx(35.0 / 11.95, rel=0.01), figures


def test_the_reports_gain_is_taken_at_the_load_both_applied() -> None:
    """The report's best operates at concurrency 8 (its 32 not applied), the defaults at 32:
    its gain is the one at 8, per GPU (35 / 11.95) and as measured on its 2 GPUs (70 / 11.95),
    not 35 / 32.9 across two loads."""
    from optimizer.report.build import build_report

    study = _moved_best_study()
    report = build_report(study, parse_study(QUICKSTART), with_importances=False)
    assert report.best is not None and report.best.number == 1
    gain = report.gain_bounds
    assert gain is not None and gain.load == "concurrency=8", gain
    assert gain.value == pytest.approx(35.0 / 11.95)
    whole = report.gain_as_measured
    assert whole is not None and whole.value == pytest.approx(70.0 / 11.95)


def test_the_reports_ratio_as_measured_of_a_latency_at_a_shared_load_is_its_ratio() -> None:
    """A latency is what one request sees, on any number of GPUs: trial 11's TPOT on 2 GPUs
    against the defaults' on 1, compared at concurrency 8 (its 32 not applied), is 3.30 / 3.43
    as measured too. The report scaled a ratio at a shared load by the GPUs whatever the
    objective: "1.92x as measured", twice what was measured."""
    from optimizer.report.build import build_report

    study = optuna.create_study(direction="minimize")
    dist = optuna.distributions.IntDistribution(1, 2)
    for params, steps, is_base in (({"data_parallel_size": 1}, DEFAULTS, True),
                                   ({"data_parallel_size": 2}, TRIAL_11, False)):
        record, value = _record(params, steps, is_baseline=is_base, objective="tpot")
        study.add_trial(optuna.trial.create_trial(
            params={"data_parallel_size": params["data_parallel_size"]},
            distributions={"data_parallel_size": dist}, value=value,
            user_attrs={"record": record.to_user_attr(), **({"baseline": True} if is_base
                                                           else {})}))
    report = build_report(study, parse_study({**QUICKSTART, "objective": "tpot"}),
                          with_importances=False)
    gain = report.gain_bounds
    assert gain is not None and gain.load == "concurrency=8", gain
    assert gain.value == pytest.approx(3.30 / 3.43)
    whole = report.gain_as_measured
    assert whole is not None and whole.value == pytest.approx(3.30 / 3.43), whole


def test_operating_points_at_two_loads_with_every_level_applied_compare_best_to_best() -> None:
    """The defaults miss at 32 (their best is 8), the config's best is 32, every level applied:
    each operating point is its config's best over the same levels, and the gain is best to
    best (as two capacities are), not the ratio at the config's own load."""
    mine = at_loads("goodput", step_records([_level(0, 10.0, 3.0), _level(1, 40.0, 3.5)]), 1, 1)
    theirs = at_loads("goodput", step_records([_level(0, 12.0, 3.0), _level(1, 5.0, 3.5)]), 1, 0)
    assert not mine.is_moved and not theirs.is_moved
    gain = gains.gain_over(40.0, 12.0, None, None, maximize=True, loads=mine,
                           defaults_loads=theirs)
    assert gain.load is None and gain.value == pytest.approx(40.0 / 12.0)


def test_a_shared_load_where_a_figure_is_0_gives_way_to_one_with_a_ratio() -> None:
    """Trial operating at 32 (its 8 applied), the defaults at 8 (their 32 not applied; at 32 a
    0 would give no ratio): compared at 8, the one load both applied with figures."""
    mine = at_loads("goodput", step_records([_level(0, 10.0, 3.0), _level(1, 40.0, 3.5)]), 1, 1)
    theirs = at_loads("goodput", step_records([_level(0, 12.0, 3.0),
                                               _level(1, 0.5, 3.5, applied=False)]), 1, 0)
    assert theirs.is_moved and theirs.unapplied == {"concurrency=32"}
    gain = gains.same_load(mine, theirs, maximize=True)
    assert gain.load == "concurrency=8" and gain.value == pytest.approx(10.0 / 12.0)


def test_versus_a_best_at_another_load_the_verdict_is_of_that_load_and_new_best_is_optunas(
        ) -> None:
    """Trial 11 (8.93 per GPU at 8, its 32 not applied) against a best of 16.4 at 8: worse
    there, and not the new best; against a best that measured 0 at the shared load: no ratio,
    never "+0%, within noise"."""
    study = _study()
    best = reference_of(study.trials[1], None, "goodput")
    assert best is not None
    loads = at_loads_of_run("goodput", TRIAL_11, 2)
    told = conclude(params={"data_parallel_size": 2}, state="complete", objective="goodput",
                    value=8.93, best=best, number=11, num_gpus=2,
                    vllm_defaults={"data_parallel_size": 1}, loads=loads)
    assert "at concurrency=8): -46%, worse there" in told.text, told.text
    assert "new best" not in told.text


def test_two_trials_with_no_level_applied_give_no_ratio() -> None:
    """Every level of both unapplied: both operating points unknown (None) read as equal, and
    their values were compared as one load's (review s18)."""
    steps = step_records([_level(0, 11.0, 3.3, applied=False), _level(1, 30.0, 3.9,
                                                                      applied=False)])
    loads = at_loads("goodput", steps, 1, 1)
    assert loads.operating is None and loads.is_moved
    gain = gains.gain_over(40.0, 30.0, None, None, maximize=True, loads=loads,
                           defaults_loads=loads)
    assert gain.value is None and gain.not_comparable == "no level of either applied its load"
    assert "not comparable at one load (no level of either applied its load)" in \
        gains.format_gain(gain, "the vLLM defaults")


def test_versus_a_best_with_no_level_applied_a_trial_with_none_is_not_compared() -> None:
    """A trial and the best, every level of each unapplied: no load to compare at; the two
    operating points (both unknown) were read as one load and their values compared."""
    unapplied = [_level(0, 11.0, 3.3, applied=False), _level(1, 30.0, 3.9, applied=False)]
    loads = at_loads_of_run("goodput", unapplied, 1)
    assert loads.operating is None
    best = Reference(4, {"quantization": "fp8"}, 25.0, loads=loads)
    told = conclude(params={"quantization": "fp8", "data_parallel_size": 1}, state="complete",
                    objective="goodput", value=30.0, best=best, number=7, num_gpus=1,
                    vllm_defaults={}, loads=loads)
    assert "vs best trial 4: not comparable at one load (no level of either applied its " \
        "load)" in told.text, told.text
    assert "new best" not in told.text


def test_a_trial_with_no_figure_at_the_level_says_so_not_that_a_figure_was_0() -> None:
    theirs = at_loads("goodput", step_records(DEFAULTS), 1, 1)
    gain = gains.at_level("concurrency=8", None, theirs, maximize=True)
    assert gain.value is None and gain.not_comparable == "it has no figure at concurrency=8"
    zero = gains.at_level("concurrency=8", 0.0, replace(theirs, levels={
        k: replace(v, value=0.0) for k, v in theirs.levels.items()}), maximize=True)
    assert zero.not_comparable == "at concurrency=8 a figure was 0"
