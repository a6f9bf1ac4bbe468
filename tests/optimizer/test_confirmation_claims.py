"""What the final comparison may claim (held-out check s17, #4 and #4b): defaults that could
not run (infeasible before launch, an OOM) are not launched again and no gain over them is
stated, never "infx"; a round whose defaults measured 0 gives no ratio; and the simulated
engine's repeats, no confirmation, never change the pick nor are called the confirmation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import parse_study
from optimizer.export import render, select_trial
from optimizer.export.render import gain_line
from optimizer.results.confirmation import SIMULATED_VERDICT, confirm, confirm_summary
from optimizer.results.trial_record import STUDY_ATTR_CONFIRM, TrialRecord, confirmation_of
from tests.optimizer.test_export import _morning_study, _noise

INFEASIBLE = ("the weights need 131.4 GiB per GPU but gpu_memory_utilization 0.92 of 80 GiB "
              "allows 73.3 GiB")


def _seventy_b(tmp_path: Path) -> tuple[optuna.Study, Any]:
    """The s17 70B study's end: the defaults rejected before launch (held complete in Optuna
    with the worst value, as `tell_config_failure` tells it; `failed` in its record) and a
    measured TP 8 trial, with a confirmation round asked for."""
    cfg = parse_study({"name": "x17-70b", "model": {"path": "qwen2.5-7b"},
                       "budget": {"trials": 2}, "slo": {"ttft_p99_ms": 2500},
                       "confirm_rounds": 2, "results_dir": str(tmp_path / "results"),
                       "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    study = optuna.create_study(direction="maximize")
    dist = {"tensor_parallel_size": optuna.distributions.CategoricalDistribution([1, 8])}
    defaults = TrialRecord.failed({"tensor_parallel_size": 1}, "infeasible", INFEASIBLE,
                                  f"rejected before launch (infeasible): {INFEASIBLE}",
                                  is_baseline=True)
    study.add_trial(optuna.trial.create_trial(
        params={"tensor_parallel_size": 1}, distributions=dist, value=0.0,
        user_attrs={"record": defaults.to_user_attr(), "baseline": True}))
    tp8 = {"state": "complete", "params": {"tensor_parallel_size": 8},
           "flags": {"tensor_parallel_size": 8}, "values": [0.444], "metrics": {},
           "steps": [], "argv": ["vllm", "serve"], "env": {},
           "conclusion": "tensor_parallel_size=8: no defaults measurement to compare with"}
    study.add_trial(optuna.trial.create_trial(
        params={"tensor_parallel_size": 8}, distributions=dist, value=0.444,
        user_attrs={"record": tp8}))
    return study, cfg


def test_defaults_that_could_not_run_are_not_launched_again_and_no_gain_is_stated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    study, cfg = _seventy_b(tmp_path)
    launched: list[str] = []

    def measure(params: Any, label: str) -> None:
        launched.append(label)

    caplog.set_level("INFO", logger="optimizer.results.confirmation")
    confirm(study, cfg, measure, lambda: False)
    assert launched == [], "the pre-launch check already called the defaults infeasible"
    assert STUDY_ATTR_CONFIRM not in study.user_attrs
    assert f"no final confirmation: the vLLM defaults could not run (infeasible: " \
        f"{INFEASIBLE})" in caplog.text
    line = gain_line(study, study.trials[1], cfg)
    assert line == f"none stated: the vLLM defaults could not run (infeasible: {INFEASIBLE})", \
        line


def test_a_round_whose_defaults_measured_zero_states_no_ratio_never_inf() -> None:
    summary = confirm_summary("goodput", 3, 0, [{"defaults": 0.0, "best": 39.9},
                                                {"defaults": 30.0, "best": 39.9}])
    assert summary["gain"] is None and not summary["is_confirmed"]
    assert "inf" not in summary["sentence"], summary["sentence"]
    assert summary["sentence"].endswith(
        "goodput: no ratio to the vLLM defaults (the vLLM defaults measured 0 in round 1 of "
        "2): "
        "no ratio, not confirmed"), summary["sentence"]
    json.dumps(summary, allow_nan=False)  # nothing non-finite is stored
    study, cfg = _morning_study(confirm=summary)
    line = gain_line(study, study.trials[3], cfg)
    assert line.startswith("none stated: trial 3 (the exported config)") and "inf" not in line
    # MLflow's study metrics hold no gain, not a 0 in its place (read back as None).
    from optimizer.tracking.study_summary import study_summary

    stored = confirmation_of(study)
    assert stored is not None and stored.gain is None
    metrics, tags = study_summary(study, cfg)
    assert "confirm.gain" not in metrics and tags["confirmed"] == "false"


def test_a_study_that_stored_an_infinite_gain_is_never_printed_infx() -> None:
    # What a study confirmed before the fix holds: the ratio over an infeasible defaults' 0.
    stored = {**_noise(None, None), "gain": float("inf"), "ratios": [float("inf")] * 2,
              "sentence": "trial 3 (the exported config) vs the defaults (trial 0), re-run "
                          "interleaved: goodput infx the vLLM defaults (2 rounds, no interval)"}
    study, cfg = _morning_study(confirm=stored)
    text = render(study.trials[3], cfg, "sh", study=study)
    gain = next(line for line in text.splitlines() if line.startswith("# gain: "))
    assert gain.startswith("# gain: none stated: "), gain


def test_simulated_repeats_within_noise_do_not_change_the_pick_nor_are_called_a_confirmation(
) -> None:
    from optimizer.cli.results import recommendation_text
    from optimizer.export import choice_note
    from optimizer.results.recommendation import confirmation_sentence, recommended_trial

    repeats = {**_noise(0.04, 42.98), "is_simulated": True,
               "sentence": "trial 3 (the exported config) vs the defaults (trial 0), re-run "
                           "interleaved on the simulated engine: goodput 1.05x the vLLM "
                           f"defaults (95% CI [0.04x, 42.98x] over 2 rounds): {SIMULATED_VERDICT}"}
    study, cfg = _morning_study(confirm=repeats)
    confirmed = confirmation_of(study)
    assert confirmed is not None and confirmed.is_simulated
    chosen = select_trial(study, cfg)
    assert chosen.number == 3 and recommended_trial(study).number == 3, \
        "the simulated repeats leave the search's pick"
    assert "final confirmation" not in choice_note(study, chosen)
    assert "final confirmation" not in recommendation_text(study, cfg.objectives)
    assert "(the exported config)" in confirmation_sentence(study)
    text = render(chosen, cfg, "sh", study=study)
    gain = next(line for line in text.splitlines() if line.startswith("# gain: "))
    assert gain.startswith("# gain: goodput 1.05x the vLLM defaults (95% CI [0.04x, 42.98x] "
                           "over 2 rounds); not confirmed (re-run interleaved with the defaults "
                           "on the simulated engine: simulated: repeats of a model, not a "
                           "confirmation"), gain
    assert "final confirmation" not in text
    # Measured repeats within noise still make the defaults the pick (docs/commands.md).
    measured, _ = _morning_study(confirm=_noise(0.97, 1.13))
    assert recommended_trial(measured).number == 0


def test_the_simulated_verdict_names_the_hosts_load_not_the_model_alone() -> None:
    assert "host's load" in SIMULATED_VERDICT and "model's spread" not in SIMULATED_VERDICT
    assert "not a confirmation" in SIMULATED_VERDICT and \
        "do not change the pick" in SIMULATED_VERDICT


def test_the_simulated_repeats_are_never_logged_as_confirming(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from runners.capacity.bracket import Bracket
    from tests.optimizer.test_gains_conclusions import (
        DEFAULTS_BRACKET,
        FP8_BRACKET,
        _add,
        _record,
    )

    argv = ["python3", "-m", "runners.simulated", "--port", "1"]
    cfg = parse_study({"name": "engine", "model": {"path": "qwen2.5-7b"},
                       "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 50},
                       "confirm_rounds": 2, "results_dir": str(tmp_path / "results"),
                       "workload": {"capacity": {"axis": "request_rate", "low": 1, "high": 40}},
                       "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"})
    study = optuna.create_study(direction="maximize")
    _add(study, {"quantization": "none"},
         {**_record({}, 8.7, DEFAULTS_BRACKET, True), "argv": argv}, {"baseline": True})
    _add(study, {"quantization": "fp8"},
         {**_record({"quantization": "fp8"}, 18.5, FP8_BRACKET), "argv": argv}, {})

    def measure(params: Any, label: str) -> optuna.trial.FrozenTrial:
        record = _record(dict(params), 19.0 if params.get("quantization") == "fp8" else 9.0,
                         Bracket("request_rate", 9.5, 10.0, "resolved", 6))
        _add(study, dict(params), {**record, "argv": argv}, {"confirm": label})
        return study.trials[-1]

    caplog.set_level("INFO", logger="optimizer.results.confirmation")
    confirm(study, cfg, measure, lambda: False)
    assert "simulated repeats (not a confirmation): trial 1 (best) vs trial 0" in caplog.text
    assert "confirming" not in caplog.text
