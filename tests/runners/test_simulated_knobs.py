"""The simulated engine's model of issue 23's knobs moves its figures in the direction
docs/simulated-engine.md states, and leaves them unchanged at vLLM's defaults. These are
properties of the model, never measurements."""

from __future__ import annotations

import pytest

from runners.base import EngineConfig
from runners.hardware import load_preset
from runners.simulated.benchmark import simulate_benchmark
from runners.simulated.performance import PerformanceModel
from runners.simulated.scheduler import Scheduler, SimRequest

H200 = load_preset("h200")
MODE = "compilation_config.cudagraph_mode"


def model_for(flags: dict[str, object] | None = None,
              shape: str = "qwen2.5-7b") -> PerformanceModel:
    return PerformanceModel.from_config(EngineConfig(shape, flags or {}), H200)


def decode_step_s(flags: dict[str, object], seqs: int = 32, shape: str = "qwen2.5-7b") -> float:
    return model_for(flags, shape).step_time(seqs, seqs * 600).total_s


def mixed_step_s(flags: dict[str, object]) -> float:
    return model_for(flags, SMALL).step_time(8, 8 * 600, num_prefill_tokens=200).total_s


# A 0.5B model on an H200: its GPU step is shorter than launching its kernels one by one, so
# the launch cost CUDA graphs save shows (for a 7B model the GPU time hides most of it).
SMALL = "qwen2.5-0.5b"


def test_the_defaults_of_the_knobs_leave_every_figure_unchanged() -> None:
    explicit = {MODE: "FULL_AND_PIECEWISE", "stream_interval": 1,
                "long_prefill_token_threshold": 0, "spec_method": "none"}
    assert model_for(explicit) == model_for({}), "vLLM's defaults are the calibrated model"


def test_cudagraph_none_is_launch_bound_piecewise_between_and_full_decode_like_full() -> None:
    def step(flags: dict[str, object]) -> float:
        return decode_step_s(flags, seqs=8, shape=SMALL)

    full = step({})
    assert step({MODE: "FULL_DECODE_ONLY"}) == pytest.approx(full), \
        "a decode-only step replays the same full graph"
    assert full < step({MODE: "PIECEWISE"}) < step({MODE: "NONE"})
    assert step({MODE: "NONE"}) < step({"enforce_eager": True}), \
        "NONE keeps torch.compile's fused kernels, eager launches each one from Python"
    assert mixed_step_s({MODE: "FULL_DECODE_ONLY"}) > mixed_step_s({}), \
        "a mixed batch runs without graph pieces when only decode graphs are captured"


def test_fewer_graphs_start_faster_and_leave_more_kv_cache() -> None:
    default, piecewise, none = (model_for(f) for f in ({}, {MODE: "PIECEWISE"}, {MODE: "NONE"}))
    assert default.startup().graph_capture_s > piecewise.startup().graph_capture_s > 0
    assert none.startup().graph_capture_s == 0 and none.kv_cache_tokens > default.kv_cache_tokens
    smaller = model_for({"max_cudagraph_capture_size": 64})
    assert smaller.startup().graph_capture_s < default.startup().graph_capture_s


def test_async_scheduling_off_adds_host_time_per_step_and_ngram_turns_it_off() -> None:
    assert decode_step_s({"no_async_scheduling": True}) > decode_step_s({})
    assert not model_for({"spec_method": "ngram"}).async_scheduling, \
        "vLLM 0.26 turns async scheduling off for ngram (config/vllm.py:1069-1080)"
    assert model_for({"spec_method": "ngram_gpu"}).async_scheduling


def test_speculation_without_modelled_acceptance_only_costs() -> None:
    base = simulate_benchmark(model_for({}), input_len=512, output_len=64, max_concurrency=16,
                              num_requests=32)
    for method in ("ngram", "ngram_gpu"):
        spec = simulate_benchmark(model_for({"spec_method": method, "spec_tokens": 4}),
                                  input_len=512, output_len=64, max_concurrency=16,
                                  num_requests=32)
        assert spec.output_throughput <= base.output_throughput, method


def test_a_larger_stream_interval_sends_fewer_chunks_and_leaves_the_step_alone() -> None:
    # vLLM 0.26 buffers tokens in the API server's output processor, not in the engine core.
    assert decode_step_s({"stream_interval": 16}) == decode_step_s({})
    model = model_for({"stream_interval": 4})
    scheduler = Scheduler(model)
    request = SimRequest("r", num_prompt_tokens=16, max_tokens=10, arrival_s=0.0)
    scheduler.add(request)
    chunks = []
    now = 0.0
    while (plan := scheduler.schedule(now)) is not None:
        now += plan.breakdown.total_s
        chunks.extend(e.num_tokens for e in scheduler.complete(plan, now))
    assert chunks == [1, 4, 4, 1], "the first token at once, then every 4, the rest at the end"


def test_a_prefill_threshold_splits_long_prompts_so_decodes_wait_less() -> None:
    def plan_tokens(flags: dict[str, object]) -> list[int]:
        scheduler = Scheduler(model_for(flags))
        scheduler.add(SimRequest("long", num_prompt_tokens=6000, max_tokens=4, arrival_s=0.0))
        plan = scheduler.schedule(0.0)
        assert plan is not None
        return [take for _, take in plan.scheduled]

    assert plan_tokens({}) == [6000]
    assert plan_tokens({"long_prefill_token_threshold": 2048}) == [2048]
    long = dict(input_len=6000, output_len=64, max_concurrency=8, num_requests=16)
    capped = simulate_benchmark(model_for({"long_prefill_token_threshold": 512}), **long)
    free = simulate_benchmark(model_for({}), **long)
    assert capped.p99_tpot_ms < free.p99_tpot_ms, \
        "decodes no longer share a step with a whole 6000-token prefill"


def test_a_larger_block_size_wastes_more_of_each_requests_last_block() -> None:
    small, large = model_for({}), model_for({"block_size": 64})
    assert large.kv_cache_tokens <= small.kv_cache_tokens + 64
    for model in (small, large):
        scheduler = Scheduler(model)
        scheduler.add(SimRequest("r", num_prompt_tokens=17, max_tokens=1, arrival_s=0.0))
        scheduler.schedule(0.0)
        assert scheduler.running[0].num_blocks * model.block_size == (
            32 if model is small else 64), "KV is held in whole blocks"
