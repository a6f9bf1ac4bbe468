"""One engine config as the simulated engine resolves and sizes it (`EngineSizing`): its flags
read with vLLM 0.26's defaults, its memory per GPU (weights, activations, CUDA graphs, KV cache)
and the checks vLLM makes before it serves, with vLLM's wording. A model, never a measurement.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Self

from runners.base import EngineConfig, Failure, FailureReason, FlagValue
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo, load_model_info
from runners.simulated.calibration import (
    ACTIVATION_HIDDEN_BUFFERS,
    CUDA_GRAPH_BASE_BYTES,
    CUDA_GRAPH_BYTES_PER_SIZE,
    CUDAGRAPH_MODES,
    DEFAULT_BLOCK_SIZE,
    GIB,
    JIT_WHILE_SERVING_QUANTIZATIONS,
    NCCL_BUFFER_BYTES,
    NON_TORCH_BYTES,
)
from search_spaces.engine.facts import (
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
    bytes_per_param,
    kv_cache_is_fp8,
    vllm_scheduler_defaults,
    weights_are_fp8,
)

ENGINE_VERSION = "0.26.0"

AttentionBackend = Literal["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"]
# vLLM's SM90 priority order: what "auto" resolves to is the first one the config allows.
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = (
    "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")

# Flags the simulated engine accepts but does not model: a trial runs with them and its figures
# are those of the same config without them (docs/simulated-engine.md, "Knobs").
UNMODELLED_FLAGS = frozenset({
    "scheduling_policy", "max_num_partial_prefills", "max_long_partial_prefills",
    "optimization_level"})


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


def flag_bool(flags: Mapping[str, FlagValue], name: str, default: bool) -> bool:
    """A boolean flag (or environment variable): a string is true when it reads 1, true, yes or
    on (any case), any other value by its truth; `default` when it is not set."""
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
class EngineSizing:
    """One engine config on one GPU type, as the simulated engine resolves it (vLLM 0.26's
    defaults) and sizes it: weights, activations, CUDA graphs and the KV cache per GPU, and the
    checks vLLM makes before it serves. `PerformanceModel` adds its times. Pure: no clock, no
    I/O."""

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
                    is_compile_cache_warm: bool = False) -> Self:
        """Defaults follow vLLM 0.26 (REFERENCE.md): 8192/1024 on >= 70 GiB GPUs, else 2048/256.

        Raises ValueError when the model's shape is unknown (no config.json reachable)."""
        info = model or resolve_model_info(config.model)
        if info is None:
            raise ValueError(
                f"the simulated engine needs a model shape but {config.model!r} is neither a "
                "directory with config.json nor a bundled shape; pass a bundled shape name.")
        flags = config.flags
        defaults = vllm_scheduler_defaults(hardware.gpu_memory_gib, hardware.gpu_name,
                                           ENGINE_VERSION)
        max_num_seqs = _flag_int(flags, "max_num_seqs", defaults["max_num_seqs"])
        requested = _flag_str(flags, "attention_backend", "auto").upper()
        kv_dtype = _flag_str(flags, "kv_cache_dtype", "auto").lower()
        quant = flags.get("quantization")
        quantization = str(quant).lower() if quant else info.quant_method
        enforce_eager = flag_bool(flags, "enforce_eager", False)
        cudagraph_mode = "NONE" if enforce_eager else _flag_str(
            flags, "compilation_config.cudagraph_mode", "FULL_AND_PIECEWISE").upper()
        if cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"flag compilation_config.cudagraph_mode must be one of "
                             f"{', '.join(CUDAGRAPH_MODES)} but got {cudagraph_mode!r}.")
        spec_method = _flag_str(flags, "spec_method", "none").lower()
        # vLLM 0.26 turns async scheduling off by itself for ngram/suffix speculation
        # (config/vllm.py:1069-1080); an explicit --async-scheduling then fails (:1038-1048).
        async_scheduling = not flag_bool(flags, "no_async_scheduling", False) and \
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
                                             defaults["max_num_batched_tokens"]),
            block_size=_flag_int(flags, "block_size", DEFAULT_BLOCK_SIZE),
            enforce_eager=enforce_eager,
            attention_backend=cls._resolve_backend(requested, kv_dtype, hardware),
            requested_backend=requested,
            kv_cache_dtype=kv_dtype,
            quantization=quantization,
            max_cudagraph_capture_size=_flag_int(
                flags, "max_cudagraph_capture_size", min(512, 2 * max_num_seqs)),
            enable_prefix_caching=flag_bool(flags, "enable_prefix_caching", True)
            and not flag_bool(flags, "no_enable_prefix_caching", False),
            enable_chunked_prefill=flag_bool(flags, "enable_chunked_prefill", True),
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
        if kv_cache_is_fp8(kv_dtype) and hardware.compute_capability < 9.0:
            return "FLASHINFER"
        if kv_dtype == "fp8_e5m2":
            return "FLASHINFER"
        return "FLASH_ATTN"

    # --- sizes -------------------------------------------------------------------------------
    @property
    def is_fp8_weights(self) -> bool:
        return weights_are_fp8(self.quantization)

    @property
    def is_jit_while_serving(self) -> bool:
        """A kernel path measured to JIT-compile while serving (see JIT_STEP_STALL_S)."""
        return self.quantization in JIT_WHILE_SERVING_QUANTIZATIONS

    @property
    def weight_bytes_per_param(self) -> float:
        if self.quantization is None:
            return 2.0 if self.model.dtype in {"bfloat16", "float16", "half"} else 4.0
        return bytes_per_param(self.quantization)

    @property
    def lm_head_params(self) -> int:
        return self.model.lm_head_params

    @property
    def linear_params(self) -> int:
        """Every linear layer's parameters, every expert of an MoE model included (embeddings
        are a lookup): what the GPUs hold."""
        return self.model.linear_params

    @property
    def weight_bytes(self) -> float:
        """Checkpoint as loaded, every expert of an MoE model included. vLLM keeps embeddings
        and lm_head in bf16 when quantizing."""
        return self.model.weight_bytes(self.weight_bytes_per_param)

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.tensor_parallel_size

    @property
    def kv_dtype_bytes(self) -> float:
        return 1.0 if kv_cache_is_fp8(self.kv_cache_dtype) else 2.0

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
        width = m.ffn_width_per_token  # an MoE layer: its routed and shared experts' outputs
        per_token = (2 * width / tp + ACTIVATION_HIDDEN_BUFFERS * m.hidden_size) * 2
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
        is_fp8_kv = kv_cache_is_fp8(self.kv_cache_dtype)
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
