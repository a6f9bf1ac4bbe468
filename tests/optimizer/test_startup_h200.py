"""The compile-cache facts read back from the H200 run of issue 23 (docs/h200-widened.md, records
in fixtures/h200/widened/): the committed server logs classified by the shipped log parser, and the
estimated compile key against the key vLLM 0.26 itself used (its cache directory in the log)."""

from __future__ import annotations

import itertools
from pathlib import Path

import optuna
import pytest

from optimizer.results.trial_record import record_of
from runners.vllm.logs import parse_log

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "h200" / "widened"


@pytest.fixture(scope="module")
def startups() -> dict[int, dict[str, object]]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="h200-widened",
                              storage=f"sqlite:///{RUN / 'optuna.db'}")
    out = {}
    for trial in study.trials:
        record = record_of(trial)
        if record is not None and record.startup:
            out[trial.number] = dict(record.startup)
    return out


@pytest.mark.parametrize(("trial", "state"), [
    ("0000", "cold"),  # the defaults: first compile of their key on this machine
    ("0001", "cold"),  # the Hopper template
    ("0002", "warm"),  # fp8 weights: the regress run compiled the same key minutes before
    ("0003", "warm"),  # prefix caching off: outside the key, so the defaults' compile serves
    ("0004", "cold"),  # a sampled config of its own key
])
def test_the_h200_logs_say_warm_or_cold_as_the_start_up_went(trial: str, state: str) -> None:
    info = parse_log((RUN / "trials" / trial / "server.log").read_text())
    assert info.compile_cache == state


def test_the_estimated_key_groups_trials_exactly_as_vllms_own_key_did(
        startups: dict[int, dict[str, object]]) -> None:
    assert len(startups) == 5
    for a, b in itertools.combinations(sorted(startups), 2):
        same_estimate = startups[a]["compile_key"] == startups[b]["compile_key"]
        same_vllm = startups[a]["vllm_key"] == startups[b]["vllm_key"]
        assert same_estimate == same_vllm, (a, b)
    # The one pair that shared a key: the defaults and prefix caching off.
    assert startups[0]["vllm_key"] == startups[3]["vllm_key"]


def test_a_key_compiled_by_another_process_was_mispredicted_cold_and_recorded_so(
        startups: dict[int, dict[str, object]]) -> None:
    """The study predicts from the keys it compiled itself: trial 2's key was compiled by the
    regress run in the same cache root, so it started warm against a cold prediction, and the
    record says the prediction was wrong (docs/startup-cost.md)."""
    assert startups[2]["predicted"] == "cold" and startups[2]["compile_cache"] == "warm"
    assert startups[2]["is_prediction_right"] is False
    assert all(startups[n]["is_prediction_right"] for n in (0, 1, 3, 4))
    assert startups[3]["predicted"] == "warm"  # launched with VLLM_FORCE_AOT_LOAD=1: it held
    assert startups[3]["is_warm_check_refused"] is False
