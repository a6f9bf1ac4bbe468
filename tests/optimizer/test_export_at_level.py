"""Every line of an export describes one load: `export --max-tpot-ms` picks a trial at a fixed
level, and its header's first line, SLO line and gain are that level's (they were the trial's
operating point's beside a note naming the level); a trial whose operating point moved (a
level's load not applied) names the load its figures are at, in the export header and in
`status`'s table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.cli import main
from optimizer.cli.results import status_rows
from optimizer.cli.table import moved_note, trial_table
from optimizer.config import parse_study
from optimizer.export import render
from optimizer.results.trial_record import STUDY_ATTR_FINGERPRINT
from tests.builders import study_dict
from tests.optimizer.test_cli import _draw
from tests.optimizer.test_gains_same_load import DEFAULTS, QUICKSTART, _level, _study


def _fingerprinted(study: optuna.Study, cfg: object) -> optuna.Study:
    """`study` with the fingerprint `start` stores (the header's SLO line reads its bounds)."""
    from optimizer.run.engine_choice import simulated_hardware
    from optimizer.tuning_memory.fingerprint_of import fingerprint_of
    from runners.model_info import load_model_info

    fp = fingerprint_of(cfg, engine="simulated", engine_version="simulated 0.26.0",  # type: ignore[arg-type]
                        hardware=simulated_hardware("h200", 2),
                        model=load_model_info("qwen2.5-7b"))
    study.set_user_attr(STUDY_ATTR_FINGERPRINT, fp.to_dict())
    return study


def _stored(tmp_path: Path) -> Path:
    """The quickstart's three trials stored where the study file written here points; the
    file's path."""
    data = study_dict(tmp_path, name="quickstart", workload=QUICKSTART["workload"],
                      slo=QUICKSTART["slo"])
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    (tmp_path / "results").mkdir()
    _fingerprinted(_study(optuna.create_study(
        direction="maximize", storage=f"sqlite:///{tmp_path}/results/optuna.db",
        study_name="quickstart")), parse_study(data))
    return path


def _header(text: str) -> list[str]:
    return [line.removeprefix("# ") for line in text.splitlines() if line.startswith("# ")]


def test_export_max_tpot_ms_states_the_picked_levels_figure_slo_and_gain(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """TPOT p99 <= 3.5 ms picks trial 1 at concurrency 8 (16.4 req/s/GPU, TPOT 3.32 ms); its
    operating point is 32 (42.8 req/s/GPU, TPOT 3.85 ms). The header said 42.8, the p99s at
    32 and "1.30x the vLLM defaults" (42.8 / 32.9 at 32) beside the note naming 8: at 8 it is
    16.4 / 11.95, 1.38x."""
    path = _stored(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(path), "--max-tpot-ms", "3.5", "--format", "sh"]) == 0
    head = _header(capsys.readouterr().out)
    assert head[0] == ("nightshift study 'quickstart', trial 1 at concurrency=8 (the level "
                       "picked; its operating point is concurrency=32): goodput 16.4 req/s per "
                       "GPU on 1 GPU"), head[0]
    slo = next(line for line in head if line.startswith("slo: "))
    assert "TPOT p99 <= 10 ms (concurrency=8's p99: 3.32 ms, met)" in slo, slo
    gain = next(line for line in head if line.startswith("gain: "))
    assert gain.startswith("gain: goodput 1.38x the vLLM defaults at concurrency=8, a load "
                           "both applied (one measurement each: no interval)"), gain
    assert not any(figure in line for line in head[:-2] for figure in ("42.8", "3.85", "1.30x")), \
        "no figure of the operating point stands in a header picked at another level"


def test_a_level_the_defaults_did_not_apply_gives_no_ratio_at_the_picked_level() -> None:
    """The defaults' concurrency 8 was not applied: the pick at 8 has nothing of theirs to be
    compared with there (the ratio at the operating points, 42.8 / 32.9, is of another load)."""
    cfg = parse_study(QUICKSTART)
    study = _fingerprinted(_study(defaults=[_level(0, 11.95, 3.30, applied=False),
                                            DEFAULTS[1]]), cfg)
    gain = next(line for line in _header(render(study.trials[1], cfg, "sh", study=study,
                                                level="concurrency=8"))
                if line.startswith("gain: "))
    assert gain.startswith("gain: goodput no ratio to the vLLM defaults: not comparable at one "
                           "load (the load of their concurrency=8 was not applied)"), gain


def test_a_confirmations_interval_of_the_operating_points_is_not_the_picked_levels_gain(
        ) -> None:
    """The final confirmation re-measured trial 1 against the defaults at their operating
    points (1.30x): the pick at concurrency 8 states the search's ratio there, not that
    interval, and says what the confirmation re-measured."""
    cfg = parse_study(QUICKSTART)
    study = _fingerprinted(_study(), cfg)
    study.set_user_attr("confirm", {
        "objective": "goodput", "best_trial": 1, "baseline_trial": 0, "gain": 1.30,
        "ci_low": 1.2, "ci_high": 1.4, "ratios": [1.25, 1.35], "is_confirmed": True})
    gain = next(line for line in _header(render(study.trials[1], cfg, "sh", study=study,
                                                level="concurrency=8"))
                if line.startswith("gain: "))
    assert gain == ("gain: goodput 1.38x the vLLM defaults at concurrency=8, a load both "
                    "applied (one measurement each: no interval); not confirmed (the final "
                    "confirmation compared the two runs' operating points, not at this "
                    "level)"), gain
    at_operating_point = next(line for line in _header(render(study.trials[1], cfg, "sh",
                                                              study=study))
                              if line.startswith("gain: "))
    assert "95% CI [1.20x, 1.40x] over 2 rounds); confirmed" in at_operating_point


def test_the_export_header_names_the_load_a_moved_operating_point_is_at() -> None:
    """Trial 2 (the quickstart's 11, 2 replicas): its 32 not applied, its 8.93 req/s per GPU
    is at concurrency 8; trial 1 did not move, and its line is as it was."""
    cfg = parse_study(QUICKSTART)
    study = _fingerprinted(_study(), cfg)
    moved = _header(render(study.trials[2], cfg, "sh", study=study))[0]
    assert moved == ("nightshift study 'quickstart', trial 2: goodput 8.93 req/s per GPU on 2 "
                     "GPUs at concurrency=8 (its operating point; the load of concurrency=32 "
                     "was not applied)"), moved
    still = _header(render(study.trials[1], cfg, "sh", study=study))[0]
    assert still == "nightshift study 'quickstart', trial 1: goodput 42.8 req/s per GPU on 1 GPU"
    unapplied = _fingerprinted(_study(defaults=[_level(0, 11.95, 3.3, applied=False),
                                                _level(1, 32.9, 3.9, applied=False)]), cfg)
    first = _header(render(unapplied.trials[0], cfg, "sh", study=unapplied))[0]
    assert first.endswith("goodput 32.9 req/s per GPU on 1 GPU (no level's load was applied: "
                          "its figures are concurrency=32's, at another load)"), first
    picked = _header(render(unapplied.trials[0], cfg, "sh", study=unapplied,
                            level="concurrency=8"))[0]
    assert "trial 0 at concurrency=8 (the level picked; its operating point is concurrency=32, " \
        "whose load was not applied)" in picked, picked


def test_status_names_the_load_of_a_moved_operating_point_under_its_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Trial 2's 8.93 req/s per GPU is at concurrency 8 (its 32 not applied), the others' at
    32: its figure is marked and the load named under the table."""
    path = _stored(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["status", str(path)]) == 0
    text = capsys.readouterr().out
    assert "8.93*" in text and "42.8*" not in text and "32.9*" not in text, text
    assert ("*: a level's load was not applied, so the row's figures are at the load named: "
            "trial 2 at concurrency=8.") in text, text


def test_the_status_table_is_no_wider_where_something_moved_and_fits_80_columns() -> None:
    """The mark fits the column a figure and its header already take (the narrowest layout
    has no room to spare at 80 columns with two p99 columns); a trial whose every level's load
    was not applied is at its own level, said so."""
    rows = status_rows(_study().get_trials(), objective="goodput")
    assert [r.at_load for r in rows] == ["", "", "at concurrency=8"]
    unmoved = [replace(r, at_load="") for r in rows]
    for width in (80, 160):
        drawn = _draw(trial_table(rows, ["goodput"], width, latencies=("ttft", "tpot")), width)
        assert max(len(line.rstrip()) for line in drawn) <= width
        assert [len(line) for line in drawn] == [len(line) for line in _draw(trial_table(
            unmoved, ["goodput"], width, latencies=("ttft", "tpot")), width)]
    assert moved_note(unmoved) == ""
    everything_unapplied = status_rows(_study(defaults=[_level(0, 11.95, 3.3, applied=False),
                                                        _level(1, 32.9, 3.9, applied=False)]
                                              ).get_trials(), objective="goodput")
    assert everything_unapplied[0].at_load == (
        "(no level's load was applied: its figures are concurrency=32's, at another load)")


def test_the_recommendation_line_names_the_load_of_a_moved_operating_point() -> None:
    """`status` and the end-of-run line: the DP-2 pick's 35 req/s per GPU is at concurrency 8
    (its 32 not applied); a pick that did not move reads as before."""
    from optimizer.cli.results import recommendation_text
    from tests.optimizer.test_gains_same_load import _moved_best_study

    assert recommendation_text(_moved_best_study(), ["goodput"]) == \
        "recommended: trial 1, goodput 35.0 req/s/GPU at concurrency=8 (the load of " \
        "concurrency=32 was not applied)"
    assert recommendation_text(_study(), ["goodput"]) == \
        "recommended: trial 1, goodput 42.8 req/s/GPU"


def test_the_status_note_of_a_trial_with_no_level_applied_says_its_figures_are_at_no_load(
        ) -> None:
    """Every level of the defaults unapplied: its figure is concurrency 32's, at another load
    than 32; the note said the row's figures "are at the load named: trial 0 at
    concurrency=32, its load not applied" (review s18)."""
    rows = status_rows(_study(defaults=[_level(0, 11.95, 3.3, applied=False),
                                        _level(1, 32.9, 3.9, applied=False)]).get_trials(),
                       objective="goodput")
    assert moved_note(rows) == (
        "*: a level's load was not applied, so the row's figures are as named: trial 0 (no "
        "level's load was applied: its figures are concurrency=32's, at another load); trial 2 "
        "at concurrency=8.")
    assert moved_note(rows[1:]) == ("*: a level's load was not applied, so the row's figures "
                                    "are at the load named: trial 2 at concurrency=8.")


def _confirmed(load: str | None = None) -> tuple[optuna.Study, object]:
    """The quickstart's trials, trial 1 re-measured against the defaults: 1.30x [1.20, 1.40]
    over 2 rounds, compared at `load` (None: the two runs' operating points)."""
    cfg = parse_study(QUICKSTART)
    study = _fingerprinted(_study(), cfg)
    study.set_user_attr("confirm", {
        "objective": "goodput", "best_trial": 1, "baseline_trial": 0, "gain": 1.30,
        "ci_low": 1.2, "ci_high": 1.4, "ratios": [1.25, 1.35], "is_confirmed": True,
        "load": load})
    return study, cfg


def _gain_at(study: optuna.Study, cfg: object, level: str | None) -> str:
    return next(line for line in _header(render(study.trials[1], cfg, "sh", study=study,  # type: ignore[arg-type]
                                                level=level))
                if line.startswith("gain: "))


def test_a_level_picked_at_the_operating_point_states_the_confirmations_interval() -> None:
    """Trial 1's operating point is concurrency 32: picked there, its gain is the one the
    confirmation's rounds measured at the operating points, as without --max-tpot-ms; it read
    "one measurement each ... not confirmed (the final confirmation re-measured its operating
    point, not this level)" under a first line saying the level is its operating point."""
    study, cfg = _confirmed()
    at_level = _gain_at(study, cfg, "concurrency=32")
    assert at_level == _gain_at(study, cfg, None), at_level
    assert "(95% CI [1.20x, 1.40x] over 2 rounds); confirmed" in at_level, at_level


def test_a_level_picked_where_the_confirmation_compared_states_its_interval() -> None:
    """The confirmation compared the two at concurrency 8 (a level not applied): picked at
    8, the gain is its interval there; picked at 32, the search's ratio, saying where the
    confirmation compared."""
    study, cfg = _confirmed("concurrency=8")
    at_8 = _gain_at(study, cfg, "concurrency=8")
    assert at_8.startswith("gain: goodput 1.30x the vLLM defaults at concurrency=8, a load both "
                           "applied (95% CI [1.20x, 1.40x] over 2 rounds); confirmed"), at_8
    at_32 = _gain_at(study, cfg, "concurrency=32")
    assert at_32.endswith("; not confirmed (the final confirmation compared the two at "
                          "concurrency=8, not at this level)"), at_32
