"""The figures of one load level, as vLLM's `calculate_metrics` computes them
(`compute_metrics`), and the gap between the client's and the server's prompt counts."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from runners.base import BenchmarkMetrics
from runners.loadgen.client import RequestOutput
from runners.workload import SLO

logger = logging.getLogger(__name__)

_MS_PER_S = 1000.0


def _stats_ms(values_s: list[float]
              ) -> tuple[float | None, float | None, float | None, float | None, float | None]:
    """mean, median, std, p90, p99 in ms (numpy's linear percentiles, as vLLM's); all None for
    no sample, where vLLM's `values or 0` writes 0 ms: an undefined figure is not a fast one."""
    if not values_s:
        return None, None, None, None, None
    return (
        float(np.mean(values_s)) * _MS_PER_S,
        float(np.median(values_s)) * _MS_PER_S,
        float(np.std(values_s)) * _MS_PER_S,
        float(np.percentile(values_s, 90)) * _MS_PER_S,
        float(np.percentile(values_s, 99)) * _MS_PER_S,
    )


def tpot_s(out: RequestOutput) -> float | None:
    """A successful request's time per output token after the first, s, as vLLM computes it;
    None with a single token (vLLM's goodput then takes it as 0)."""
    output_len = out.output_tokens or 1
    return (out.latency_s - out.ttft_s) / (output_len - 1) if output_len > 1 else None


def compute_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    slo: SLO,
    *,
    max_concurrency_seen: int = 0,
) -> BenchmarkMetrics:
    """The figures of one level, as vLLM's `calculate_metrics` computes them.

    Only successful requests count. TPOT per request is (latency - ttft) / (output_tokens - 1)
    when output_tokens > 1; a request meets the SLO when each set bound holds for it (its TPOT
    taken as 0 with a single token, as vLLM does). Goodput is None without an SLO. Unlike
    vLLM, a statistic with no sample (TPOT when every request produced one token) is None,
    not 0.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0 but got {duration_s}.")
    completed = 0
    total_input = 0
    total_output = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    all_tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for out in outputs:
        if not out.success:
            continue
        # vLLM without a tokenizer counts a success that reported no tokens as one token.
        output_len = out.output_tokens or 1
        total_output += output_len
        total_input += out.prompt_len
        tpot = tpot_s(out)
        if tpot is not None:
            tpots.append(tpot)
        all_tpots.append(tpot or 0.0)
        itls.extend(out.itl_s)
        ttfts.append(out.ttft_s)
        e2els.append(out.latency_s)
        completed += 1

    goodput: float | None = None
    if slo.is_set:
        bounds: list[tuple[list[float], float]] = [
            (values, bound_ms / _MS_PER_S)
            for values, bound_ms in ((ttfts, slo.ttft_p99_ms), (all_tpots, slo.tpot_p99_ms),
                                     (e2els, slo.e2el_ms))
            if bound_ms is not None
        ]
        num_good = sum(
            all(bound_s >= values[i] for values, bound_s in bounds) for i in range(completed)
        )
        goodput = num_good / duration_s

    if outputs and completed == 0:
        first_error = next((o.error for o in outputs if o.error), "")
        logger.warning("all %d requests failed; first error: %s", len(outputs), first_error)

    ttft = _stats_ms(ttfts)
    tpot_ms = _stats_ms(tpots)
    itl = _stats_ms(itls)
    e2el = _stats_ms(e2els)
    return BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=completed / duration_s,
        request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        mean_ttft_ms=ttft[0], median_ttft_ms=ttft[1], std_ttft_ms=ttft[2],
        p90_ttft_ms=ttft[3], p99_ttft_ms=ttft[4],
        mean_tpot_ms=tpot_ms[0], median_tpot_ms=tpot_ms[1], std_tpot_ms=tpot_ms[2],
        p90_tpot_ms=tpot_ms[3], p99_tpot_ms=tpot_ms[4],
        mean_itl_ms=itl[0], median_itl_ms=itl[1], std_itl_ms=itl[2],
        p90_itl_ms=itl[3], p99_itl_ms=itl[4],
        mean_e2el_ms=e2el[0], median_e2el_ms=e2el[1], std_e2el_ms=e2el[2],
        p90_e2el_ms=e2el[3], p99_e2el_ms=e2el[4],
        max_concurrency_seen=max_concurrency_seen,
        num_tpot_samples=len(tpots),
        num_itl_samples=len(itls),
    )


def prompt_len_gap(outputs: Sequence[RequestOutput]) -> dict[str, float]:
    """How far the load generator's prompt lengths are from the server's usage.prompt_tokens,
    over the successful requests where the server sent one: the mean of (server - client) and
    the largest gap, in tokens. Counted with the model's tokenizer they agree (special tokens
    included); an estimate (UTF-8 bytes / 4) shows its error here. Empty where the server sent
    none."""
    gaps = [o.server_prompt_len - o.client_prompt_len for o in outputs
            if o.success and o.server_prompt_len is not None]
    if not gaps:
        return {}
    return {"prompt_tokens_server_minus_client_mean": float(np.mean(gaps)),
            "prompt_tokens_server_minus_client_max_abs": float(max(abs(g) for g in gaps))}
