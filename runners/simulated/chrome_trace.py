"""The simulated engine's profiler: the steps rank 0 ran while it was on (`ProfileRecorder`),
written as a torch-profiler chrome trace of the kernels the config would launch, each part of a
step's modelled time split over them (`build_trace_events`)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runners.simulated.calibration import GIB
from runners.simulated.performance import PerformanceModel, StepBreakdown
from runners.simulated.scheduler import StepPlan
from search_spaces.engine.facts import kv_cache_is_fp8

logger = logging.getLogger(__name__)

MAX_TRACE_EVENTS = 4000  # keeps a trace small enough for tests and the trace summariser


@dataclass(frozen=True)
class ProfiledStep:
    start_us: float
    breakdown: StepBreakdown
    num_tokens: int
    num_decode_seqs: int


class ProfileRecorder:
    """Between `start` and `stop` (the /start_profile and /stop_profile routes), the steps rank 0
    ran, on the modelled clock; `stop` writes them as one rank's chrome trace."""

    def __init__(self, model: PerformanceModel, profile_dir: Path | None) -> None:
        self.model = model
        self.profile_dir = profile_dir
        self._steps: list[ProfiledStep] | None = None  # None: not profiling
        self._num_events = 0

    def start(self) -> None:
        self._steps = []
        self._num_events = 0

    def record(self, plan: StepPlan, step_s: float, start_s: float) -> None:
        """One step of `step_s` slept seconds that started at `start_s` (the modelled clock,
        epoch-anchored: seconds since the epoch), while profiling and under MAX_TRACE_EVENTS."""
        if self._steps is None or self._num_events >= MAX_TRACE_EVENTS:
            return
        # The trace shows the noisy step actually slept, so scale every part alike.
        b = plan.breakdown
        scale = step_s / b.total_s if b.total_s else 1.0
        breakdown = dataclasses.replace(
            b, gemm_s=b.gemm_s * scale, attention_s=b.attention_s * scale,
            kv_write_s=b.kv_write_s * scale, elementwise_s=b.elementwise_s * scale,
            quant_s=b.quant_s * scale, comm_s=b.comm_s * scale, launch_s=b.launch_s * scale,
            host_s=b.host_s * scale)
        # Steps sit on the modelled clock (epoch-anchored), so a busy host adds no gaps.
        self._steps.append(ProfiledStep(start_s * 1e6, breakdown, plan.num_tokens,
                                        plan.num_decode_seqs))
        self._num_events += _events_per_step(self.model)

    def stop(self) -> Path | None:
        """Stop profiling; the trace written under the profile dir (None without one)."""
        steps, self._steps = self._steps or [], None
        directory = self.profile_dir
        if directory is None:
            return None
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank0.{time.time_ns()}.pt.trace.json.gz"
        trace = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": 0, "name": self.model.hardware.gpu_name,
                                  "totalGlobalMem": int(self.model.hardware.gpu_memory_gib
                                                        * GIB)}],
            "traceEvents": build_trace_events(self.model, steps),
            "displayTimeUnit": "ms",
        }
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            json.dump(trace, handle)
        logger.info("Profiler trace written to %s (%d steps)", path, len(steps))
        return path

def _kernel_names(model: PerformanceModel, is_decode: bool) -> dict[str, str]:
    """Kernel names as the config would launch them (vLLM's category regexes match these)."""
    hopper = model.hardware.compute_capability >= 9.0
    if model.is_fp8_weights:
        gemm = ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t,"
                " cutlass::bfloat16_t>>")
    elif hopper:
        gemm = ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT" if is_decode
                else "nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_TNT")
    else:
        gemm = "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn"
    kv = ("unsigned char, (vllm::Fp8KVCacheDataType)1" if kv_cache_is_fp8(model.kv_cache_dtype)
          else "__nv_bfloat16, (vllm::Fp8KVCacheDataType)0")
    backend = model.attention_backend
    if backend == "FLASHINFER":
        attention = ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<128, 8, 16>" if is_decode
                     else "void flashinfer::BatchPrefillWithPagedKVCacheKernel<128, 4, 1>")
    elif backend == "TRITON_ATTN":
        attention = "kernel_unified_attention_2d"
    elif backend == "FLEX_ATTENTION":
        attention = "triton_tem_fused_flex_attn_0"
    elif hopper:
        attention = ("void flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, "
                     "cute::tuple<cute::C<1>, cute::C<1>, cute::C<1>>, cute::tuple<cute::C<128>, "
                     "cute::C<128>, cute::C<128>>, 128, cutlass::bfloat16_t, float, "
                     "cutlass::arch::Sm90>>")
    else:
        attention = ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, "
                     "4, false, false, cutlass::bfloat16_t>>")
    if model.enforce_eager:
        norm = "void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>"
        rope = "void vllm::rotary_embedding_kernel<c10::BFloat16, true>"
        act = ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, "
               "true>")
    else:
        norm = "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1"
        rope = "triton_poi_fused_cat_index_select_mul_split_2"
        act = "triton_poi_fused_mul_silu_slice_3"
    return {
        "gemm": gemm, "attention": attention, "norm": norm, "rope": rope, "act": act,
        "kv_write": f"void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, {kv}>",
        "quant": "void vllm::dynamic_scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn>",
        "comm": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "softmax": "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, "
                   "float, at::native::(anonymous namespace)::SoftMaxForwardEpilogue>",
        "argmax": "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                  "at::native::ArgMaxOps<float>, unsigned int, long, 4>>",
    }


def _layer_kernels(model: PerformanceModel, b: StepBreakdown) -> list[tuple[str, str, float]]:
    """(kind, category, seconds) of one layer, splitting the step's parts by FLOP/byte share."""
    m = model.model
    layers = m.num_hidden_layers
    q_kv = m.hidden_size * (m.num_attention_heads + 2 * m.num_key_value_heads) * m.head_dim
    o_proj = m.num_attention_heads * m.head_dim * m.hidden_size
    gate_up = 2 * m.hidden_size * m.ffn_width_per_token  # an MoE layer: the experts routed to
    down = m.hidden_size * m.ffn_width_per_token
    linear = (q_kv + o_proj + gate_up + down) * layers
    gemm_layer_s = b.gemm_s * linear / (linear + model.lm_head_params) / layers
    shares = {"qkv": q_kv, "o": o_proj, "gate_up": gate_up, "down": down}
    total_share = sum(shares.values())
    elementwise = b.elementwise_s / layers
    kernels: list[tuple[str, str, float]] = [("norm", "kernel", elementwise * 0.35)]
    if b.quant_s:
        kernels.append(("quant", "kernel", b.quant_s / layers / 4))
    kernels += [
        ("gemm", "kernel", gemm_layer_s * shares["qkv"] / total_share),
        ("rope", "kernel", elementwise * 0.2),
        ("kv_write", "kernel", b.kv_write_s / layers),
        ("attention", "kernel", b.attention_s / layers),
        ("gemm", "kernel", gemm_layer_s * shares["o"] / total_share),
    ]
    if b.comm_s:
        kernels.append(("comm", "kernel", b.comm_s / layers / 2))
    kernels.append(("norm", "kernel", elementwise * 0.25))
    if b.quant_s:
        kernels.append(("quant", "kernel", b.quant_s / layers / 4))
    kernels += [("gemm", "kernel", gemm_layer_s * shares["gate_up"] / total_share),
                ("act", "kernel", elementwise * 0.2),
                ("gemm", "kernel", gemm_layer_s * shares["down"] / total_share)]
    if b.comm_s:
        kernels.append(("comm", "kernel", b.comm_s / layers / 2))
    return kernels


def _events_per_step(model: PerformanceModel) -> int:
    per_layer = 9 + (2 if model.tensor_parallel_size > 1 else 0) + (
        2 if model.is_fp8_weights else 0)
    return per_layer * model.model.num_hidden_layers + 5


def build_trace_events(model: PerformanceModel,
                       steps: list[ProfiledStep]) -> list[dict[str, Any]]:
    """Chrome-trace `X` events for the recorded steps: kernels back to back on one stream,
    separated by the launch gaps the model predicts (eager: the GPU waits on Python)."""
    events: list[dict[str, Any]] = []
    correlation = 0

    def emit(name: str, cat: str, ts_us: float, dur_us: float) -> None:
        nonlocal correlation
        correlation += 1
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7,
                       "ts": round(ts_us, 3), "dur": round(max(dur_us, 0.5), 3),
                       "args": {"device": 0, "stream": 7, "correlation": correlation}})

    for step in steps:
        b = step.breakdown
        names = _kernel_names(model, is_decode=step.num_tokens == step.num_decode_seqs)
        layer = _layer_kernels(model, b)
        num_kernels = len(layer) * model.model.num_hidden_layers + 4
        # Launch-bound steps leave a gap before every kernel; graph replays leave ~1 us.
        gap_us = max(1.0, (b.launch_s - b.gpu_s) * 1e6 / num_kernels)
        ts = step.start_us + b.host_s * 1e6 * 0.5  # input preparation precedes the forward
        emit("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", ts, 3.0 + step.num_tokens * 0.01)
        ts += 5.0
        for _ in range(model.model.num_hidden_layers):
            for kind, cat, seconds in layer:
                ts += gap_us
                emit(names[kind], cat, ts, seconds * 1e6)
                ts += seconds * 1e6
        lm_head_s = b.gemm_s - sum(s for k, _, s in layer if k == "gemm") * (
            model.model.num_hidden_layers)
        for kind, dur_us in (("gemm", lm_head_s * 1e6), ("softmax", 4.0), ("argmax", 3.0)):
            ts += gap_us
            emit(names[kind], "kernel", ts, dur_us)
            ts += dur_us
        emit("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy", ts + 1.0, 2.0)
        if len(events) >= MAX_TRACE_EVENTS:
            break
    return events
