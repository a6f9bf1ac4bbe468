"""The roofline of a level: the decode step's two terms (`roofline_terms`) and the measured
prefill/decode step mix against the card's FLOP and bandwidth ceilings (`step_roofline`, per
level `level_metrics`). Pure; docs/bottleneck.md, "Roofline", explains the arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from optimizer.bottleneck.memory_fit import bytes_per_param, is_fp8_weights
from runners import prometheus
from runners.base import EngineConfig, StepMetrics
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from search_spaces.engine.facts import EngineFlags


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
    KV of every computed token written (by KV dtype). Of an MoE model, the FLOPs are those of
    the experts a token is routed to and the bytes those of the experts a step's tokens touch
    (`ModelInfo.experts_read`, uniform routing: an upper estimate). Activations are left out."""
    m = step.metrics
    if model is None or hardware is None or m.completed <= 0 or not m.duration_s > 0:
        return None
    bandwidth = positive(hardware.memory_bandwidth_gbps)
    bf16 = positive(hardware.bf16_tflops)
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
    lm_head = model.lm_head_params
    linear = model.active_linear_params  # of an MoE model, the experts a token is routed to
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
        mean_tpot = positive(m.mean_tpot_ms)
        if mean_tpot is None or decode_tps_per_replica <= 0:
            return None
        batch = decode_tps_per_replica * mean_tpot / 1e3  # sequences per decode step
        steps = decode_tps_per_replica / max(batch, 1.0)
    # Of an MoE model a step reads the experts its tokens are routed to (`experts_read`).
    tokens_per_step = (prefill_tps + decode_tps) / dp / steps if steps > 0 else 1.0
    weight_bytes = model.weight_bytes_read(bytes_per_param(config, model), tokens_per_step)
    kv_per_token = model.kv_bytes_per_token(EngineFlags(config.flags).kv_bytes_per_element)
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


def finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def positive(value: object) -> float | None:
    v = finite(value)
    return v if v is not None and v > 0 else None
