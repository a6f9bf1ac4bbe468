"""The H200 run of session 8 read back through the shipped code (docs/h200-knobs.md, records in
fixtures/h200/knobs/): the widened knobs one at a time against the defaults on the shared-prefix
load (Qwen2.5-7B shape), and prompt-lookup speculation on SmolLM2-135M's real weights with text
prompts through its tokenizer. Every figure the doc states comes from these records."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import load_study
from optimizer.report import build_report
from optimizer.results.trial_record import record_of
from runners.prometheus import spec_decode_acceptance
from runners.vllm.logs import parse_log

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "tests" / "fixtures" / "h200" / "knobs"


def _study(name: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=f"h200-{name}",
                             storage=f"sqlite:///{RUN / name / 'optuna.db'}")


@pytest.fixture(scope="module")
def knobs() -> optuna.Study:
    return _study("knobs")


@pytest.fixture(scope="module")
def spec() -> optuna.Study:
    return _study("spec")


def test_each_knob_against_the_defaults_as_the_doc_states(knobs: optuna.Study) -> None:
    report = build_report(knobs, load_study(REPO / "bench" / "h200" / "knobs.yaml"))
    assert report.baseline is not None and round(report.baseline.value or 0, 1) == 36.5
    effects = [(e.param, str(e.value), round(e.gain.value or 0, 2), e.verdict)
               for e in report.knob_effects]
    assert effects == [
        ("enable_prefix_caching", "False", 0.05, "beyond the repeats' spread (3%)"),
        ("cudagraph_mode", "PIECEWISE", 0.32, "within the repeats' spread (100%)"),
        ("quantization", "fp8", 1.39, "beyond the repeats' spread (3%)"),
        ("stream_interval", "16", 0.91, "beyond the repeats' spread (2%)"),
        ("long_prefill_token_threshold", "512", 0.96, "beyond the repeats' spread (1%)"),
        ("kv_cache_dtype", "fp8", 0.98, "within noise (under 2%)"),
        ("max_cudagraph_capture_size", "64", 1.0, "within noise (under 2%)"),
    ]
    assert report.importances == {}, "8 trials: fANOVA needs 9 here (7 varied + 2)"
    assert report.queued == 1, "async scheduling off was queued and never ran"


def test_the_estimated_compile_key_predicted_every_start(knobs: optuna.Study) -> None:
    startups = {t.number: dict(r.startup) for t in knobs.trials
                if (r := record_of(t)) is not None and r.startup}
    assert len(startups) == 8
    assert all(s["is_prediction_right"] for s in startups.values())
    for a, b in itertools.combinations(sorted(startups), 2):
        same_estimate = startups[a]["compile_key"] == startups[b]["compile_key"]
        assert same_estimate == (startups[a]["vllm_key"] == startups[b]["vllm_key"]), (a, b)
    # Prefix caching, the prefill threshold and the stream interval are outside the key: the
    # three launched warm after the defaults, under VLLM_FORCE_AOT_LOAD, and loaded the AOT
    # artefact.
    for number in (1, 2, 3):
        assert startups[number]["predicted"] == startups[number]["compile_cache"] == "warm"
        log = (RUN / "knobs" / "trials" / f"{number:04d}" / "server.log").read_text()
        assert "Directly load AOT compilation" in log
        assert parse_log(log).compile_cache == "warm"


def _headline_server(trial: optuna.trial.FrozenTrial, level: int) -> dict[str, Any]:
    record = record_of(trial)
    assert record is not None
    return dict(record.steps[level]["server"])


def test_ngram_drafts_were_accepted_yet_goodput_fell(spec: optuna.Study) -> None:
    defaults, ngram = spec.trials[0], spec.trials[1]
    assert ngram.params == {"spec_method": "ngram", "spec_tokens": 4}
    got = spec_decode_acceptance(_headline_server(ngram, 1))
    assert round(got["spec_decode_acceptance_rate"], 2) == 0.83
    assert round(got["spec_decode_mean_acceptance_length"], 1) == 4.3
    assert spec_decode_acceptance(_headline_server(defaults, 1)) == {}
    assert round(ngram.values[0] / defaults.values[0], 2) == 0.37
    log = (RUN / "spec" / "trials" / "0001" / "server.log").read_text()
    assert "Async scheduling not supported with ngram-based speculative decoding" in log
    assert parse_log(log).async_scheduling is False
    defaults_log = (RUN / "spec" / "trials" / "0000" / "server.log").read_text()
    assert parse_log(defaults_log).async_scheduling is True
    assert (parse_log(defaults_log).model_runner, parse_log(log).model_runner) == ("V2", "V1")


def test_text_prompts_counted_by_the_client_match_vllms_usage(spec: optuna.Study) -> None:
    """Issue 21 on the GPU: SmolLM2's tokenizer.json in the load generator against vLLM's own
    usage.prompt_tokens, every request of every level of both trials."""
    for trial in spec.trials[:2]:
        for level in (0, 1):
            server = _headline_server(trial, level)
            assert server["prompt_len_is_estimated"] == 0.0
            assert server["prompt_tokens_server_minus_client_max_abs"] == 0.0
