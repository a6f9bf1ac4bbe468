"""Facts about vLLM as an engine that more than one part of nightshift relies on, asked here and
never re-derived where they are needed: which KV cache dtypes are fp8, which quantization
methods run fp8 GEMMs and which a checkpoint accepts, the bytes a weight takes under each, the
scheduler defaults a host gets, and which environment variables belong to a launch;
`EngineFlags`, one config's flags with those facts derived. Flag names, types and defaults are
the release's table (`search_spaces.engine.tables`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, cast

from search_spaces.engine.tables import DEFAULT_VERSION, bundled_flags, version_key

# `--quantization` values that quantize bf16 weights to fp8 while loading (REFERENCE.md: vLLM
# 0.26's per-tensor `fp8` and the three online shorthands).
FP8_ONLINE_QUANTIZATIONS: Final = ("fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
# Methods whose GEMMs run on fp8 weights: the online ones, and a ModelOpt fp8 checkpoint.
# compressed-tensors is left out: its checkpoints may hold fp8, int8 or int4 weights, and the
# method name alone does not say which.
FP8_WEIGHT_METHODS: Final = frozenset({*FP8_ONLINE_QUANTIZATIONS, "modelopt"})
# Methods that quantize bf16 weights while loading; the rest read a pre-quantized checkpoint.
ON_THE_FLY_QUANTIZATIONS: Final = (*FP8_ONLINE_QUANTIZATIONS, "bitsandbytes")
# --quantization values a checkpoint of each quant_method accepts.
CHECKPOINT_QUANTIZATIONS: Final[Mapping[str, tuple[str, ...]]] = {
    "awq": ("awq", "awq_marlin"),
    "gptq": ("gptq", "gptq_marlin"),
    "fp8": ("fp8",),
    "compressed-tensors": ("compressed-tensors",),
    "bitsandbytes": ("bitsandbytes",),
}

# Bytes per weight by `--quantization` (or the checkpoint's quant_method); unlisted: bf16 (2.0).
# 4-bit methods pack two weights a byte: AWQ/GPTQ are 0.5, their group-128 fp16 scales and
# zeros (~0.02 B a weight, 4%) left out, as vLLM 0.26's own MFU estimator counts them.
BYTES_PER_PARAM: Final[Mapping[str, float]] = {
    "bf16": 2.0, "fp8": 1.0, "fp8_per_tensor": 1.0, "fp8_per_block": 1.0, "fp8_per_channel": 1.0,
    "modelopt": 1.0, "compressed-tensors": 1.0, "awq": 0.5, "awq_marlin": 0.5, "gptq": 0.5,
    "gptq_marlin": 0.5, "bitsandbytes": 0.5, "gguf": 0.5,
}
DEFAULT_BYTES_PER_PARAM: Final = 2.0  # bf16 / fp16 weights


def bytes_per_param(method: str | None) -> float:
    """Bytes a linear-layer weight takes under `method` (None or unknown: bf16)."""
    return BYTES_PER_PARAM.get((method or "").lower(), DEFAULT_BYTES_PER_PARAM)


def kv_cache_is_fp8(dtype: object) -> bool:
    """Whether a `--kv-cache-dtype` value keeps the KV cache in fp8: every fp8 spelling the
    releases' tables list (`fp8`, `fp8_e4m3`, `fp8_e5m2`, `fp8_inc`, `fp8_ds_mla`,
    `fp8_per_token_head`), in any case; unset (None) or `auto` is the model's dtype, not fp8."""
    return str(dtype or "auto").lower().startswith("fp8")


def weights_are_fp8(method: object) -> bool:
    """Whether the GEMMs run on fp8 weights under quantization method `method` (a
    `--quantization` value or a checkpoint's quant_method): an fp8 method or an fp8 spelling."""
    name = str(method or "").lower()
    return name in FP8_WEIGHT_METHODS or name.startswith("fp8")


@dataclass(frozen=True)
class EngineFlags:
    """One config's engine flags (snake_case, as `EngineConfig.flags` holds them) with what vLLM
    derives from them: the KV cache's dtype and bytes, the weights' quantization."""

    flags: Mapping[str, object]

    @property
    def kv_cache_dtype(self) -> str:
        """`--kv-cache-dtype` as given, lower case; `auto` when unset."""
        return str(self.flags.get("kv_cache_dtype") or "auto").lower()

    @property
    def kv_cache_is_fp8(self) -> bool:
        return kv_cache_is_fp8(self.kv_cache_dtype)

    @property
    def kv_bytes_per_element(self) -> float:
        """Bytes a KV cache element takes: 1 in fp8, else 2 (bf16/fp16: the sub-byte dtypes of
        later releases are not modelled)."""
        return 1.0 if self.kv_cache_is_fp8 else 2.0

    @property
    def quantization(self) -> str:
        """`--quantization` as given, lower case; empty when unset."""
        return str(self.flags.get("quantization") or "").lower()

    def weight_method(self, checkpoint_method: str | None = None) -> str:
        """The method the weights run under: `--quantization`, else the checkpoint's own
        quant_method; empty for unquantized weights."""
        return self.quantization or str(checkpoint_method or "").lower()

    def weights_are_fp8(self, checkpoint_method: str | None = None) -> bool:
        return weights_are_fp8(self.weight_method(checkpoint_method))

    def bytes_per_param(self, checkpoint_method: str | None = None,
                        checkpoint_dtype: str = "bfloat16") -> float:
        """Bytes a linear-layer weight takes: by the weights' method (`BYTES_PER_PARAM`), else
        by the checkpoint's dtype (4 for float32, else 2)."""
        method = self.weight_method(checkpoint_method)
        if method:
            return BYTES_PER_PARAM.get(method, DEFAULT_BYTES_PER_PARAM)
        return 4.0 if checkpoint_dtype.lower() in ("float32", "fp32") else DEFAULT_BYTES_PER_PARAM


# vLLM 0.26's `--gpu-memory-utilization` default (0.92, REFERENCE.md), as the bundled flag
# table records it: the fraction the simulated engine and the memory estimate assume unset.
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION: Final = float(
    cast(float, bundled_flags().default("gpu_memory_utilization")))

# Environment variables that change what vLLM does, kept with a launch (audit, export).
ENV_PREFIXES: Final = ("VLLM_", "NCCL_", "CUDA_", "TORCH_", "PYTORCH_")


def vllm_scheduler_defaults(gpu_memory_gib: float, gpu_name: str,
                            version: str = DEFAULT_VERSION,
                            compute_capability: float | None = None) -> dict[str, int]:
    """`vllm serve`'s `max_num_seqs` and `max_num_batched_tokens` when unset, by release
    (`EngineArgs.get_batch_defaults`): the larger 1024 / 8192 on a GPU of >= 70 GiB that is not
    an A100, else 256 / 2048 (0.26, REFERENCE.md); from 0.28 a GPU of >= 160 GiB (B200, B300)
    gets 1024 / 16384; from 0.33 a GB10 (compute capability 12.1) keeps the small tier."""
    release = version_key(version)
    if release >= (0, 28) and gpu_memory_gib >= 160:
        return {"max_num_seqs": 1024, "max_num_batched_tokens": 16384}
    is_gb10 = release >= (0, 33) and compute_capability is not None and \
        abs(compute_capability - 12.1) < 1e-6
    is_high_end = gpu_memory_gib >= 70 and "A100" not in gpu_name and not is_gb10
    return {"max_num_seqs": 1024 if is_high_end else 256,
            "max_num_batched_tokens": 8192 if is_high_end else 2048}
