"""The bottleneck classifier: roofline arithmetic, one table row per label (full and partial
evidence), evidence built from runs, and the one-line conclusion."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from optimizer.bottleneck import (
    LABELS,
    Evidence,
    Thresholds,
    Verdict,
    classify,
    evidence_from,
    roofline_decode_s,
    roofline_terms,
    sentence,
)
from runners.base import BenchmarkMetrics, EngineConfig, RunResult, StepMetrics
from runners.hardware import load_preset
from runners.load_level import LoadLevel
from runners.model_info import load_model_info
from runners.profiler_trace.summary import summarize

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
H200 = load_preset("h200")  # 4300 GB/s and 790 TFLOP/s bf16, measured
QWEN_7B = load_model_info("qwen2.5-7b")

# A decode roofline of 4 ms: 16 GB per step at 4000 GB/s, FLOPs well below.
MEMORY_ROOFLINE = Evidence(decode_batch=32, context_tokens=0.0, weight_bytes=16e9,
                           kv_bytes_per_token=1.0, flops_per_token=2e9,
                           memory_bandwidth_gbps=4000, peak_tflops=800)


def _metrics(tpot_ms: float, output_tps: float, completed: int = 256) -> BenchmarkMetrics:
    zero = dict.fromkeys((f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
                          for m in ("ttft", "tpot", "itl", "e2el")), 0.0)
    zero.update(mean_tpot_ms=tpot_ms, median_tpot_ms=tpot_ms, p99_tpot_ms=1.1 * tpot_ms)
    return BenchmarkMetrics(completed=completed, failed=0, duration_s=10.0,
                            total_input_tokens=512 * completed,
                            total_output_tokens=256 * completed, request_throughput=1.0,
                            request_goodput=None, output_throughput=output_tps,
                            total_token_throughput=1.0, **zero)


def _step(tpot_ms: float, output_tps: float, **server: float) -> StepMetrics:
    return StepMetrics(step=0, level=LoadLevel(max_concurrency=64),
                       metrics=_metrics(tpot_ms, output_tps), server_metrics=server)


# --- roofline -----------------------------------------------------------------------------------

def test_roofline_is_the_slower_of_bytes_and_flops_split_over_tp() -> None:
    kw = dict(weight_bytes=15e9, kv_bytes_read=1e9, flops=1e12, memory_bandwidth_gbps=4000.0,
              peak_tflops=1000.0)
    assert roofline_decode_s(**kw) == pytest.approx(4e-3), "16 GB at 4 TB/s beats 1 ms of FLOPs"
    assert roofline_decode_s(**kw, tensor_parallel_size=2) == pytest.approx(2e-3)
    compute = roofline_terms(**{**kw, "flops": 1e13})
    assert compute.time_s == pytest.approx(10e-3) and not compute.is_memory_dominated


def test_roofline_fraction_needs_every_input() -> None:
    assert replace(MEMORY_ROOFLINE, tpot_ms=8.0).roofline_fraction() == pytest.approx(0.5)
    assert replace(MEMORY_ROOFLINE, tpot_ms=8.0, peak_tflops=None).roofline_fraction() is None
    assert MEMORY_ROOFLINE.roofline_fraction() is None, "no measured step time"


# --- one row per label --------------------------------------------------------------------------

CASES: list[tuple[str, Evidence, str, tuple[str, ...]]] = [
    ("kv full and preempting", Evidence(max_kv_cache_usage_perc=0.98, num_preemptions=12.0),
     "kv-capacity-bound", ("metrics",)),
    ("kv full, queue rising", Evidence(max_kv_cache_usage_perc=0.96, is_waiting_rising=True,
                                       num_preemptions=0.0), "kv-capacity-bound", ("metrics",)),
    ("kv full wins over a comm-heavy trace",
     Evidence(max_kv_cache_usage_perc=0.99, num_preemptions=3.0, communication_share=0.4),
     "kv-capacity-bound", ("metrics",)),
    ("close to the roofline", replace(MEMORY_ROOFLINE, tpot_ms=4.4, gpu_busy_fraction=0.3),
     "at-physical-limit", ("roofline", "metrics")),
    ("collectives in the trace", Evidence(communication_share=0.31, gpu_busy_fraction=0.7,
                                          tensor_parallel_size=2),
     "communication-bound", ("trace",)),
    ("TP=2 slower than TP=1, no trace",
     Evidence(tensor_parallel_size=2, tpot_ms=10.0, tp1_tpot_ms=8.0),
     "communication-bound", ("metrics", "config")),
    ("GPU idle between kernels", Evidence(gpu_busy_fraction=0.19, gemm_share=0.6),
     "launch-bound", ("trace",)),
    ("eager far off the roofline, no trace",
     replace(MEMORY_ROOFLINE, tpot_ms=20.0, is_enforce_eager=True),
     "launch-bound", ("config", "roofline")),
    ("GEMM-full busy GPU", Evidence(gemm_share=0.85, gpu_busy_fraction=0.9),
     "compute-bound", ("trace",)),
    ("FLOP-dominated roofline with a busy GPU, no trace",
     replace(MEMORY_ROOFLINE, decode_batch=8192, tpot_ms=80.0, gpu_util_mean_pct=97.0),
     "compute-bound", ("roofline", "telemetry")),
    # The decode roofline at the ridge: FLOP term 1.06x (batch 1700) or 0.94x (batch 1500) the
    # byte term, within `ridge_margin`, names both ceilings from either side.
    ("FLOP term just over the byte term, busy GPU, no trace",
     replace(MEMORY_ROOFLINE, decode_batch=1700, tpot_ms=10.0, gpu_util_mean_pct=97.0),
     "compute-and-memory-bound", ("roofline", "telemetry")),
    ("byte term just over the FLOP term", replace(MEMORY_ROOFLINE, decode_batch=1500,
                                                  tpot_ms=10.0),
     "compute-and-memory-bound", ("roofline",)),
    # Rule 5b has no trace form: the trace decides, and the decode roofline overrules it only
    # past 2x (`memory_dominance`); a ridge inside that would call a byte term 1.06x the FLOP
    # term compute-and-memory-bound and one 1.5x it compute-bound (docs/bottleneck.md, 5b).
    ("busy GEMMs with the decode roofline at the ridge",
     replace(MEMORY_ROOFLINE, decode_batch=1500, tpot_ms=10.0, gemm_share=0.85,
             gpu_busy_fraction=0.9),
     "compute-bound", ("trace",)),
    ("busy GEMMs that stream weights",
     replace(MEMORY_ROOFLINE, tpot_ms=6.0, gemm_share=0.85, gpu_busy_fraction=0.9),
     "memory-bound", ("trace", "roofline")),
    ("bandwidth-dominated roofline", replace(MEMORY_ROOFLINE, tpot_ms=7.0),
     "memory-bound", ("roofline",)),
    ("memory controller busy, nothing else", Evidence(mem_util_mean_pct=72.0),
     "memory-bound", ("telemetry",)),
    ("nothing measured", Evidence(), "unknown", ()),
    ("kv full but no pressure", Evidence(max_kv_cache_usage_perc=0.97, num_preemptions=0.0,
                                         is_waiting_rising=False), "unknown", ("metrics",)),
    ("TP=1 slower than a reference is not communication",
     Evidence(tensor_parallel_size=1, tpot_ms=10.0, tp1_tpot_ms=8.0), "unknown", ()),
]


@pytest.mark.parametrize(("case", "evidence", "label", "sources"), CASES,
                         ids=[c[0] for c in CASES])
def test_classify_table(case: str, evidence: Evidence, label: str,
                        sources: tuple[str, ...]) -> None:
    verdict = classify(evidence)
    assert verdict.label == label, f"{case}: {verdict.reason}"
    assert verdict.sources == sources, f"{case}: the evidence named must be what decided"
    assert verdict.reason.startswith(f"{label}: ") and verdict.reason.endswith(").")
    assert all(isinstance(v, float) for v in verdict.evidence.values())


def test_every_label_is_reachable() -> None:
    assert {c[2] for c in CASES} == set(LABELS)


def test_unknown_says_what_evidence_is_missing() -> None:
    verdict = classify(Evidence(max_kv_cache_usage_perc=0.5, num_preemptions=0.0))
    assert verdict.label == "unknown"
    assert "missing trace, telemetry, roofline" in verdict.reason
    assert "(from metrics)" in verdict.reason


def test_thresholds_are_parameters_not_constants() -> None:
    evidence = Evidence(gpu_busy_fraction=0.3)
    assert classify(evidence).label == "launch-bound"
    assert classify(evidence, Thresholds(launch_busy_fraction=0.2)).label == "unknown"


# --- evidence from runs -------------------------------------------------------------------------

def test_evidence_from_steps_builds_the_h200_roofline() -> None:
    """The H200 defaults row (shared/gpu/README.md): 7382 tok/s, TPOT p50 7.06 ms at 64
    concurrent, 512 in / 256 out: memory-bound at about half of the bandwidth roofline."""
    step = _step(7.06, 7382.0, max_kv_cache_usage_perc=0.05, num_preemptions=0.0,
                 is_waiting_rising=0.0, max_num_requests_running=64.0)
    evidence = evidence_from([step], EngineConfig("qwen2.5-7b"), H200, QWEN_7B)
    assert evidence.decode_batch == pytest.approx(7382 * 7.06e-3), "Little's law on decode"
    assert evidence.context_tokens == 512 + 128
    # 15.2 GB of bf16 weights, less the input embedding (1.1 GB), which a step only gathers.
    assert evidence.weight_bytes == pytest.approx(14.1e9, rel=0.02)
    verdict = classify(evidence)
    assert verdict.label == "memory-bound"
    assert verdict.roofline_fraction == pytest.approx(0.53, abs=0.03)


def test_evidence_from_steps_reads_fp8_and_eager_flags() -> None:
    fp8 = evidence_from(_step(5.37, 8619.0), EngineConfig("m", {"quantization": "fp8",
                                                                "kv_cache_dtype": "fp8"}),
                        H200, QWEN_7B)
    bf16 = evidence_from(_step(5.37, 8619.0), EngineConfig("m"), H200, QWEN_7B)
    assert fp8.peak_tflops == 1580 and bf16.peak_tflops == 790
    assert fp8.weight_bytes is not None and bf16.weight_bytes is not None
    assert fp8.weight_bytes < 0.6 * bf16.weight_bytes
    assert fp8.kv_bytes_per_token == 0.5 * (bf16.kv_bytes_per_token or 0)
    eager = evidence_from(_step(18.84, 3073.0), EngineConfig("m", {"enforce_eager": "true"}),
                          H200, QWEN_7B)
    assert eager.is_enforce_eager is True
    assert classify(eager).label == "launch-bound", "eager at 20% of the roofline, no trace"


@pytest.mark.parametrize(("fixture", "flags", "label"), [
    ("sim_eager", {"enforce_eager": True}, "launch-bound"),
    ("sim_tp2", {"tensor_parallel_size": 2}, "communication-bound"),
])
def test_evidence_from_a_profiled_run_uses_the_trace(fixture: str, flags: dict[str, object],
                                                     label: str) -> None:
    summary = summarize(TRACES / f"{fixture}.pt.trace.json.gz")
    # NVML as the H200 saw an eager trial unprofiled (study 2, trial 2): a kernel ran 49% of it.
    result = RunResult(status="complete", steps=(_step(18.0, 3000.0),), trace_summary=summary,
                       telemetry={"gpu_util_mean_pct": 49.0, "mem_util_mean_pct": 30.0})
    evidence = evidence_from(result, EngineConfig("qwen2.5-7b", flags), H200, QWEN_7B)
    assert evidence.gpu_busy_fraction == summary["gpu_busy_fraction"]
    assert evidence.gpu_util_mean_pct == 49.0
    verdict = classify(evidence)
    assert verdict.label == label, verdict.reason
    assert "trace" in verdict.sources


def test_evidence_without_model_or_hardware_has_no_roofline() -> None:
    evidence = evidence_from(_step(7.0, 7000.0, max_kv_cache_usage_perc=0.99,
                                   num_preemptions=4.0), EngineConfig("hub/unknown"))
    assert evidence.roofline() is None
    assert classify(evidence).label == "kv-capacity-bound"


def _probe(i: int, rate: float, meets: bool, **server: float) -> StepMetrics:
    return StepMetrics(step=i, level=LoadLevel(request_rate_rps=rate),
                       metrics=_metrics(7.0, 7000.0), server_metrics=server, meets_slo=meets)


def test_the_label_is_computed_from_the_operating_probe_not_the_overload_probe() -> None:
    overload = _probe(0, 64.0, False, max_kv_cache_usage_perc=1.0, num_preemptions=40.0,
                      is_waiting_rising=1.0)
    operating = _probe(1, 9.9, True, max_kv_cache_usage_perc=0.42, num_preemptions=0.0)
    result = RunResult(status="complete", steps=(overload, operating, _probe(
        2, 12.0, False, max_kv_cache_usage_perc=0.97, num_preemptions=3.0)))
    evidence = evidence_from(result, EngineConfig("hub/unknown"), objective="goodput")
    assert evidence.max_kv_cache_usage_perc == 0.42, "the operating probe's /metrics"
    verdict = classify(evidence)
    assert verdict.label != "kv-capacity-bound", "the overload probe's full KV cache is no label"
    assert verdict.load == "9.9 req/s, the highest load that met the SLO"
    assert "at 9.9 req/s, the highest load that met the SLO" in sentence("", "", verdict)


def test_with_no_load_within_the_slo_the_label_describes_the_lightest_and_says_it_missed(
        ) -> None:
    steps = (_probe(0, 64.0, False, max_kv_cache_usage_perc=1.0, num_preemptions=40.0),
             _probe(1, 2.0, False, max_kv_cache_usage_perc=0.99, num_preemptions=2.0))
    verdict = classify(evidence_from(steps, EngineConfig("hub/unknown"), objective="goodput"))
    assert verdict.label == "kv-capacity-bound" and verdict.evidence["num_preemptions"] == 2.0
    assert verdict.load == ("2 req/s, the lightest load probed, which missed the SLO (no load "
                            "met it)")


def test_a_trace_verdict_says_where_the_profile_was_taken() -> None:
    verdict = classify(Evidence(communication_share=0.4, tensor_parallel_size=2,
                                load="9.9 req/s", is_within_slo=True,
                                profile_load="concurrency 16", is_profile_in_stream=False))
    assert verdict.reason == (
        "communication-bound: collectives take 40% of GPU kernel time at 9.9 req/s, the "
        "highest load that met the SLO (from trace; the trace taken after the load levels, "
        "at concurrency 16)."), verdict.reason
    inside = classify(Evidence(communication_share=0.4, tensor_parallel_size=2,
                               load="9.9 req/s", is_within_slo=True,
                               profile_load="9.9 req/s", is_profile_in_stream=True))
    assert inside.reason.endswith("(from trace; the trace taken inside the stream at 9.9 req/s, "
                                  "in steady state)."), inside.reason


def test_the_evidence_reads_where_the_runner_says_the_profile_ran() -> None:
    from optimizer.bottleneck.evidence import _profile_load

    assert _profile_load({"profile.request_rate_rps": 10.7}) == "10.7 req/s"
    assert _profile_load({"profile.concurrency": 16.0}) == "concurrency 16"
    assert _profile_load({}) == ""


def test_a_run_without_measured_levels_gives_empty_evidence() -> None:
    evidence = evidence_from(RunResult(status="failed"), EngineConfig("m"), H200, QWEN_7B)
    assert evidence.tpot_ms is None and evidence.decode_batch is None
    assert classify(evidence).label == "unknown"


# --- what is stored and said --------------------------------------------------------------------

def test_verdict_round_trips_through_json_user_attrs() -> None:
    verdict = classify(Evidence(communication_share=0.4, tensor_parallel_size=2))
    stored = json.loads(json.dumps(verdict.as_user_attr(tensor_parallel_size=2,
                                                        objective_value=3.5)))
    assert stored["label"] == "communication-bound" and stored["tensor_parallel_size"] == 2
    assert stored["objective_value"] == 3.5
    assert Verdict.from_user_attr(stored) == verdict
    assert verdict.as_metrics()["bottleneck.communication_share"] == 0.4


def test_sentence_reads_change_metric_conclusion() -> None:
    verdict = classify(Evidence(gpu_busy_fraction=0.19, is_enforce_eager=True))
    line = sentence({"enforce_eager": True}, "TPOT p99 18.8 ms (+165% vs best)", verdict)
    assert line == ("enforce_eager=True: TPOT p99 18.8 ms (+165% vs best): launch-bound "
                    "(GPU busy 19% of the kernel span); keep CUDA graphs on.")


def test_sentence_gives_advice_for_every_label() -> None:
    for _, evidence, label, _ in CASES:
        line = sentence("x=1", "", classify(evidence))
        assert line.startswith(f"x=1: {label}") and line.endswith(".")


@pytest.mark.parametrize(("hardware", "model", "flags", "problem"), [
    # The H200 study's OOM probe: 14.3 GiB of bf16 weights in 6% of 141 GiB.
    ("h200", "qwen2.5-7b", {"gpu_memory_utilization": 0.06, "max_model_len": 4096},
     "the weights need 14.2 GiB per GPU but gpu_memory_utilization 0.06"),
    ("h200", "qwen2.5-7b", {}, None),
    # fp8 weights fit where bf16 did not.
    ("h200", "qwen2.5-7b", {"gpu_memory_utilization": 0.08, "quantization": "fp8"}, None),
    # An 8B model on a 24 GB card: the weights fit, one 128k-token request's KV does not.
    ("rtx4090-2x-pcie", "llama-3.1-8b", {"gpu_memory_utilization": 0.9}, "KV cache of one"),
    ("rtx4090-2x-pcie", "llama-3.1-8b", {"gpu_memory_utilization": 0.9,
                                         "max_model_len": 8192}, None),
    # Split over two cards by TP, it fits.
    ("rtx4090-2x-pcie", "llama-3.1-8b", {"gpu_memory_utilization": 0.9,
                                         "tensor_parallel_size": 2}, None),
])
def test_memory_check_rejects_only_configs_that_cannot_fit(
        hardware: str, model: str, flags: dict, problem: str | None) -> None:
    from optimizer.bottleneck import memory_problem

    found = memory_problem(EngineConfig(model, flags), load_preset(hardware),
                           load_model_info(model))
    if problem is None:
        assert found is None, found
    else:
        assert found is not None and problem in found, found
