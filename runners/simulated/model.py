"""The simulated engine's performance model: memory check, start-up time, per-step time, and the
pure continuous-batching scheduler that turns step times into request latencies.

Everything here is a model, never a measurement. Each constant is explained, with how it was
calibrated, in docs/simulated-engine.md; `simulate_benchmark` replays the calibration workload in
virtual time so tests can check the model without sleeping.
"""

from __future__ import annotations

import math
import random
import re
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from runners.base import EngineConfig, Failure, FailureReason, FlagValue
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo, load_model_info
from search_spaces.engine.facts import (
    BYTES_PER_PARAM,
    FP8_WEIGHT_METHODS,
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
)

GIB = 1024**3
ENGINE_VERSION = "0.26.0"

AttentionBackend = Literal["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]
# vLLM's SM90 priority order: what "auto" resolves to is the first one the config allows.
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = (
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")

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
# Flags the simulated engine accepts but does not model: a trial runs with them and its figures
# are those of the same config without them (docs/simulated-engine.md, "Knobs").
UNMODELLED_FLAGS = frozenset({
    "scheduling_policy", "max_num_partial_prefills", "max_long_partial_prefills",
    "optimization_level"})


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


def resolve_model_info(model: str) -> ModelInfo | None:
    """ModelInfo for a path, a bundled shape, or a hub id whose last part names a bundled shape
    (`Qwen/Qwen2.5-7B-Instruct` -> qwen2.5-7b): the simulator needs shapes, not weights."""
    info = load_model_info(model)
    if info is not None:
        return info
    tail = model.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-chat", "-base", "-hf"):
        tail = tail.removesuffix(suffix)
    return load_model_info(tail.replace("meta-llama-", "llama-"))


def _flag_int(flags: Mapping[str, FlagValue], name: str, default: int) -> int:
    value = flags.get(name)
    if value is None or value == "auto":
        return default
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", value)
        if match is None:
            raise ValueError(f"flag {name} must be an integer but got {value!r}.")
        scale = {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
        return int(float(match.group(1)) * scale)
    return int(value)


def _flag_bool(flags: Mapping[str, FlagValue], name: str, default: bool) -> bool:
    value = flags.get(name)
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def _flag_str(flags: Mapping[str, FlagValue], name: str, default: str) -> str:
    value = flags.get(name)
    return default if value is None else str(value)


def capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's default CUDA-graph capture sizes up to `max_size` (51 sizes for 512)."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_size + 1, 16)]
    return tuple(s for s in sizes if s <= max_size)


@dataclass(frozen=True)
class PerformanceModel:
    """A roofline-style model of one engine config on one GPU type. Pure: no clock, no I/O."""

    model: ModelInfo
    hardware: HardwareProfile
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int = 32768  # tokens
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192  # tokens per step
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block
    enforce_eager: bool = False
    attention_backend: str = "FLASH_ATTN"  # the resolved one
    requested_backend: str = "auto"  # as asked for
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    max_cudagraph_capture_size: int = 512  # tokens
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    load_format: str = "auto"
    is_compile_cache_warm: bool = False
    cudagraph_mode: str = "FULL_AND_PIECEWISE"  # NONE with enforce_eager
    async_scheduling: bool = True  # vLLM 0.26 decides on; off with ngram (CPU) speculation
    stream_interval: int = 1  # tokens per streamed chunk
    long_prefill_token_threshold: int = 0  # tokens per request per step; 0 = no cap
    spec_method: str = "none"  # ngram / ngram_gpu / suffix; no acceptance is modelled

    @classmethod
    def from_config(cls, config: EngineConfig, hardware: HardwareProfile,
                    model: ModelInfo | None = None, *,
                    is_compile_cache_warm: bool = False) -> PerformanceModel:
        """Defaults follow vLLM 0.26 (REFERENCE.md): 8192/1024 on >= 70 GiB GPUs, else 2048/256.

        Raises ValueError when the model's shape is unknown (no config.json reachable)."""
        info = model or resolve_model_info(config.model)
        if info is None:
            raise ValueError(
                f"the simulated engine needs a model shape but {config.model!r} is neither a "
                "directory with config.json nor a bundled shape; pass a bundled shape name.")
        flags = config.flags
        is_big_gpu = hardware.gpu_memory_gib >= 70 and "A100" not in hardware.gpu_name
        max_num_seqs = _flag_int(flags, "max_num_seqs", 1024 if is_big_gpu else 256)
        requested = _flag_str(flags, "attention_backend", "auto").upper()
        kv_dtype = _flag_str(flags, "kv_cache_dtype", "auto").lower()
        quant = flags.get("quantization")
        quantization = str(quant).lower() if quant else info.quant_method
        enforce_eager = _flag_bool(flags, "enforce_eager", False)
        cudagraph_mode = "NONE" if enforce_eager else _flag_str(
            flags, "compilation_config.cudagraph_mode", "FULL_AND_PIECEWISE").upper()
        if cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"flag compilation_config.cudagraph_mode must be one of "
                             f"{', '.join(CUDAGRAPH_MODES)} but got {cudagraph_mode!r}.")
        spec_method = _flag_str(flags, "spec_method", "none").lower()
        # vLLM 0.26 turns async scheduling off by itself for ngram/suffix speculation
        # (config/vllm.py:1069-1080); an explicit --async-scheduling then fails (:1038-1048).
        async_scheduling = not _flag_bool(flags, "no_async_scheduling", False) and \
            spec_method not in ("ngram", "suffix")
        return cls(
            model=info,
            hardware=hardware,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=float(flags.get("gpu_memory_utilization")
                                         or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION),
            max_model_len=_flag_int(flags, "max_model_len", info.default_max_model_len),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=_flag_int(flags, "max_num_batched_tokens",
                                             8192 if is_big_gpu else 2048),
            block_size=_flag_int(flags, "block_size", DEFAULT_BLOCK_SIZE),
            enforce_eager=enforce_eager,
            attention_backend=cls._resolve_backend(requested, kv_dtype, hardware),
            requested_backend=requested,
            kv_cache_dtype=kv_dtype,
            quantization=quantization,
            max_cudagraph_capture_size=_flag_int(
                flags, "max_cudagraph_capture_size", min(512, 2 * max_num_seqs)),
            enable_prefix_caching=_flag_bool(flags, "enable_prefix_caching", True)
            and not _flag_bool(flags, "no_enable_prefix_caching", False),
            enable_chunked_prefill=_flag_bool(flags, "enable_chunked_prefill", True),
            load_format=config.load_format,
            is_compile_cache_warm=is_compile_cache_warm,
            cudagraph_mode=cudagraph_mode,
            async_scheduling=async_scheduling,
            stream_interval=max(1, _flag_int(flags, "stream_interval", 1)),
            long_prefill_token_threshold=_flag_int(flags, "long_prefill_token_threshold", 0),
            spec_method=spec_method,
        )

    @staticmethod
    def _resolve_backend(requested: str, kv_dtype: str, hardware: HardwareProfile) -> str:
        if requested not in {"AUTO", ""}:
            return requested
        # FA3 (SM90) takes fp8 KV; FA2 elsewhere does not, so auto falls to FlashInfer there.
        if kv_dtype.startswith("fp8") and hardware.compute_capability < 9.0:
            return "FLASHINFER"
        if kv_dtype == "fp8_e5m2":
            return "FLASHINFER"
        return "FLASH_ATTN"

    # --- sizes -------------------------------------------------------------------------------
    @property
    def is_fp8_weights(self) -> bool:
        return self.quantization in FP8_WEIGHT_METHODS

    @property
    def is_jit_while_serving(self) -> bool:
        """A kernel path measured to JIT-compile while serving (see JIT_STEP_STALL_S)."""
        return self.quantization in JIT_WHILE_SERVING_QUANTIZATIONS

    @property
    def weight_bytes_per_param(self) -> float:
        if self.quantization is None:
            return 2.0 if self.model.dtype in {"bfloat16", "float16", "half"} else 4.0
        return BYTES_PER_PARAM.get(self.quantization, 2.0)

    @property
    def lm_head_params(self) -> int:
        return self.model.vocab_size * self.model.hidden_size

    @property
    def linear_params(self) -> int:
        """Parameters every forward streams: all linear layers (embeddings are a lookup)."""
        embeddings = self.lm_head_params * (1 if self.model.tie_word_embeddings else 2)
        return self.model.num_params - embeddings

    @property
    def weight_bytes(self) -> float:
        """Checkpoint as loaded. vLLM keeps embeddings and lm_head in bf16 when quantizing."""
        embeddings = self.model.num_params - self.linear_params
        return self.linear_params * self.weight_bytes_per_param + embeddings * 2.0

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tensor_parallel_size

    @property
    def kv_dtype_bytes(self) -> float:
        return 1.0 if self.kv_cache_dtype.startswith("fp8") else 2.0

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes)

    @property
    def kv_heads_per_gpu(self) -> int:
        # KV heads are replicated, not split, once TP exceeds their number.
        return max(1, math.ceil(self.model.num_key_value_heads / self.tensor_parallel_size))

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        m = self.model
        return 2 * m.num_hidden_layers * self.kv_heads_per_gpu * m.head_dim * self.kv_dtype_bytes

    @property
    def cuda_graph_sizes(self) -> tuple[int, ...]:
        if self.enforce_eager or self.cudagraph_mode == "NONE":
            return ()
        return capture_sizes(self.max_cudagraph_capture_size)

    @property
    def activation_bytes_per_gpu(self) -> float:
        m, tp = self.model, self.tensor_parallel_size
        per_token = (2 * m.intermediate_size / tp + ACTIVATION_HIDDEN_BUFFERS * m.hidden_size) * 2
        logits = self.max_num_seqs * m.vocab_size / tp * 4  # fp32 logits of the sampler
        nccl = NCCL_BUFFER_BYTES if tp > 1 else 0.0
        return self.max_num_batched_tokens * per_token + logits + NON_TORCH_BYTES + nccl

    @property
    def cuda_graph_bytes_per_gpu(self) -> float:
        sizes = self.cuda_graph_sizes
        if not sizes:
            return 0.0
        return CUDA_GRAPH_BASE_BYTES + CUDA_GRAPH_BYTES_PER_SIZE * len(sizes)

    @property
    def kv_cache_bytes_per_gpu(self) -> float:
        """What is left for the KV cache; <= 0 means vLLM refuses to start."""
        budget = self.hardware.gpu_memory_gib * GIB * self.gpu_memory_utilization
        return (budget - self.weight_bytes_per_gpu - self.activation_bytes_per_gpu
                - self.cuda_graph_bytes_per_gpu)

    @property
    def num_kv_blocks(self) -> int:
        per_block = self.kv_bytes_per_token_per_gpu * self.block_size
        return max(0, int(self.kv_cache_bytes_per_gpu // per_block))

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def max_concurrency_at_max_len(self) -> float:
        return self.kv_cache_tokens / self.max_model_len

    # --- feasibility --------------------------------------------------------------------------
    def check_arguments(self) -> Failure | None:
        """Rules vLLM applies before loading anything (hardware, backend, parallelism)."""
        hw, m, tp = self.hardware, self.model, self.tensor_parallel_size
        if tp > hw.num_gpus:
            return Failure(FailureReason.UNSUPPORTED_CONFIG,
                           f"world_size ({tp}) must be less than than max local gpu count "
                           f"({hw.num_gpus})")
        if m.num_attention_heads % tp:
            return Failure(FailureReason.INVALID_ARGUMENT,
                           f"Total number of attention heads ({m.num_attention_heads}) must be "
                           f"divisible by tensor parallel size ({tp}).")
        capability = round(hw.compute_capability * 10)
        if self.is_fp8_weights and capability < 89:
            return Failure(FailureReason.UNSUPPORTED_CONFIG,
                           f"The quantization method {self.quantization} is not supported for "
                           f"the current GPU. Minimum capability: 89. Current capability: "
                           f"{capability}.")
        if self.attention_backend not in ATTENTION_BACKENDS:
            return Failure(FailureReason.INVALID_ARGUMENT,
                           f"Invalid attention backend: '{self.attention_backend}'. Valid "
                           f"backends are: {list(ATTENTION_BACKENDS)}")
        is_fp8_kv = self.kv_cache_dtype.startswith("fp8")
        # FA2 (pre-Hopper) and FlexAttention take no fp8 KV; FA3 takes e4m3 but never e5m2.
        is_kv_unsupported = is_fp8_kv and (
            capability < 89 or self.attention_backend == "FLEX_ATTENTION"
            or (self.kv_cache_dtype == "fp8_e5m2" and self.attention_backend == "FLASH_ATTN"))
        if is_kv_unsupported:
            return Failure(FailureReason.UNSUPPORTED_CONFIG,
                           f"Selected backend AttentionBackendEnum.{self.attention_backend} is "
                           "not valid for this configuration. Reason: "
                           "['kv_cache_dtype not supported']")
        return None

    def check_memory(self) -> Failure | None:
        """The checks vLLM makes after the profile run, with its wording."""
        if self.weight_bytes_per_gpu > self.hardware.gpu_memory_gib * GIB:
            return Failure(FailureReason.OOM_AT_START,
                           "Failed to load model - not enough GPU memory. Tried to allocate "
                           f"{self.weight_bytes_per_gpu / GIB:.2f} GiB.")
        if self.num_kv_blocks <= 0:
            return Failure(FailureReason.OOM_AT_START,
                           "No available memory for the cache blocks. Try increasing "
                           "`gpu_memory_utilization` when initializing the engine.")
        if self.kv_cache_tokens < self.max_model_len:
            needed = self.max_model_len * self.kv_bytes_per_token_per_gpu / GIB
            available = self.kv_cache_bytes_per_gpu / GIB
            return Failure(FailureReason.KV_CACHE_TOO_SMALL,
                           "To serve at least one request with the model's max seq len "
                           f"({self.max_model_len}), ({needed:.2f} GiB KV cache is needed, "
                           "which is larger than the available KV cache memory "
                           f"({available:.2f} GiB). Based on the available memory, the "
                           f"estimated maximum model length is {self.kv_cache_tokens}. Try "
                           "increasing `gpu_memory_utilization` or decreasing `max_model_len` "
                           "when initializing the engine.")
        return None

    def check(self) -> Failure | None:
        return self.check_arguments() or self.check_memory()

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

        # GEMMs: weights are streamed once per step; compute grows with tokens.
        gemm_bytes = (self.linear_params * self.weight_bytes_per_param
                      + self.lm_head_params * 2.0) / tp
        if self.is_fp8_weights and hw.fp8_tflops > 0:
            linear_peak = hw.fp8_tflops * 1e12 * FP8_GEMM_FLOP_EFF
        else:
            linear_peak = bf16_flops * GEMM_FLOP_EFF
        linear_s = 2 * self.linear_params / tp * tokens / linear_peak
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
        if self.kv_cache_dtype.startswith("fp8"):
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


# --- scheduler ---------------------------------------------------------------------------------
@dataclass(eq=False)
class SimRequest:
    """One request inside the scheduler. Times are on the caller's clock, in seconds."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    arrival_s: float
    block_hashes: tuple[int, ...] = ()  # chained hashes of full prompt blocks (prefix caching)
    admissible_s: float = 0.0  # when it reaches the scheduler (set by Scheduler.add)
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_blocks: int = 0  # KV blocks held
    num_cached_tokens: int = 0  # prefix-cache hit on the last admission
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    is_admitted_once: bool = False
    num_unsent_tokens: int = 0  # produced but held back until the stream interval is reached

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.finished_s is not None


@dataclass(frozen=True)
class StepPlan:
    """What one iteration computes: (request, tokens scheduled) pairs and the modelled time."""

    scheduled: tuple[tuple[SimRequest, int], ...]
    breakdown: StepBreakdown
    num_decode_seqs: int
    num_prefill_tokens: int
    num_preempted: int

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(frozen=True)
class TokenEvent:
    """A request produced a token at the end of a step (finished: it was the last one)."""

    request: SimRequest
    is_first: bool
    is_finished: bool
    time_s: float = 0.0  # when the step that produced it ended, on the caller's clock
    num_tokens: int = 1  # tokens this chunk carries (--stream-interval buffers them)


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained hashes of full blocks, as vLLM's prefix cache keys them (ints hash stably)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return tuple(hashes)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens
    prefix_cache_hits: int = 0  # tokens


class Scheduler:
    """vLLM V1's continuous batching, simplified: running requests first (decodes and unfinished
    chunks), then waiting ones while `max_num_seqs`, the token budget and free KV blocks allow.
    When a running request cannot get a block, the latest-admitted one is preempted (recompute:
    its blocks are freed and it goes back to the head of the queue). Pure: the caller owns time.
    """

    def __init__(self, model: PerformanceModel) -> None:
        self.model = model
        self.num_total_blocks = model.num_kv_blocks
        self.num_free_blocks = self.num_total_blocks
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = SchedulerStats()
        # Hashes of blocks computed before, LRU; a hit saves compute (not memory: see docs).
        self._cached_blocks: OrderedDict[int, None] = OrderedDict()
        self._last_admissible_s = 0.0
        self._last_step_s: tuple[float, float] | None = None  # (planned at, ended at)

    @property
    def kv_cache_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: SimRequest) -> None:
        """Queue a request; it reaches the scheduler after the API server's trip, which grows
        with the streams open now (API_LAG_PER_STREAM_S), in arrival order."""
        lag_s = API_LAG_PER_STREAM_S * len(self.running)
        request.admissible_s = max(request.arrival_s + lag_s, self._last_admissible_s)
        self._last_admissible_s = request.admissible_s
        self.waiting.append(request)

    def next_admissible_s(self) -> float | None:
        """When the first waiting request reaches the scheduler (None: nothing waits)."""
        return self.waiting[0].admissible_s if self.waiting else None

    def _admission_cutoff_s(self, now_s: float) -> float:
        """Arrivals the step planned now can take. With async scheduling (vLLM 0.26's default)
        the engine plans a step while the previous one runs (`EngineCore.
        step_with_batch_queue`, v1/engine/core.py:617-705, a batch queue of 2): the step that
        runs next was planned when the last one started, so it takes only what had arrived by
        then. An engine with nothing running plans at once."""
        last = self._last_step_s
        if self.model.async_scheduling and last is not None and last[1] >= now_s \
                and self.running:
            return last[0]
        return now_s

    def reset_prefix_cache(self) -> None:
        """Forget computed blocks (vLLM's /reset_prefix_cache): later prompts miss."""
        self._cached_blocks.clear()

    def abort(self, request: SimRequest) -> None:
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.model.block_size)

    def _free(self, request: SimRequest) -> None:
        self.num_free_blocks += request.num_blocks
        request.num_blocks = 0

    def _allocate(self, request: SimRequest, num_new_tokens: int) -> bool:
        needed = self._blocks_for(request.num_computed_tokens + num_new_tokens)
        extra = needed - request.num_blocks
        if extra > self.num_free_blocks:
            return False
        self.num_free_blocks -= max(0, extra)
        request.num_blocks = max(request.num_blocks, needed)
        return True

    def _prefix_hit_tokens(self, request: SimRequest) -> int:
        if not self.model.enable_prefix_caching:
            return 0
        hits = 0
        for block_hash in request.block_hashes:
            if block_hash not in self._cached_blocks:
                break
            self._cached_blocks.move_to_end(block_hash)
            hits += 1
        # At least one token is always computed, so the last full block never counts.
        return min(hits * self.model.block_size, request.num_tokens - 1)

    def _remember_blocks(self, request: SimRequest, num_computed_before: int) -> None:
        """The prompt blocks the last step filled join the LRU (earlier ones are in it)."""
        if not self.model.enable_prefix_caching:
            return
        num_full = min(len(request.block_hashes),
                       request.num_computed_tokens // self.model.block_size)
        first = min(num_computed_before // self.model.block_size, num_full)
        for block_hash in request.block_hashes[first:num_full]:
            self._cached_blocks[block_hash] = None
            self._cached_blocks.move_to_end(block_hash)
        while len(self._cached_blocks) > self.num_total_blocks:
            self._cached_blocks.popitem(last=False)

    def schedule(self, now_s: float) -> StepPlan | None:
        """Plan the next iteration, or None when there is nothing to run."""
        budget = self.model.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        num_preempted = 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            take = min(self._prefill_cap(request.num_tokens - request.num_computed_tokens),
                       budget)
            while not self._allocate(request, take):
                victim = self.running.pop()
                self._preempt(victim)
                num_preempted += 1
                if victim is request:
                    break
            else:
                scheduled.append((request, take))
                budget -= take
                index += 1
        cutoff_s = self._admission_cutoff_s(now_s)
        if num_preempted == 0:
            while (self.waiting and budget > 0
                   and len(self.running) < self.model.max_num_seqs):
                request = self.waiting[0]
                if not request.is_admitted_once and request.admissible_s > cutoff_s:
                    break  # still on its way through the API server
                if not request.is_admitted_once:
                    hit = self._prefix_hit_tokens(request)
                    # vLLM records no query with prefix caching off (kv_cache_manager.py:
                    # 224-228 returns before `prefix_cache_stats.record`, 272-277).
                    if self.model.enable_prefix_caching:
                        self.stats.prefix_cache_queries += request.num_prompt_tokens
                        self.stats.prefix_cache_hits += hit
                    request.num_computed_tokens = hit
                    request.num_cached_tokens = hit
                else:  # a preempted request recomputes, minus what the cache still holds
                    request.num_computed_tokens = self._prefix_hit_tokens(request)
                remaining = request.num_tokens - request.num_computed_tokens
                take = min(self._prefill_cap(remaining), budget)
                if take < remaining and not self.model.enable_chunked_prefill:
                    break
                if not self._allocate(request, take):
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.is_admitted_once = True
                if request.first_scheduled_s is None:
                    request.first_scheduled_s = now_s
                scheduled.append((request, take))
                budget -= take
        if not scheduled:
            return None
        num_decode = decode_ctx = prefill_tokens = prefill_seqs = 0
        pairs = 0.0
        # Prefix-cache hits share physical blocks (vLLM maps a hit to the cached block and
        # counts its references: v1/core/block_pool.py `touch`), so a step's decodes read each
        # shared block once from HBM and the other sequences' reads of it hit in L2.
        shared_blocks: set[int] = set()
        for request, take in scheduled:
            is_decode = take == 1 and request.num_output_tokens > 0
            if is_decode:
                num_decode += 1
                hits = request.block_hashes[:request.num_cached_tokens // self.model.block_size]
                shared_blocks.update(hits)
                decode_ctx += request.num_computed_tokens + 1 - len(hits) * self.model.block_size
            else:
                prefill_seqs += 1
                prefill_tokens += take
                pairs += take * (request.num_computed_tokens + (take + 1) / 2)
        decode_ctx += len(shared_blocks) * self.model.block_size
        breakdown = self.model.step_time(num_decode, decode_ctx, prefill_tokens,
                                         prefill_seqs, pairs)
        self._last_step_s = (now_s, math.inf)
        return StepPlan(tuple(scheduled), breakdown, num_decode, prefill_tokens, num_preempted)

    def _prefill_cap(self, num_new_tokens: int) -> int:
        """vLLM 0.26 caps a request's tokens per step at long_prefill_token_threshold when it is
        between 0 and the tokens left (v1/core/sched/scheduler.py:507 and :861)."""
        threshold = self.model.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new_tokens else num_new_tokens

    def _preempt(self, request: SimRequest) -> None:
        self._free(request)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.stats.num_preemptions += 1

    def complete(self, plan: StepPlan, now_s: float) -> list[TokenEvent]:
        """Apply a planned step that ended at `now_s`; return the tokens it produced."""
        if self._last_step_s is not None:
            self._last_step_s = (self._last_step_s[0], now_s)
        events: list[TokenEvent] = []
        for request, take in plan.scheduled:
            if request not in self.running:  # aborted while the step ran
                continue
            request.num_computed_tokens += take
            self._remember_blocks(request, request.num_computed_tokens - take)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk with more to come: no token yet
            request.num_output_tokens += 1
            is_first = request.first_token_s is None
            if is_first:
                request.first_token_s = now_s
            request.last_token_s = now_s
            is_finished = request.num_output_tokens >= request.max_tokens
            if is_finished:
                request.finished_s = now_s
                self.running.remove(request)
                self._free(request)
            # vLLM sends the first token at once, then every stream_interval tokens, and the
            # rest when the request finishes.
            request.num_unsent_tokens += 1
            if is_first or is_finished or \
                    request.num_unsent_tokens >= self.model.stream_interval:
                events.append(TokenEvent(request, is_first, is_finished, now_s,
                                         request.num_unsent_tokens))
                request.num_unsent_tokens = 0
        return events


# --- virtual-time benchmark --------------------------------------------------------------------
@dataclass(frozen=True)
class BenchmarkEstimate:
    """What `vllm bench serve` would report for a closed-loop run, in the model's virtual time."""

    num_requests: int
    duration_s: float
    output_throughput: float  # tokens/s
    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    num_preemptions: int
    per_request: tuple[tuple[float, float], ...] = field(default=(), repr=False)  # (ttft, tpot)
    # What the engine's /metrics counters would have grown by over the run (vLLM's names).
    counters: Mapping[str, float] = field(default_factory=dict, repr=False)
    total_input_tokens: int = 0  # of the finished requests
    total_output_tokens: int = 0
    mean_e2el_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    request_throughput: float = 0.0  # requests/s
    request_goodput: float | None = None  # requests/s meeting the SLO; None without one


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def simulate_benchmark(model: PerformanceModel, *, input_len: int, output_len: int,
                       max_concurrency: int | None, num_requests: int,
                       noise_sigma: float = 0.0, seed: int = 0,
                       prompts: Iterable[Sequence[int]] | None = None,
                       request_rate_rps: float | None = None,
                       input_len_range: tuple[int, int] | None = None,
                       slo_ttft_p99_ms: float | None = None,
                       slo_tpot_p99_ms: float | None = None) -> BenchmarkEstimate:
    """Replay a `vllm bench serve` run through the scheduler in virtual time (no sleeping): the
    model's answer to the calibration set.

    Closed loop at `max_concurrency` by default; with `request_rate_rps`, Poisson arrivals
    (seeded) capped at `max_concurrency` when that is set too. `input_len_range` (low, high)
    draws each prompt's length uniformly (seeded) instead of `input_len`. With an SLO bound the
    estimate carries goodput, counted per request as vLLM does."""
    rng = random.Random(seed)
    arrival_rng = random.Random(seed + 1)
    scheduler = Scheduler(model)
    prompt_iter = iter(prompts) if prompts is not None else None
    now = 0.0
    submitted = 0
    in_flight = 0
    finished: list[SimRequest] = []
    cap = max_concurrency if max_concurrency is not None else num_requests
    arrivals: deque[float] = deque()
    if request_rate_rps is not None:
        at = 0.0
        for _ in range(num_requests):
            arrivals.append(at)
            at += arrival_rng.expovariate(request_rate_rps)

    def submit(arrival_s: float) -> None:
        nonlocal submitted, in_flight
        hashes: tuple[int, ...] = ()
        length = input_len
        if prompt_iter is not None:
            ids = next(prompt_iter)
            length = len(ids)
            hashes = block_hashes(ids, model.block_size)
        elif input_len_range is not None:
            length = arrival_rng.randint(*input_len_range)
        scheduler.add(SimRequest(f"r{submitted}", length, output_len, arrival_s, hashes))
        submitted += 1
        in_flight += 1

    def submit_due() -> None:
        if request_rate_rps is None:
            while submitted < num_requests and in_flight < cap:
                submit(now)
            return
        while arrivals and arrivals[0] <= now and in_flight < cap:
            submit(arrivals.popleft())

    submit_due()
    counters = dict.fromkeys((
        "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
        "vllm:generation_tokens_total", "vllm:iteration_tokens_total_count",
        "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
        "vllm:estimated_write_bytes_per_gpu_total"), 0.0)
    while scheduler.has_work or arrivals:
        if not scheduler.has_work:  # open loop, idle: jump to the next arrival
            now = max(now, arrivals[0])
            submit_due()
            continue
        plan = scheduler.schedule(now)
        next_admissible_s = scheduler.next_admissible_s()
        if plan is None and next_admissible_s is not None and next_admissible_s > now:
            now = next_admissible_s  # idle while the next request is on its way in
            submit_due()
            continue
        if plan is None:
            raise RuntimeError("scheduler stalled: a request does not fit the KV cache")
        estimate = vllm_mfu_estimate(model, [
            (take, request.num_computed_tokens + take, take > 1 or request.num_output_tokens == 0)
            for request, take in plan.scheduled])
        counters["vllm:iteration_tokens_total_count"] += 1
        counters["vllm:estimated_flops_per_gpu_total"] += estimate.flops
        counters["vllm:estimated_read_bytes_per_gpu_total"] += estimate.read_bytes
        counters["vllm:estimated_write_bytes_per_gpu_total"] += estimate.write_bytes
        step = plan.breakdown.total_s
        if noise_sigma > 0:
            step *= rng.lognormvariate(0.0, noise_sigma)
        now += step
        for event in scheduler.complete(plan, now):
            counters["vllm:generation_tokens_total"] += event.num_tokens
            if event.is_first:
                counters["vllm:prompt_tokens_total"] += event.request.num_prompt_tokens
                counters["vllm:prompt_tokens_cached_total"] += event.request.num_cached_tokens
            if event.is_finished:
                finished.append(event.request)
                in_flight -= 1
        submit_due()
    per_request: list[tuple[float, float]] = []
    for request in finished:
        if request.first_token_s is None or request.finished_s is None:
            continue
        ttft = request.first_token_s - request.arrival_s
        decode = request.finished_s - request.first_token_s
        tpot = decode / (request.max_tokens - 1) if request.max_tokens > 1 else 0.0
        per_request.append((ttft, tpot))
    ttfts = [t * 1e3 for t, _ in per_request]
    tpots = [t * 1e3 for _, t in per_request]
    goodput: float | None = None
    if slo_ttft_p99_ms is not None or slo_tpot_p99_ms is not None:
        num_good = sum(
            (slo_ttft_p99_ms is None or ttft <= slo_ttft_p99_ms)
            and (slo_tpot_p99_ms is None or tpot <= slo_tpot_p99_ms)
            for ttft, tpot in zip(ttfts, tpots, strict=True))
        goodput = num_good / now if now > 0 else 0.0
    return BenchmarkEstimate(
        num_requests=len(finished),
        duration_s=now,
        p99_ttft_ms=_quantile(ttfts, 0.99),
        request_throughput=len(finished) / now if now > 0 else 0.0,
        request_goodput=goodput,
        output_throughput=len(finished) * output_len / now if now > 0 else 0.0,
        mean_ttft_ms=sum(ttfts) / len(ttfts),
        median_ttft_ms=_quantile(ttfts, 0.5),
        mean_tpot_ms=sum(tpots) / len(tpots),
        median_tpot_ms=_quantile(tpots, 0.5),
        p99_tpot_ms=_quantile(tpots, 0.99),
        num_preemptions=scheduler.stats.num_preemptions,
        per_request=tuple(per_request),
        counters=counters,
        total_input_tokens=sum(r.num_prompt_tokens for r in finished),
        total_output_tokens=sum(r.max_tokens for r in finished),
        mean_e2el_ms=sum((r.finished_s or 0.0) - r.arrival_s for r in finished)
        / max(len(finished), 1) * 1e3,
    )


# --- vLLM's MFU accounting -----------------------------------------------------------------------
# Quantization names vLLM 0.26's estimator knows (vllm/v1/metrics/perf.py), with their bytes per
# weight; any other method (the online shorthands `fp8_per_tensor/_block/_channel` report the
# name "online") makes it drop the attention and MLP parts and count the unembedding alone.
VLLM_MFU_WEIGHT_BYTES: Mapping[str, float] = {
    "fp8": 1.0, "fbgemm_fp8": 1.0, "ptpc_fp8": 1.0, "modelopt": 1.0, "awq": 0.5,
    "awq_marlin": 0.5, "gptq": 0.5, "gptq_marlin": 0.5, "bitsandbytes": 0.5,
    "compressed-tensors": 0.5}
_ACTIVATION_BYTES = 2  # vLLM's estimator assumes bf16 activations


@dataclass(frozen=True)
class PerfEstimate:
    """One step as vLLM's `--enable-mfu-metrics` counts it, per GPU (a model of its counters)."""

    flops: float
    read_bytes: float
    write_bytes: float


def vllm_mfu_estimate(model: PerformanceModel, scheduled: Sequence[tuple[int, int, bool]],
                      data_parallel_size: int = 1) -> PerfEstimate:
    """What vLLM 0.26's analytic estimator adds to its MFU counters for one step of a dense
    model: `scheduled` holds (tokens, context length after the step, is_prefill) per request.
    Its own conventions are kept, so the counters compare with a real engine's: a prefill token
    is charged attention over the whole context (no causal half), the MLP is split over
    TP x DP, and an unknown quantization method leaves only the unembedding counted."""
    m, tp = model.model, model.tensor_parallel_size
    layers, hidden, head_dim = m.num_hidden_layers, m.hidden_size, m.head_dim
    q = max(1, m.num_attention_heads // tp)
    kv = max(1, m.num_key_value_heads // tp)
    inter = m.intermediate_size // (tp * data_parallel_size)
    vocab = m.vocab_size // tp
    act = _ACTIVATION_BYTES
    cache = model.kv_dtype_bytes
    method = model.quantization
    weight = model.weight_bytes_per_param if method is None \
        else VLLM_MFU_WEIGHT_BYTES.get(method, 0.0)
    tokens = sum(n for n, _, _ in scheduled)
    token_context = sum(n * c for n, c, _ in scheduled)
    prefill_tokens = sum(n for n, _, p in scheduled if p)
    prefill_context = sum(c for _, c, p in scheduled if p)
    decode_tokens = sum(n for n, _, p in scheduled if not p)
    decode_context = sum(c for _, c, p in scheduled if not p)
    logit_rows = sum(1 for _, _, p in scheduled if p) + decode_tokens
    flops = 2.0 * logit_rows * hidden * vocab
    read = float(logit_rows * hidden * act + hidden * vocab * 2)
    write = float(logit_rows * vocab * act)
    if weight > 0:  # attention and MLP parts (absent for a method vLLM does not know)
        flops += layers * (2 * tokens * hidden * (q + 2 * kv) * head_dim
                           + 4 * q * token_context * head_dim + 2 * tokens * hidden * q * head_dim
                           + 6 * hidden * inter * tokens)
        read += layers * (tokens * hidden * act + hidden * (q + 2 * kv) * head_dim * weight
                          + (prefill_tokens * q + 2 * prefill_context * kv) * head_dim * act
                          + decode_tokens * q * head_dim * act
                          + 2 * decode_context * kv * head_dim * cache
                          + tokens * q * head_dim * act + q * head_dim * hidden * weight
                          + tokens * hidden * act + 2 * hidden * inter * weight
                          + 2 * tokens * inter * act + tokens * inter * act
                          + hidden * inter * weight)
        write += layers * (tokens * (q + 2 * kv) * head_dim * act
                           + 2 * tokens * kv * head_dim * cache + tokens * hidden * act
                           + 2 * tokens * inter * act + tokens * inter * act
                           + tokens * hidden * act)
    return PerfEstimate(flops=flops, read_bytes=read, write_bytes=write)
