"""What limits a measured config: a pure classifier from evidence (profiler trace shares, NVML
telemetry, /metrics, the roofline of the measured prefill/decode step mix, vLLM's own MFU
counters) to a `Verdict`, and the one-line conclusion built on it.

Rules and thresholds are explained in docs/bottleneck.md; `classify` never does I/O, so it is
tested on recorded summaries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Final, Literal, get_args

from runners import prometheus
from runners.base import EngineConfig, EngineInfo, RunResult, StepMetrics
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.vllm.facts import (
    BYTES_PER_PARAM,
    FP8_WEIGHT_METHODS,
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
)

Label = Literal["compute-bound", "memory-bound", "communication-bound", "launch-bound",
                "kv-capacity-bound", "at-physical-limit", "unknown"]
LABELS: Final[tuple[Label, ...]] = get_args(Label)
Source = Literal["trace", "telemetry", "metrics", "roofline", "config"]

ATTR_VERDICT: Final = "verdict"  # trial user attribute holding `Verdict.as_user_attr()`

GIB: Final = 1 << 30


@dataclass(frozen=True)
class Thresholds:
    """Where each rule fires; docs/bottleneck.md gives the reason for every number."""

    at_limit_roofline_fraction: float = 0.8  # measured step within 1.25x of the roofline
    kv_full_perc: float = 0.95  # KV cache usage, 0-1
    communication_share: float = 0.25  # of kernel time
    tp_slowdown: float = 1.15  # TPOT at TP>1 over the TP=1 reference
    launch_busy_fraction: float = 0.4  # GPU busy over the kernel span
    # NVML's share of time with a kernel running, sampled in the unprofiled measured window; at or
    # over this, the profiled window's gaps are the profiler's own host overhead, not the engine's.
    launch_max_gpu_util_pct: float = 80.0
    eager_roofline_fraction: float = 0.35  # without a trace: eager and this far off the roofline
    compute_gemm_share: float = 0.8
    compute_busy_fraction: float = 0.8
    compute_gpu_util_pct: float = 90.0  # without a trace, with a compute-dominated roofline
    memory_dominance: float = 2.0  # bytes term over FLOPs term that makes busy GEMMs memory-bound
    memory_util_pct: float = 50.0  # without a roofline: NVML memory-controller busy
    # The step-mix roofline (time-averaged utilisation of the FLOP and bandwidth ceilings):
    # at or over this, the dominant ceiling is what the level is bound by.
    bound_fraction: float = 0.4
    # Below `bound_fraction` on both: the GPU idled between kernels while it had work when
    # NVML saw a kernel running less than this share of the time (or eager / runtime JIT).
    launch_idle_gpu_util_pct: float = 50.0
    # Little's law at the level: fewer requests than this in flight on average is a load that
    # leaves the engine idle, which no ceiling explains.
    min_requests_in_flight: float = 1.0


DEFAULT_THRESHOLDS: Final = Thresholds()


@dataclass(frozen=True)
class Evidence:
    """Everything `classify` may use; every field is optional (None = not measured)."""

    # Profiler trace (runners.trace.summarize).
    gemm_share: float | None = None  # of kernel time, 0-1
    attention_share: float | None = None  # of kernel time, 0-1
    communication_share: float | None = None  # of kernel time, 0-1
    gpu_busy_fraction: float | None = None  # union of kernel intervals / kernel span, 0-1
    median_gap_us: float | None = None  # between kernels on the busiest stream
    # NVML telemetry over the load levels.
    gpu_util_mean_pct: float | None = None
    mem_util_mean_pct: float | None = None  # memory controller busy
    power_mean_w: float | None = None  # per GPU
    sm_clock_mean_mhz: float | None = None
    sm_clock_min_mhz: float | None = None
    # Server /metrics over one load level.
    max_kv_cache_usage_perc: float | None = None  # 0-1
    max_num_requests_waiting: float | None = None
    num_preemptions: float | None = None  # during the level
    is_waiting_rising: bool | None = None  # the queue grew over the level
    # Decode roofline inputs.
    decode_batch: float | None = None  # sequences per decode step
    context_tokens: float | None = None  # mean tokens per sequence whose KV a step reads
    tpot_ms: float | None = None  # measured time per decode step (median TPOT)
    weight_bytes: float | None = None  # whole model, read once per step
    kv_bytes_per_token: float | None = None  # all layers, whole model
    flops_per_token: float | None = None  # about 2 x the parameters a token passes
    memory_bandwidth_gbps: float | None = None  # one GPU, GB/s
    peak_tflops: float | None = None  # one GPU, dense, in the GEMMs' dtype
    tensor_parallel_size: int = 1
    tp1_tpot_ms: float | None = None  # TPOT of the best TP=1 config at the same load
    is_enforce_eager: bool | None = None
    # The roofline of the measured step mix (`step_roofline`), per GPU, 0-1 of each ceiling.
    compute_utilization: float | None = None  # seconds of FLOPs at peak per second
    bandwidth_utilization: float | None = None  # bytes/s over HBM bandwidth
    prefill_flop_share: float | None = None  # of the level's FLOPs, prefill's (0-1)
    kv_read_share: float | None = None  # of the level's bytes, KV read by decode (0-1)
    prefill_tokens_per_s: float | None = None  # computed prompt tokens, whole engine
    decode_tokens_per_s: float | None = None  # generated tokens, whole engine
    vllm_compute_utilization: float | None = None  # the same from vLLM's MFU counters
    vllm_bandwidth_utilization: float | None = None
    requests_in_flight: float | None = None  # Little's law: request rate x mean latency
    num_runtime_jit_compiles: float | None = None  # kernels vLLM JIT-compiled while serving
    is_fp8_weights: bool | None = None  # the GEMMs' weights are fp8 (flag or checkpoint)
    is_fp8_kv: bool | None = None  # kv_cache_dtype fp8*

    @property
    def has_trace(self) -> bool:
        return any(v is not None for v in (self.gemm_share, self.communication_share,
                                            self.gpu_busy_fraction))

    @property
    def has_telemetry(self) -> bool:
        return any(v is not None for v in (self.gpu_util_mean_pct, self.mem_util_mean_pct,
                                            self.power_mean_w, self.sm_clock_mean_mhz))

    @property
    def has_metrics(self) -> bool:
        return any(v is not None for v in (self.max_kv_cache_usage_perc,
                                            self.num_preemptions, self.is_waiting_rising))

    @property
    def has_mix(self) -> bool:
        """The step-mix roofline was computed (`compute_utilization`/`bandwidth_utilization`)."""
        return self.compute_utilization is not None and self.bandwidth_utilization is not None

    def roofline(self) -> Roofline | None:
        """The decode roofline of this operating point, or None when an input is missing."""
        batch, weights, kv, flops = (self.decode_batch, self.weight_bytes,
                                     self.kv_bytes_per_token, self.flops_per_token)
        bandwidth, peak = self.memory_bandwidth_gbps, self.peak_tflops
        if (batch is None or weights is None or kv is None or flops is None
                or bandwidth is None or peak is None):
            return None
        if not all(math.isfinite(v) and v > 0 for v in (batch, weights, kv, flops, bandwidth,
                                                          peak)):
            return None
        return roofline_terms(weight_bytes=weights,
                              kv_bytes_read=batch * (self.context_tokens or 0.0) * kv,
                              flops=flops * batch, memory_bandwidth_gbps=bandwidth,
                              peak_tflops=peak, tensor_parallel_size=self.tensor_parallel_size)

    def roofline_fraction(self) -> float | None:
        """How close the level ran to the hardware, 1.0 being its limit: with the step mix, the
        dominant of the two utilisations; else decode roofline time over measured step time."""
        if self.has_mix:
            return max(self.compute_utilization or 0.0, self.bandwidth_utilization or 0.0)
        terms = self.roofline()
        if terms is None or self.tpot_ms is None or not self.tpot_ms > 0:
            return None
        return terms.time_s / (self.tpot_ms / 1e3)


@dataclass(frozen=True)
class Roofline:
    memory_s: float  # bytes per GPU / bandwidth
    compute_s: float  # FLOPs per GPU / peak

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def is_memory_dominated(self) -> bool:
        return self.memory_s >= self.compute_s


def roofline_terms(*, weight_bytes: float, kv_bytes_read: float, flops: float,
                   memory_bandwidth_gbps: float, peak_tflops: float,
                   tensor_parallel_size: int = 1) -> Roofline:
    """Both terms of one decode step's roofline. All inputs are for the whole model; tensor
    parallelism splits weights, KV heads and FLOPs evenly, and communication is left out on
    purpose, so a TP config's distance from its roofline shows what communication costs."""
    tp = max(1, tensor_parallel_size)
    return Roofline(memory_s=(weight_bytes + kv_bytes_read) / tp / (memory_bandwidth_gbps * 1e9),
                    compute_s=flops / tp / (peak_tflops * 1e12))


def roofline_decode_s(*, weight_bytes: float, kv_bytes_read: float, flops: float,
                      memory_bandwidth_gbps: float, peak_tflops: float,
                      tensor_parallel_size: int = 1) -> float:
    """The least time one decode step can take on this hardware, in seconds:
    max((weight + KV bytes) / TP / bandwidth, FLOPs / TP / peak)."""
    return roofline_terms(weight_bytes=weight_bytes, kv_bytes_read=kv_bytes_read, flops=flops,
                          memory_bandwidth_gbps=memory_bandwidth_gbps, peak_tflops=peak_tflops,
                          tensor_parallel_size=tensor_parallel_size).time_s


@dataclass(frozen=True)
class StepRoofline:
    """One load level against the card's ceilings: what each GPU was asked to compute and move
    per second, from the measured prefill/decode mix (docs/bottleneck.md, "Roofline")."""

    prefill_tokens_per_s: float  # prompt tokens computed (cache hits left out), whole engine
    decode_tokens_per_s: float  # generated tokens, whole engine
    steps_per_s: float  # engine steps of one data-parallel replica
    flops_per_s: float  # per GPU
    bytes_per_s: float  # per GPU: weights per step, KV read by decode, KV written
    compute_utilization: float  # per GPU: linear FLOPs / GEMM peak + attention / bf16 peak
    bandwidth_utilization: float  # per GPU: bytes_per_s / HBM bandwidth
    prefill_flop_share: float  # of flops_per_s (0-1)
    kv_read_share: float  # of bytes_per_s (0-1)
    is_steps_counted: bool  # steps from vLLM's step counter, not Little's law on decode
    vllm_flops_per_s: float | None = None  # vLLM's MFU counters, per GPU
    vllm_bytes_per_s: float | None = None  # read + written, per GPU
    vllm_compute_utilization: float | None = None  # vllm_flops_per_s / GEMM peak
    vllm_bandwidth_utilization: float | None = None

    @property
    def roofline_fraction(self) -> float:
        """The dominant utilisation: a lower bound of the share of time the mix needs at the
        ceilings (steps bound by FLOPs and steps bound by bytes do not overlap perfectly)."""
        return max(self.compute_utilization, self.bandwidth_utilization)

    def as_metrics(self) -> dict[str, float]:
        """MLflow names: `roofline.*` (ours) and `vllm_mfu.*` (vLLM's counters)."""
        out = {"roofline.compute_util": self.compute_utilization,
               "roofline.bandwidth_util": self.bandwidth_utilization,
               "roofline.fraction": self.roofline_fraction,
               "roofline.tflops_per_gpu": self.flops_per_s / 1e12,
               "roofline.gbps_per_gpu": self.bytes_per_s / 1e9,
               "roofline.prefill_tokens_per_s": self.prefill_tokens_per_s,
               "roofline.decode_tokens_per_s": self.decode_tokens_per_s,
               "roofline.steps_per_s": self.steps_per_s,
               "roofline.prefill_flop_share": self.prefill_flop_share}
        if self.vllm_compute_utilization is not None and self.vllm_flops_per_s is not None:
            out["vllm_mfu.compute_util"] = self.vllm_compute_utilization
            out["vllm_mfu.tflops_per_gpu"] = self.vllm_flops_per_s / 1e12
        if self.vllm_bandwidth_utilization is not None and self.vllm_bytes_per_s is not None:
            out["vllm_mfu.bandwidth_util"] = self.vllm_bandwidth_utilization
            out["vllm_mfu.gbps_per_gpu"] = self.vllm_bytes_per_s / 1e9
        return out


def is_fp8_weights(config: EngineConfig, model: ModelInfo | None = None) -> bool:
    """The GEMMs run on fp8 weights: `--quantization` an fp8 method, or an fp8 checkpoint."""
    method = str(config.flags.get("quantization") or (model.quant_method if model else "")
                 or "").lower()
    return method in FP8_WEIGHT_METHODS or method.startswith("fp8")


def is_fp8_kv(config: EngineConfig) -> bool:
    return str(config.flags.get("kv_cache_dtype") or "auto").lower().startswith("fp8")


def step_roofline(step: StepMetrics, config: EngineConfig, hardware: HardwareProfile | None,
                  model: ModelInfo | None) -> StepRoofline | None:
    """The roofline of one measured level's prefill/decode mix, per GPU; None without a model
    shape, ceilings, a measured duration or completed requests. Pure.

    Tokens come from the level's counter growth (`vllm:prompt_tokens_total` less cached prompt
    tokens, `vllm:generation_tokens_total`), else from the load generator's counts; engine
    steps from `vllm:iteration_tokens_total_count`, else from Little's law on decode (output
    tokens/s x mean TPOT = sequences per step). FLOPs: 2 x the linear parameters per token
    (the LM head once per generated token and once per prompt), plus causal attention over each
    token's context (a prompt token at position p attends to p keys: on average half the
    prompt; a generated one to the prompt and half the output). Bytes: the weights once per
    step (by dtype; the LM head stays bf16), the KV of its context per generated token, and the
    KV of every computed token written (by KV dtype). Activations are left out (both figures
    are lower bounds)."""
    m = step.metrics
    if model is None or hardware is None or m.completed <= 0 or not m.duration_s > 0:
        return None
    bandwidth = _positive(hardware.memory_bandwidth_gbps)
    bf16 = _positive(hardware.bf16_tflops)
    if bandwidth is None or bf16 is None:
        return None
    bandwidth_bps, bf16_flops = bandwidth * 1e9, bf16 * 1e12
    fp8 = is_fp8_weights(config, model)
    gemm_flops = hardware.fp8_tflops * 1e12 if fp8 and hardware.fp8_tflops > 0 else bf16_flops

    counters = prometheus.level_counters(step.server_metrics)
    duration = m.duration_s
    prompt = counters.prompt_tokens or float(m.total_input_tokens)
    computed = counters.computed_prompt_tokens if counters.prompt_tokens else None
    if computed is None:
        computed = prompt
    cached_fraction = 1.0 - computed / prompt if prompt > 0 else 0.0
    generated = counters.generation_tokens or float(m.total_output_tokens)
    mean_prompt = m.total_input_tokens / m.completed
    mean_output = m.total_output_tokens / m.completed
    prefill_tps, decode_tps = computed / duration, generated / duration
    prompts_per_s = prompt / duration / mean_prompt if mean_prompt > 0 else 0.0

    tp, pp, dp = (config.tensor_parallel_size, config.pipeline_parallel_size,
                  config.data_parallel_size)
    num_gpus = tp * pp * dp
    lm_head = model.vocab_size * model.hidden_size
    embeddings = lm_head * (1 if model.tie_word_embeddings else 2)
    linear = max(model.num_params - embeddings, 0)
    # A computed prompt token sits after the cached part: its mean position is halfway between
    # the cached prefix and the prompt's end.
    prefill_context = mean_prompt * (1.0 + cached_fraction) / 2.0
    decode_context = mean_prompt + mean_output / 2.0
    attention_per_key = 4.0 * model.num_hidden_layers * model.num_attention_heads * \
        model.head_dim  # QK^T and AV, 2 FLOPs per multiply-add
    linear_prefill = 2.0 * linear * prefill_tps + 2.0 * lm_head * prompts_per_s
    linear_decode = 2.0 * (linear + lm_head) * decode_tps
    attn_prefill = attention_per_key * prefill_context * prefill_tps
    attn_decode = attention_per_key * decode_context * decode_tps
    total_flops = linear_prefill + linear_decode + attn_prefill + attn_decode
    compute_util = ((linear_prefill + linear_decode) / gemm_flops
                    + (attn_prefill + attn_decode) / bf16_flops) / num_gpus

    decode_tps_per_replica = decode_tps / dp
    steps = counters.num_steps / dp / duration if counters.num_steps else None
    is_counted = steps is not None
    if steps is None:
        mean_tpot = _positive(m.mean_tpot_ms)
        if mean_tpot is None or decode_tps_per_replica <= 0:
            return None
        batch = decode_tps_per_replica * mean_tpot / 1e3  # sequences per decode step
        steps = decode_tps_per_replica / max(batch, 1.0)
    weight_bytes = linear * _bytes_per_param(config, model) + lm_head * 2.0
    kv_per_token = model.kv_bytes_per_token(1.0 if is_fp8_kv(config) else 2.0)
    heads = model.num_key_value_heads
    kv_share = math.ceil(heads / tp) / heads / pp / dp  # one GPU's part of the engine's KV
    weight_bps = weight_bytes / (tp * pp) * steps
    kv_read_bps = decode_tps * decode_context * kv_per_token * kv_share
    kv_write_bps = (prefill_tps + decode_tps) * kv_per_token * kv_share
    total_bps = weight_bps + kv_read_bps + kv_write_bps

    vllm_flops = vllm_bytes = vllm_cu = vllm_bu = None
    if counters.has_mfu:
        # Per GPU of each engine, summed over the data-parallel engines by the parser.
        vllm_flops = (counters.estimated_flops_per_gpu or 0.0) / dp / duration
        vllm_bytes = ((counters.estimated_read_bytes_per_gpu or 0.0)
                      + (counters.estimated_write_bytes_per_gpu or 0.0)) / dp / duration
        vllm_cu, vllm_bu = vllm_flops / gemm_flops, vllm_bytes / bandwidth_bps
    return StepRoofline(
        prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps, steps_per_s=steps,
        flops_per_s=total_flops / num_gpus, bytes_per_s=total_bps,
        compute_utilization=compute_util, bandwidth_utilization=total_bps / bandwidth_bps,
        prefill_flop_share=(linear_prefill + attn_prefill) / total_flops if total_flops else 0.0,
        kv_read_share=kv_read_bps / total_bps if total_bps else 0.0,
        is_steps_counted=is_counted, vllm_flops_per_s=vllm_flops, vllm_bytes_per_s=vllm_bytes,
        vllm_compute_utilization=vllm_cu, vllm_bandwidth_utilization=vllm_bu)


def level_metrics(steps: Sequence[StepMetrics], config: EngineConfig,
                  hardware: HardwareProfile | None,
                  model: ModelInfo | None) -> list[dict[str, float]]:
    """`StepRoofline.as_metrics` of each level, in order ({} where it cannot be computed): the
    per-level figures logged to MLflow at step = level."""
    out: list[dict[str, float]] = []
    for step in steps:
        terms = step_roofline(step, config, hardware, model)
        out.append(terms.as_metrics() if terms is not None else {})
    return out


@dataclass(frozen=True)
class Verdict:
    """The classifier's answer. `evidence` holds only the numbers that decided it."""

    label: Label
    roofline_fraction: float | None  # roofline time / measured step time; None without inputs
    evidence: dict[str, float] = field(default_factory=dict)
    reason: str = ""  # one sentence, naming the evidence used
    detail: str = ""  # the short phrase `sentence` puts in parentheses
    sources: tuple[Source, ...] = ()  # the kinds of evidence that decided

    def as_user_attr(self, **extra: float | int | str | None) -> dict[str, Any]:
        """JSON-able, for `trial.set_user_attr(ATTR_VERDICT, ...)`; `extra` adds what
        `BottleneckPruner` reads (`tensor_parallel_size`, `objective_value`, `step`)."""
        out: dict[str, Any] = {**asdict(self), "sources": list(self.sources)}
        out.update({k: v for k, v in extra.items() if v is not None})
        return out

    @classmethod
    def from_user_attr(cls, data: Mapping[str, Any]) -> Verdict:
        label = data.get("label")
        rf = data.get("roofline_fraction")
        return cls(label=label if label in LABELS else "unknown",
                   roofline_fraction=float(rf) if isinstance(rf, int | float) else None,
                   evidence={str(k): float(v) for k, v in (data.get("evidence") or {}).items()
                             if isinstance(v, int | float)},
                   reason=str(data.get("reason") or ""), detail=str(data.get("detail") or ""),
                   sources=tuple(data.get("sources") or ()))

    def as_metrics(self) -> dict[str, float]:
        """Flat figures for the tracker (`bottleneck.<name>`), and the operating point's two
        utilisations under the names the per-level figures use (`roofline.compute_util`,
        `roofline.bandwidth_util`, `vllm_mfu.compute_util`, `vllm_mfu.bandwidth_util`)."""
        out = {f"bottleneck.{k}": v for k, v in self.evidence.items()}
        if self.roofline_fraction is not None:
            out["bottleneck.roofline_fraction"] = self.roofline_fraction
        for key, name in (("compute_utilization", "roofline.compute_util"),
                          ("bandwidth_utilization", "roofline.bandwidth_util"),
                          ("vllm_compute_utilization", "vllm_mfu.compute_util"),
                          ("vllm_bandwidth_utilization", "vllm_mfu.bandwidth_util")):
            if key in self.evidence:
                out[name] = self.evidence[key]
        return out


# --- the rules ----------------------------------------------------------------------------------


def _num(values: Mapping[str, float | None]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if v is not None}


def _verdict(label: Label, rf: float | None, evidence: Mapping[str, float | None],
             detail: str, why: str, sources: Sequence[Source]) -> Verdict:
    used = ", ".join(sources)
    return Verdict(label=label, roofline_fraction=rf, evidence=_num(evidence),
                   reason=f"{label}: {why} (from {used}).", detail=detail,
                   sources=tuple(sources))


# Figures every verdict carries when measured, whatever rule decided: the two utilisations (and
# vLLM's), and the config facts `advice` must not contradict.
_CONTEXT_FIELDS: Final = ("compute_utilization", "bandwidth_utilization",
                          "vllm_compute_utilization", "vllm_bandwidth_utilization",
                          "prefill_flop_share", "kv_read_share", "requests_in_flight",
                          "num_runtime_jit_compiles",
                          "is_fp8_weights", "is_fp8_kv", "is_enforce_eager")


def classify(evidence: Evidence, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> Verdict:
    """The first rule that the evidence supports, in this order: kv-capacity-bound,
    at-physical-limit, communication-bound, launch-bound, compute-bound, memory-bound; else
    unknown. Each rule has a form for partial evidence (no trace: telemetry, metrics, config).
    The verdict's evidence also carries the level's utilisations and fp8/eager facts."""
    verdict = _classify(evidence, thresholds)
    extra: dict[str, float] = {}
    for name in _CONTEXT_FIELDS:
        value = getattr(evidence, name)
        if value is not None and name not in verdict.evidence:
            extra[name] = float(value)
    if not extra:
        return verdict
    return replace(verdict, evidence={**verdict.evidence, **extra})


def _classify(evidence: Evidence, thresholds: Thresholds) -> Verdict:
    e, t = evidence, thresholds
    rf = e.roofline_fraction()
    terms = e.roofline()
    rf_ev: dict[str, float | None] = {"roofline_fraction": rf}

    # A full KV cache that preempts or lets the queue grow caps the batch, however fast each
    # step is; it has its own levers (KV dtype, memory utilisation), so it is named first.
    kv = e.max_kv_cache_usage_perc
    pressure = (e.num_preemptions or 0.0) > 0 or bool(e.is_waiting_rising)
    if kv is not None and kv >= t.kv_full_perc and pressure:
        return _verdict(
            "kv-capacity-bound", rf,
            {"max_kv_cache_usage_perc": kv, "num_preemptions": e.num_preemptions,
             "is_waiting_rising": float(e.is_waiting_rising) if e.is_waiting_rising is not None
             else None},
            f"KV cache {kv:.0%} full, {_pressure(e)}",
            f"the KV cache was {kv:.0%} full with {_pressure(e)}", ["metrics"])

    if rf is not None and rf >= t.at_limit_roofline_fraction and e.has_mix:
        ceiling = _dominant_ceiling(e)
        return _verdict("at-physical-limit", rf, rf_ev, f"{rf:.0%} of the {ceiling} ceiling",
                        f"the level ran at {e.compute_utilization:.0%} of the FLOP ceiling and "
                        f"{e.bandwidth_utilization:.0%} of the bandwidth ceiling",
                        ["roofline", "metrics"])
    if rf is not None and rf >= t.at_limit_roofline_fraction:
        return _verdict("at-physical-limit", rf, rf_ev, f"{rf:.0%} of the roofline",
                        f"a decode step takes {e.tpot_ms:.3g} ms, within "
                        f"{1 / rf:.2f}x of the roofline", ["roofline", "metrics"])

    if e.communication_share is not None and e.communication_share > t.communication_share:
        share = e.communication_share
        return _verdict("communication-bound", rf,
                        {"communication_share": share, **rf_ev,
                         "tensor_parallel_size": e.tensor_parallel_size},
                        f"communication {share:.0%} of kernel time",
                        f"collectives take {share:.0%} of GPU kernel time", ["trace"])
    if (e.tensor_parallel_size > 1 and e.tpot_ms is not None and e.tp1_tpot_ms is not None
            and e.tp1_tpot_ms > 0 and e.tpot_ms > t.tp_slowdown * e.tp1_tpot_ms):
        ratio = e.tpot_ms / e.tp1_tpot_ms
        return _verdict("communication-bound", rf,
                        {"tp_slowdown": ratio, "tpot_ms": e.tpot_ms, "tp1_tpot_ms": e.tp1_tpot_ms,
                         "tensor_parallel_size": e.tensor_parallel_size},
                        f"TPOT {ratio:.2f}x the TP=1 reference",
                        f"TP={e.tensor_parallel_size} decodes {ratio:.2f}x slower than TP=1 at "
                        "the same load", ["metrics", "config"])

    busy = e.gpu_busy_fraction
    util = e.gpu_util_mean_pct
    # The trace comes from a profiled window, whose host-side overhead widens the gaps between
    # kernels; NVML, sampled while the load ran unprofiled, says whether they exist without it.
    profiler_gaps = busy is not None and busy < t.launch_busy_fraction and \
        util is not None and util >= t.launch_max_gpu_util_pct
    if busy is not None and busy < t.launch_busy_fraction and not profiler_gaps:
        return _verdict("launch-bound", rf,
                        {"gpu_busy_fraction": busy, "median_gap_us": e.median_gap_us,
                         "is_enforce_eager": _flag(e.is_enforce_eager), **rf_ev},
                        f"GPU busy {busy:.0%} of the kernel span",
                        f"the GPU was busy only {busy:.0%} of the kernel span, idle between "
                        "kernels", ["trace"])
    if e.has_mix and rf is not None:
        return _classify_mix(e, t, rf, busy, util, profiler_gaps)
    if (busy is None and e.is_enforce_eager and rf is not None
            and rf < t.eager_roofline_fraction):
        return _verdict("launch-bound", rf, {"is_enforce_eager": 1.0, **rf_ev},
                        f"eager mode at {rf:.0%} of the roofline",
                        f"enforce_eager runs {rf:.0%} of the roofline with no trace to show "
                        "the gaps", ["config", "roofline"])

    gemm = e.gemm_share
    if (gemm is not None and busy is not None and gemm > t.compute_gemm_share
            and busy > t.compute_busy_fraction):
        ev = {"gemm_share": gemm, "gpu_busy_fraction": busy, **rf_ev}
        # Decode GEMMs at a small batch stream weights: busy GEMMs are then memory-bound.
        if terms is not None and terms.memory_s > t.memory_dominance * terms.compute_s:
            return _verdict("memory-bound", rf,
                            {**ev, "memory_over_compute": terms.memory_s / terms.compute_s},
                            f"GEMM {gemm:.0%} of a {busy:.0%}-busy GPU, streaming weights",
                            f"GEMMs fill {gemm:.0%} of a {busy:.0%}-busy GPU but the roofline "
                            "is bandwidth-dominated", ["trace", "roofline"])
        return _verdict("compute-bound", rf, ev,
                        f"GEMM {gemm:.0%} of kernel time, GPU busy {busy:.0%}",
                        f"GEMMs fill {gemm:.0%} of a GPU busy {busy:.0%} of the time",
                        ["trace"])
    if busy is None and terms is not None and not terms.is_memory_dominated and \
            (util is None or util >= t.compute_gpu_util_pct):
        sources: list[Source] = ["roofline"] if util is None else ["roofline", "telemetry"]
        return _verdict("compute-bound", rf,
                        {"compute_over_memory": terms.compute_s / terms.memory_s,
                         "gpu_util_mean_pct": util, **rf_ev},
                        "FLOPs dominate the roofline",
                        "the roofline's FLOP term exceeds its byte term", sources)

    if terms is not None and terms.is_memory_dominated:
        ev2 = {"memory_over_compute": terms.memory_s / terms.compute_s,
               "gpu_busy_fraction": busy, "gpu_util_mean_pct": e.gpu_util_mean_pct,
               "decode_batch": e.decode_batch, **rf_ev}
        at = f" at {rf:.0%} of it" if rf is not None else ""
        used: list[Source] = ["roofline", "trace"] if busy is not None else ["roofline"]
        why = f"reading weights and KV dominates the decode roofline{at}"
        if profiler_gaps:
            used.append("telemetry")
            why += (f"; the profiled window's gaps (GPU busy {busy:.0%}) are the profiler's: "
                    f"unprofiled, a kernel ran {util:.0f}% of the time")
        return _verdict("memory-bound", rf, ev2, f"bandwidth roofline{at}", why, used)
    if terms is None and e.mem_util_mean_pct is not None \
            and e.mem_util_mean_pct >= t.memory_util_pct:
        return _verdict("memory-bound", rf, {"mem_util_mean_pct": e.mem_util_mean_pct},
                        f"memory controller busy {e.mem_util_mean_pct:.0f}%",
                        f"the memory controller was busy {e.mem_util_mean_pct:.0f}% of the "
                        "time", ["telemetry"])

    missing = [name for name, present in (("trace", e.has_trace), ("telemetry", e.has_telemetry),
                                          ("metrics", e.has_metrics),
                                          ("roofline", terms is not None)) if not present]
    have: list[Source] = [s for s in ("trace", "telemetry", "metrics", "roofline")
                          if s not in missing]
    why = "no rule fired"
    if missing:
        why += f"; missing {', '.join(missing)}"
    return Verdict(label="unknown", roofline_fraction=rf, evidence=_num(rf_ev),
                   reason=f"unknown: {why} (from {', '.join(have) or 'nothing'}).",
                   detail="not enough evidence", sources=tuple(have))


def _dominant_ceiling(e: Evidence) -> str:
    return "FLOP" if (e.compute_utilization or 0.0) >= (e.bandwidth_utilization or 0.0) \
        else "bandwidth"


def _mix_figures(e: Evidence) -> str:
    return (f"{e.compute_utilization:.0%} of the FLOP ceiling, {e.bandwidth_utilization:.0%} of "
            "the bandwidth ceiling")


def _classify_mix(e: Evidence, t: Thresholds, rf: float, busy: float | None,
                  util: float | None, profiler_gaps: bool) -> Verdict:
    """The rules on the step-mix roofline, below the physical limit, once kv-capacity,
    communication and a trace's launch gaps have been ruled out."""
    cu, bu = e.compute_utilization or 0.0, e.bandwidth_utilization or 0.0
    rf_ev: dict[str, float | None] = {"roofline_fraction": rf, "compute_utilization": cu,
                                      "bandwidth_utilization": bu}
    sources: list[Source] = ["roofline", "metrics"]
    if busy is not None:
        sources.append("trace")  # it showed no launch gaps (or only the profiler's)
    note = ""
    if profiler_gaps:
        sources.append("telemetry")
        note = (f"; the profiled window's gaps (GPU busy {busy:.0%}) are the profiler's: "
                f"unprofiled, a kernel ran {util:.0f}% of the time")
    is_far = rf < t.bound_fraction
    in_flight = e.requests_in_flight
    had_work = in_flight is None or in_flight >= t.min_requests_in_flight
    jit = e.num_runtime_jit_compiles or 0.0
    is_gpu_busy = util is not None and util >= t.launch_max_gpu_util_pct
    is_gpu_idle = util is not None and util < t.launch_idle_gpu_util_pct
    # Far below both ceilings with work waiting, and a sign that the GPU waited on the host:
    # Python launching kernels (eager), kernels compiled while serving, or NVML saw it idle.
    signs = [s for s, on in (("eager mode", bool(e.is_enforce_eager)),
                             (f"{jit:.0f} kernels JIT-compiled while serving", jit > 0),
                             (f"NVML saw a kernel running {util or 0:.0f}% of the time",
                              is_gpu_idle)) if on]
    if is_far and had_work and busy is None and not is_gpu_busy and signs:
        used: list[Source] = ["roofline", "config"]
        if util is not None:
            used.insert(1, "telemetry")
        return _verdict(
            "launch-bound", rf,
            {**rf_ev, "gpu_util_mean_pct": util, "is_enforce_eager": _flag(e.is_enforce_eager),
             "num_runtime_jit_compiles": jit if jit else None,
             "requests_in_flight": in_flight},
            f"{signs[0]}, {rf:.0%} of the {_dominant_ceiling(e)} ceiling",
            f"with work waiting the level reached only {_mix_figures(e)}; "
            + "; ".join(signs), used)
    if not is_far and cu >= bu:
        share = e.prefill_flop_share
        mix = f"prefill {share:.0%} of the FLOPs, " if share is not None else ""
        return _verdict("compute-bound", rf, {**rf_ev, "prefill_flop_share": share},
                        f"{mix}{cu:.0%} of the FLOP ceiling",
                        f"the step mix ran at {_mix_figures(e)}{note}", sources)
    if not is_far:
        return _verdict("memory-bound", rf, {**rf_ev, "prefill_flop_share": e.prefill_flop_share},
                        f"{bu:.0%} of the bandwidth ceiling, {cu:.0%} of FLOPs",
                        f"the step mix ran at {_mix_figures(e)}{note}", sources)
    # Far below both ceilings and no sign of host gaps: no ceiling explains the level.
    if not had_work:
        why = (f"the load left the engine idle ({in_flight:.2f} requests in flight on "
               f"average) at {_mix_figures(e)}")
    elif is_gpu_busy or (busy is not None and busy >= t.launch_busy_fraction):
        seen = f"NVML saw a kernel running {util:.0f}% of the time" if is_gpu_busy \
            else f"the trace shows the GPU busy {busy:.0%} of the kernel span"
        why = (f"the GPU was busy ({seen}) yet the level reached only {_mix_figures(e)}: its "
               "kernels run well below the hardware's rates for this mix")
    else:
        why = f"the level reached only {_mix_figures(e)} and no other evidence explains it"
    have: list[Source] = ["roofline", "metrics"]
    if util is not None:
        have.append("telemetry")
    if busy is not None:
        have.append("trace")
    return Verdict(label="unknown", roofline_fraction=rf,
                   evidence=_num({**rf_ev, "gpu_util_mean_pct": util,
                                  "gpu_busy_fraction": busy, "requests_in_flight": in_flight}),
                   reason=f"unknown: {why} (from {', '.join(have)}).",
                   detail=f"below both ceilings: {_mix_figures(e)}", sources=tuple(have))


def _pressure(e: Evidence) -> str:
    parts = []
    if e.num_preemptions:
        parts.append(f"{e.num_preemptions:.0f} preemptions")
    if e.is_waiting_rising:
        parts.append("the queue rising")
    return " and ".join(parts)


def _flag(value: bool | None) -> float | None:
    return None if value is None else float(value)


# --- building evidence --------------------------------------------------------------------------


def memory_problem(config: EngineConfig, hardware: HardwareProfile | None,
                   model: ModelInfo | None) -> str | None:
    """Why a config cannot fit its GPUs, judged before launch (None when it may): the weights
    alone, or the weights and the KV cache of one longest request, above what
    `gpu_memory_utilization` lets vLLM take. Deliberately lenient (activations and CUDA graphs
    are left out): it rejects only the impossible, and vLLM judges the rest."""
    if hardware is None or model is None or hardware.gpu_memory_gib <= 0:
        return None
    tp = config.tensor_parallel_size * config.pipeline_parallel_size
    gmu = float(config.flags.get("gpu_memory_utilization") or VLLM_DEFAULT_GPU_MEMORY_UTILIZATION)
    budget_gib = gmu * hardware.gpu_memory_gib
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_word_embeddings else 2)
    linear = max(model.num_params - embeddings, 0)
    weights_gib = (linear * _bytes_per_param(config, model) + embeddings * 2.0) / tp / GIB
    if weights_gib > budget_gib:
        return (f"the weights need {weights_gib:.1f} GiB per GPU but gpu_memory_utilization "
                f"{gmu:g} of {hardware.gpu_memory_gib:.0f} GiB allows {budget_gib:.1f} GiB")
    kv_dtype = str(config.flags.get("kv_cache_dtype") or "auto").lower()
    max_len = int(config.flags.get("max_model_len") or model.max_position_embeddings)
    kv_gib = model.kv_bytes_per_token(1.0 if kv_dtype.startswith("fp8") else 2.0) * \
        max_len / tp / GIB
    if weights_gib + kv_gib > budget_gib:
        return (f"the weights ({weights_gib:.1f} GiB per GPU) and the KV cache of one "
                f"{max_len}-token request ({kv_gib:.1f} GiB) exceed the {budget_gib:.1f} GiB "
                f"gpu_memory_utilization {gmu:g} allows")
    return None


def _bytes_per_param(config: EngineConfig, model: ModelInfo | None) -> float:
    method = str(config.flags.get("quantization") or (model.quant_method if model else "") or "")
    if method:
        return BYTES_PER_PARAM.get(method.lower(), 2.0)
    dtype = (model.dtype if model else "bfloat16").lower()
    return 4.0 if dtype in ("float32", "fp32") else 2.0


def _is_true(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _positive(value: object) -> float | None:
    v = _finite(value)
    return v if v is not None and v > 0 else None


def evidence_from(result: RunResult | StepMetrics | Sequence[StepMetrics],
                  config: EngineConfig, hardware: HardwareProfile | None = None,
                  model: ModelInfo | None = None, *, engine: EngineInfo | None = None,
                  trace_summary: Mapping[str, Any] | None = None,
                  telemetry: Mapping[str, float] | None = None,
                  tp1_tpot_ms: float | None = None) -> Evidence:
    """Evidence for one trial: from a finished `RunResult` (its trace summary, telemetry,
    engine info and last measured level), or mid-run from its `StepMetrics` so far (then only
    metrics, config and roofline; `trace_summary`, `telemetry` and `engine` may add more).
    The operating point is the last level that completed a request. Pure."""
    if isinstance(result, RunResult):
        steps: Sequence[StepMetrics] = result.steps
        engine = engine or result.engine
        trace_summary = trace_summary if trace_summary is not None else result.trace_summary
        telemetry = telemetry if telemetry is not None else result.telemetry
    elif isinstance(result, StepMetrics):
        steps = (result,)
    else:
        steps = result
    measured = [s for s in steps if s.metrics.completed > 0]
    # The operating point: the level that served the most requests per second, the latest of
    # equals (a capacity search's probes are not in load order). Not the one closest to a
    # ceiling: a light level of small decode batches streams weights all the time and would
    # call a prefill-heavy trial memory-bound.
    step = max(reversed(measured), key=lambda s: _finite(s.metrics.request_throughput) or 0.0,
               default=None)
    mix = step_roofline(step, config, hardware, model) if step is not None else None
    trace = trace_summary or {}
    tel = telemetry or {}
    server = step.server_metrics if step is not None else {}
    tp = config.tensor_parallel_size

    preemptions = _finite(server.get("num_preemptions"))
    if preemptions is None:
        preemptions = _finite(server.get("vllm:num_preemptions_total"))
    rising = _finite(server.get("is_waiting_rising"))

    tpot_ms = decode_batch = context = None
    if step is not None:
        m = step.metrics
        tpot_ms = _positive(m.median_tpot_ms)
        mean_tpot = _positive(m.mean_tpot_ms)
        # Little's law on decode: each running sequence gives one token per step. Data-parallel
        # replicas share the load: the roofline is one replica's, so is its batch.
        if mean_tpot is not None and m.output_throughput > 0:
            decode_batch = m.output_throughput * mean_tpot / 1e3
            running = _positive(server.get("max_num_requests_running"))
            if running is not None:
                decode_batch = min(decode_batch, running)
            decode_batch /= config.data_parallel_size
        context = (m.total_input_tokens + m.total_output_tokens / 2) / m.completed

    weight_bytes = flops_per_token = kv_per_token = None
    kv_dtype = str(config.flags.get("kv_cache_dtype") or "auto").lower()
    if model is not None:
        lm_head = model.vocab_size * model.hidden_size
        embeddings = lm_head * (1 if model.tie_word_embeddings else 2)
        linear = max(model.num_params - embeddings, 0)
        # The LM head stays in bf16 under vLLM's fp8 and is read whole each step; the input
        # embedding is a gather of a few rows, left out.
        weight_bytes = linear * _bytes_per_param(config, model) + lm_head * 2.0
        flops_per_token = 2.0 * (linear + lm_head)
        kv_per_token = model.kv_bytes_per_token(1.0 if kv_dtype.startswith("fp8") else 2.0)
    elif engine is not None and engine.model_memory_gib:
        weight_bytes = engine.model_memory_gib * GIB * tp  # the log's figure is per GPU

    bandwidth = peak = None
    if hardware is not None:
        bandwidth = _positive(hardware.memory_bandwidth_gbps)
        is_fp8 = is_fp8_weights(config, model) and hardware.fp8_tflops > 0
        peak = _positive(hardware.fp8_tflops if is_fp8 else hardware.bf16_tflops)

    in_flight = None
    if step is not None and step.metrics.mean_e2el_ms > 0:
        in_flight = step.metrics.request_throughput * step.metrics.mean_e2el_ms / 1e3
    jit = engine.num_runtime_jit_compiles if engine is not None else None
    eager = config.flags.get("enforce_eager")
    return Evidence(
        gemm_share=_finite(trace.get("gemm_share")),
        attention_share=_finite(trace.get("attention_share")),
        communication_share=_finite(trace.get("communication_share")),
        gpu_busy_fraction=_finite(trace.get("gpu_busy_fraction")),
        median_gap_us=_finite(trace.get("median_gap_us")),
        # NVML over the operating level where the runner sampled it, else over the whole run.
        gpu_util_mean_pct=_finite(server.get("gpu_util_mean_pct"))
        if _finite(server.get("gpu_util_mean_pct")) is not None
        else _finite(tel.get("gpu_util_mean_pct")),
        mem_util_mean_pct=_finite(tel.get("mem_util_mean_pct")),
        power_mean_w=_finite(tel.get("power_mean_w")),
        sm_clock_mean_mhz=_finite(tel.get("sm_clock_mean_mhz")),
        sm_clock_min_mhz=_finite(tel.get("sm_clock_min_mhz")),
        max_kv_cache_usage_perc=_finite(server.get("max_kv_cache_usage_perc")),
        max_num_requests_waiting=_finite(server.get("max_num_requests_waiting")),
        num_preemptions=preemptions,
        is_waiting_rising=None if rising is None else rising > 0,
        decode_batch=decode_batch,
        context_tokens=context,
        tpot_ms=tpot_ms,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        flops_per_token=flops_per_token,
        memory_bandwidth_gbps=bandwidth,
        peak_tflops=peak,
        tensor_parallel_size=tp,
        tp1_tpot_ms=_positive(tp1_tpot_ms),
        is_enforce_eager=None if eager is None else _is_true(eager),
        compute_utilization=mix.compute_utilization if mix else None,
        bandwidth_utilization=mix.bandwidth_utilization if mix else None,
        prefill_flop_share=mix.prefill_flop_share if mix else None,
        kv_read_share=mix.kv_read_share if mix else None,
        prefill_tokens_per_s=mix.prefill_tokens_per_s if mix else None,
        decode_tokens_per_s=mix.decode_tokens_per_s if mix else None,
        vllm_compute_utilization=mix.vllm_compute_utilization if mix else None,
        vllm_bandwidth_utilization=mix.vllm_bandwidth_utilization if mix else None,
        requests_in_flight=in_flight,
        num_runtime_jit_compiles=None if jit is None else float(jit),
        is_fp8_weights=is_fp8_weights(config, model),
        is_fp8_kv=is_fp8_kv(config),
    )


# --- the conclusion -----------------------------------------------------------------------------

_ADVICE: Final[Mapping[Label, str]] = {
    "communication-bound": "prefer a smaller tensor_parallel_size (replicas instead)",
    "at-physical-limit": "this is the hardware's limit for this batch; stop tuning this config",
    "unknown": "profile the trial to tell",
}


def advice(verdict: Verdict, *,
           config: EngineConfig | Mapping[str, Any] | None = None) -> str:
    """What to do next, given the verdict; never what the config already does. `config` (an
    `EngineConfig` or its flags) adds what the verdict's evidence does not say (quantization
    method, memory utilisation, max_num_seqs); without it the evidence's fp8/eager facts rule
    out the levers already pulled."""
    flags: Mapping[str, Any] = {}
    if isinstance(config, EngineConfig):
        flags = config.flags
    elif config is not None:
        flags = config
    ev = verdict.evidence
    quantization = str(flags.get("quantization") or "").lower()
    fp8_weights = ev.get("is_fp8_weights") == 1.0 or quantization in FP8_WEIGHT_METHODS
    kv_dtype = str(flags.get("kv_cache_dtype") or "").lower()
    fp8_kv = ev.get("is_fp8_kv") == 1.0 or kv_dtype.startswith("fp8")
    eager = ev.get("is_enforce_eager") == 1.0 or _is_true(flags.get("enforce_eager") or False)
    label = verdict.label
    if label == "launch-bound":
        if eager:
            return "keep CUDA graphs on"
        if (ev.get("num_runtime_jit_compiles") or 0) > 0:
            fix = ("use quantization fp8 (precompiled kernels) instead of "
                   f"{quantization}" if quantization.startswith("fp8_per") else
                   "warm up the shapes it serves or pick kernels that need no compile")
            return f"kernels were JIT-compiled while serving: {fix}"
        return "cut host overhead: CUDA graph capture sizes covering the batch, scheduling"
    if label == "compute-bound":
        if not fp8_weights:
            return "fewer FLOPs per token at the same rate: fp8 weights (quantization fp8)"
        return ("only fewer prefill FLOPs help now: prefix caching of shared prompts, "
                "shorter prompts, or more GPUs (data_parallel_size)")
    if label == "memory-bound":
        levers = []
        if not fp8_weights:
            levers.append("fp8 weights (quantization fp8)")
        # fp8 KV halves only the KV part of the bytes: named where that part is worth it.
        if not fp8_kv and ev.get("kv_read_share", 1.0) >= 0.1:
            levers.append("an fp8 KV cache (kv_cache_dtype fp8)")
        if levers:
            return "read fewer bytes per token: " + " or ".join(levers)
        return ("read the weights for more sequences per step (a larger max_num_seqs where "
                "the KV cache has room) or add replicas (data_parallel_size)")
    if label == "kv-capacity-bound":
        levers = []
        if not fp8_kv:
            levers.append("kv_cache_dtype fp8")
        gmu = flags.get("gpu_memory_utilization")
        if gmu is None or float(gmu) < 0.95:
            levers.append("a higher gpu_memory_utilization")
        if not fp8_weights:
            levers.append("fp8 weights (more memory left for KV)")
        levers.append("a smaller max_num_seqs")
        return "give the KV cache room: " + ", ".join(levers)
    if label == "unknown" and ev.get("gpu_busy_fraction") is not None:
        return "compare kernel times with a faster config at this load"
    return _ADVICE[label]


def sentence(params_change: str | Mapping[str, Any], metric_change: str,
             verdict: Verdict) -> str:
    """"change -> metric -> conclusion" in one line, e.g. `enforce_eager=True: TPOT p99 18.8 ms
    (+165% vs best): launch-bound (GPU busy 19% of the kernel span); keep CUDA graphs on.`"""
    change = params_change if isinstance(params_change, str) else ", ".join(
        f"{k}={v}" for k, v in params_change.items())
    head = f"{change}: " if change else ""
    metric = f"{metric_change}: " if metric_change else ""
    detail = f" ({verdict.detail})" if verdict.detail else ""
    return f"{head}{metric}{verdict.label}{detail}; {advice(verdict)}."

