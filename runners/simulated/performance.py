"""The simulated engine's times (`PerformanceModel`): modelled start-up and the time of one
engine step, part by part (`StepBreakdown`), from a roofline of the config on its GPU. Each
constant is explained, with how it was calibrated, in docs/simulated-engine.md; a model, never a
measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from runners.simulated.calibration import (
    ALLREDUCE_BW_EFF,
    ALLREDUCE_LATENCY_S,
    ATTN_DECODE_BW_EFF,
    ATTN_PREFILL_FLOP_EFF,
    BACKEND_EFF,
    COMPILE_COLD_BASE_S,
    COMPILE_COLD_PER_LAYER_S,
    COMPILE_WARM_BASE_S,
    COMPILE_WARM_PER_LAYER_S,
    COMPILED_DISPATCH_S,
    COMPILED_KERNELS_PER_LAYER,
    DUMMY_LOAD_BYTES_PER_S,
    EAGER_DISPATCH_S,
    EAGER_FLASHINFER_KERNELS_PER_LAYER,
    EAGER_FP8_QUANT_KERNELS_PER_LAYER,
    EAGER_KERNELS_PER_LAYER,
    ELEMENTWISE_PASSES_COMPILED,
    ELEMENTWISE_PASSES_EAGER,
    ENGINE_MISC_S,
    FLASHINFER_PLAN_PER_SEQ_S,
    FLASHINFER_PLAN_S,
    FP8_ACT_QUANT_PASSES,
    FP8_GEMM_BW_EFF,
    FP8_GEMM_FLOP_EFF,
    GEMM_BW_EFF,
    GEMM_FLOP_EFF,
    GRAPH_CAPTURE_S_PER_SIZE_LAYER,
    GRAPH_CAPTURE_SHARE,
    GRAPH_REPLAY_S,
    HOST_PER_PREFILL_TOKEN_S,
    HOST_PER_SEQ_S,
    HOST_STEP_S,
    JIT_STARTUP_S,
    JIT_STEP_STALL_S,
    KV_FP8_PREFILL_S_PER_TOKEN_LAYER,
    NGRAM_LOOKUP_PER_SEQ_S,
    PCIE_FALLBACK_GBPS,
    PIECEWISE_ATTN_KERNELS_PER_LAYER,
    PROCESS_START_S,
    PROFILE_RUN_S,
    SYNC_SCHEDULE_PER_SEQ_S,
    SYNC_SCHEDULE_S,
    TP_INIT_S_PER_RANK,
    WEIGHT_LOAD_BYTES_PER_S,
)
from runners.simulated.sizing import EngineSizing
from search_spaces.engine.facts import kv_cache_is_fp8


@dataclass(frozen=True)
class StartupTimes:
    """Modelled real-world start-up, in seconds; the server sleeps each times its time scale."""

    process_start_s: float
    model_load_s: float
    profile_s: float
    compile_s: float  # 0 with enforce_eager
    graph_capture_s: float  # 0 with enforce_eager
    misc_s: float

    @property
    def init_engine_s(self) -> float:
        return self.profile_s + self.compile_s + self.graph_capture_s

    @property
    def total_s(self) -> float:
        return (self.process_start_s + self.model_load_s + self.init_engine_s + self.misc_s)


@dataclass(frozen=True)
class StepBreakdown:
    """One engine iteration, seconds. GPU parts are per GPU (they run in parallel under TP)."""

    gemm_s: float
    attention_s: float
    kv_write_s: float
    elementwise_s: float
    quant_s: float
    comm_s: float
    launch_s: float  # host time launching kernels (hidden when the GPU is slower)
    host_s: float  # scheduling, sampling, output processing: the GPU waits
    uses_cuda_graph: bool

    @property
    def gpu_s(self) -> float:
        return (self.gemm_s + self.attention_s + self.kv_write_s + self.elementwise_s
                + self.quant_s + self.comm_s)

    @property
    def total_s(self) -> float:
        return max(self.gpu_s, self.launch_s) + self.host_s

    @property
    def gpu_busy_fraction(self) -> float:
        return self.gpu_s / self.total_s if self.total_s > 0 else 0.0


@dataclass(frozen=True)
class PerformanceModel(EngineSizing):
    """A roofline-style model of one engine config on one GPU type: its start-up and the time of
    one engine step, on top of its sizes (`EngineSizing`). Pure: no clock, no I/O."""

    # --- start-up ------------------------------------------------------------------------------
    def startup(self) -> StartupTimes:
        m, tp = self.model, self.tensor_parallel_size
        rate = DUMMY_LOAD_BYTES_PER_S if self.load_format == "dummy" else WEIGHT_LOAD_BYTES_PER_S
        compile_s = graph_s = 0.0
        if not self.enforce_eager:
            if self.is_compile_cache_warm:
                compile_s = COMPILE_WARM_BASE_S + COMPILE_WARM_PER_LAYER_S * m.num_hidden_layers
            else:
                compile_s = COMPILE_COLD_BASE_S + COMPILE_COLD_PER_LAYER_S * m.num_hidden_layers
            graph_s = (GRAPH_CAPTURE_S_PER_SIZE_LAYER * len(self.cuda_graph_sizes)
                       * m.num_hidden_layers * GRAPH_CAPTURE_SHARE[self.cudagraph_mode])
        return StartupTimes(
            process_start_s=PROCESS_START_S + (TP_INIT_S_PER_RANK * tp if tp > 1 else 0.0),
            model_load_s=self.weight_bytes_per_gpu / rate,
            profile_s=PROFILE_RUN_S,
            compile_s=compile_s,
            graph_capture_s=graph_s,
            misc_s=ENGINE_MISC_S + (JIT_STARTUP_S if self.is_jit_while_serving else 0.0),
        )

    # --- step time -----------------------------------------------------------------------------
    def step_time(self, num_decode_seqs: int, decode_context_tokens: int,
                  num_prefill_tokens: int = 0, num_prefill_seqs: int | None = None,
                  prefill_attention_pairs: float | None = None) -> StepBreakdown:
        """One engine iteration.

        `decode_context_tokens` is the sum of the decoding sequences' lengths (KV read);
        `prefill_attention_pairs` the causal query-key pairs of the prefill chunks (default: one
        fresh prompt of `num_prefill_tokens`); `num_prefill_seqs` how many chunks there are.
        """
        m, hw, tp = self.model, self.hardware, self.tensor_parallel_size
        layers = m.num_hidden_layers
        tokens = num_decode_seqs + num_prefill_tokens
        if tokens <= 0:
            return StepBreakdown(0, 0, 0, 0, 0, 0, 0, 0, False)
        if num_prefill_seqs is None:
            num_prefill_seqs = 1 if num_prefill_tokens else 0
        if prefill_attention_pairs is None:
            prefill_attention_pairs = num_prefill_tokens * (num_prefill_tokens + 1) / 2
        bandwidth = hw.memory_bandwidth_gbps * 1e9
        bf16_flops = hw.bf16_tflops * 1e12
        logit_rows = num_decode_seqs + num_prefill_seqs

        # GEMMs: the weights the step's tokens are routed to are streamed once per step (all of
        # a dense model's; of an MoE layer, the experts touched: `ModelInfo.experts_read`);
        # compute grows with tokens times the weights one token passes.
        gemm_bytes = m.weight_bytes_read(self.weight_bytes_per_param, tokens) / tp
        if self.is_fp8_weights and hw.fp8_tflops > 0:
            linear_peak = hw.fp8_tflops * 1e12 * FP8_GEMM_FLOP_EFF
        else:
            linear_peak = bf16_flops * GEMM_FLOP_EFF
        linear_s = 2 * m.active_linear_params / tp * tokens / linear_peak
        lm_head_s = 2 * self.lm_head_params / tp * logit_rows / (bf16_flops * GEMM_FLOP_EFF)
        bw_eff = FP8_GEMM_BW_EFF if self.is_fp8_weights else GEMM_BW_EFF
        gemm_s = max(gemm_bytes / (bandwidth * bw_eff), linear_s + lm_head_s)

        # Attention: decode reads the KV of every context token; prefill is causal compute.
        backend_eff = BACKEND_EFF.get(self.attention_backend, 1.0)
        heads_per_gpu = m.num_attention_heads / tp
        decode_kv_bytes = decode_context_tokens * self.kv_bytes_per_token_per_gpu
        decode_attn_s = decode_kv_bytes / (bandwidth * ATTN_DECODE_BW_EFF * backend_eff)
        prefill_flops = 4 * layers * heads_per_gpu * m.head_dim * prefill_attention_pairs
        prefill_attn_s = prefill_flops / (bf16_flops * ATTN_PREFILL_FLOP_EFF * backend_eff)
        if kv_cache_is_fp8(self.kv_cache_dtype):
            prefill_attn_s += KV_FP8_PREFILL_S_PER_TOKEN_LAYER * layers * num_prefill_tokens
        attention_s = decode_attn_s + prefill_attn_s
        kv_write_s = tokens * self.kv_bytes_per_token_per_gpu * 2 / bandwidth  # read + write

        mode = "NONE" if self.enforce_eager else self.cudagraph_mode
        fits = tokens <= self.max_cudagraph_capture_size and mode != "NONE"
        # A full graph replays a decode-only step; PIECEWISE alone never captures one, and only
        # the piecewise modes replay graph pieces around the attention of a mixed batch.
        uses_graph = fits and num_prefill_tokens == 0 and mode != "PIECEWISE"
        uses_pieces = fits and not uses_graph and mode in ("PIECEWISE", "FULL_AND_PIECEWISE")
        passes = ELEMENTWISE_PASSES_EAGER if self.enforce_eager else ELEMENTWISE_PASSES_COMPILED
        elementwise_s = tokens * layers * m.hidden_size * 2 * passes / bandwidth
        quant_s = 0.0
        if self.is_fp8_weights:
            quant_s = tokens * layers * m.hidden_size * 2 * FP8_ACT_QUANT_PASSES / bandwidth

        comm_s = 0.0
        if tp > 1:
            link = hw.interconnect if hw.interconnect in ALLREDUCE_LATENCY_S else "pcie"
            link_gbps = hw.interconnect_gbps or PCIE_FALLBACK_GBPS
            ring_bytes = 2 * (tp - 1) / tp * tokens * m.hidden_size * 2
            per_allreduce = (ALLREDUCE_LATENCY_S[link]
                             + ring_bytes / (link_gbps * 1e9 * ALLREDUCE_BW_EFF))
            comm_s = 2 * layers * per_allreduce

        if uses_graph:
            launch_s = GRAPH_REPLAY_S
        elif self.enforce_eager:
            kernels = EAGER_KERNELS_PER_LAYER
            if self.is_fp8_weights:
                kernels += EAGER_FP8_QUANT_KERNELS_PER_LAYER
            if self.attention_backend == "FLASHINFER":
                kernels += EAGER_FLASHINFER_KERNELS_PER_LAYER
            launch_s = layers * kernels * EAGER_DISPATCH_S
        elif uses_pieces:
            # Mixed batches replay the piecewise graphs; attention is launched between them.
            launch_s = GRAPH_REPLAY_S * layers + (
                layers * PIECEWISE_ATTN_KERNELS_PER_LAYER * COMPILED_DISPATCH_S)
        else:
            launch_s = layers * COMPILED_KERNELS_PER_LAYER * COMPILED_DISPATCH_S

        num_seqs = num_decode_seqs + num_prefill_seqs
        # --stream-interval does not change the step: vLLM 0.26 applies it in the API
        # server's output processor (v1/engine/output_processor.py:289-300), a process apart,
        # while the engine core still hands every token over each step.
        host_s = HOST_STEP_S + HOST_PER_SEQ_S * num_seqs
        host_s += HOST_PER_PREFILL_TOKEN_S * num_prefill_tokens
        if not self.async_scheduling:
            host_s += SYNC_SCHEDULE_S + SYNC_SCHEDULE_PER_SEQ_S * num_seqs
        if self.spec_method == "ngram":
            host_s += NGRAM_LOOKUP_PER_SEQ_S * num_decode_seqs
        if self.attention_backend == "FLASHINFER":
            host_s += FLASHINFER_PLAN_S + FLASHINFER_PLAN_PER_SEQ_S * num_seqs
        if self.is_jit_while_serving:
            host_s += JIT_STEP_STALL_S
        return StepBreakdown(gemm_s=gemm_s, attention_s=attention_s, kv_write_s=kv_write_s,
                             elementwise_s=elementwise_s, quant_s=quant_s, comm_s=comm_s,
                             launch_s=launch_s, host_s=host_s, uses_cuda_graph=uses_graph)
