"""The category of a GPU kernel by its name (`classify_kernel`, `CATEGORIES`): vLLM's own map,
reordered where it misfiles real names, and torch.compile's fused kernels by what they fuse."""

from __future__ import annotations

import re
from typing import Final

CATEGORIES: Final = ("gemm", "attention", "communication", "norm", "activation", "rope",
                     "quantize", "kv_write", "other", "memcpy", "memset")

# vLLM's own map (tools/profiler/nsys_profile_tools/vllm_engine_model.json), first match wins,
# reordered where its order misfiles real names: communication and KV writes first (their names
# are unambiguous, and `reshape_and_cache_flash_kernel` says "flash"); attention before GEMM
# because FlashAttention's template arguments name cutlass types; and no bare "flash" for
# attention, which would take FlashInfer's norm, activation and sampling kernels.
_KERNEL_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("communication", re.compile(
        r"nccl(Dev)?Kernel|cross_device_reduce|(?i:all_?reduce|all_?gather|reduce_?scatter)")),
    ("kv_write", re.compile(r"reshape_and_cache|concat_and_cache")),
    ("attention", re.compile(
        r"flash::|flash_fwd|FlashAttn|fmha|_attn_|attention|reduce_segments|BatchDecode|"
        r"BatchPrefill|paged_attention|flex_attn|(?i:mla_)")),
    ("gemm", re.compile(
        r"(?i:gemm|gemv)|nvjet|cutlass|cublas|wgmma|xmma|scaled_mm|_mm_|matmul|"
        r"fused_moe_kernel|GroupProblemShape|group_gemm_starts|bmm_|[Mm]arlin")),
    ("norm", re.compile(r"_norm_|Norm|rms_?norm|layer_?norm")),
    ("activation", re.compile(r"act_and_mul|(silu|gelu)_and_mul|activation::")),
    ("rope", re.compile(r"[Rr]otary|_rope|rope_")),
    ("quantize", re.compile(r"fp8_quant|_quant_|quant_kernel|cvt_|quantize")),
)

# torch.compile (Inductor) names its generated kernels after the ops it fused into them:
# `triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_..._silu_...` (H200, fp8 weights) is
# the dynamic fp8 quantization of the activation that *feeds* a scaled_mm, not a GEMM. Pointwise
# and reduction kernels (`poi`, `red`, `per`) never multiply matrices (Inductor's own matmul
# templates are `triton_tem_`), so they are filed by what they fuse, first match wins.
_INDUCTOR_FUSED: Final = re.compile(r"^triton_(poi|red|per)_fused")
_INDUCTOR_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    # amax (abs + max) and a clamp to the fp8 range: per-tensor dynamic quantization.
    ("quantize", re.compile(r"_abs_.*clamp|clamp.*_abs_|quant|fp8|e4m3")),
    ("norm", re.compile(r"rms_norm|layer_norm|_norm_|group_norm")),
    ("activation", re.compile(r"silu|gelu|relu|act_and_mul")),
    ("rope", re.compile(r"rotary|_rope")),
)


def classify_kernel(name: str, cat: str = "kernel") -> str:
    """The category of one GPU event: memcpy/memset by its `cat`, kernels by name."""
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    if _INDUCTOR_FUSED.match(name):
        for category, pattern in _INDUCTOR_PATTERNS:
            if pattern.search(name):
                return category
        return "other"
    for category, pattern in _KERNEL_PATTERNS:
        if pattern.search(name):
            return category
    return "other"
