"""The final confirmation's rounds compare the two configs at ONE load, as a trial's gain does
(`gains.gain_over`): where a fixed level of either run was "load not applied", a round's ratio
of the two operating points was of two loads (the best at concurrency 8 against the defaults
at 32), no gain; such a round is compared at the load both applied, named, or set aside as not
comparable, never averaged (s17 "Left"). A round whose value is 0 is a measurement (a miss):
the confirmation's words count it so, never "a round had nothing to compare"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import parse_study
from optimizer.export.render import gain_line
from optimizer.results.confirmation import confirm, confirm_summary
from optimizer.results.trial_record import STUDY_ATTR_CONFIRM, confirmation_of
from runners.base import StepMetrics
from tests.optimizer.test_export import _morning_study
from tests.optimizer.test_gains_conclusions import _add
from tests.optimizer.test_gains_same_load import QUICKSTART, _level, _record

# Concurrency 8, then 32. The defaults gain little from 8 to 32; fp8's 32 was not applied
# (the client held fewer in flight), so its operating point is 8: its 16.4 is 1.38x the
# defaults' 11.95 at 8, not 1.17x their 14.0 at 32.
DEFAULTS = [_level(0, 11.95, 3.3), _level(1, 14.0, 3.9)]
FP8 = [_level(0, 16.44, 3.3), _level(1, 49.8, 3.8, applied=False)]


def _study(tmp_path: Path, rounds: int) -> tuple[optuna.Study, Any]:
    cfg = parse_study({**QUICKSTART, "confirm_rounds": rounds,
                       "results_dir": str(tmp_path / "results"),
                       "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    study = optuna.create_study(direction="maximize")
    _add(study, {"quantization": "none"}, _as_attr({}, DEFAULTS, is_baseline=True),
         {"baseline": True})
    _add(study, {"quantization": "fp8"}, _as_attr({"quantization": "fp8"}, FP8), {})
    return study, cfg


def _as_attr(params: dict[str, Any], steps: list[StepMetrics], *,
             is_baseline: bool = False) -> dict[str, Any]:
    record, _ = _record(params, steps, is_baseline=is_baseline)
    return record.to_user_attr()


def _confirm(study: optuna.Study, cfg: Any,
             runs: list[tuple[list[StepMetrics], list[StepMetrics]]]) -> dict[str, Any]:
    """`confirm` with each round's runs measuring these levels (defaults', best's)."""
    planned = [steps for pair in runs for steps in pair]

    def measure(params: Any, label: str) -> optuna.trial.FrozenTrial:
        _add(study, dict(params), _as_attr(dict(params), planned.pop(0)), {"confirm": label})
        return study.trials[-1]

    confirm(study, cfg, measure, lambda: False)
    assert not planned, "every planned run was measured"
    return study.user_attrs[STUDY_ATTR_CONFIRM]


def test_a_round_whose_best_run_left_a_level_unapplied_compares_the_two_at_one_load(
        tmp_path: Path) -> None:
    study, cfg = _study(tmp_path, rounds=2)
    summary = _confirm(study, cfg, [
        ([_level(0, 12.0, 3.3), _level(1, 14.1, 3.9)],
         [_level(0, 16.6, 3.3), _level(1, 49.0, 3.8, applied=False)]),
        ([_level(0, 11.9, 3.3), _level(1, 13.9, 3.9)],
         [_level(0, 16.3, 3.3), _level(1, 50.1, 3.8, applied=False)])])
    assert summary["rounds"] == [
        {"defaults": pytest.approx(12.0), "best": pytest.approx(16.6), "load": "concurrency=8"},
        {"defaults": pytest.approx(11.9), "best": pytest.approx(16.3), "load": "concurrency=8"}]
    assert summary["ratios"] == [pytest.approx(16.6 / 12.0), pytest.approx(16.3 / 11.9)]
    sentence = summary["sentence"]
    assert "goodput 1.38x the vLLM defaults at concurrency=8, a load both applied (95% CI [" \
        in sentence and "over 2 rounds)" in sentence, sentence
    assert sentence.endswith("confirmed at concurrency=8: the 95% interval excludes 1.0"), \
        sentence
    assert "1.17x" not in sentence, "no ratio of 8 against 32"
    stored = confirmation_of(study)
    assert stored is not None and stored.load == "concurrency=8" and stored.num_rounds == 2
    line = gain_line(study, study.trials[1], cfg)
    assert line.startswith("goodput 1.38x the vLLM defaults at concurrency=8, a load both "
                           "applied (95% CI ["), line
    assert line.endswith("(re-measured interleaved with the defaults: confirmed at "
                         "concurrency=8: the 95% interval excludes 1.0)"), line


def test_a_round_at_no_load_both_runs_applied_is_named_and_never_averaged(
        tmp_path: Path) -> None:
    """Round 2's defaults run left concurrency 8 unapplied and the best run 32: no load both
    applied, so that round has no ratio; rounds 1 and 3 are averaged, of 3 each."""
    study, cfg = _study(tmp_path, rounds=3)
    best = [_level(0, 16.5, 3.3), _level(1, 49.0, 3.8, applied=False)]
    summary = _confirm(study, cfg, [
        ([_level(0, 12.0, 3.3), _level(1, 14.1, 3.9)], best),
        ([_level(0, 12.1, 3.3, applied=False), _level(1, 14.0, 3.9)], best),
        ([_level(0, 11.9, 3.3), _level(1, 13.9, 3.9)], best)])
    assert summary["ratios"][1] is None and summary["num_rounds"] == 2
    assert summary["gain"] == pytest.approx((16.5 / 12.0 * 16.5 / 11.9) ** 0.5)
    sentence = summary["sentence"]
    assert "at concurrency=8, a load both applied (95% CI [" in sentence and \
        "over 2 of 3 rounds); not averaged: round 2, not comparable at one load (its operating " \
        "point is concurrency=8, theirs concurrency=32, and neither level's load was applied " \
        "in both)" in sentence, sentence
    stored = confirmation_of(study)
    assert stored is not None and (stored.num_rounds, stored.rounds_each) == (2, 3)
    assert "over 2 of 3 rounds" in gain_line(study, study.trials[1], cfg)
    # MLflow's study run: the gain with the rounds it averages and the load they compared at.
    from optimizer.tracking.study_summary import study_summary

    metrics, tags = study_summary(study, cfg)
    assert metrics["confirm.gain"] == pytest.approx(summary["gain"])
    assert metrics["confirm.num_rounds"] == 2 and tags["confirm.load"] == "concurrency=8"


def test_every_round_at_no_common_load_states_no_ratio() -> None:
    summary = confirm_summary("goodput", 1, 0, [
        {"defaults": 14.0, "best": 16.5, "not_comparable": "its operating point is "
         "concurrency=8, theirs concurrency=32, and neither level's load was applied in both"}])
    assert summary["gain"] is None and not summary["is_confirmed"]
    assert summary["sentence"].endswith(
        "goodput: no ratio to the vLLM defaults: not comparable at one load in any round of 1 "
        "(round 1: its operating point is concurrency=8, theirs concurrency=32, and neither "
        "level's load was applied in both): not comparable, not confirmed"), summary["sentence"]


def test_rounds_where_every_level_was_applied_still_compare_the_operating_points(
        tmp_path: Path) -> None:
    """The common case, unchanged: each run's operating point (its best level), best against
    best, as Optuna holds them, and no load named."""
    study, cfg = _study(tmp_path, rounds=2)
    summary = _confirm(study, cfg, [
        ([_level(0, 12.0, 3.3), _level(1, 14.1, 3.9)],
         [_level(0, 16.6, 3.3), _level(1, 30.0, 3.8)]),
        ([_level(0, 11.9, 3.3), _level(1, 13.9, 3.9)],
         [_level(0, 16.3, 3.3), _level(1, 29.0, 3.8)])])
    assert summary["rounds"] == [{"defaults": pytest.approx(14.1), "best": pytest.approx(30.0)},
                                 {"defaults": pytest.approx(13.9), "best": pytest.approx(29.0)}]
    assert summary.get("load") is None and "concurrency" not in summary["sentence"]
    assert summary["sentence"] == confirm_summary(
        "goodput", 1, 0, [{"defaults": 14.1, "best": 30.0},
                          {"defaults": 13.9, "best": 29.0}])["sentence"]


def test_a_round_at_zero_is_a_measurement_and_the_rounds_are_counted() -> None:
    """The best measured goodput 0 in round 1 (a miss): a ratio of 0, averaged as one; it was
    called "a round had nothing to compare"."""
    summary = confirm_summary("goodput", 3, 0, [{"defaults": 10.0, "best": 0.0},
                                                {"defaults": 10.0, "best": 20.0}])
    sentence = summary["sentence"]
    assert summary["gain"] == pytest.approx(1.0) and not summary["is_confirmed"]
    assert "goodput 1.00x the vLLM defaults (2 rounds, no interval); trial 3 measured 0 (a " \
        "miss) in round 1 of 2, so the mean is of the ratios, not their logs: no interval (a " \
        "round's ratio was 0), not confirmed" in sentence, sentence
    assert "nothing to compare" not in sentence and "one measurement" not in sentence
    study, cfg = _morning_study(confirm=summary)
    line = gain_line(study, study.trials[3], cfg)
    assert "(2 rounds, no interval)" in line and "nothing to compare" not in line, line
    one = confirm_summary("goodput", 3, 0, [{"defaults": 10.0, "best": 0.0}])
    assert "trial 3 measured 0 (a miss) in round 1 of 1: one round: no interval" in \
        one["sentence"], one["sentence"]


def test_rounds_compared_at_two_places_average_only_one_and_name_the_other() -> None:
    """Round 1 compared the two at concurrency 8 (a level not applied), round 2 at their
    operating points: two different loads, so one ratio is averaged (the earlier's place on a
    tie) and the other named, not mixed into one mean."""
    summary = confirm_summary("goodput", 1, 0, [
        {"defaults": 12.0, "best": 16.5, "load": "concurrency=8"},
        {"defaults": 14.0, "best": 30.0}])
    assert summary["gain"] == pytest.approx(16.5 / 12.0) and summary["num_rounds"] == 1
    assert "1.38x the vLLM defaults at concurrency=8, a load both applied (1 of 2 rounds " \
        "compared: no interval); not averaged: round 2, compared at the two runs' operating " \
        "points: one round of 2 compared: no interval, not confirmed" in summary["sentence"], \
        summary["sentence"]


def _unapplied(i: int, goodput: float, tpot: float) -> StepMetrics:
    return _level(i, goodput, tpot, applied=False)


def test_rounds_where_no_level_of_either_run_applied_its_load_are_not_comparable(
        tmp_path: Path) -> None:
    """Every level of both runs unapplied: neither operating point is at a load applied, so
    the two are compared at no one load; they were averaged and "confirmed" (review s18)."""
    study, cfg = _study(tmp_path, rounds=2)
    summary = _confirm(study, cfg, [
        ([_unapplied(0, 12.0, 3.3), _unapplied(1, 14.1, 3.9)],
         [_unapplied(0, 16.6, 3.3), _unapplied(1, 49.0, 3.8)]),
        ([_unapplied(0, 11.9, 3.3), _unapplied(1, 13.9, 3.9)],
         [_unapplied(0, 16.3, 3.3), _unapplied(1, 50.1, 3.8)])])
    assert [r.get("not_comparable") for r in summary["rounds"]] == \
        ["no level of either applied its load"] * 2
    assert summary["gain"] is None and not summary["is_confirmed"]
    assert summary["sentence"].endswith("not comparable, not confirmed"), summary["sentence"]


def test_a_round_with_a_level_unapplied_and_both_operating_points_at_one_level_is_averaged(
        tmp_path: Path) -> None:
    """Round 2's defaults left concurrency 8 unapplied, yet both runs operate at 32, as in
    round 1 where nothing moved: both rounds compared at one place and are averaged; round 2
    was named "at concurrency=32" and set aside from round 1, "at the operating points"."""
    study, cfg = _study(tmp_path, rounds=2)
    summary = _confirm(study, cfg, [
        ([_level(0, 12.0, 3.3), _level(1, 14.1, 3.9)],
         [_level(0, 16.6, 3.3), _level(1, 49.0, 3.8)]),
        ([_unapplied(0, 11.9, 3.3), _level(1, 13.9, 3.9)],
         [_level(0, 16.3, 3.3), _level(1, 50.1, 3.8)])])
    assert summary["rounds"] == [{"defaults": pytest.approx(14.1), "best": pytest.approx(49.0)},
                                 {"defaults": pytest.approx(13.9), "best": pytest.approx(50.1)}]
    assert summary["num_rounds"] == 2 and summary["load"] is None
    sentence = summary["sentence"]
    assert "over 2 rounds)" in sentence and "not averaged" not in sentence, sentence
    assert sentence.endswith("confirmed: the 95% interval excludes 1.0"), sentence
