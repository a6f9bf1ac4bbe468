"""The report's one-knob effects, its headline and `status`'s recommended line at one load: a
fixed level judged "load not applied" moves a trial's operating point to a lighter level, and
an effect, a gain or a figure beside one is never stated across two loads unnamed (the gains
and records of test_gains_same_load)."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from optimizer.cli.results import recommendation_text
from optimizer.config import parse_study
from optimizer.report import build_report, headline, render_html, render_markdown
from optimizer.report.build import Report
from optimizer.report.render import best_tags
from runners.base import StepMetrics
from tests.optimizer.test_gains_same_load import (
    DEFAULTS,
    QUICKSTART,
    _level,
    _metrics,
    _moved_best_study,
    _pair,
    _study,
)


def _report(study: optuna.Study) -> Report:
    return build_report(study, parse_study(QUICKSTART), with_importances=False)


def _repeated(step: StepMetrics, low: float, high: float) -> StepMetrics:
    """The level measured twice on one server (goodput `low` and `high`): its spread."""
    return replace(step, repeats=(_metrics(low, 3.3), _metrics(high, 3.3)))


def test_a_one_knob_effect_whose_operating_point_moved_is_taken_at_the_load_both_applied(
        ) -> None:
    """DP 2 operates at concurrency 8 (its 32 not applied), the defaults at 32: its effect is
    35 / 11.95 per GPU at 8, with the two spreads there (10% the defaults', 5% its), not
    35 / 32.9 across two loads with the defaults' spread at 32 (1%)."""
    defaults = [_repeated(DEFAULTS[0], 9.0, 10.0), _repeated(DEFAULTS[1], 32.0, 32.32)]
    moved = [_repeated(_level(0, 70.0, 3.4), 66.5, 70.0),
             _level(1, 80.0, 3.9, applied=False)]
    report = _report(_pair(defaults, moved, {"data_parallel_size": 2}))
    (effect,) = report.knob_effects
    assert effect.param == "data_parallel_size" and effect.gain.load == "concurrency=8"
    assert effect.gain.value == pytest.approx(35.0 / 11.95), "not 35 / 32.9 across two loads"
    assert (effect.measured, effect.defaults_measured) == (35.0, 11.95)
    assert effect.spread == pytest.approx(0.1), "the spreads at the load compared"
    assert effect.verdict == "beyond the repeats' spread (10%)"
    assert "| data_parallel_size | 2 | 1 | 2.93x (1 run) at concurrency=8 |" in \
        render_markdown(report)
    assert report.knobs_not_comparable == ()


def test_a_one_knob_pair_with_no_common_applied_load_is_left_out_and_counted() -> None:
    """The defaults' 8 was not applied (they operate at 32), the config's 32 was not (it
    operates at 8): no load both applied, no effect; the report says which trial and why."""
    defaults = [_level(0, 11.95, 3.3, applied=False), DEFAULTS[1]]
    moved = [_level(0, 70.0, 3.4), _level(1, 80.0, 3.9, applied=False)]
    report = _report(_pair(defaults, moved, {"data_parallel_size": 2}))
    assert report.knob_effects == ()
    why = ("its operating point is concurrency=8, theirs concurrency=32, and neither level's "
           "load was applied in both")
    assert report.knobs_not_comparable == ((1, why),)
    line = (f"Left out, 1 one-change trial not comparable with the defaults at one load: "
            f"trial 1 ({why}).")
    markdown = render_markdown(report)
    assert "## One knob at a time" in markdown and line in markdown
    assert "| data_parallel_size |" not in markdown, "no row across two loads"
    html = render_html(report)
    assert 'id="knobs-left-out"' in html and 'id="knob-effects"' not in html
    # The headline's figures name their loads beside "no ratio".
    text = headline(report)
    assert "35 req/s per GPU at concurrency=8, no ratio to the vLLM defaults per GPU: not " \
        "comparable at one load" in text, text
    assert "(trial 0: 32.9 req/s at concurrency=32) measured in the same study" in text, text


def test_the_headline_names_the_load_of_each_figure_beside_a_gain_at_one_load() -> None:
    """The best operates at 8 (its 32 not applied), the defaults at 32: the headline's gain is
    at 8, and the defaults' figure beside it is theirs at 8 too, not 32.9 alone (35 / 32.9 is
    not the 2.93x it states)."""
    report = _report(_moved_best_study())
    text = headline(report)
    assert ("goodput 70 req/s on 2 GPUs = 35 req/s per GPU at concurrency=8, 2.93x the vLLM "
            "defaults per GPU at concurrency=8, a load both applied") in text, text
    assert "(trial 0: 32.9 req/s at concurrency=32 and 11.9 req/s at concurrency=8) " \
        "measured in the same study" in text, text
    assert best_tags(report)["best.metric"] == \
        "goodput 70 req/s on 2 GPUs = 35 req/s per GPU at concurrency=8"
    # The best at 32 (applied), the defaults moved to 8: the best's figure at 8 stands beside.
    moved_defaults = [DEFAULTS[0], _level(1, 20.0, 3.9, applied=False)]
    report = _report(_pair(moved_defaults, [_level(0, 15.0, 3.3), _level(1, 40.0, 3.8)],
                           {"data_parallel_size": 1, "quantization": "fp8"}))
    text = headline(report)
    assert "goodput 40 req/s at concurrency=32 and 15 req/s at concurrency=8, 1.26x the vLLM " \
        "defaults at concurrency=8, a load both applied" in text, text
    assert "(trial 0: 11.9 req/s at concurrency=8) measured" in text, text


def test_every_level_applied_leaves_the_headline_and_knobs_as_they_were() -> None:
    report = _report(_study())
    assert headline(report).startswith(
        "Best: trial 1 (quantization=fp8), goodput 42.8 req/s, 1.30x the vLLM defaults (one "
        "measurement each: no interval) (trial 0: 32.9 req/s) measured in the same study.")
    assert [(e.number, round(e.gain.value or 0, 2), e.gain.load)
            for e in report.knob_effects] == [(1, 1.3, None)]


def test_status_names_the_load_of_a_recommended_trial_whose_operating_point_moved() -> None:
    assert recommendation_text(_moved_best_study(), ["goodput"]) == (
        "recommended: trial 1, goodput 35.0 req/s/GPU at concurrency=8 (the load of "
        "concurrency=32 was not applied)")
    assert recommendation_text(_study(), ["goodput"]) == \
        "recommended: trial 1, goodput 42.8 req/s/GPU", "every level applied: as before"


def test_a_levels_spread_is_kept_for_every_objective_ttft_too() -> None:
    """A one-knob effect at a load other than an operating point reads the spreads there: a
    TTFT study's levels kept none, and its repeats would read "one measurement each"."""
    from optimizer.results.at_load import at_loads
    from optimizer.results.trial_record import step_records

    step = replace(_level(0, 12.0, 3.3), repeats=tuple(
        replace(_metrics(12.0, 3.3), p99_ttft_ms=ttft) for ttft in (90.0, 100.0)))
    loads = at_loads("ttft", step_records([step]), 1, 0)
    assert loads.levels["concurrency=8"].spread == pytest.approx(0.1)
