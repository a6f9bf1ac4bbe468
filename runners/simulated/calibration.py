"""The simulated engine's constants: memory, start-up, step time, admission, and the knobs'
assumptions. Each is explained, with how it was calibrated, in docs/simulated-engine.md; their
users are `sizing.py`, `performance.py` and `scheduler.py`. A model's numbers, never a
measurement.
"""

from __future__ import annotations

from collections.abc import Mapping

GIB = 1024**3

# --- memory --------------------------------------------------------------------------------
# CUDA context, cuBLAS workspaces, allocator fragmentation: the "non-torch" memory vLLM's
# profiler sees (0.5-0.7 GiB on H200), plus NCCL buffers once there is a peer.
NON_TORCH_BYTES = 0.6 * GIB
NCCL_BUFFER_BYTES = 0.4 * GIB
# Peak activation of the profile run per token of max_num_batched_tokens: the MLP's gate_up
# output (2 * intermediate) plus ~4 hidden-sized buffers, in bf16.
ACTIVATION_HIDDEN_BUFFERS = 4
# CUDA-graph pool: a fixed part plus a per-captured-size part (vLLM 0.26 reports ~0.6-0.7 GiB
# for a 7B model with the 51 default sizes).
CUDA_GRAPH_BASE_BYTES = 0.25 * GIB
CUDA_GRAPH_BYTES_PER_SIZE = 0.008 * GIB
DEFAULT_BLOCK_SIZE = 16

# --- start-up (real-world seconds; the server sleeps these times startup_time_scale) ---------
PROCESS_START_S = 30.0  # imports of torch/vLLM, API server, engine-core spawn, device init
WEIGHT_LOAD_BYTES_PER_S = 1.5e9  # safetensors from a warm page cache, per GPU in parallel
DUMMY_LOAD_BYTES_PER_S = 15e9  # --load-format dummy: random init on the GPU
PROFILE_RUN_S = 6.0  # the dummy forward at max_num_batched_tokens plus KV allocation
ENGINE_MISC_S = 13.0  # tokenizer, sampler warm-up, API server routes, first health answer
COMPILE_COLD_BASE_S = 95.0  # Dynamo trace + Inductor compile of the piecewise subgraphs
COMPILE_COLD_PER_LAYER_S = 0.5
COMPILE_WARM_BASE_S = 15.0  # loading the compiled artifacts from the compile cache
COMPILE_WARM_PER_LAYER_S = 0.2
GRAPH_CAPTURE_S_PER_SIZE_LAYER = 0.021  # FULL_AND_PIECEWISE capture of each size, per layer
TP_INIT_S_PER_RANK = 4.0  # NCCL communicator set-up and custom all-reduce IPC handles

# --- step time ------------------------------------------------------------------------------
GEMM_BW_EFF = 0.85  # share of profile bandwidth a skinny (decode) GEMM streams weights at
GEMM_FLOP_EFF = 0.90  # share of the measured bf16 peak a large GEMM reaches (nvjet)
FP8_GEMM_FLOP_EFF = 0.55  # calibrated: fp8 prefill ~1.2x bf16 at the decode-mix knee (H200 labels)
# fp8 GEMMs at decode batch sizes stream their (halved) weights less well than bf16's nvjet
# (calibrated: fp8 TPOT 3.6 ms at 8 concurrent, 4.7-5.0 ms at 64, H200 studies 2-4 and labels).
FP8_GEMM_BW_EFF = 0.70
FP8_ACT_QUANT_PASSES = 4  # dynamic activation quant: one read+write of the input per GEMM
ATTN_DECODE_BW_EFF = 0.75  # share of bandwidth paged decode attention reaches reading KV
ATTN_PREFILL_FLOP_EFF = 0.50  # causal prefill attention at short lengths
# Per-backend efficiency on the attention part, relative to FA3 (calibrated on H200).
BACKEND_EFF: Mapping[str, float] = {
    "FLASH_ATTN": 1.0, "FLASHINFER": 0.92, "TRITON_ATTN": 0.85, "FLEX_ATTENTION": 0.6}
# FlashInfer plans each batch on the host every step (calibrated: +0.7 ms TPOT at 64 seqs).
FLASHINFER_PLAN_S = 0.35e-3
FLASHINFER_PLAN_PER_SEQ_S = 4e-6
# fp8 KV on prefill: Q and new K/V are quantized per chunk and the fp8 prefill kernel runs at
# lower occupancy (calibrated: TTFT worse with fp8 KV on H200); per prefill token per layer.
KV_FP8_PREFILL_S_PER_TOKEN_LAYER = 0.07e-6
ELEMENTWISE_PASSES_COMPILED = 8  # hidden-sized reads+writes per layer once Inductor fused them
ELEMENTWISE_PASSES_EAGER = 14  # separate norm, rope, residual, activation kernels
# Host work per engine step that the GPU waits for: scheduling, input preparation, sampling,
# output processing (GPU busy ~0.55 of the span with CUDA graphs on H200).
HOST_STEP_S = 0.6e-3
HOST_PER_SEQ_S = 12e-6
HOST_PER_PREFILL_TOKEN_S = 0.05e-6
# Kernel launches: a graph replay is one launch; eager launches each kernel from Python.
GRAPH_REPLAY_S = 40e-6
EAGER_KERNELS_PER_LAYER = 14
EAGER_DISPATCH_S = 40e-6  # torch module dispatch + launch per kernel (eager TPOT 18.8 ms)
COMPILED_KERNELS_PER_LAYER = 9
COMPILED_DISPATCH_S = 12e-6  # Inductor's wrapper launches kernels with little Python
PIECEWISE_ATTN_KERNELS_PER_LAYER = 2  # attention runs between graph pieces in mixed batches
# Eager extras per layer (calibrated on H200 study 1): fp8 weights launch a dynamic activation
# quant kernel before each of the 4 GEMMs (eager fp8 TPOT 19.6-21.5 vs 16.1-18.8 ms bf16);
# FlashInfer's Python wrapper runs per layer (eager FLASHINFER +2.8 to +7.4 ms TPOT).
EAGER_FP8_QUANT_KERNELS_PER_LAYER = 4
EAGER_FLASHINFER_KERNELS_PER_LAYER = 4
# Online block-wise fp8 (`quantization: fp8_per_block`) on vLLM 0.26 / H200 JIT-compiles its
# kernels at start and again while serving (Llama-3.1-8B shape, 2026-12-04: start-up 306 s vs
# 153 s, TPOT p99 475 ms at 2 req/s, GPU 14% busy). Modelled as measured, not explained: extra
# start-up, and every step stalls on the host. Fitted to those two figures only.
JIT_WHILE_SERVING_QUANTIZATIONS = frozenset({"fp8_per_block"})
JIT_STARTUP_S = 153.0
JIT_STEP_STALL_S = 0.45
# Two all-reduces per layer (after o_proj and down_proj).
ALLREDUCE_LATENCY_S: Mapping[str, float] = {"nvlink": 15e-6, "pcie": 60e-6, "none": 60e-6}
ALLREDUCE_BW_EFF = 0.7
PCIE_FALLBACK_GBPS = 25.0  # per direction, when the profile does not say

# --- scheduler and graph knobs (issue 23; docs/simulated-engine.md "Knobs"): assumptions, not
# calibrated; their defaults leave every figure above unchanged.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# Share of the FULL_AND_PIECEWISE capture time each mode spends (it captures both kinds).
GRAPH_CAPTURE_SHARE: Mapping[str, float] = {
    "NONE": 0.0, "PIECEWISE": 0.5, "FULL": 0.5, "FULL_DECODE_ONLY": 0.5,
    "FULL_AND_PIECEWISE": 1.0}
# Async scheduling (on by default in 0.26, config/vllm.py:1059-1107; the calibration ran with
# it) hides the next step's scheduling behind the GPU; off, the GPU also waits for this.
SYNC_SCHEDULE_S = 0.25e-3
SYNC_SCHEDULE_PER_SEQ_S = 3e-6
# ngram (CPU) prompt lookup per decoding sequence; ngram_gpu looks up on the GPU. Acceptance is
# modelled as none: the engine's synthesised prompts are random tokens, on which prompt lookup
# finds no match, so no draft is proposed or verified (docs/simulated-engine.md).
NGRAM_LOOKUP_PER_SEQ_S = 2e-6
# --- the way in (calibrated on the H200 records; docs/simulated-engine.md "Admission") ----------
# A new request reaches the scheduler only after its trip through the client and the API server,
# whose Python event loops also handle one chunk per open stream per step: the client's TTFT
# exceeded vLLM's own TTFT histogram by 0.6-1.55 ms per running request (median ~1.0) on all 20
# H200 records that carry both, at 64-124 concurrent (39-122 ms), so the trip grows with the
# streams open when the request arrives. The trip is charged on the way in (it holds the request
# back from the scheduler): a closed-loop client's next request then reaches the engine as late
# as the round trip makes it, which keeps a level's requests together in waves.
API_LAG_PER_STREAM_S = 1.0e-3
