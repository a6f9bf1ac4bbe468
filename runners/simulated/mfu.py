"""What vLLM 0.26's `--enable-mfu-metrics` estimator counts for one step (`vllm_mfu_estimate`):
its analytic FLOPs and bytes per GPU, with its own conventions, so the simulated engine's
counters compare with a real engine's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from runners.simulated.performance import PerformanceModel

# Quantization names vLLM 0.26's estimator knows (vllm/v1/metrics/perf.py), with their bytes per
# weight; any other method (the online shorthands `fp8_per_tensor/_block/_channel` report the
# name "online") makes it drop the attention and MLP parts and count the unembedding alone.
VLLM_MFU_WEIGHT_BYTES: Mapping[str, float] = {
    "fp8": 1.0, "fbgemm_fp8": 1.0, "ptpc_fp8": 1.0, "modelopt": 1.0, "awq": 0.5,
    "awq_marlin": 0.5, "gptq": 0.5, "gptq_marlin": 0.5, "bitsandbytes": 0.5,
    "compressed-tensors": 0.5}
_ACTIVATION_BYTES = 2  # vLLM's estimator assumes bf16 activations


@dataclass(frozen=True)
class PerfEstimate:
    """One step as vLLM's `--enable-mfu-metrics` counts it, per GPU (a model of its counters)."""

    flops: float
    read_bytes: float
    write_bytes: float


def vllm_mfu_estimate(model: PerformanceModel, scheduled: Sequence[tuple[int, int, bool]],
                      data_parallel_size: int = 1) -> PerfEstimate:
    """What vLLM 0.26's analytic estimator adds to its MFU counters for one step of a dense or
    MoE model (vllm/v1/metrics/perf.py `FfnMetrics`: top-k token rows through the experts,
    min(rows, experts) experts' weights read): `scheduled` holds (tokens, context length after
    the step, is_prefill) per request.
    Its own conventions are kept, so the counters compare with a real engine's: a prefill token
    is charged attention over the whole context (no causal half), the MLP is split over
    TP x DP, and an unknown quantization method leaves only the unembedding counted."""
    m, tp = model.model, model.tensor_parallel_size
    layers, hidden, head_dim = m.num_hidden_layers, m.hidden_size, m.head_dim
    q = max(1, m.num_attention_heads // tp)
    kv = max(1, m.num_key_value_heads // tp)
    inter = m.intermediate_size // (tp * data_parallel_size)
    vocab = m.vocab_size // tp
    act = _ACTIVATION_BYTES
    cache = model.kv_dtype_bytes
    method = model.quantization
    weight = model.weight_bytes_per_param if method is None \
        else VLLM_MFU_WEIGHT_BYTES.get(method, 0.0)
    tokens = sum(n for n, _, _ in scheduled)
    token_context = sum(n * c for n, c, _ in scheduled)
    prefill_tokens = sum(n for n, _, p in scheduled if p)
    prefill_context = sum(c for _, c, p in scheduled if p)
    decode_tokens = sum(n for n, _, p in scheduled if not p)
    decode_context = sum(c for _, c, p in scheduled if not p)
    logit_rows = sum(1 for _, _, p in scheduled if p) + decode_tokens
    flops = 2.0 * logit_rows * hidden * vocab
    read = float(logit_rows * hidden * act + hidden * vocab * 2)
    write = float(logit_rows * vocab * act)
    if weight > 0:  # attention and MLP parts (absent for a method vLLM does not know)
        flops += layers * (2 * tokens * hidden * (q + 2 * kv) * head_dim
                           + 4 * q * token_context * head_dim + 2 * tokens * hidden * q * head_dim)
        read += layers * (tokens * hidden * act + hidden * (q + 2 * kv) * head_dim * weight
                          + (prefill_tokens * q + 2 * prefill_context * kv) * head_dim * act
                          + decode_tokens * q * head_dim * act
                          + 2 * decode_context * kv * head_dim * cache
                          + tokens * q * head_dim * act + q * head_dim * hidden * weight)
        write += layers * (tokens * (q + 2 * kv) * head_dim * act
                           + 2 * tokens * kv * head_dim * cache + tokens * hidden * act)
        # The MLP: dense, or vLLM's routed experts (every layer counted as MoE, routing
        # perfectly balanced, shared experts only where the config says `n_shared_experts`:
        # none in the families modelled, so Qwen2-MoE's shared expert goes uncounted).
        rows, width = tokens, inter  # token rows through the MLP, and the MLP's width
        weight_rows = float(inter)  # the width's worth of weights read
        if m.num_experts > 0:
            rows = tokens * m.num_experts_per_tok
            width = m.moe_intermediate_size // (tp * data_parallel_size)
            weight_rows = float(width * min(rows, m.num_experts))
        flops += layers * 6 * hidden * width * rows
        read += layers * (rows * hidden * act + 3 * hidden * weight_rows * weight
                          + 3 * rows * width * act)
        write += layers * (3 * rows * width * act + rows * hidden * act)
    return PerfEstimate(flops=flops, read_bytes=read, write_bytes=write)
