"""Issue 18's H200 run read back: labels, utilisation figures, capacity brackets and gains.

Recorded 2026-12-04 on one lent NVIDIA H200 (driver 580.159.04), vLLM 0.26.0, by
`bench/h200/run_study.sh` with bench/h200/decode.yaml and bench/h200/prefill.yaml; the stores are
docs/h200/labels/ (write-up docs/h200-labels.md). Each study is the vLLM defaults (trial 0)
against fp8 weights + fp8 KV (trial 1). The stores are copied before they are opened, so a test
never writes into docs/.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient

from optimizer import bottleneck, gains
from runners.capacity import Bracket

LABELS = Path(__file__).resolve().parents[2] / "docs" / "h200" / "labels"
# (study, trial) -> (label, compute utilisation, bandwidth utilisation), as recorded.
RECORDED = {
    ("decode", 0): ("compute-bound", 0.443, 0.215),
    ("decode", 1): ("unknown", 0.270, 0.236),
    ("prefill", 0): ("kv-capacity-bound", 0.519, 0.151),
    ("prefill", 1): ("compute-bound", 0.407, 0.117),
}
BRACKETS = {  # (study, trial) -> (met, missed) in the study's load unit
    ("decode", 0): (95.0, 100.0), ("decode", 1): (124.0, 132.0),
    ("prefill", 0): (19.4, 21.0), ("prefill", 1): (32.0, None),
}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("h200-labels")
    out = {}
    for name in ("decode", "prefill"):
        shutil.copy(LABELS / name / "optuna.db", tmp / f"{name}.db")
        study = optuna.load_study(study_name=f"h200-{name}", storage=f"sqlite:///{tmp}/{name}.db")
        for trial in study.trials:
            out[(name, trial.number)] = trial.user_attrs["record"]
    return out


def _evidence(verdict: dict[str, Any]) -> bottleneck.Evidence:
    """The classifier's input rebuilt from the numbers the recorded verdict kept."""
    fields = {f.name: f.type for f in dataclasses.fields(bottleneck.Evidence)}
    return bottleneck.Evidence(**{
        k: (bool(v) if "bool" in str(fields[k]) else v)
        for k, v in verdict["evidence"].items() if k in fields})


@pytest.mark.parametrize("key", sorted(RECORDED))
def test_the_recorded_evidence_gives_the_recorded_label_and_figures(
        records: dict[tuple[str, int], dict[str, Any]], key: tuple[str, int]) -> None:
    label, compute, bandwidth = RECORDED[key]
    verdict = records[key]["verdict"]
    assert verdict["label"] == label
    assert bottleneck.classify(_evidence(verdict)).label == label, \
        "today's classifier gives the label the H200 run recorded, from the same evidence"
    assert verdict["evidence"]["compute_utilization"] == pytest.approx(compute, abs=0.001)
    assert verdict["evidence"]["bandwidth_utilization"] == pytest.approx(bandwidth, abs=0.001)
    # vLLM's own estimate (--enable-mfu-metrics) agrees on FLOPs within 4% on every trial.
    assert verdict["evidence"]["vllm_compute_utilization"] == pytest.approx(compute, rel=0.04)


def test_no_trial_is_called_memory_bound_below_both_ceilings(
        records: dict[tuple[str, int], dict[str, Any]]) -> None:
    for key, record in records.items():
        ev = record["verdict"]["evidence"]
        if record["verdict"]["label"] == "memory-bound":
            assert ev["bandwidth_utilization"] >= 0.4, key


@pytest.mark.parametrize("study", ["decode", "prefill"])
def test_the_fp8_trials_are_never_told_to_use_fp8(
        records: dict[tuple[str, int], dict[str, Any]], study: str) -> None:
    record = records[(study, 1)]
    params = record["params"]
    assert params["quantization"] == "fp8" and params["kv_cache_dtype"] == "fp8"
    advice = bottleneck.advice(bottleneck.Verdict.from_user_attr(record["verdict"]))
    assert "fp8" not in advice.lower(), advice
    label_part = record["conclusion"].split("the vLLM defaults")[-1]
    assert "fp8" not in label_part.lower(), record["conclusion"]


@pytest.mark.parametrize("key", sorted(BRACKETS))
def test_the_recorded_brackets(records: dict[tuple[str, int], dict[str, Any]],
                               key: tuple[str, int]) -> None:
    capacity = records[key]["capacity"]
    met, missed = BRACKETS[key]
    assert capacity["met_load"] == pytest.approx(met)
    assert capacity["missed_load"] == (None if missed is None else pytest.approx(missed))
    assert capacity["status"] == ("at_least" if missed is None else "resolved")


def _bracket(record: dict[str, Any]) -> Bracket:
    c = record["capacity"]
    return Bracket(c["axis"], c["met_load"], c["missed_load"], c["status"], c["num_probes"])


def test_the_gains_are_the_ranges_the_brackets_allow(
        records: dict[tuple[str, int], dict[str, Any]]) -> None:
    decode = gains.capacity_gain(_bracket(records[("decode", 1)]),
                                 _bracket(records[("decode", 0)]))
    assert (decode.low, decode.high) == (pytest.approx(124 / 100), pytest.approx(132 / 95))
    assert "more than 1.24x and less than 1.39x" in gains.format_gain(decode)
    prefill = gains.capacity_gain(_bracket(records[("prefill", 1)]),
                                  _bracket(records[("prefill", 0)]))
    assert prefill.low == pytest.approx(32 / 21) and prefill.high is None, "open above"
    assert "more than 1.52x" in gains.format_gain(prefill)
    assert "less than" not in gains.format_gain(prefill)


def test_the_mlflow_store_reads_back(tmp_path: Path) -> None:
    shutil.copy(LABELS / "mlruns" / "mlflow.db", tmp_path / "mlflow.db")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    for name in ("h200-decode", "h200-prefill"):
        exp = client.get_experiment_by_name(name)
        assert exp is not None, name
        runs = client.search_runs([exp.experiment_id],
                                  filter_string="tags.`nightshift.kind` = 'trial'")
        assert len(runs) == 2, name
        for run in runs:
            for metric in ("capacity.bracket_low", "roofline.compute_util",
                           "roofline.bandwidth_util", "vllm_mfu.compute_util"):
                assert metric in run.data.metrics, (name, metric)
            assert run.data.tags.get("bottleneck"), name
