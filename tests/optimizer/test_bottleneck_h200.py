"""The classifier on real H200 traces (vLLM 0.26; tests/fixtures/traces/h200/README.md): each
trimmed trace, with its trial's recorded metrics, telemetry and engine figures, is labelled as
the device labelled it, and the shares tell eager from CUDA graphs and bf16 from fp8 weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from optimizer.bottleneck import classify, evidence_from
from runners.base import BenchmarkMetrics, EngineConfig, EngineInfo, RunResult, StepMetrics
from runners.hardware import load_preset
from runners.load_level import LoadLevel
from runners.model_info import load_model_info
from runners.profiler_trace.kernels import classify_kernel
from runners.profiler_trace.summary import summarize

H200_TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "h200"
TRIALS: dict[str, dict[str, Any]] = json.loads(
    (H200_TRACES / "trials.json").read_text())["trials"]
H200 = load_preset("h200")
QWEN_7B = load_model_info("qwen2.5-7b")
GRAPHS = ("trial0", "trial1", "trial4", "trial5", "trial6", "trial7")  # CUDA graphs on
EAGER = "trial2"
FP8_WEIGHTS = ("trial1", "trial5")


def _summary(name: str) -> dict[str, float]:
    return summarize(H200_TRACES / f"{name}.pt.trace.json.gz")


def _as_result(facts: dict[str, Any], summary: dict[str, float] | None,
               step: int = 0) -> tuple[RunResult, EngineConfig]:
    """A trial's extracted facts (bench/h200/extract_fixtures.py) as the daemon held them:
    its measured level at 64 concurrent, engine figures, NVML telemetry and trace summary."""
    fields = BenchmarkMetrics.__dataclass_fields__
    measured = StepMetrics(step=step, level=LoadLevel(max_concurrency=64),
                           metrics=BenchmarkMetrics(**{k: v for k, v in
                                                       facts["step_metrics"].items()
                                                       if k in fields}),
                           server_metrics=facts["server_metrics"])
    engine = EngineInfo(**{k: v for k, v in facts["engine"].items()
                           if k in EngineInfo.__dataclass_fields__})
    result = RunResult(status="complete", steps=(measured,), engine=engine,
                       trace_summary=summary, telemetry=facts["telemetry"])
    return result, EngineConfig(model="qwen2.5-7b", flags=facts["flags"])


def _result(name: str) -> tuple[RunResult, EngineConfig]:
    return _as_result(TRIALS[name], _summary(name))


@pytest.mark.parametrize("name", sorted(TRIALS))
def test_real_h200_trial_gets_the_label_the_device_logged(name: str) -> None:
    result, config = _result(name)
    verdict = classify(evidence_from(result, config, H200, QWEN_7B))
    assert verdict.label == TRIALS[name]["device_verdict"]["label"], verdict.reason
    assert "trace" in verdict.sources, "a profiled trial is classified from its trace"


def test_eager_trace_is_launch_bound_and_graphs_traces_are_not() -> None:
    eager = _summary(EAGER)["gpu_busy_fraction"]
    graphs = {name: _summary(name)["gpu_busy_fraction"] for name in GRAPHS}
    assert eager < 0.25, f"eager: the GPU waits on launches most of the time (busy {eager:.2f})"
    assert min(graphs.values()) > 0.4, f"CUDA graphs keep the GPU busier: {graphs}"
    result, config = _result(EAGER)
    assert classify(evidence_from(result, config, H200, QWEN_7B)).label == "launch-bound"


def test_fp8_weights_show_as_fp8_gemms_plus_a_quantize_share() -> None:
    for name in FP8_WEIGHTS:
        summary = _summary(name)
        assert summary["quantize_share"] > 0.08, \
            f"{name}: Inductor's fused dynamic fp8 quantization is filed as quantize, not GEMM"
        assert summary["gemm_share"] < 0.75
    bf16 = _summary("trial0")
    assert bf16["quantize_share"] == 0.0 and bf16["gemm_share"] > 0.75


def test_trimmed_fixture_keeps_the_busy_fraction_of_the_whole_window() -> None:
    for name in TRIALS:
        full = json.loads((H200_TRACES / f"{name}.summary.json").read_text())
        trimmed = _summary(name)["gpu_busy_fraction"]
        assert trimmed == pytest.approx(full["gpu_busy_fraction"], abs=0.1), \
            f"{name}: 6000 steady-state kernels tell the story of the whole profiled window"


@pytest.mark.parametrize(("name", "category"), [
    ("triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_max_mul_reciprocal_silu_slice_"
     "unsqueeze_2", "quantize"),
    ("triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_fused_add_rms_norm_max_mul_"
     "reciprocal_unsqueeze_3", "quantize"),
    ("triton_red_fused_fused_add_rms_norm_0", "norm"),
    ("triton_poi_fused_mul_silu_slice_1", "activation"),
    ("triton_poi_fused_3", "other"),
    ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t, "
     "cutlass::bfloat16_t, vllm::c3x::ScaledEpilogue>", "gemm"),
    ("nvjet_sm90_tst_384x32_64x4_4x1_v_bz_TNT", "gemm"),
    ("kernel_unified_attention", "attention"),
    ("reduce_segments", "attention"),
    ("reshape_and_cache_kernel_flash", "kv_write"),
])
def test_real_h200_kernel_names_are_filed_by_what_they_do(name: str, category: str) -> None:
    assert classify_kernel(name) == category


# --- the H200 grid (study h200-grid, 2026-12-03; tests/fixtures/traces/h200/grid/) -------------

GRID = H200_TRACES / "grid"
GRID_TRIALS: dict[str, dict[str, Any]] = json.loads(
    (GRID / "trials.json").read_text())["trials"]


def _grid_result(name: str) -> tuple[RunResult, EngineConfig]:
    """A grid trial as the daemon saw it: its measured level, NVML telemetry of the unprofiled
    load, and the summary of its whole profiled window where the fixture keeps one (trials 0
    and 3; the others are judged as an unprofiled trial would be)."""
    path = GRID / f"{name}.summary.json"
    summary = json.loads(path.read_text()) if path.exists() else None
    return _as_result(GRID_TRIALS[name], summary, step=1)


def test_profiler_gaps_under_a_busy_gpu_are_not_launch_bound() -> None:
    """Grid trial 3 (fp8 weights, 2048-token budget, CUDA graphs): its profiled window shows the
    GPU busy 37% of the kernel span, but NVML saw a kernel running 95% of the measured, unprofiled
    load; the device labelled it launch-bound (as study 3 did the same config), the classifier
    now says the gaps are the profiler's and the step is bound by bandwidth."""
    name = "trial3"
    full = json.loads((GRID / f"{name}.summary.json").read_text())
    cut = summarize(GRID / f"{name}.pt.trace.json.gz")
    assert full["gpu_busy_fraction"] < 0.4 and cut["gpu_busy_fraction"] < 0.45, \
        "the profiled window does show the gaps"
    assert GRID_TRIALS[name]["telemetry"]["gpu_util_mean_pct"] > 90
    assert GRID_TRIALS[name]["device_verdict"]["label"] == "launch-bound", "what the device logged"
    result, config = _grid_result(name)
    verdict = classify(evidence_from(result, config, H200, QWEN_7B))
    assert verdict.label == "memory-bound", verdict.reason
    assert "profiler" in verdict.reason and "telemetry" in verdict.sources


@pytest.mark.parametrize("name", sorted(set(GRID_TRIALS) - {"trial3"}))
def test_grid_trials_keep_the_label_the_device_logged(name: str) -> None:
    result, config = _grid_result(name)
    verdict = classify(evidence_from(result, config, H200, QWEN_7B))
    assert verdict.label == GRID_TRIALS[name]["device_verdict"]["label"] == "memory-bound", \
        verdict.reason
