"""Conclusions and headline metrics of a finished trial."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from optimizer.results.conclusion import Reference, conclude, param_changes
from optimizer.results.objectives import (
    described_step,
    objective_value,
    objective_values,
    operating_step,
)
from optimizer.results.trial_record import summary_metrics
from runners.base import BenchmarkMetrics, EngineInfo, RunResult, StepMetrics
from runners.load_level import LoadLevel


def _metrics(goodput: float, tpot: float, completed: int = 10) -> BenchmarkMetrics:
    zero = dict.fromkeys(
        f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
        for m in ("ttft", "tpot", "itl", "e2el")) | {"p99_tpot_ms": tpot}
    return BenchmarkMetrics(completed=completed, failed=0, duration_s=1.0, total_input_tokens=1,
                            total_output_tokens=1, request_throughput=goodput,
                            request_goodput=goodput, output_throughput=100 * goodput,
                            total_token_throughput=1.0, **{k: v or 0.0 for k, v in zero.items()})


def _step(i: int, goodput: float, tpot: float) -> StepMetrics:
    return StepMetrics(step=i, level=LoadLevel(max_concurrency=8 * (i + 1)),
                       metrics=_metrics(goodput, tpot), server_metrics={"vllm:x": 1.0})


def test_operating_point_is_the_best_level_for_goodput_and_worst_for_latency() -> None:
    steps = [_step(0, 2.0, 5.0), _step(1, 3.0, 9.0), _step(2, 2.5, 12.0)]
    assert operating_step("goodput", steps).step == 1
    assert operating_step("tpot", steps).step == 2


def test_a_fixed_level_whose_load_was_not_applied_is_not_the_trials_operating_point() -> None:
    """Concurrency 16 gave the most goodput, but its client held 9 of 16: its figures are of
    a lighter load than its label, so the trial's are the applied level's; the conclusion's
    note names it and why. With no level applied, the best still speaks, with the note."""
    from optimizer.search.notes import unapplied_levels_note

    reason = ("load not applied: 9 of 16 requests in flight on average over the 4 s window; "
              "the SLO is not shown at 16")
    unapplied = StepMetrics(step=1, level=LoadLevel(max_concurrency=16),
                            metrics=_metrics(3.0, 9.0),
                            server_metrics={"steady.is_load_unapplied": 1.0},
                            miss_reason=reason)
    steps = [_step(0, 2.0, 5.0), unapplied]
    assert unapplied.is_load_unapplied and not steps[0].is_load_unapplied
    assert operating_step("goodput", steps).step == 0
    assert objective_values(["goodput", "tpot"], steps) == [2.0, 5.0]
    assert unapplied_levels_note(steps) == (
        f"Load not applied at 1 level(s), whose figures are of another load than their "
        f"label (concurrency=16: {reason}).")
    assert unapplied_levels_note([steps[0]]) == ""
    assert operating_step("goodput", [unapplied]).step == 1


def test_every_objective_of_a_trial_reads_the_first_ones_operating_level() -> None:
    steps = [_step(0, 2.0, 5.0), _step(1, 3.0, 9.0), _step(2, 2.5, 12.0)]
    assert objective_values(["goodput", "tpot"], steps) == [3.0, 9.0], \
        "the TPOT p99 of the level that gave the goodput, not the worst level's 12 ms"


def _probe(i: int, rate: float, goodput: float, tpot: float, meets: bool) -> StepMetrics:
    return StepMetrics(step=i, level=LoadLevel(request_rate_rps=rate),
                       metrics=_metrics(goodput, tpot), meets_slo=meets,
                       server_metrics={"max_kv_cache_usage_perc": 1.0 if not meets else 0.4})


def _search() -> list[StepMetrics]:
    """An overload probe first (as a capacity search runs it), with more goodput than the
    operating point, then the bracket's two ends."""
    return [_probe(0, 64.0, 20.0, 40.0, False), _probe(1, 8.0, 7.9, 11.0, True),
            _probe(2, 12.0, 10.5, 16.0, False), _probe(3, 10.0, 9.8, 14.0, True)]


def test_operating_point_of_a_capacity_search_is_the_highest_load_that_met_the_slo() -> None:
    steps = _search()
    assert operating_step("goodput", steps).step == 3, \
        "not the overload probe, whose goodput is higher: it missed the SLO"
    assert operating_step("tpot", steps).step == 3, "one operating point whatever the objective"
    assert objective_value("goodput", steps) == 10.0, "the operating probe's offered rate"
    assert objective_value("throughput", steps) == pytest.approx(980.0), \
        "the operating probe's figure"
    assert objective_value("tpot", steps) == 14.0


def test_summary_metrics_describe_one_load_the_operating_point() -> None:
    m = summary_metrics(RunResult(status="complete", steps=tuple(_search())), ["goodput"])
    assert m["headline_level"] == 3.0
    assert (m["request_goodput"], m["p99_tpot_ms"]) == (9.8, 14.0), \
        "goodput and its latencies from the same probe, never the overload probe's TPOT"
    assert m["server.max_kv_cache_usage_perc"] == 0.4


def test_no_operating_point_when_no_load_met_the_slo_and_the_lightest_is_described() -> None:
    steps = [_probe(0, 64.0, 20.0, 40.0, False), _probe(1, 2.0, 1.9, 16.0, False)]
    assert operating_step("goodput", steps) is None
    assert described_step("goodput", steps).step == 1, "the lightest load probed"
    assert objective_value("goodput", steps) == 0.0
    m = summary_metrics(RunResult(status="complete", steps=tuple(steps)), ["goodput"])
    assert "headline_level" not in m and "p99_tpot_ms" not in m, \
        "no level's figures stand for a trial that met the SLO nowhere"


def test_a_probe_missed_for_overload_errors_is_a_missed_slo_not_a_failed_trial() -> None:
    overloaded = StepMetrics(step=0, level=LoadLevel(request_rate_rps=60.0),
                             metrics=_metrics(12.0, 30.0), meets_slo=False)
    steps = [overloaded, _probe(1, 8.0, 7.9, 11.0, True)]
    assert objective_values(["goodput"], steps) == [8.0]
    assert objective_values(["goodput"], [overloaded]) == [0.0], \
        "a search that met the SLO nowhere has a value of 0, not a failure"


def test_rates_are_per_gpu_and_latencies_as_measured() -> None:
    steps = _search()
    assert objective_value("goodput", steps, num_gpus=2) == 5.0
    assert objective_value("throughput", steps, num_gpus=4) == pytest.approx(245.0)
    assert objective_value("tpot", steps, num_gpus=2) == 14.0
    m = summary_metrics(RunResult(status="complete", steps=tuple(steps)), ["goodput", "tpot"],
                        num_gpus=2)
    assert m["objective.goodput"] == 10.0 and m["objective.goodput.per_gpu"] == 5.0, \
        "MLflow keeps the raw figure and the per-GPU one Optuna is told"
    assert m["num_gpus"] == 2.0 and "objective.tpot.per_gpu" not in m


def test_summary_metrics_flatten_level_engine_and_objectives() -> None:
    result = RunResult(status="complete", steps=(_step(0, 2.0, 5.0), _step(1, 3.0, 9.0)),
                       engine=EngineInfo(kv_cache_tokens=1000, attention_backend="FLASH_ATTN"),
                       telemetry={"gpu_util_mean_pct": 80.0}, wall_s=12.0)
    m = summary_metrics(result, ["goodput", "tpot"])
    assert m["request_goodput"] == 3.0 and m["headline_level"] == 1.0
    assert m["objective.goodput"] == 3.0 and m["objective.tpot"] == 9.0
    assert m["engine.kv_cache_tokens"] == 1000.0
    assert "engine.attention_backend" not in m, "strings are not metrics"
    assert m["gpu.gpu_util_mean_pct"] == 80.0 and m["server.vllm_x"] == 1.0


def test_conclusions_say_change_effect_and_lesson() -> None:
    vllm = {"enforce_eager": False, "max_num_seqs": 256}
    defaults = Reference(0, vllm, 9.0)
    best = Reference(3, {"enforce_eager": False, "max_num_seqs": 512}, 10.0)
    worse = conclude(params={"enforce_eager": True, "max_num_seqs": 256}, state="complete",
                     objective="goodput", value=4.0, best=best, baseline=defaults,
                     vllm_defaults=vllm).text
    assert worse.startswith("enforce_eager=True vs the vLLM defaults: goodput 4 req/s, 0.44x "
                            "the vLLM defaults (one measurement each: no interval)"), worse
    assert "vs best trial 3 (10 req/s): -60%, worse." in worse
    assert "keep" not in worse and "→" not in worse, "no keep-advice, no arrows"
    better = conclude(params={"enforce_eager": False, "max_num_seqs": 1024}, state="complete",
                      objective="goodput", value=12.0, best=best, baseline=defaults,
                      vllm_defaults=vllm).text
    assert better.endswith("+20%, new best."), better
    same = conclude(params=best.params, state="complete", objective="goodput", value=10.1,
                    best=best, baseline=defaults, vllm_defaults=vllm).text
    assert "within noise of the best" in same
    failed = conclude(params={"kv_cache_dtype": "fp8"}, state="failed", objective="goodput",
                      value=None, failure_reason="unsupported_config",
                      failure_message="FLEX_ATTENTION has no fp8 KV.", best=None)
    assert failed.text == ("kv_cache_dtype=fp8: failed (unsupported_config): FLEX_ATTENTION "
                           "has no fp8 KV.")
    baseline = conclude(params={}, state="complete", objective="tpot", value=7.1,
                        is_baseline=True)
    assert baseline.text.startswith("vLLM defaults: tpot 7.1 ms TPOT p99")
    pruned = conclude(params={"max_num_seqs": 64}, state="pruned", objective="goodput",
                      value=1.0, best=best, baseline=defaults, vllm_defaults=vllm, pruned_at=0)
    assert "pruned at level 0" in pruned.text and pruned.short == "max_num_seqs=64: pruned at 0"


def test_param_changes_lists_only_differences() -> None:
    assert param_changes({"a": 1, "b": 2}, {"a": 1, "b": 3}) == ["b=2"]
    assert param_changes({"a": None, "b": 2}, {"a": 4, "b": 2}) == [], \
        "None is the default: not a change"


def test_confirmed_gain_is_the_mean_paired_ratio_with_a_t_interval() -> None:
    from optimizer.results.confirmation import confirm_summary

    pairs = [{"defaults": 10.0, "best": 13.0}, {"defaults": 10.0, "best": 14.0},
             {"defaults": 11.0, "best": 14.3}]
    summary = confirm_summary("goodput", 5, 0, pairs)
    logs = [math.log(r) for r in (1.3, 1.4, 1.3)]
    mean_log = sum(logs) / 3
    assert summary["gain"] == pytest.approx(math.exp(mean_log)), "the geometric mean"
    sd = math.sqrt(sum((x - mean_log) ** 2 for x in logs) / 2)
    half = 4.303 * sd / 3 ** 0.5  # t(0.975, 2) x sd / sqrt(n), on the log ratios
    assert summary["ci_low"] == pytest.approx(math.exp(mean_log - half), rel=1e-3)
    assert "(95% CI [1.19x, 1.49x] over 3 rounds): confirmed" in summary["sentence"]
    # Two rounds that disagree: a wide interval, but both ends are ratios (never below 0).
    apart = confirm_summary("goodput", 5, 0, [{"defaults": 10.0, "best": 4.0},
                                             {"defaults": 10.0, "best": 9.0}])
    assert 0 < apart["ci_low"] < 1 < apart["ci_high"], "an interval of ratios stays positive"
    # Lower is better for latency: the ratio is oriented so > 1 still means better.
    tpot = confirm_summary("tpot", 5, 0, [{"defaults": 10.0, "best": 8.0}])
    assert tpot["gain"] == pytest.approx(1.25) and tpot["ci_low"] is None
    assert "one round: no interval, not confirmed" in tpot["sentence"]


@dataclass(frozen=True)
class _RunnerStep(StepMetrics):
    """`StepMetrics` with the fields issue 32's runner adds (all optional there too)."""

    miss_reason: str | None = None
    offered_rate_rps: float | None = None
    completed_rate_rps: float | None = None


def test_a_probe_missed_for_overload_keeps_its_reason_and_the_trial_says_it_has_no_operating_point(
        ) -> None:
    from optimizer.results.trial_record import step_records
    from optimizer.search.notes import no_operating_point_note

    missed = _RunnerStep(step=0, level=LoadLevel(request_rate_rps=9.9), metrics=_metrics(7.6, 9.0),
                         meets_slo=False, miss_reason="overload: 12 connect timeouts",
                         offered_rate_rps=9.9, completed_rate_rps=7.6)
    record, = step_records([missed])
    assert record["miss_reason"] == "overload: 12 connect timeouts"
    assert record["metrics"]["window.completed_rate_rps"] == 7.6
    assert no_operating_point_note("goodput", [missed]) == (
        "No operating point: no probed load met the SLO; the lightest, 9.9 req/s, missed it "
        "(overload: 12 connect timeouts).")
    assert no_operating_point_note("goodput", _search()) == "", "the search met it at 10 req/s"


def test_typed_accessors_read_a_trials_marks_and_the_studys_confirmation() -> None:
    import optuna

    from optimizer.results.trial_record import (
        ATTR_BASELINE,
        ATTR_CONFIRM,
        ATTR_DUPLICATE_OF,
        STUDY_ATTR_CONFIRM,
        confirm_label,
        confirmation_of,
        is_baseline,
        ran_nothing,
        record_of,
    )

    study = optuna.create_study(direction="maximize")
    assert confirmation_of(study) is None, "no confirmation ran"
    study.set_user_attr(STUDY_ATTR_CONFIRM, {
        "best_trial": 3, "gain": 1.2, "ci_low": 1.05, "ci_high": 1.4, "ratios": [1.1, 1.3],
        "is_confirmed": True, "sentence": "trial 3 vs the defaults: 1.2x"})
    confirmed = confirmation_of(study)
    assert confirmed is not None and (confirmed.best_trial, confirmed.gain, confirmed.ci_low,
                                      confirmed.num_rounds, confirmed.is_confirmed) == \
        (3, 1.2, 1.05, 2, True)
    dist = {"x": optuna.distributions.IntDistribution(0, 1)}
    for attrs in ({ATTR_BASELINE: True}, {ATTR_BASELINE: True, ATTR_CONFIRM: "defaults"},
                  {ATTR_DUPLICATE_OF: 0}):
        study.add_trial(optuna.trial.create_trial(params={"x": 0}, distributions=dist,
                                                  value=1.0, user_attrs=attrs))
    baseline, rerun, repeat = study.trials
    assert is_baseline(baseline) and confirm_label(baseline) is None
    assert is_baseline(rerun) and confirm_label(rerun) == "defaults"
    assert ran_nothing(repeat) and not ran_nothing(baseline)
    assert record_of(baseline) is None, "a trial without a record has none"
