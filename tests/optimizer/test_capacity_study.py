"""End to end on the simulated engine: a capacity study's brackets land in MLflow (metrics,
tags, the run description) and its gain over the defaults is stated with them."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from optimizer.cli import main
from optimizer.tracking.payload import description_of
from tests.builders import load, trial_runs, write_study

pytestmark = pytest.mark.slow


def test_capacity_brackets_land_in_mlflow_and_bound_the_gain(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_study(tmp_path, trials=2, max_parallel_trials=1,
                       seed_trials=[{"quantization": "fp8", "kv_cache_dtype": "fp8"}],
                       workload={"input_len": 128, "output_len": 24, "num_requests": 32,
                                 "warmup_requests": 2,
                                 "capacity": {"axis": "concurrency", "low": 2, "high": 32,
                                              "max_probes": 4, "min_window_requests": 24,
                                              "min_window_s": 1, "max_window_s": 4,
                                              # 1 s, not two 2.2 s lives sized from the
                                              # 2 s TTFT bound: a request lives well under
                                              # 1 s here (7 steps: 57 s -> 34 s)
                                              "warmup_s": 1,
                                              "hold_s": 2, "hold_lives": 1, "max_holds": 2}},
                       slo={"tpot_p99_ms": 7})
    assert main(["start", str(path), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "review in MLflow: mlflow ui --backend-store-uri" in err and \
        "workflowType=machine_learning" in err, "start says where the runs table opens"

    records = {t.number: t.user_attrs["record"] for t in load(tmp_path).trials}
    runs = {int(r.data.tags["nightshift.trial"]): r for r in trial_runs(tmp_path)}
    for number, run in runs.items():
        record = records[number]
        capacity = record["capacity"]
        probes = {s["level"]["max_concurrency"]: s["meets_slo"] for s in record["steps"]}
        metrics, tags = run.data.metrics, run.data.tags
        met = capacity["met_load"]
        assert metrics["capacity.bracket_low"] == (met or 0.0)
        assert met is None or probes[met] is True, "the lower end met the SLO"
        if capacity["missed_load"] is None:
            assert "capacity.bracket_high" not in metrics, "absent when no probe missed"
        else:
            assert metrics["capacity.bracket_high"] == capacity["missed_load"]
            assert probes[capacity["missed_load"]] is False, "the upper end missed it"
        if met is not None:  # the claim was held (or the record says it was not)
            assert capacity["held"] is not None
            assert metrics["capacity.is_held"] == (1.0 if capacity["held"] else 0.0)
            holds = [s for s in record["steps"] if s["server"].get("steady.is_hold")]
            assert holds and (not capacity["held"] or any(
                s["meets_slo"] and s["level"]["max_concurrency"] == met for s in holds))
        assert tags["capacity.status"] == capacity["status"]
        assert (tags.get("unresolved") == "true") == (capacity["status"] == "unresolved")
        assert tags["conclusion"] == record["conclusion"]
        assert tags["mlflow.note.content"] == description_of(record["conclusion"],
                                                             is_simulated=True)
        assert len(record["conclusion_short"]) <= 70
        assert "None" not in record["conclusion"] and "→" not in record["conclusion"]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    parent = client.search_runs([client.get_experiment_by_name("e2e").experiment_id],
                                filter_string="tags.`nightshift.kind` = 'study'")[0]
    if parent.data.tags.get("best_trial") not in (None, "0"):
        assert "capacity brackets" in parent.data.tags["conclusion"], \
            "the gain over the defaults is stated with both brackets"
    report = (tmp_path / "results" / "report" / "report.md").read_text()
    assert "x the vLLM defaults (" not in report or "capacity brackets" in report
