"""Facts about vLLM as an engine that more than one part of nightshift relies on: which
quantization methods run fp8 GEMMs, the bytes a weight takes under each, and which environment
variables belong to a launch. Flag names, types and defaults are `runners.vllm.flags`' table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, cast

from runners.vllm.flags import bundled_flags

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


def vllm_scheduler_defaults(gpu_memory_gib: float, gpu_name: str) -> dict[str, int]:
    """vLLM 0.26's `max_num_seqs` and `max_num_batched_tokens` when unset (REFERENCE.md): the
    larger 1024 / 8192 on a GPU of >= 70 GiB that is not an A100, else 256 / 2048."""
    is_high_end = gpu_memory_gib >= 70 and "A100" not in gpu_name
    return {"max_num_seqs": 1024 if is_high_end else 256,
            "max_num_batched_tokens": 8192 if is_high_end else 2048}
