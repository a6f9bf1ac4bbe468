"""What a config's weights and KV cache take per GPU: bytes per weight by quantization, the fp8
facts (weights, KV cache), and `memory_problem`, the check before launch that they can fit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from runners.base import EngineConfig
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from search_spaces.engine.facts import VLLM_DEFAULT_GPU_MEMORY_UTILIZATION, EngineFlags

GIB: Final = 1 << 30
def is_fp8_weights(config: EngineConfig, model: ModelInfo | None = None) -> bool:
    """The GEMMs run on fp8 weights: `--quantization` an fp8 method, or an fp8 checkpoint."""
    return EngineFlags(config.flags).weights_are_fp8(model.quant_method if model else None)


def is_fp8_kv(config: EngineConfig) -> bool:
    return EngineFlags(config.flags).kv_cache_is_fp8


@dataclass(frozen=True)
class MemoryNeed:
    """A config's weights and one longest request's KV cache per GPU, against what its
    `gpu_memory_utilization` lets vLLM take of one GPU."""

    weights_gib: float  # every expert of an MoE model is held
    kv_gib: float  # the KV cache of one `max_len`-token request
    budget_gib: float
    gmu: float
    max_len: int

    @property
    def shortfall_gib(self) -> float:
        """By how much weights and KV overrun the budget (<= 0: they fit)."""
        return self.weights_gib + self.kv_gib - self.budget_gib


def memory_need(config: EngineConfig, hardware: HardwareProfile,
                model: ModelInfo) -> MemoryNeed:
    tp = config.tensor_parallel_size * config.pipeline_parallel_size
    gmu = float(config.flags.get("gpu_memory_utilization") or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION)
    max_len = int(config.flags.get("max_model_len") or model.default_max_model_len)
    return MemoryNeed(
        weights_gib=model.weight_bytes(bytes_per_param(config, model)) / tp / GIB,
        kv_gib=model.kv_bytes_per_token(EngineFlags(config.flags).kv_bytes_per_element)
        * max_len / tp / GIB,
        budget_gib=gmu * hardware.gpu_memory_gib, gmu=gmu, max_len=max_len)


def memory_problem(config: EngineConfig, hardware: HardwareProfile | None,
                   model: ModelInfo | None) -> str | None:
    """Why a config cannot fit its GPUs, judged before launch (None when it may): the weights
    alone, or the weights and the KV cache of one longest request, above what
    `gpu_memory_utilization` lets vLLM take. Deliberately lenient (activations and CUDA graphs
    are left out): it rejects only the impossible, and vLLM judges the rest."""
    if hardware is None or model is None or hardware.gpu_memory_gib <= 0:
        return None
    need = memory_need(config, hardware, model)
    if need.weights_gib > need.budget_gib:
        return (f"the weights need {need.weights_gib:.1f} GiB per GPU but "
                f"gpu_memory_utilization {need.gmu:g} of {hardware.gpu_memory_gib:.0f} GiB "
                f"allows {need.budget_gib:.1f} GiB")
    if need.shortfall_gib > 0:
        return (f"the weights ({need.weights_gib:.1f} GiB per GPU) and the KV cache of one "
                f"{need.max_len}-token request ({need.kv_gib:.1f} GiB) exceed the "
                f"{need.budget_gib:.1f} GiB gpu_memory_utilization {need.gmu:g} allows")
    return None


def bytes_per_param(config: EngineConfig, model: ModelInfo | None) -> float:
    return EngineFlags(config.flags).bytes_per_param(model.quant_method if model else None,
                                                     model.dtype if model else "bfloat16")
