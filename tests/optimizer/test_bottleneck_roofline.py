"""The roofline of the measured prefill/decode step mix (issue 18, items 1-2): per-level
compute and bandwidth utilisation from the counters a real vLLM run records, vLLM's own MFU
counters beside them, the labels that follow, and advice that never repeats the config."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from optimizer.bottleneck import (
    Evidence,
    Thresholds,
    Verdict,
    advice,
    classify,
    evidence_from,
    level_metrics,
    step_roofline,
)
from runners.base import BenchmarkMetrics, EngineConfig, EngineInfo, RunResult, StepMetrics
from runners.hardware import HardwareProfile, load_preset
from runners.load_level import LoadLevel
from runners.model_info import load_model_info
from runners.simulated.benchmark import simulate_benchmark
from runners.simulated.performance import PerformanceModel

H200 = load_preset("h200")  # 4300 GB/s copy, 790 TFLOP/s bf16 measured; fp8 2x
QWEN_7B = load_model_info("qwen2.5-7b")
LLAMA_8B = load_model_info("llama-3.1-8b")
ZERO = dict.fromkeys((f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
                      for m in ("ttft", "tpot", "itl", "e2el")), 0.0)


def _level(*, completed: int = 100, duration_s: float = 10.0, input_len: int = 2000,
           output_len: int = 128, tpot_ms: float = 20.0, e2el_ms: float = 3000.0,
           **server: float) -> StepMetrics:
    metrics = BenchmarkMetrics(
        completed=completed, failed=0, duration_s=duration_s,
        total_input_tokens=input_len * completed, total_output_tokens=output_len * completed,
        request_throughput=completed / duration_s, request_goodput=None,
        output_throughput=output_len * completed / duration_s,
        total_token_throughput=(input_len + output_len) * completed / duration_s,
        **{**ZERO, "mean_tpot_ms": tpot_ms, "median_tpot_ms": tpot_ms,
           "p99_tpot_ms": 1.2 * tpot_ms, "mean_e2el_ms": e2el_ms})
    return StepMetrics(step=0, level=LoadLevel(request_rate_rps=completed / duration_s),
                       metrics=metrics, server_metrics=server)


def _counted(completed: int = 100, input_len: int = 2000, output_len: int = 128,
             steps: float = 2000.0, cached: float = 0.0, **extra: Any) -> StepMetrics:
    """A level as the runner records it from vLLM: the counters' growth over the level."""
    return _level(completed=completed, input_len=input_len, output_len=output_len, **{
        "vllm:prompt_tokens_total": float(input_len * completed),
        "vllm:prompt_tokens_cached_total": cached,
        "vllm:generation_tokens_total": float(output_len * completed),
        "vllm:iteration_tokens_total_count": steps, **extra})


# --- the arithmetic ---------------------------------------------------------------------------

def test_weights_are_read_once_per_counted_step_and_kv_once_per_generated_token() -> None:
    """A level whose prompts were all served from the cache is pure decode: its bytes are the
    weights once per engine step plus each generated token's context KV read and its KV
    written, all at 4300 GB/s."""
    step = _counted(cached=200_000.0, steps=2000.0)
    terms = step_roofline(step, EngineConfig("qwen2.5-7b"), H200, QWEN_7B)
    assert terms is not None and terms.is_steps_counted
    assert terms.prefill_tokens_per_s == 0.0
    lm_head = QWEN_7B.vocab_size * QWEN_7B.hidden_size
    linear = QWEN_7B.num_params - 2 * lm_head
    weights = 2.0 * (linear + lm_head)
    kv = QWEN_7B.kv_bytes_per_token(2.0)
    decode_tps = 12_800 / 10.0
    expected = weights * 200.0 + decode_tps * (2000 + 64) * kv + decode_tps * kv
    assert terms.bytes_per_s == pytest.approx(expected)
    assert terms.bandwidth_utilization == pytest.approx(expected / 4300e9)


def test_prefix_cache_hits_are_not_prefill_work() -> None:
    config = EngineConfig("llama-3.1-8b")
    cold = step_roofline(_counted(), config, H200, LLAMA_8B)
    warm = step_roofline(_counted(cached=100_000.0), config, H200, LLAMA_8B)
    # The counter vLLM 0.26 has, and the prefix-cache hits where it is missing, agree.
    hits = step_roofline(_level(**{"vllm:prompt_tokens_total": 200_000.0,
                                   "vllm:prefix_cache_hits_total": 100_000.0,
                                   "vllm:generation_tokens_total": 12_800.0,
                                   "vllm:iteration_tokens_total_count": 2000.0}),
                         config, H200, LLAMA_8B)
    assert cold is not None and warm is not None and hits is not None
    assert cold.prefill_tokens_per_s == 20_000.0 and warm.prefill_tokens_per_s == 10_000.0
    assert hits.prefill_tokens_per_s == warm.prefill_tokens_per_s
    assert warm.compute_utilization < 0.6 * cold.compute_utilization


def test_fp8_weights_halve_the_gemm_time_and_the_weight_bytes() -> None:
    step = _counted()
    bf16 = step_roofline(step, EngineConfig("llama-3.1-8b"), H200, LLAMA_8B)
    fp8 = step_roofline(step, EngineConfig("llama-3.1-8b", {"quantization": "fp8"}), H200,
                        LLAMA_8B)
    assert bf16 is not None and fp8 is not None
    assert fp8.flops_per_s == bf16.flops_per_s, "the same work"
    # Linear FLOPs run at the fp8 peak (2x); attention stays at bf16.
    assert 0.5 < fp8.compute_utilization / bf16.compute_utilization < 0.56
    assert fp8.bytes_per_s < 0.7 * bf16.bytes_per_s


def test_tensor_parallel_splits_the_per_gpu_figures() -> None:
    step = _counted()
    one = step_roofline(step, EngineConfig("llama-3.1-8b"), H200, LLAMA_8B)
    two = step_roofline(step, EngineConfig("llama-3.1-8b", {"tensor_parallel_size": 2}), H200,
                        LLAMA_8B)
    assert one is not None and two is not None
    assert two.compute_utilization == pytest.approx(one.compute_utilization / 2)
    assert two.bandwidth_utilization == pytest.approx(one.bandwidth_utilization / 2)


def test_without_counters_the_load_generator_and_littles_law_stand_in() -> None:
    """An engine without /metrics: tokens from the load generator, steps from decode tokens/s
    over the decode batch (output tokens/s x mean TPOT)."""
    terms = step_roofline(_level(tpot_ms=20.0), EngineConfig("qwen2.5-7b"), H200, QWEN_7B)
    assert terms is not None and not terms.is_steps_counted
    batch = 1280.0 * 20e-3
    assert terms.steps_per_s == pytest.approx(1280.0 / batch)
    assert terms.prefill_tokens_per_s == 20_000.0 and terms.vllm_compute_utilization is None


def test_vllm_mfu_counters_are_per_gpu_and_summed_over_data_parallel_engines() -> None:
    step = _counted(**{"vllm:estimated_flops_per_gpu_total": 2 * 3.16e15,
                       "vllm:estimated_read_bytes_per_gpu_total": 2 * 2e13,
                       "vllm:estimated_write_bytes_per_gpu_total": 2 * 1.5e12})
    terms = step_roofline(step, EngineConfig("llama-3.1-8b", {"data_parallel_size": 2}), H200,
                          LLAMA_8B)
    assert terms is not None
    assert terms.vllm_flops_per_s == pytest.approx(3.16e14)
    assert terms.vllm_compute_utilization == pytest.approx(3.16e14 / 790e12)
    assert terms.vllm_bandwidth_utilization == pytest.approx(2.15e12 / 4300e9)
    off = step_roofline(_counted(**{"vllm:estimated_flops_per_gpu_total": 0.0}),
                        EngineConfig("llama-3.1-8b"), H200, LLAMA_8B)
    assert off is not None and off.vllm_compute_utilization is None, \
        "counters that stayed 0 (flag off) are no measurement"


def test_per_level_figures_carry_the_mlflow_names() -> None:
    steps = [_counted(), _level(completed=0)]
    figures = level_metrics(steps, EngineConfig("llama-3.1-8b"), H200, LLAMA_8B)
    assert set(figures[0]) >= {"roofline.compute_util", "roofline.bandwidth_util",
                               "roofline.fraction", "roofline.prefill_tokens_per_s",
                               "roofline.decode_tokens_per_s"}
    assert figures[1] == {}, "a level that completed nothing has no roofline"
    assert level_metrics(steps, EngineConfig("m"), None, None) == [{}, {}]


# --- labels -----------------------------------------------------------------------------------

MIX = Evidence(compute_utilization=0.1, bandwidth_utilization=0.1, requests_in_flight=20.0)

MIX_CASES: list[tuple[str, Evidence, str]] = [
    ("prefill-dominated near the FLOP ceiling",
     replace(MIX, compute_utilization=0.6, bandwidth_utilization=0.25, prefill_flop_share=0.93),
     "compute-bound"),
    ("decode-dominated near the bandwidth ceiling",
     replace(MIX, compute_utilization=0.3, bandwidth_utilization=0.55), "memory-bound"),
    ("at the bandwidth ceiling", replace(MIX, bandwidth_utilization=0.85), "at-physical-limit"),
    ("GPU idle with work waiting",
     replace(MIX, gpu_util_mean_pct=14.0, num_runtime_jit_compiles=3.0), "launch-bound"),
    ("eager far below both, no NVML", replace(MIX, is_enforce_eager=True), "launch-bound"),
    ("busy GPU far below both ceilings", replace(MIX, gpu_util_mean_pct=95.0), "unknown"),
    ("busy GPU beats the eager hint", replace(MIX, gpu_util_mean_pct=95.0,
                                              is_enforce_eager=True), "unknown"),
    ("a light load that leaves the engine idle",
     replace(MIX, gpu_util_mean_pct=10.0, requests_in_flight=0.3), "unknown"),
]


@pytest.mark.parametrize(("case", "evidence", "label"), MIX_CASES,
                         ids=[c[0] for c in MIX_CASES])
def test_labels_follow_the_step_mix(case: str, evidence: Evidence, label: str) -> None:
    verdict = classify(evidence)
    assert verdict.label == label, f"{case}: {verdict.reason}"
    assert "roofline" in verdict.sources
    assert verdict.evidence["compute_utilization"] == evidence.compute_utilization
    assert verdict.evidence["bandwidth_utilization"] == evidence.bandwidth_utilization
    assert verdict.roofline_fraction == max(evidence.compute_utilization or 0,
                                            evidence.bandwidth_utilization or 0)


def test_far_below_both_ceilings_is_never_memory_bound_and_says_the_figures() -> None:
    """The issue's prefill-heavy H200 trials were 'memory-bound at 19% of the roofline'."""
    verdict = classify(Evidence(compute_utilization=0.17, bandwidth_utilization=0.19,
                                gpu_util_mean_pct=92.0, requests_in_flight=12.0))
    assert verdict.label == "unknown"
    assert "17% of the FLOP ceiling, 19% of the bandwidth ceiling" in verdict.reason


def test_online_fp8_per_block_compiling_while_serving_is_launch_bound() -> None:
    """The H200 case of the issue (Llama-3.1-8B shape, `quantization fp8_per_block`, 2 req/s):
    14% GPU utilisation, TPOT p99 475 ms, kernels JIT-compiled while serving. The figures
    below are those reported; the step is built so the load had work waiting."""
    config = EngineConfig("llama-3.1-8b", {"quantization": "fp8_per_block"})
    counted = _counted(completed=60, steps=3000.0)
    step = replace(counted, metrics=replace(counted.metrics, duration_s=30.0,
                                            request_throughput=2.0, mean_e2el_ms=40_000.0,
                                            mean_tpot_ms=300.0, p99_tpot_ms=475.0))
    result = RunResult(status="complete", steps=(step,), telemetry={"gpu_util_mean_pct": 14.0},
                       engine=EngineInfo(num_runtime_jit_compiles=4))
    verdict = classify(evidence_from(result, config, H200, LLAMA_8B))
    assert verdict.label == "launch-bound", verdict.reason
    assert "JIT-compiled while serving" in verdict.reason
    said = advice(verdict, config=config)
    assert "fp8_per_block" in said and "JIT" in said, said


# --- advice -----------------------------------------------------------------------------------

FP8_BOTH = EngineConfig("llama-3.1-8b", {"quantization": "fp8", "kv_cache_dtype": "fp8"})


@pytest.mark.parametrize("label", ["compute-bound", "memory-bound", "compute-and-memory-bound",
                                   "kv-capacity-bound", "launch-bound", "communication-bound",
                                   "at-physical-limit", "unknown"])
def test_advice_to_an_fp8_weights_and_kv_trial_never_mentions_fp8(label: str) -> None:
    facts = {"is_fp8_weights": 1.0, "is_fp8_kv": 1.0}
    verdict = Verdict(label=label, roofline_fraction=0.5, evidence=facts)  # type: ignore[arg-type]
    assert "fp8" not in advice(verdict), advice(verdict)
    bare = Verdict(label=label, roofline_fraction=0.5)  # type: ignore[arg-type]
    assert "fp8" not in advice(bare, config=FP8_BOTH), advice(bare, config=FP8_BOTH)


def test_the_issues_fp8_trial_is_not_told_to_use_fp8() -> None:
    """'read fewer bytes per token: fp8 weights or KV cache' was said to a trial already on
    fp8 weights and fp8 KV; the verdict now carries those facts from the config."""
    step = _counted(cached=200_000.0, steps=2000.0)
    verdict = classify(evidence_from([step], FP8_BOTH, H200, LLAMA_8B))
    assert verdict.evidence["is_fp8_weights"] == 1.0 and verdict.evidence["is_fp8_kv"] == 1.0
    assert "fp8" not in advice(verdict), advice(verdict)


def test_advice_names_only_the_levers_not_yet_pulled() -> None:
    memory = Verdict(label="memory-bound", roofline_fraction=0.5)
    assert "kv_cache_dtype fp8" in advice(memory, config={"quantization": "fp8"})
    assert "quantization fp8" not in advice(memory, config={"quantization": "fp8"})
    assert "quantization fp8" in advice(memory, config={"kv_cache_dtype": "fp8"})
    kv = Verdict(label="kv-capacity-bound", roofline_fraction=None)
    assert "gpu_memory_utilization" not in advice(kv, config={"gpu_memory_utilization": 0.97})
    assert advice(Verdict(label="launch-bound", roofline_fraction=None,
                          evidence={"is_enforce_eager": 1.0})) == "keep CUDA graphs on"


# The session-14 H100 trial (docs/h100/session14/, vLLM 0.26, fp8 weights and KV): memory-bound
# at 11 req/s held, with at most 126 requests running under vLLM's default max_num_seqs of 1024.
H100 = load_preset("h100-8x-nvlink")
FP8_MEMORY = {"is_fp8_weights": 1.0, "is_fp8_kv": 1.0, "bandwidth_utilization": 0.47,
              "compute_utilization": 0.11}


def test_memory_bound_advice_says_a_batch_far_below_its_cap_was_not_held_by_it() -> None:
    """'a larger max_num_seqs' was advised to a trial whose batch (126 running) never came near
    its cap (1024): the batch followed the load, and a larger cap changes nothing."""
    below = Verdict(label="memory-bound", roofline_fraction=0.47,
                    evidence={**FP8_MEMORY, "max_num_requests_running": 126.0,
                              "max_num_seqs": 1024.0})
    text = advice(below)
    assert "more sequences per step" not in text, text
    assert "at most 126 running of max_num_seqs 1024" in text, text
    assert "a larger max_num_seqs changes nothing" in text, text


def test_memory_bound_advice_names_a_larger_max_num_seqs_where_the_batch_reached_it() -> None:
    at_cap = Verdict(label="memory-bound", roofline_fraction=0.6,
                     evidence={**FP8_MEMORY, "max_num_requests_running": 250.0,
                               "max_num_seqs": 256.0})
    text = advice(at_cap)
    assert "the batch reached 250 of max_num_seqs 256" in text, text
    assert "a larger max_num_seqs raises it" in text, text
    unmeasured = advice(Verdict(label="memory-bound", roofline_fraction=0.6,
                                evidence=FP8_MEMORY))
    assert "helps only where the batch reaches it" in unmeasured, \
        "without the running count, no claim that the cap held the batch"


def test_evidence_carries_the_running_count_and_the_cards_default_max_num_seqs() -> None:
    """vLLM 0.26 gives an 80 GB H100 max_num_seqs 1024 when unset; a config's own value wins;
    the running gauge is per data-parallel replica, as max_num_seqs caps it."""
    step = _counted(cached=200_000.0, steps=2000.0, max_num_requests_running=126.0)
    verdict = classify(evidence_from([step], FP8_BOTH, H100, LLAMA_8B))
    assert verdict.evidence["max_num_requests_running"] == 126.0
    assert verdict.evidence["max_num_seqs"] == 1024.0, "vLLM 0.26's default on an H100"
    own = EngineConfig("llama-3.1-8b", {**FP8_BOTH.flags, "max_num_seqs": 128,
                                        "data_parallel_size": 2})
    evidence = evidence_from([step], own, H100, LLAMA_8B)
    assert evidence.max_num_seqs == 128.0 and evidence.max_num_requests_running == 63.0


# --- the simulated engine's physics -------------------------------------------------------------

def _simulated_level(model: str, flags: dict[str, Any], input_lens: tuple[int, int],
                     output_len: int, concurrency: int, num_requests: int, *,
                     hardware: HardwareProfile = H200) -> tuple[StepMetrics, EngineConfig]:
    """A closed-loop level replayed through the simulated engine's scheduler in virtual time
    on `hardware`, recorded as the runner records a vLLM level (load-generator counts,
    counter growth)."""
    config = EngineConfig(model, flags)
    engine = PerformanceModel.from_config(config, hardware)
    rng = random.Random(0)
    prompts = [[rng.randrange(32_000) for _ in range(rng.randint(*input_lens))]
               for _ in range(num_requests)]
    run = simulate_benchmark(engine, input_len=input_lens[0], output_len=output_len,
                             max_concurrency=concurrency, num_requests=num_requests,
                             prompts=prompts)
    metrics = BenchmarkMetrics(
        completed=run.num_requests, failed=0, duration_s=run.duration_s,
        total_input_tokens=run.total_input_tokens, total_output_tokens=run.total_output_tokens,
        request_throughput=run.num_requests / run.duration_s, request_goodput=None,
        output_throughput=run.output_throughput, total_token_throughput=0.0,
        **{**ZERO, "mean_tpot_ms": run.mean_tpot_ms, "median_tpot_ms": run.median_tpot_ms,
           "p99_tpot_ms": run.p99_tpot_ms, "mean_e2el_ms": run.mean_e2el_ms})
    step = StepMetrics(step=0, level=LoadLevel(max_concurrency=concurrency), metrics=metrics,
                       server_metrics=dict(run.counters))
    return step, config


def test_simulated_prefill_heavy_llama_is_compute_bound() -> None:
    """Llama-3.1-8B shape, prompts of 1000-3000 tokens, 128 out, 64 in flight: prefill chunks
    fill the steps and the FLOPs dominate (simulated: the model's physics, not a GPU)."""
    step, config = _simulated_level("llama-3.1-8b", {}, (1000, 3000), 128, 64, 64)
    verdict = classify(evidence_from([step], config, H200, LLAMA_8B))
    assert verdict.label == "compute-bound", verdict.reason
    ev = verdict.evidence
    assert ev["compute_utilization"] > 2 * ev["bandwidth_utilization"]
    assert ev["prefill_flop_share"] > 0.9


def test_simulated_decode_heavy_qwen_is_memory_bound() -> None:
    """Qwen2.5-7B shape, 512 in / 256 out at 64 concurrent (the H200 study's workload)."""
    step, config = _simulated_level("qwen2.5-7b", {}, (512, 512), 256, 64, 128)
    verdict = classify(evidence_from([step], config, H200, QWEN_7B))
    assert verdict.label == "memory-bound", verdict.reason
    assert verdict.evidence["bandwidth_utilization"] > verdict.evidence["compute_utilization"]


def test_simulated_mfu_counters_agree_with_our_roofline_where_vllm_knows_the_method() -> None:
    """vLLM's estimator (modelled in the simulated engine) and ours count the same work; theirs
    adds activations (bandwidth a little higher). For `fp8_per_block` vLLM 0.26 reports the
    method as "online", which its estimator does not know: only the unembedding is counted."""
    step, config = _simulated_level("llama-3.1-8b", {}, (1000, 3000), 128, 16, 32)
    terms = step_roofline(step, config, H200, LLAMA_8B)
    assert terms is not None and terms.vllm_compute_utilization is not None
    assert terms.vllm_compute_utilization == pytest.approx(terms.compute_utilization, rel=0.1)
    assert terms.vllm_bandwidth_utilization == pytest.approx(terms.bandwidth_utilization,
                                                             rel=0.25)
    step, config = _simulated_level("llama-3.1-8b", {"quantization": "fp8_per_block"},
                                    (1000, 3000), 128, 16, 32)
    block = step_roofline(step, config, H200, LLAMA_8B)
    assert block is not None and block.vllm_compute_utilization is not None
    assert block.vllm_compute_utilization < 0.1 * block.compute_utilization


# --- recorded H200 trials, judged as an unprofiled trial would be --------------------------------

@pytest.mark.parametrize("name", ["trial0", "trial1", "trial2", "trial4", "trial5", "trial6",
                                  "trial7"])
def test_recorded_h200_trials_without_their_trace_keep_their_label(name: str) -> None:
    """Study h200-proof-2 (vLLM 0.26, Qwen2.5-7B shape, 512/256 at 64 concurrent): without the
    profiled window, the step mix and NVML alone still tell eager (NVML 49%, 25% of bandwidth)
    from the CUDA-graph trials (NVML 91-99%, 41-58% of bandwidth)."""
    from tests.optimizer.test_bottleneck_h200 import TRIALS, _as_result

    result, config = _as_result(TRIALS[name], None)
    verdict = classify(evidence_from(result, config, H200, QWEN_7B))
    assert verdict.label == TRIALS[name]["device_verdict"]["label"], verdict.reason
    assert "trace" not in verdict.sources and "roofline" in verdict.sources
    if name == "trial2":
        assert "eager mode" in verdict.reason and verdict.evidence["gpu_util_mean_pct"] < 50
    else:
        assert 0.4 <= verdict.evidence["bandwidth_utilization"] < 0.6


def test_the_operating_point_is_the_level_that_served_most_not_a_light_one() -> None:
    """At 4 in flight the prefill-heavy Llama's steps are mostly small decode batches that
    stream the weights (simulated: ~0.6 of bandwidth); at 64 prefill dominates. The trial is
    judged where it served the most requests, whatever order the levels ran in."""
    light, config = _simulated_level("llama-3.1-8b", {}, (1000, 3000), 128, 4, 16)
    heavy, _ = _simulated_level("llama-3.1-8b", {}, (1000, 3000), 128, 64, 64)
    light_terms = step_roofline(light, config, H200, LLAMA_8B)
    assert light_terms is not None and light_terms.bandwidth_utilization > 0.5
    for order in ([light, heavy], [heavy, light]):
        verdict = classify(evidence_from(order, config, H200, LLAMA_8B))
        assert verdict.label == "compute-bound", verdict.reason


# --- the ceiling's precision; figures over 100% (session 13) ---------------------------------

AT_FLOP_LIMIT = replace(MIX, compute_utilization=0.89, bandwidth_utilization=0.3)


def test_at_the_bf16_flop_ceiling_of_an_fp8_card_the_advice_is_fp8_weights_not_stop() -> None:
    """The explore check's one-token answers: the bf16 defaults at 89% of the bf16 FLOP
    ceiling were told "stop tuning", then fp8 weights beat them by 1.19x (confirmed)."""
    verdict = classify(replace(AT_FLOP_LIMIT, is_fp8_weights=False, is_fp8_capable=True))
    assert verdict.label == "at-physical-limit"
    assert verdict.detail == "89% of the bf16 FLOP ceiling"
    said = advice(verdict)
    assert "stop tuning" not in said and "fp8 weights (quantization fp8) raise the ceiling" \
        in said, said
    # fp8 weights on that card: the fp8 ceiling, and there the limit is the hardware's.
    verdict = classify(replace(AT_FLOP_LIMIT, is_fp8_weights=True, is_fp8_capable=True))
    assert verdict.detail == "89% of the fp8 FLOP ceiling" and "stop tuning" in advice(verdict)
    # A card without fp8 tensor cores: bf16 is its ceiling.
    verdict = classify(replace(AT_FLOP_LIMIT, is_fp8_weights=False, is_fp8_capable=False))
    assert verdict.detail == "89% of the bf16 FLOP ceiling" and "stop tuning" in advice(verdict)


def test_evidence_says_whether_the_card_has_fp8_and_how_long_the_window_was() -> None:
    evidence = evidence_from(_counted(), EngineConfig("qwen2.5-7b"), H200, QWEN_7B)
    assert evidence.is_fp8_capable is True and evidence.window_s == 10.0
    verdict = classify(evidence)
    assert verdict.evidence["is_fp8_capable"] == 1.0 and verdict.evidence["window_s"] == 10.0


@pytest.mark.parametrize(("window_s", "why"), [
    (0.089, "its 0.089 s window is too short to measure a rate"),
    (30.0, "its figures are inconsistent")])
def test_a_level_over_100_percent_of_a_ceiling_is_never_labelled(window_s: float,
                                                                 why: str) -> None:
    """The explore check's trial 0: "at-physical-limit (2240% of the FLOP ceiling)" from a
    0.09 s window of 2 requests."""
    verdict = classify(replace(MIX, compute_utilization=22.4, bandwidth_utilization=0.5,
                               window_s=window_s))
    assert verdict.label == "unknown", verdict.reason
    assert why in verdict.reason and "which no GPU runs" in verdict.reason
    assert "stop tuning" not in advice(verdict)
    assert "longer window" in advice(verdict)
    decode = Evidence(decode_batch=8.0, context_tokens=600.0, tpot_ms=0.01, weight_bytes=15e9,
                      kv_bytes_per_token=57344.0, flops_per_token=15e9,
                      memory_bandwidth_gbps=4300.0, peak_tflops=790.0, window_s=window_s)
    assert decode.roofline_fraction() > 1.0
    assert classify(decode).label == "unknown", "the decode roofline too"


# --- at the ridge (issue 32: repeat stability) --------------------------------------------------

# The config of bench/repeat_stability.py (the simulated H200, Qwen2.5-7B shape, 512 in / 128
# out) at fixed request rates, 600 requests a level, session 16: its step mix's compute and
# bandwidth utilisation by completed req/s. The FLOP term over the byte term crosses 1 between
# 41.7 and 43.4 req/s, where three repeats of its capacity search stopped (40.5, 41.2 and
# 43.2 req/s): the old rule (compute-bound where compute >= bandwidth) called them memory-bound
# twice and compute-bound once.
SIM_QWEN_MIX = {34.6: (0.3751, 0.5166), 38.2: (0.4151, 0.4879), 40.1: (0.4353, 0.4738),
                41.7: (0.4526, 0.4595), 43.4: (0.4714, 0.4370), 45.3: (0.4919, 0.4192)}


def _sim(rate: float) -> Evidence:
    cu, bu = SIM_QWEN_MIX[rate]
    return replace(MIX, compute_utilization=cu, bandwidth_utilization=bu,
                   prefill_flop_share=0.8)


@pytest.mark.parametrize(("rate", "label"), [
    (34.6, "memory-bound"),  # FLOP term 0.73x the byte term
    (38.2, "memory-bound"),  # 0.85x
    (40.1, "compute-and-memory-bound"),  # 0.92x
    (41.7, "compute-and-memory-bound"),  # 0.98x
    (43.4, "compute-and-memory-bound"),  # 1.08x
    (45.3, "compute-bound"),  # 1.17x
])
def test_within_the_ridge_margin_the_label_names_both_ceilings(rate: float, label: str) -> None:
    verdict = classify(_sim(rate))
    assert verdict.label == label, verdict.reason
    cu, bu = SIM_QWEN_MIX[rate]
    assert verdict.evidence["compute_over_memory"] == pytest.approx(cu / bu)


def test_repeats_at_loads_either_side_of_the_ridge_get_one_label() -> None:
    """The repeat-stability flip: operating points a few percent apart, on either side of the
    ridge, were memory-bound and compute-bound on a difference the roofline cannot resolve."""
    verdicts = [classify(_sim(rate)) for rate in (40.1, 41.7, 43.4)]
    assert {v.label for v in verdicts} == {"compute-and-memory-bound"}
    ridge = verdicts[-1]
    assert ridge.detail == "at the ridge: 47% of the FLOP ceiling, 44% of the bandwidth ceiling"
    assert "FLOP term is 1.08x its byte term, within the 10% the roofline resolves" \
        in ridge.reason, ridge.reason


def test_the_ridge_margin_is_inclusive_and_a_parameter() -> None:
    at_edge = replace(MIX, compute_utilization=0.55, bandwidth_utilization=0.5)  # 1.1x
    assert classify(at_edge).label == "compute-and-memory-bound"
    below = replace(MIX, compute_utilization=0.5, bandwidth_utilization=0.55)  # 1 / 1.1x
    assert classify(below).label == "compute-and-memory-bound"
    assert classify(at_edge, Thresholds(ridge_margin=0.05)).label == "compute-bound"
    assert classify(below, Thresholds(ridge_margin=0.05)).label == "memory-bound"
    assert classify(_sim(45.3), Thresholds(ridge_margin=0.2)).label == \
        "compute-and-memory-bound"


def test_at_the_ridge_the_advice_cuts_both_and_never_repeats_the_config() -> None:
    """fp8 weights leave the FLOPs as they are: they raise the FLOP ceiling (fp8 tensor cores)
    and halve the weight bytes. The utilisations are time averages and decode attention adds
    to a step, so a one-sided lever cuts its side's share of the step, not "gains only until
    the other binds" (found in review)."""
    bf16 = classify(_sim(41.7))
    said = advice(bf16)
    assert said.startswith("raise the FLOP ceiling and cut bytes at once: fp8 weights "
                           "(quantization fp8)"), said
    assert "cut FLOPs" not in said, said
    on_fp8 = classify(replace(_sim(41.7), is_fp8_weights=True, kv_read_share=0.3))
    said = advice(on_fp8)
    assert "quantization fp8" not in said and "kv_cache_dtype fp8" in said, said
    assert said.startswith("each lever cuts only its side's share of the step: "), said
    assert "until the other" not in said and "shorter prompts" in said, said
    assert "capacity, not capacity per GPU" in said, said
    assert "fp8" not in advice(on_fp8, config=FP8_BOTH)


@pytest.mark.parametrize("label", ["compute-bound", "compute-and-memory-bound"])
def test_prefix_caching_is_advised_only_where_the_config_has_it_off(label: str) -> None:
    """vLLM 0.26 turns prefix caching on by default (its flag table's default), so advice
    offered it to configs that already had it (found in review)."""
    on_fp8 = Verdict(label=label, roofline_fraction=0.5,  # type: ignore[arg-type]
                     evidence={"is_fp8_weights": 1.0, "is_fp8_kv": 1.0})
    assert "prefix caching" not in advice(on_fp8), advice(on_fp8)
    assert "shorter prompts" in advice(on_fp8), advice(on_fp8)
    assert "prefix caching" not in advice(on_fp8, config={"enable_prefix_caching": True})
    said = advice(on_fp8, config={"enable_prefix_caching": False})
    assert "prefix caching of shared prompts (enable_prefix_caching, off in this config)" \
        in said, said
    assert "prefix caching" in advice(on_fp8, config={"no_enable_prefix_caching": True})
    off = replace(on_fp8, evidence={**on_fp8.evidence, "is_prefix_caching": 0.0})
    assert "prefix caching" in advice(off), advice(off)
    assert "prefix caching" not in advice(off, config={"enable_prefix_caching": "true"})


def test_the_verdict_carries_whether_the_config_caches_prefixes() -> None:
    """From the config's flag, else vLLM's default for the engine's release (on in 0.26), so
    `sentence` (which has no config) does not advise what the config already does."""
    step = _counted(steps=2000.0)
    on_fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    default = classify(evidence_from([step], EngineConfig("qwen2.5-7b", on_fp8), H200, QWEN_7B))
    assert default.evidence["is_prefix_caching"] == 1.0
    off = classify(evidence_from(
        [step], EngineConfig("qwen2.5-7b", {**on_fp8, "enable_prefix_caching": False}), H200,
        QWEN_7B))
    assert off.evidence["is_prefix_caching"] == 0.0
    for verdict in (default, off):
        for label in ("compute-bound", "compute-and-memory-bound"):
            said = advice(replace(verdict, label=label))
            assert ("prefix caching" in said) == (verdict is off), said


def test_at_the_physical_limit_at_the_ridge_the_detail_names_both_and_advises_fp8() -> None:
    """At 82% of the bf16 FLOP ceiling and 85% of bandwidth on an fp8 card the FLOP ceiling
    binds as much as the bandwidth one: fp8 weights raise it (and halve the weights read); the
    old rule named the bandwidth ceiling alone and said stop tuning."""
    verdict = classify(replace(MIX, compute_utilization=0.82, bandwidth_utilization=0.85,
                               is_fp8_weights=False, is_fp8_capable=True))
    assert verdict.label == "at-physical-limit"
    assert verdict.detail == ("82% of the bf16 FLOP ceiling and 85% of the bandwidth ceiling, "
                              "at the ridge")
    assert "fp8 weights (quantization fp8) raise the ceiling" in advice(verdict)
    apart = classify(replace(MIX, compute_utilization=0.5, bandwidth_utilization=0.85,
                             is_fp8_weights=False, is_fp8_capable=True))
    # At the bandwidth ceiling the bf16 bytes bind: fp8 weights and KV read fewer (s17 #6).
    assert apart.detail == "85% of the bandwidth ceiling" and "stop tuning" not in advice(apart)
    assert "fp8 weights (quantization fp8) or an fp8 KV cache" in advice(apart), advice(apart)
