"""The MLflow store of the H200 grid study (fixtures/h200/grid/mlruns, 2026-12-03, vLLM 0.26.0):
what a user finds in the MLflow UI the morning after, read back with MLflow's own client. Each
trial's run carries the change (params, exact launch command), the metrics, the bottleneck label
with its evidence and sources, a one-line conclusion, the server log and the trimmed trace."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from runners.profiler_trace.summary import summarize

STORE = Path(__file__).resolve().parents[1] / "fixtures" / "h200" / "grid"
LABELS = {"compute-bound", "memory-bound", "communication-bound", "launch-bound",
          "kv-capacity-bound", "at-physical-limit"}


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MlflowClient:
    # A copy: opening a store may migrate its schema. Artifact URIs are relative to the repo.
    shutil.copytree(STORE / "mlruns", tmp_path / "tests" / "fixtures" / "h200" / "grid" / "mlruns")
    monkeypatch.chdir(tmp_path)
    return MlflowClient("sqlite:///tests/fixtures/h200/grid/mlruns/mlflow.db")


def test_every_measured_h200_trial_has_label_evidence_conclusion_and_trace(
        client: MlflowClient) -> None:
    experiment = client.get_experiment_by_name("h200-grid")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("nightshift.kind") == "study")
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    complete = [r for r in trials if r.data.tags["state"] == "complete"]
    assert len(complete) == 6
    for run in complete:
        tags, metrics = run.data.tags, run.data.metrics
        assert tags["bottleneck"] in LABELS
        assert tags["bottleneck"] in tags["conclusion"], "the sentence states the label"
        assert tags["bottleneck.reason"] and tags["bottleneck.sources"]
        assert "vllm.entrypoints.cli.main serve" in tags["launch_command"]
        assert tags["engine.engine_version"] == "0.26.0"
        for name in ("request_goodput", "p99_tpot_ms", "p99_ttft_ms", "output_throughput",
                     "engine.startup_s", "engine.kv_cache_tokens", "gpu.gpu_util_mean_pct",
                     "trace.gemm_share", "trace.gpu_busy_fraction",
                     "bottleneck.roofline_fraction"):
            assert name in metrics, f"{run.info.run_name}: {name}"
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
        assert {"server.log", "record.json", "launch.json",
                "trace.trimmed.pt.trace.json.gz"} <= artifacts
    labels = {r.info.run_name: r.data.tags["bottleneck"] for r in complete}
    assert labels["trial-000"] == "memory-bound"
    # As logged on the device; today's classifier overrules it (test_bottleneck_h200.py).
    assert labels["trial-003"] == "launch-bound"


def test_the_trimmed_trace_artifact_reads_back(client: MlflowClient, tmp_path: Path) -> None:
    run = client.search_runs([client.get_experiment_by_name("h200-grid").experiment_id],
                             filter_string="attributes.run_name = 'trial-002'")[0]
    local = client.download_artifacts(run.info.run_id, "trace.trimmed.pt.trace.json.gz",
                                      str(tmp_path))
    summary = summarize(Path(local))
    assert summary["num_kernels"] == 20000
    assert summary["quantize_share"] > 0.1, "fp8 weights: Inductor's fused dynamic quantization"


def test_the_showcase_says_what_it_is_and_its_failed_trial_shows_no_objective(
        client: MlflowClient) -> None:
    """Issue 22: a KILLED study run and a FAILED trial with an objective read as a crash and a
    measurement; the store says it is the first 6 of 48 configs, cut when device time ended
    (bench/h200/annotate_grid_store.py), and the interrupted trial has no objective value."""
    experiment = client.get_experiment_by_name("h200-grid")
    assert "first 6 of 48 configs" in experiment.tags["mlflow.note.content"]
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("nightshift.kind") == "study")
    assert parent.info.status == "KILLED" and "stopped before its budget" in \
        parent.data.tags["mlflow.note.content"]
    for run in runs:
        if run.info.status == "FAILED":
            assert not any(k.startswith("objective.") for k in run.data.metrics), \
                f"{run.info.run_name}: a failed trial has no objective value"
            assert "no objective" in run.data.tags["mlflow.note.content"]
