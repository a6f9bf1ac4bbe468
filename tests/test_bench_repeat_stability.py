"""bench/repeat_stability.py's line of figures for a run's verdict, from either roofline the
label was decided on (the real classifier on hand-built evidence; the bench itself runs the
simulated engine for minutes and is not run here)."""

from __future__ import annotations

from bench.repeat_stability import figures
from optimizer.bottleneck import Evidence, classify

# A decode roofline at the ridge (batch 1500: FLOP term 0.94x the byte term), no step mix.
DECODE_AT_RIDGE = Evidence(decode_batch=1500, context_tokens=0.0, weight_bytes=16e9,
                           kv_bytes_per_token=1.0, flops_per_token=2e9,
                           memory_bandwidth_gbps=4000, peak_tflops=800, tpot_ms=10.0)


def test_figures_of_a_decode_roofline_verdict_give_its_ratio_without_a_step_mix() -> None:
    """Its evidence has `compute_over_memory` but no utilisations: figures() raised KeyError
    on `compute_utilization` (found in review)."""
    verdict = classify(DECODE_AT_RIDGE)
    assert verdict.label == "compute-and-memory-bound", verdict.reason
    assert "compute_utilization" not in verdict.evidence
    assert figures(verdict) == \
        "FLOP term 0.938x the byte term (the decode roofline's; no step mix)"


def test_figures_of_a_step_mix_verdict_give_both_utilisations() -> None:
    verdict = classify(Evidence(compute_utilization=0.4714, bandwidth_utilization=0.4370,
                                requests_in_flight=20.0))
    assert figures(verdict) == ("FLOP term 1.079x the byte term: 47.1% of the FLOP ceiling, "
                                "43.7% of the bandwidth ceiling")
    assert figures(classify(Evidence())) == "no roofline ratio"
