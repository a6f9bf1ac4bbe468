"""What `classify` may use (`Evidence`) and how one trial's is gathered: `evidence_from` a
finished `RunResult` or the `StepMetrics` measured so far, with the config, hardware and model."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from optimizer.bottleneck.memory_fit import GIB, bytes_per_param, is_fp8_kv, is_fp8_weights
from optimizer.bottleneck.roofline import (
    Roofline,
    finite,
    positive,
    roofline_terms,
    step_roofline,
)
from optimizer.results.objectives import described_step, is_capacity_search
from runners.base import EngineConfig, EngineInfo, RunResult, StepMetrics
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from search_spaces.engine.facts import EngineFlags, vllm_scheduler_defaults
from search_spaces.engine.tables import DEFAULT_VERSION, bundled_for


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
    # The most requests one engine (data-parallel replica) ran at once over the level: the
    # server gauge's maximum over the window, divided by data_parallel_size. Beside
    # `max_num_seqs` it tells whether the batch reached its cap or followed the load.
    max_num_requests_running: float | None = None
    # The cap on that batch, per replica: the config's max_num_seqs, else vLLM's default for
    # this card and release (`vllm_scheduler_defaults`); None where neither is known.
    max_num_seqs: float | None = None
    # Decode roofline inputs.
    decode_batch: float | None = None  # sequences per decode step
    context_tokens: float | None = None  # mean tokens per sequence whose KV a step reads
    tpot_ms: float | None = None  # measured time per decode step (median TPOT)
    weight_bytes: float | None = None  # what one decode step of decode_batch reads
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
    # Prefix caching on: the config's enable_prefix_caching, else the release's default (on in
    # vLLM 0.26 for a generation model); None where neither is known.
    is_prefix_caching: bool | None = None
    # The card has fp8 tensor cores (its fp8 FLOP ceiling is above the bf16 one): fp8 weights
    # raise the FLOP ceiling the level is measured against.
    is_fp8_capable: bool | None = None
    window_s: float | None = None  # the level's measured window (its duration), seconds
    # Which load all of the above describes (`objectives.described_step`): "9.9 req/s",
    # "concurrency 32"; "" where no level was measured.
    load: str = ""
    # True: the trial's operating point, the highest load that met the SLO; False: no load met
    # it, so the lightest probed (which missed it); None: fixed load levels (no SLO verdict).
    is_within_slo: bool | None = None
    # The profiled window's load as the runner recorded it (`trace_summary["profile.*"]`,
    # runners/capacity/profile_window.py): "9.9 req/s", "concurrency 16"; "" where not said.
    profile_load: str = ""
    # True: a window of the capacity search's own stream at the operating point, in steady
    # state; False: a batch of its own after the levels; None: not said.
    is_profile_in_stream: bool | None = None

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


def is_true(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def is_prefix_caching(flags: Mapping[str, object], version: str = DEFAULT_VERSION) -> bool | None:
    """Whether vLLM caches prompt prefixes under these flags: `enable_prefix_caching` (or
    `no_enable_prefix_caching`) where set, else the release's default from its bundled flag
    table (on in 0.26: vLLM turns it on for a generation model); None where the table has
    none for `version` or leaves the default to start-up."""
    if flags.get("no_enable_prefix_caching") is not None and \
            is_true(flags["no_enable_prefix_caching"]):
        return False
    flag = flags.get("enable_prefix_caching")
    if flag is not None:
        return is_true(flag)
    table = bundled_for(version)
    default = table.defaults.get("enable-prefix-caching") if table is not None else None
    return None if default is None else is_true(default)


def evidence_from(result: RunResult | StepMetrics | Sequence[StepMetrics],
                  config: EngineConfig, hardware: HardwareProfile | None = None,
                  model: ModelInfo | None = None, *, engine: EngineInfo | None = None,
                  trace_summary: Mapping[str, Any] | None = None,
                  telemetry: Mapping[str, float] | None = None,
                  tp1_tpot_ms: float | None = None, objective: str | None = None) -> Evidence:
    """Evidence for one trial: from a finished `RunResult` (its trace summary, telemetry,
    engine info and last measured level), or mid-run from its `StepMetrics` so far (then only
    metrics, config and roofline; `trace_summary`, `telemetry` and `engine` may add more).
    The level it reads is the trial's operating point for `objective`
    (`objectives.described_step`: after a capacity search the highest load that met the SLO,
    else the lightest probed); with fixed levels and no objective, the busiest level. Pure."""
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
    if objective is not None or is_capacity_search(measured):
        # The trial's operating point (the load its value and advice are for), or after a
        # search in which nothing met the SLO, the lightest load probed: never an overload
        # probe's queue and full KV cache.
        step = described_step(objective or "goodput", measured)
    else:
        # Fixed levels with no objective named: the level that served the most requests per
        # second, the latest of equals. Not the one closest to a ceiling: a light level of
        # small decode batches streams weights all the time and would call a prefill-heavy
        # trial memory-bound.
        step = max(reversed(measured),
                   key=lambda s: finite(s.metrics.request_throughput) or 0.0, default=None)
    mix = step_roofline(step, config, hardware, model) if step is not None else None
    trace = trace_summary or {}
    tel = telemetry or {}
    server = step.server_metrics if step is not None else {}
    tp = config.tensor_parallel_size

    preemptions = finite(server.get("num_preemptions"))
    if preemptions is None:
        preemptions = finite(server.get("vllm:num_preemptions_total"))
    rising = finite(server.get("is_waiting_rising"))

    running_max = positive(server.get("max_num_requests_running"))
    tpot_ms = decode_batch = context = None
    if step is not None:
        m = step.metrics
        tpot_ms = positive(m.median_tpot_ms)
        mean_tpot = positive(m.mean_tpot_ms)
        # Little's law on decode: each running sequence gives one token per step. Data-parallel
        # replicas share the load: the roofline is one replica's, so is its batch.
        if mean_tpot is not None and m.output_throughput > 0:
            decode_batch = m.output_throughput * mean_tpot / 1e3
            if running_max is not None:
                decode_batch = min(decode_batch, running_max)
            decode_batch /= config.data_parallel_size
        context = (m.total_input_tokens + m.total_output_tokens / 2) / m.completed

    weight_bytes = flops_per_token = kv_per_token = None
    if model is not None:
        # The weights one decode step reads (of an MoE model, the experts its batch is routed
        # to: `ModelInfo.experts_read`; one sequence's where the batch is not known) and the
        # FLOPs of the weights one token passes, the LM head included.
        weight_bytes = model.weight_bytes_read(bytes_per_param(config, model),
                                               max(decode_batch or 1.0, 1.0))
        flops_per_token = 2.0 * (model.active_linear_params + model.lm_head_params)
        kv_per_token = model.kv_bytes_per_token(EngineFlags(config.flags).kv_bytes_per_element)
    elif engine is not None and engine.model_memory_gib:
        weight_bytes = engine.model_memory_gib * GIB * tp  # the log's figure is per GPU

    bandwidth = peak = None
    if hardware is not None:
        bandwidth = positive(hardware.memory_bandwidth_gbps)
        is_fp8 = is_fp8_weights(config, model) and hardware.fp8_tflops > 0
        peak = positive(hardware.fp8_tflops if is_fp8 else hardware.bf16_tflops)

    in_flight = None
    mean_e2el_ms = positive(step.metrics.mean_e2el_ms) if step is not None else None
    if step is not None and mean_e2el_ms is not None:
        in_flight = step.metrics.request_throughput * mean_e2el_ms / 1e3
    jit = engine.num_runtime_jit_compiles if engine is not None else None
    eager = config.flags.get("enforce_eager")
    return Evidence(
        gemm_share=finite(trace.get("gemm_share")),
        attention_share=finite(trace.get("attention_share")),
        communication_share=finite(trace.get("communication_share")),
        gpu_busy_fraction=finite(trace.get("gpu_busy_fraction")),
        median_gap_us=finite(trace.get("median_gap_us")),
        # NVML over the operating level where the runner sampled it, else over the whole run.
        gpu_util_mean_pct=finite(server.get("gpu_util_mean_pct"))
        if finite(server.get("gpu_util_mean_pct")) is not None
        else finite(tel.get("gpu_util_mean_pct")),
        mem_util_mean_pct=finite(tel.get("mem_util_mean_pct")),
        power_mean_w=finite(tel.get("power_mean_w")),
        sm_clock_mean_mhz=finite(tel.get("sm_clock_mean_mhz")),
        sm_clock_min_mhz=finite(tel.get("sm_clock_min_mhz")),
        max_kv_cache_usage_perc=finite(server.get("max_kv_cache_usage_perc")),
        max_num_requests_waiting=finite(server.get("max_num_requests_waiting")),
        num_preemptions=preemptions,
        is_waiting_rising=None if rising is None else rising > 0,
        max_num_requests_running=None if running_max is None
        else running_max / config.data_parallel_size,
        max_num_seqs=_max_num_seqs(config, hardware, engine),
        decode_batch=decode_batch,
        context_tokens=context,
        tpot_ms=tpot_ms,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_per_token,
        flops_per_token=flops_per_token,
        memory_bandwidth_gbps=bandwidth,
        peak_tflops=peak,
        tensor_parallel_size=tp,
        tp1_tpot_ms=positive(tp1_tpot_ms),
        is_enforce_eager=None if eager is None else is_true(eager),
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
        is_prefix_caching=is_prefix_caching(
            config.flags, engine.engine_version if engine is not None and engine.engine_version
            else DEFAULT_VERSION),
        is_fp8_capable=hardware.fp8_tflops > hardware.bf16_tflops > 0
        if hardware is not None else None,
        window_s=positive(step.metrics.duration_s) if step is not None else None,
        load=_load_text(step) if step is not None else "",
        is_within_slo=step.meets_slo if step is not None else None,
        profile_load=_profile_load(trace) if trace else "",
        is_profile_in_stream=bool(trace["profile.is_in_stream"] and
                                  trace.get("profile.is_operating_point"))
        if trace and trace.get("profile.is_in_stream") is not None else None,
    )


def _max_num_seqs(config: EngineConfig, hardware: HardwareProfile | None,
                  engine: EngineInfo | None) -> float | None:
    """The batch cap one replica ran under: the config's max_num_seqs, else the default vLLM
    gives this card in the engine's release (the bundled table's where the log did not say)."""
    flag = positive(config.flags.get("max_num_seqs"))
    if flag is not None:
        return flag
    if hardware is None or not hardware.gpus:
        return None
    gpu = hardware.gpus[0]
    version = engine.engine_version if engine is not None and engine.engine_version \
        else DEFAULT_VERSION
    major, minor = gpu.compute_capability
    return float(vllm_scheduler_defaults(gpu.memory_gib, gpu.name, version,
                                         major + minor / 10)["max_num_seqs"])


def _profile_load(trace: Mapping[str, Any]) -> str:
    """The profiled window's load (`profile.request_rate_rps` or `profile.concurrency`)."""
    rate, concurrency = finite(trace.get("profile.request_rate_rps")), \
        finite(trace.get("profile.concurrency"))
    if rate is not None:
        return f"{rate:.3g} req/s"
    return f"concurrency {concurrency:g}" if concurrency is not None else ""


def _load_text(step: StepMetrics) -> str:
    """A level's offered load in a few characters: `9.9 req/s`, `concurrency 32`."""
    level = step.level
    if level.request_rate_rps is not None:
        return f"{level.request_rate_rps:.3g} req/s"
    if level.max_concurrency is not None:
        return f"concurrency {level.max_concurrency}"
    return level.label
