"""Facts about vLLM as an engine that more than one part of nightshift relies on: which
quantization methods run fp8 GEMMs, the bytes a weight takes under each, and which environment
variables belong to a launch. Flag names, types and defaults are `runners.vllm.flags`' table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, cast

from runners.vllm.flags import DEFAULT_VERSION, bundled_flags, version_key

# `--quantization` values that quantize bf16 weights to fp8 while loading (REFERENCE.md: vLLM
# 0.26's per-tensor `fp8` and the three online shorthands).
FP8_ONLINE_QUANTIZATIONS: Final = ("fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel")
# Methods whose GEMMs run on fp8 weights: the online ones, and a ModelOpt fp8 checkpoint.
# compressed-tensors is left out: its checkpoints may hold fp8, int8 or int4 weights, and the
# method name alone does not say which.
FP8_WEIGHT_METHODS: Final = frozenset({*FP8_ONLINE_QUANTIZATIONS, "modelopt"})

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
