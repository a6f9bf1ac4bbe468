"""Gains are stated with what bounds them, "confirmed" only when the interval excludes 1.0, and
a trial's conclusion compares it with the vLLM defaults first (None is vLLM's default)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import parse_study
from optimizer.report import build_report, headline, render_html, render_markdown
from optimizer.results import gains
from optimizer.results.baseline_words import baseline_words
from optimizer.results.conclusion import SHORT_CHARS, Reference, conclude
from optimizer.results.confirmation import confirm_summary
from optimizer.storage.study import open_study
from runners.capacity.bracket import Bracket

DEFAULTS_BRACKET = Bracket("request_rate", 8.9, 18.9, "unresolved", 8)
FP8_BRACKET = Bracket("request_rate", 18.9, 40.0, "unresolved", 8)


def test_a_capacity_gain_lies_between_the_ratios_the_brackets_allow() -> None:
    # The H200 study: defaults in [8.9, 18.9), fp8 in [18.9, 40) req/s. Not "2.03x".
    gain = gains.capacity_gain(FP8_BRACKET, DEFAULTS_BRACKET)
    assert gain.low == pytest.approx(1.0) and gain.high == pytest.approx(40.0 / 8.9)
    text = gains.format_gain(gain, "the vLLM defaults")
    assert text == ("more than 1.00x and less than 4.50x the vLLM defaults (capacity brackets; "
                    "lower ends 2.12x)")
    assert gain.is_better, "touching brackets: fp8 >= 18.9 > the defaults, strictly"
    overlapping = gains.capacity_gain(Bracket("request_rate", 17.0, 40.0, "unresolved", 8),
                                      DEFAULTS_BRACKET)
    assert not overlapping.is_better and not overlapping.is_worse, "overlap shows nothing"


def test_open_bracket_ends_give_open_gain_ends() -> None:
    at_least = Bracket("concurrency", 64.0, None, "at_least", 1)
    resolved = Bracket("concurrency", 20.0, 21.0, "resolved", 6)
    gain = gains.capacity_gain(at_least, resolved)
    assert gain.high is None and gain.low == pytest.approx(64 / 21)
    assert gains.format_gain(gain, "the vLLM defaults").startswith(
        "capacity in concurrent requests more than 3.04x the vLLM defaults"), \
        "a concurrency ratio says whose ratio it is"
    none = Bracket("concurrency", None, 4.0, "none", 2)
    assert gains.capacity_gain(resolved, none).value is None, "no ratio to a capacity of 0"
    assert gains.format_gain(gains.capacity_gain(resolved, none),
                             "the vLLM defaults").startswith(
        "capacity in concurrent requests more than 5.00x")
    assert gains.capacity_gain(none, resolved).low is None


def test_confirmed_only_when_the_interval_excludes_one() -> None:
    # The quickstart's "Confirmed: ... 1.25x [0.79, 1.71]".
    wide = confirm_summary("goodput", 5, 0, [{"defaults": 10.0, "best": 9.0},
                                             {"defaults": 10.0, "best": 16.0}])
    assert wide["ci_low"] < 1.0 < wide["ci_high"] and not wide["is_confirmed"]
    assert wide["sentence"].endswith("not confirmed: within noise (the 95% interval contains "
                                     "1.0)")
    tight = confirm_summary("goodput", 5, 0, [{"defaults": 10.0, "best": 13.0},
                                              {"defaults": 10.0, "best": 13.2}])
    assert tight["is_confirmed"] and tight["sentence"].endswith(
        "confirmed: the 95% interval excludes 1.0")
    worse = confirm_summary("tpot", 5, 0, [{"defaults": 10.0, "best": 13.0},
                                           {"defaults": 10.0, "best": 13.2}])
    assert not worse["is_confirmed"] and "confirmed worse" in worse["sentence"]
    one = confirm_summary("goodput", 5, 0, [{"defaults": 10.0, "best": 13.0}])
    assert one["sentence"].endswith("one round: no interval, not confirmed")



def test_simulated_repeats_are_never_called_confirmed() -> None:
    """Defect 7 (session 13): the quickstart's simulated repeats, 32.90 and 32.90 against
    42.48 and 42.48, gave "[1.29x, 1.30x] ... confirmed: the 95% interval excludes 1.0": the
    model's determinism, not noise measured."""
    from optimizer.results.confirmation import SIMULATED_VERDICT

    pairs = [{"defaults": 32.90, "best": 42.48}, {"defaults": 32.90, "best": 42.49}]
    simulated = confirm_summary("goodput", 5, 0, pairs, is_simulated=True)
    assert simulated["sentence"].endswith(SIMULATED_VERDICT) and \
        "simulated engine" in simulated["sentence"]
    assert "confirmed:" not in simulated["sentence"] and "re-measured" not in \
        simulated["sentence"], "a model's repeats measure and confirm nothing"
    assert not simulated["is_confirmed"] and simulated["is_simulated"]
    assert "1.29x the vLLM defaults (95% CI [1.28x, 1.30x] over 2 rounds)" in \
        simulated["sentence"], "the figures stay, with what they are"
    measured = confirm_summary("goodput", 5, 0, pairs)
    assert measured["is_confirmed"] and not measured["is_simulated"] and \
        measured["sentence"].endswith("confirmed: the 95% interval excludes 1.0")


def test_the_confirmation_of_simulated_runs_stores_the_simulated_wording(
        tmp_path: Path) -> None:
    """`confirm` tells from the runs' launch commands that the simulated engine ran them;
    `confirmation_of` hands it on (status, report, export and MLflow read it)."""
    from optimizer.results.confirmation import SIMULATED_VERDICT, confirm
    from optimizer.results.trial_record import confirmation_of

    for argv, is_simulated in ((["python3", "-m", "runners.simulated", "--port", "1"], True),
                               (["vllm", "serve", "m"], False)):
        cfg = parse_study({"name": "engine", "model": {"path": "qwen2.5-7b"},
                           "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 50},
                           "results_dir": str(tmp_path / "results"),
                           "workload": {"capacity": {"axis": "request_rate", "low": 1,
                                                     "high": 40}},
                           "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"})
        study = optuna.create_study(direction="maximize")  # the search, on this engine
        _add(study, {"quantization": "none"},
             {**_record({}, 8.7, DEFAULTS_BRACKET, True), "argv": argv}, {"baseline": True})
        _add(study, {"quantization": "fp8"},
             {**_record({"quantization": "fp8"}, 18.5, FP8_BRACKET), "argv": argv}, {})

        def measure(params: Any, label: str, study: optuna.Study = study,
                    argv: list[str] = argv) -> optuna.trial.FrozenTrial:
            best = params.get("quantization") == "fp8"
            record = _record(dict(params), 19.0 if best else 9.0,
                             Bracket("request_rate", 9.5, 10.0, "resolved", 6))
            _add(study, dict(params), {**record, "argv": argv}, {"confirm": label})
            return study.trials[-1]

        confirm(study, cfg, measure, lambda: False)
        confirmed = confirmation_of(study)
        assert confirmed is not None and confirmed.is_simulated == is_simulated
        assert confirmed.sentence.endswith(SIMULATED_VERDICT) == is_simulated
        assert confirmed.is_confirmed != is_simulated, \
            "two equal rounds: confirmed when measured, never when simulated"


VLLM = {"tensor_parallel_size": 1, "data_parallel_size": 1, "quantization": "none",
        "kv_cache_dtype": "auto", "max_num_seqs": 1024}


def test_a_conclusion_names_only_real_changes_from_the_vllm_defaults() -> None:
    # The defaults trial stores None for what it leaves to vLLM; the fp8 trial has TP=1, DP=1.
    baseline = Reference(0, dict.fromkeys(VLLM), 8.7, DEFAULTS_BRACKET)
    fp8 = {"tensor_parallel_size": 1, "data_parallel_size": 1, "quantization": "fp8",
           "kv_cache_dtype": "fp8", "max_num_seqs": None}
    told = conclude(params=fp8, state="complete", objective="goodput", value=18.5,
                    best=baseline, baseline=baseline, vllm_defaults=VLLM,
                    capacity=FP8_BRACKET, tolerance=0.05, number=4)
    assert told.text.startswith("quantization=fp8, kv_cache_dtype=fp8 vs the vLLM defaults: "
                                "goodput 18.5 req/s (capacity [18.9, 40) req/s, unresolved: "
                                "the bracket is wider than the 5% tolerance after 8 probes), "
                                "more than 1.00x and less than 4.50x the vLLM defaults"), told.text
    assert "None" not in told.text and "→" not in told.text and "keep" not in told.text
    assert "tensor_parallel_size" not in told.text, "TP=1 is vLLM's default: no change"
    assert told.short == "quantization=fp8 +1: 2.12x (1.00, 4.50) vs defaults unresolved"
    assert len(told.short) <= SHORT_CHARS


def test_a_conclusion_compares_with_the_best_after_the_defaults() -> None:
    baseline = Reference(0, {}, 10.0)
    best = Reference(3, {"max_num_seqs": 256}, 13.0)
    told = conclude(params={"max_num_seqs": 512}, state="complete", objective="goodput",
                    value=12.0, best=best, baseline=baseline, vllm_defaults=VLLM, number=5)
    assert told.text.startswith("max_num_seqs=512 vs the vLLM defaults: goodput 12 req/s, "
                                "1.20x the vLLM defaults (one measurement each: no interval); "
                                "vs best trial 3 (13 req/s): -8%, worse."), told.text
    first = conclude(params={}, state="complete", objective="goodput", value=10.0,
                     best=baseline, baseline=baseline, vllm_defaults=VLLM, is_baseline=True,
                     number=0)
    assert first.text.startswith("vLLM defaults: goodput 10 req/s; the baseline")


def test_every_short_form_fits_a_table_cell() -> None:
    many = {f"flag_{i}": i for i in range(12)}
    for state in ("complete", "pruned", "failed"):
        told = conclude(params=many, state=state, objective="throughput", value=1234.5,
                        failure_reason="oom_at_start", failure_message="x" * 300,
                        best=Reference(1, {}, 1000.0), baseline=Reference(0, {}, 900.0),
                        vllm_defaults={}, pruned_at=2, number=7)
        assert len(told.short) <= SHORT_CHARS, told.short


def _record(flags: dict[str, Any], value: float, bracket: Bracket,
            is_baseline: bool = False) -> dict[str, Any]:
    return {"state": "complete", "params": flags, "flags": flags, "values": [value],
            "metrics": bracket.as_metrics(), "steps": [], "failure_reason": None,
            "conclusion": "a long conclusion " * 10, "conclusion_short": "short form",
            "argv": ["vllm", "serve"], "env": {}, "verdict": None, "wall_s": 1.0,
            "is_baseline": is_baseline, "capacity": bracket.to_dict()}


def _capacity_study(tmp_path: Path,
                    fixed_flags: dict[str, Any] | None = None) -> tuple[optuna.Study, Any]:
    data = {"name": "brackets", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
            "slo": {"tpot_p99_ms": 50}, "results_dir": str(tmp_path / "results"),
            "workload": {"capacity": {"axis": "request_rate", "low": 1, "high": 40}},
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db",
            **({"fixed_flags": fixed_flags} if fixed_flags else {})}
    cfg = parse_study(data)
    study = open_study(cfg)
    for params, record, attrs in (
            ({"quantization": "none"}, _record({}, 8.7, DEFAULTS_BRACKET, True),
             {"baseline": True}),
            ({"quantization": "fp8"}, _record({"quantization": "fp8"}, 18.5, FP8_BRACKET), {})):
        _add(study, params, record, attrs)
    return study, cfg


def _add(study: optuna.Study, params: dict[str, Any], record: dict[str, Any],
         attrs: dict[str, Any]) -> None:
    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}
    study.add_trial(optuna.trial.create_trial(
        params=params, distributions=dist, value=record["values"][0],
        user_attrs={"record": record, **attrs}))


def test_the_report_states_a_capacity_gain_with_both_brackets(tmp_path: Path) -> None:
    study, cfg = _capacity_study(tmp_path)
    report = build_report(study, cfg, with_importances=False)
    line = headline(report)
    assert "capacity [18.9, 40) req/s, unresolved" in line
    assert "more than 1.00x and less than 4.50x the vLLM defaults (capacity brackets; lower " \
        "ends 2.12x)" in line
    assert "capacity [8.9, 18.9) req/s" in line, "the defaults' bracket is stated too"
    md = render_markdown(report)
    assert "| short form |" in md and "a long conclusion a long" not in md, \
        "tables show the short form"


def test_a_capacity_study_is_told_when_its_probes_cannot_close_the_bracket() -> None:
    from optimizer.run.runtime import capacity_notes

    def notes(**capacity: Any) -> list[str]:
        data = {"name": "n", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 1},
                "slo": {"ttft_p99_ms": 500},
                "workload": {"num_requests": 128, "capacity": {"axis": "request_rate",
                                                               **capacity}}}
        return capacity_notes(parse_study(data).workload)

    tight = notes(low=1, high=64, tolerance=0.05, max_probes=8)
    assert any("can take 9 probes but max_probes is 8" in n for n in tight)
    assert not any("num_requests" in n for n in tight), \
        "a steady staircase sizes its windows itself: num_requests is not its bound"
    roomy = notes(low=1, high=4, tolerance=0.1, max_probes=8, probe_duration_s=25)
    assert roomy == [], roomy
    default = parse_study({"name": "n", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 1},
                           "slo": {"ttft_p99_ms": 500},
                           "workload": {"capacity": {"low": 1, "high": 8}}}).workload
    assert default.capacity is not None and default.capacity.probe_duration_s == 30.0


def test_a_capacity_confirmation_states_the_ratio_every_rounds_brackets_allow(
        tmp_path: Path) -> None:
    study, cfg = _capacity_study(tmp_path)
    rounds = [(Bracket("request_rate", 9.5, 10.0, "resolved", 6),
               Bracket("request_rate", 19.0, 20.0, "resolved", 6)),
              (Bracket("request_rate", 9.0, 9.5, "resolved", 6),
               Bracket("request_rate", 19.5, 20.5, "resolved", 6))]
    for defaults, best in rounds:
        _add(study, {"quantization": "none"}, _record({}, 9.0, defaults), {"confirm": "defaults"})
        _add(study, {"quantization": "fp8"}, _record({"quantization": "fp8"}, 19.0, best),
             {"confirm": "best"})
    study.set_user_attr("confirm", confirm_summary(
        "goodput", 1, 0, [{"defaults": 9.0, "best": 19.0}, {"defaults": 9.0, "best": 19.5}]))
    report = build_report(study, cfg, with_importances=False)
    # Round 1 allows [19/10, 20/9.5], round 2 [19.5/9.5, 20.5/9]: both hold in [2.05, 2.11].
    assert report.confirm.endswith("re-measured capacity brackets, in every one of 2 rounds: "
                                   "more than 2.05x and less than 2.11x the vLLM "
                                   "defaults (capacity brackets)"), report.confirm
    assert "Re-measured: trial 1 (the exported config)" in headline(report)


def test_a_trial_pruned_at_a_fixed_level_is_not_given_a_ratio() -> None:
    baseline = Reference(0, {}, 10.0)
    pruned = conclude(params={"max_num_seqs": 64}, state="pruned", objective="goodput",
                      value=2.0, best=Reference(3, {}, 12.0), baseline=baseline,
                      vllm_defaults=VLLM, pruned_at=0, prune_reason="below the median",
                      number=4)
    assert "not compared: its load levels were cut short" in pruned.text
    assert "x the vLLM defaults" not in pruned.text and "vs best" not in pruned.text
    same = conclude(params={"max_num_seqs": 1024, "quantization": None}, state="complete",
                    objective="goodput", value=10.1, baseline=baseline, vllm_defaults=VLLM,
                    number=5)
    assert same.text.startswith("same flags as the vLLM defaults: goodput 10.1 req/s, within "
                                "noise of the vLLM defaults"), same.text


def test_a_request_rate_capacity_trial_scores_its_brackets_lower_end() -> None:
    from optimizer.results.objectives import objective_value
    from optimizer.results.trial_record import summary_metrics
    from runners.base import RunResult, StepMetrics
    from runners.load_level import LoadLevel
    from tests.optimizer.test_records import _metrics

    def probe(i: int, rate: float, goodput: float, ok: bool) -> StepMetrics:
        return StepMetrics(step=i, level=LoadLevel(request_rate_rps=rate),
                           metrics=_metrics(goodput, 9.0), meets_slo=ok)

    # A 6 s probe at 9.23 req/s completed 45 requests in 6.2 s (drain): 7.25 "req/s".
    steps = [probe(0, 120.0, 0.5, False), probe(1, 2.0, 1.79, True),
             probe(2, 9.23, 7.25, True), probe(3, 11.9, 9.38, False)]
    assert objective_value("goodput", steps) == 9.23, "the highest rate that met the SLO"
    assert objective_value("throughput", steps) == 725.0, "other objectives: measured"
    metrics = summary_metrics(RunResult(status="complete", steps=tuple(steps)), ["goodput"])
    assert metrics["objective.goodput"] == 9.23, "MLflow's objective is the trial's value"


def test_shown_bounds_round_outwards_so_more_than_and_less_than_stay_true() -> None:
    """A bound shown to two decimals is rounded away from the ratio it bounds: 1.2468 is
    "more than 1.24x", never "more than 1.25x" (false), and 1.3811 "less than 1.39x"."""
    from optimizer.results import gains as g

    text = g.format_gain(g.Gain(1.3, 1.2468, 1.3811, "capacity"), "the vLLM defaults")
    assert "more than 1.24x and less than 1.39x" in text, text
    assert g.short_gain(g.Gain(1.3, 1.2468, 1.3811, "capacity")) == "1.30x (1.24, 1.39)"
    assert "[1.49x, 1.59x]" in g.format_gain(g.Gain(1.54, 1.4999, 1.5801, "interval", 2),
                                    "the vLLM defaults")


def test_a_two_gpu_config_is_compared_with_the_defaults_per_gpu() -> None:
    # The quickstart's best: data_parallel_size 2 served 1.45x the defaults on one GPU.
    baseline = Reference(0, {}, 10.0)
    dp2 = conclude(params={"data_parallel_size": 2}, state="complete", objective="goodput",
                   value=7.25, baseline=baseline, vllm_defaults={"data_parallel_size": 1},
                   number=3, num_gpus=2)
    assert dp2.text.startswith(
        "data_parallel_size=2 vs the vLLM defaults: goodput 14.5 req/s on 2 GPUs = 7.25 req/s "
        "per GPU, 0.72x the vLLM defaults per GPU (one measurement each: no interval); 1.45x as "
        "measured, on 2 GPUs against the defaults on 1 GPU."), dp2.text
    assert "0.72x (1 run) vs defaults per GPU" in dp2.short
    one = conclude(params={"max_num_seqs": 512}, state="complete", objective="goodput",
                   value=12.0, baseline=baseline, vllm_defaults=VLLM, number=4)
    assert "per GPU" not in one.text, "one GPU each side: per GPU and per config agree"


def test_capacity_brackets_are_compared_per_gpu() -> None:
    dp2 = Bracket("request_rate", 29.0, 32.0, "resolved", 6)
    gain = gains.gain_over(14.5, 15.0, dp2, Bracket("request_rate", 15.0, 16.0, "resolved", 6),
                           maximize=True, num_gpus=2)
    assert gain.low == pytest.approx(14.5 / 16.0) and gain.high == pytest.approx(16.0 / 15.0)
    assert not gain.is_better, "two copies of the defaults would serve as much"
    text = conclude(params={"data_parallel_size": 2}, state="complete", objective="goodput",
                    value=14.5, capacity=dp2,
                    baseline=Reference(0, {}, 15.0,
                                       Bracket("request_rate", 15.0, 16.0, "resolved", 6)),
                    vllm_defaults={}, number=2, num_gpus=2).text
    assert "the vLLM defaults per GPU (capacity brackets" in text, text
    assert "as measured, on 2 GPUs against the defaults on 1 GPU" in text


def test_the_report_states_a_two_gpu_best_per_gpu_with_the_ratio_as_measured(
        tmp_path: Path) -> None:
    data = {"name": "dp", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
            "slo": {"tpot_p99_ms": 50}, "results_dir": str(tmp_path / "results"),
            "workload": {"levels": [{"concurrency": 32}]},
            "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    cfg = parse_study(data)
    study = open_study(cfg)
    dp2 = {"quantization": "fp8", "data_parallel_size": 2}
    for params, record, attrs in (
            ({"quantization": "none"}, {**_record({}, 10.0, DEFAULTS_BRACKET, True),
                                        "capacity": None, "metrics": {}}, {"baseline": True}),
            # 14.5 req/s on two GPUs: Optuna holds 7.25 per GPU
            ({"quantization": "fp8"}, {**_record(dp2, 7.25, FP8_BRACKET), "capacity": None,
                                       "metrics": {}}, {})):
        _add(study, params, record, attrs)
    report = build_report(study, cfg, with_importances=False)
    assert report.best is not None and report.best.number == 0, \
        "two copies of the defaults would serve more than the 2-GPU config"
    dp_row = next(r for r in report.rows if r.number == 1)
    assert dp_row.num_gpus == 2 and dp_row.value == 7.25
    report = replace(report, best=dp_row)  # as a study whose 2-GPU config won per GPU reads
    line = headline(report)
    assert "goodput 14.5 req/s on 2 GPUs = 7.25 req/s per GPU" in line, line
    assert "0.72x the vLLM defaults per GPU (one measurement each: no interval); 1.45x as " \
        "measured, on 2 GPUs against the defaults on 1 GPU" in line, line
    assert "| goodput req/s/GPU |" in render_markdown(report)


def test_a_re_measured_two_gpu_config_states_its_gain_per_gpu() -> None:
    summary = confirm_summary("goodput", 1, 0, [{"defaults": 10.0, "best": 7.25},
                                                {"defaults": 10.2, "best": 7.3}], per_gpu=True)
    assert "goodput 0.72x the vLLM defaults per GPU (95% CI" in summary["sentence"], \
        summary["sentence"]
    assert "confirmed worse than the defaults" in summary["verdict"]


# The session-14 H100 study's fixed flags (bench/h100/steady-hold-fp8.yaml): its baseline ran fp8
# weights and KV, yet its conclusion, table and report called it "the vLLM defaults".
FIXED = {"max_model_len": 4096, "quantization": "fp8", "kv_cache_dtype": "fp8"}


def test_a_baseline_that_ran_fixed_flags_is_named_so_in_its_conclusion_and_cell() -> None:
    base = Reference(0, {}, 11.0)
    kw: dict[str, Any] = dict(params={}, state="complete", objective="goodput", value=11.0,
                              best=base, baseline=base, vllm_defaults=VLLM, is_baseline=True,
                              number=0)
    fixed = conclude(**kw, baseline_words=baseline_words(FIXED))
    assert fixed.text.startswith(
        "vLLM defaults + your fixed flags (max_model_len=4096, quantization=fp8, "
        "kv_cache_dtype=fp8): goodput 11 req/s; the baseline"), fixed.text
    assert fixed.short == "baseline: 11 req/s", fixed.short
    plain = conclude(**kw, baseline_words=baseline_words({}))
    assert plain.text.startswith("vLLM defaults: goodput 11 req/s; the baseline"), plain.text
    assert plain.short == "defaults: 11 req/s", "no fixed flags: the vLLM defaults, as before"


def test_a_gain_over_a_baseline_that_ran_fixed_flags_never_says_the_vllm_defaults() -> None:
    kw: dict[str, Any] = dict(params={"max_num_seqs": 512}, state="complete",
                              objective="goodput", value=12.0, best=Reference(3, {}, 13.0),
                              baseline=Reference(0, {}, 10.0), vllm_defaults=VLLM, number=5)
    fixed = conclude(**kw, baseline_words=baseline_words(FIXED))
    assert fixed.text.startswith(
        "max_num_seqs=512 vs the baseline (vLLM defaults + your fixed flags): goodput 12 req/s, "
        "1.20x the baseline (vLLM defaults + your fixed flags) (one measurement each"), fixed.text
    assert "vLLM defaults:" not in fixed.text and "the vLLM defaults" not in fixed.text
    assert fixed.short == "max_num_seqs=512: 1.20x (1 run) vs baseline", fixed.short
    plain = conclude(**kw)
    assert plain.text.startswith("max_num_seqs=512 vs the vLLM defaults: goodput 12 req/s, "
                                 "1.20x the vLLM defaults (one"), plain.text
    assert plain.short == "max_num_seqs=512: 1.20x (1 run) vs defaults"


def test_the_report_names_a_baseline_that_ran_fixed_flags_with_them(tmp_path: Path) -> None:
    study, cfg = _capacity_study(tmp_path, fixed_flags={"max_model_len": 4096})
    report = build_report(study, cfg, with_importances=False)
    line = headline(report)
    assert "4.50x the baseline (vLLM defaults + your fixed flags) (capacity brackets" in line, \
        line
    assert "vLLM defaults" not in line.replace("the baseline (vLLM defaults + your fixed", ""), \
        line
    md = render_markdown(report)
    assert "Baseline: vLLM defaults + your fixed flags (max_model_len=4096)" in md, \
        "the report's first mention lists the flags"
    assert "| 0 | complete | (baseline) |" in md and "| change vs baseline |" in md
    assert "(vLLM defaults)" not in md
    html = render_html(report)
    assert "<td>(baseline)</td>" in html and "change vs baseline" in html
    assert "(vLLM defaults)" not in html
    as_best = headline(replace(report, best=report.baseline))
    assert as_best.startswith("Best: trial 0 (the baseline: vLLM defaults + your fixed flags), "
                              "goodput 8.7 req/s"), as_best


def test_the_report_of_a_study_without_fixed_flags_names_the_vllm_defaults(
        tmp_path: Path) -> None:
    study, cfg = _capacity_study(tmp_path)
    report = build_report(study, cfg, with_importances=False)
    md = render_markdown(report)
    assert "| 0 | complete | (vLLM defaults) |" in md and "| change vs defaults |" in md
    assert "Baseline:" not in md and "(baseline)" not in md
