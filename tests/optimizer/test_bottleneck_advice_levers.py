"""Advice at a ceiling names the precision levers the card's space still has (held-out check
s17, #6 and #6b): the bandwidth ceiling binds the bytes read, so fp8 weights and an fp8 KV cache
are levers there ("stop tuning" was said, then fp8 beat the defaults 1.29-1.69x); fp8 never makes
fewer FLOPs per token, and on a card without fp8 tensor cores it is no lever at all."""

from __future__ import annotations

from dataclasses import replace

import pytest

from optimizer.bottleneck import Evidence, Verdict, advice, classify, evidence_from
from runners.base import EngineConfig, StepMetrics
from runners.hardware import load_preset
from runners.model_info import load_model_info
from tests.optimizer.test_bottleneck_roofline import _simulated_level

A100 = load_preset("a100-80gb")  # no fp8 tensor cores: fp8_tflops 0
MIX = Evidence(compute_utilization=0.1, bandwidth_utilization=0.1, requests_in_flight=20.0)
# The MoE study's defaults: 84% of the bandwidth ceiling, bf16 weights and KV, an fp8 card.
AT_BANDWIDTH = replace(MIX, compute_utilization=0.3, bandwidth_utilization=0.84,
                       is_fp8_weights=False, is_fp8_kv=False, is_fp8_capable=True,
                       kv_read_share=0.4)


def test_at_the_bandwidth_ceiling_with_bf16_weights_and_kv_the_advice_is_fp8_not_stop() -> None:
    verdict = classify(AT_BANDWIDTH)
    assert verdict.label == "at-physical-limit" and \
        verdict.detail == "84% of the bandwidth ceiling", verdict.reason
    said = advice(verdict)
    assert "stop tuning" not in said, said
    assert said == ("the bandwidth ceiling binds the bytes read, here of bf16 weights and a "
                    "bf16 KV cache: fp8 weights (quantization fp8) or an fp8 KV cache "
                    "(kv_cache_dtype fp8) read fewer bytes per token"), said


def test_at_the_bandwidth_ceiling_only_the_levers_not_yet_pulled_are_named() -> None:
    on_fp8_weights = advice(classify(replace(AT_BANDWIDTH, is_fp8_weights=True)))
    assert "quantization fp8" not in on_fp8_weights, on_fp8_weights
    assert "here of a bf16 KV cache:" in on_fp8_weights and \
        "kv_cache_dtype fp8" in on_fp8_weights, on_fp8_weights
    on_fp8_kv = advice(classify(replace(AT_BANDWIDTH, is_fp8_kv=True)))
    assert "kv_cache_dtype" not in on_fp8_kv and "here of bf16 weights:" in on_fp8_kv, on_fp8_kv
    # A 4-bit checkpoint's weights read fewer bytes than fp8 would: only the KV is named.
    awq = advice(classify(AT_BANDWIDTH), config={"quantization": "awq_marlin"})
    assert "quantization fp8" not in awq and "kv_cache_dtype fp8" in awq, awq
    # The same through the config's flags rather than the verdict's facts.
    bare = classify(replace(AT_BANDWIDTH, is_fp8_weights=None, is_fp8_kv=None))
    assert "stop tuning" in advice(bare, config={"quantization": "fp8", "kv_cache_dtype": "fp8"})
    # fp8 KV halves only the KV part: not named where that part is under 10% of the bytes.
    small_kv = classify(replace(AT_BANDWIDTH, is_fp8_weights=True, kv_read_share=0.05))
    assert "stop tuning" in advice(small_kv), advice(small_kv)


def test_at_the_bandwidth_ceiling_of_fp8_weights_and_kv_the_limit_is_the_hardwares() -> None:
    both = classify(replace(AT_BANDWIDTH, is_fp8_weights=True, is_fp8_kv=True))
    assert advice(both) == "this is the hardware's limit for this batch; stop tuning this config"


def test_at_the_bandwidth_ceiling_of_a_card_without_fp8_no_fp8_is_advised() -> None:
    """The built-in rule fp8-needs-sm89 takes fp8 weights and KV out of an A100's space."""
    a100 = classify(replace(AT_BANDWIDTH, is_fp8_capable=False))
    assert "fp8" not in advice(a100) and "stop tuning" in advice(a100), advice(a100)


def test_at_the_ridge_with_fp8_weights_the_bandwidth_side_still_names_fp8_kv() -> None:
    ridge = classify(replace(AT_BANDWIDTH, compute_utilization=0.82, bandwidth_utilization=0.85,
                             is_fp8_weights=True))
    assert ridge.evidence.get("is_at_ridge") == 1.0, ridge.detail
    said = advice(ridge)
    assert "kv_cache_dtype fp8" in said and "stop tuning" not in said, said


def test_at_the_decode_roofline_limit_bf16_bytes_are_a_lever() -> None:
    """Without a step mix the decode roofline's limit is its bytes: fp8 reads fewer."""
    verdict = Verdict(label="at-physical-limit", roofline_fraction=0.9,
                      evidence={"is_fp8_weights": 0.0, "is_fp8_kv": 1.0, "is_fp8_capable": 1.0})
    assert "fp8 weights (quantization fp8) read fewer bytes" in advice(verdict), advice(verdict)


# --- compute-bound: fp8 raises the ceiling, on fp8 tensor cores only (#6b) ----------------------

COMPUTE = replace(MIX, compute_utilization=0.68, bandwidth_utilization=0.2,
                  prefill_flop_share=0.98, is_fp8_weights=False)


def test_compute_bound_on_an_fp8_card_advises_fp8_as_a_higher_flop_ceiling() -> None:
    said = advice(classify(replace(COMPUTE, is_fp8_capable=True)))
    assert said.startswith("raise the FLOP ceiling: fp8 weights (quantization fp8)"), said
    assert "fewer FLOPs" not in said, said


def test_compute_bound_without_fp8_tensor_cores_advises_prefill_levers_not_fp8() -> None:
    said = advice(classify(replace(COMPUTE, is_fp8_capable=False)))
    assert "fp8" not in said and "fewer FLOPs per token" not in said, said
    assert "shorter prompts" in said and "data_parallel_size" in said, said


def test_compute_bound_on_an_unknown_card_says_fp8_helps_only_on_fp8_tensor_cores() -> None:
    said = advice(classify(replace(COMPUTE, is_fp8_capable=None)))
    assert said.startswith("fewer prefill FLOPs: shorter prompts"), said
    assert "raise the FLOP ceiling only on a GPU with fp8 tensor cores" in said, said
    assert "fewer FLOPs per token" not in said, said


def _a100_level(concurrency: int = 16) -> tuple[StepMetrics, EngineConfig]:
    """The explore check's A100 study: 3000 tokens in, 64 out, 16 in flight, replayed through
    the simulated engine's scheduler in virtual time and recorded as the runner records it."""
    return _simulated_level("llama-3.1-8b", {}, (3000, 3000), 64, concurrency, 48,
                            hardware=A100)


def test_the_explore_checks_a100_trial_is_not_told_to_use_fp8() -> None:
    """'compute-bound (prefill 98% of the FLOPs, 68% of the FLOP ceiling) at concurrency 16;
    fewer FLOPs per token at the same rate: fp8 weights' was said on an A100."""
    step, config = _a100_level()
    verdict = classify(evidence_from([step], config, A100, load_model_info("llama-3.1-8b")))
    assert verdict.evidence["is_fp8_capable"] == 0.0
    assert verdict.label == "compute-bound", verdict.reason
    said = advice(verdict, config=config)
    assert "fp8" not in said and "shorter prompts" in said, said


@pytest.mark.parametrize("label", ["memory-bound", "compute-and-memory-bound",
                                   "kv-capacity-bound", "at-physical-limit"])
def test_no_advice_on_a_card_without_fp8_names_fp8(label: str) -> None:
    verdict = Verdict(label=label, roofline_fraction=0.85,  # type: ignore[arg-type]
                      evidence={"is_fp8_capable": 0.0, "bandwidth_utilization": 0.85,
                                "compute_utilization": 0.5})
    assert "fp8" not in advice(verdict), advice(verdict)


def test_a_trials_conclusion_reads_its_own_flags_so_a_4bit_trial_is_not_told_fp8_weights(
        ) -> None:
    """The conclusion hands the advice the trial's flags: at the bandwidth ceiling an AWQ
    trial is told the fp8 KV cache alone, not fp8 weights (its 4-bit weights read fewer)."""
    from optimizer.results.conclusion import conclude

    verdict = classify(AT_BANDWIDTH)
    told = conclude(params={"quantization": "awq_marlin"}, state="complete",
                    objective="goodput", value=10.0, verdict=verdict, number=1)
    assert "quantization fp8" not in told.text and "kv_cache_dtype fp8" in told.text, told.text
