"""The quality gate's H200 proof read back through the shipped code (docs/quality.md, records in
fixtures/h200/quality/): each scored trial's figures recomputed from the committed samples by
`runners.quality_eval.compare`, the noise floor, and the verdicts of the default limits."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from optimizer.config import parse_study
from optimizer.results.quality_gate import limits_failed
from optimizer.results.trial_record import record_of
from runners.quality_eval import QualitySample, QualityScores, compare

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "tests" / "fixtures" / "h200" / "quality"


@pytest.fixture(scope="module")
def reference() -> dict[str, object]:
    data: dict[str, object] = json.loads((RUN / "reference.json").read_text())
    return data


def _study() -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name="h200-quality", storage=f"sqlite:///{RUN}/optuna.db")


def test_the_noise_floor_was_zero_on_the_h200(reference: dict[str, object]) -> None:
    one = QualitySample.from_dict(reference["one_at_a_time"])  # type: ignore[arg-type]
    many = QualitySample.from_dict(reference["all_at_once"])  # type: ignore[arg-type]
    floor = compare(many, one)
    assert floor.mean_kl == 0 and floor.top1_agreement == 1.0 and floor.ppl_increase == 0, \
        "32 prompts at once gave the logprobs of one at a time (docs/quality.md)"


def test_each_scored_trial_recomputes_from_its_committed_sample(
        reference: dict[str, object]) -> None:
    one = QualitySample.from_dict(reference["one_at_a_time"])  # type: ignore[arg-type]
    scored = 0
    for trial in _study().get_trials(deepcopy=False):
        record = record_of(trial)
        stored = (record.to_user_attr().get("quality") or {}) if record else {}
        path = RUN / "trials" / f"{trial.number:04d}" / "quality.json"
        if stored.get("status") != "scored" or not path.is_file():
            continue
        data = json.loads(path.read_text())
        sample = QualitySample.from_dict(data.get("all_at_once") or data)
        again = compare(sample, one)
        assert again.ppl_increase == pytest.approx(stored["scores"]["ppl_increase"], abs=1e-9)
        assert again.mean_kl == pytest.approx(stored["scores"]["mean_kl"], abs=1e-9)
        scored += 1
    assert scored == 4, "trials 1-4 were scored (5 repeated 3; 6 changed no numerics)"


def test_the_default_limits_pass_fp8_kv_and_refuse_fp8_weights() -> None:
    defaults = parse_study({"name": "q", "model": {"path": "qwen2.5-7b"},
                            "slo": {"tpot_p99_ms": 20}, "budget": {"trials": 1}})
    verdicts = {}
    for trial in _study().get_trials(deepcopy=False):
        record = record_of(trial)
        stored = (record.to_user_attr().get("quality") or {}) if record else {}
        if stored.get("status") != "scored":
            continue
        failed = limits_failed(defaults, QualityScores.from_dict(stored["scores"]))
        verdicts[(record.params["quantization"], record.params["kv_cache_dtype"])] = \
            not failed  # type: ignore[union-attr]
    assert verdicts == {("fp8", "auto"): False, ("none", "fp8"): True, ("fp8", "fp8"): False}
