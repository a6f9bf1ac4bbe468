"""A `vllm bench serve` run replayed through the scheduler in virtual time, without sleeping
(`simulate_benchmark`): the model's answer to the calibration set, checked by tests in
milliseconds. Figures are a model's, never a measurement."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from runners.simulated.mfu import vllm_mfu_estimate
from runners.simulated.performance import PerformanceModel
from runners.simulated.scheduler import Scheduler, SimRequest, block_hashes


@dataclass(frozen=True)
class BenchmarkEstimate:
    """What `vllm bench serve` would report for a closed-loop run, in the model's virtual time."""

    num_requests: int
    duration_s: float
    output_throughput: float  # tokens/s
    mean_ttft_ms: float
    median_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    p99_tpot_ms: float
    num_preemptions: int
    per_request: tuple[tuple[float, float], ...] = field(default=(), repr=False)  # (ttft, tpot)
    # What the engine's /metrics counters would have grown by over the run (vLLM's names).
    counters: Mapping[str, float] = field(default_factory=dict, repr=False)
    total_input_tokens: int = 0  # of the finished requests
    total_output_tokens: int = 0
    mean_e2el_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    request_throughput: float = 0.0  # requests/s
    request_goodput: float | None = None  # requests/s meeting the SLO; None without one


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def simulate_benchmark(model: PerformanceModel, *, input_len: int, output_len: int,
                       max_concurrency: int | None, num_requests: int,
                       noise_sigma: float = 0.0, seed: int = 0,
                       prompts: Iterable[Sequence[int]] | None = None,
                       request_rate_rps: float | None = None,
                       input_len_range: tuple[int, int] | None = None,
                       slo_ttft_p99_ms: float | None = None,
                       slo_tpot_p99_ms: float | None = None) -> BenchmarkEstimate:
    """Replay a `vllm bench serve` run through the scheduler in virtual time (no sleeping): the
    model's answer to the calibration set.

    Closed loop at `max_concurrency` by default; with `request_rate_rps`, Poisson arrivals
    (seeded) capped at `max_concurrency` when that is set too. `input_len_range` (low, high)
    draws each prompt's length uniformly (seeded) instead of `input_len`. With an SLO bound the
    estimate carries goodput, counted per request as vLLM does."""
    rng = random.Random(seed)
    arrival_rng = random.Random(seed + 1)
    scheduler = Scheduler(model)
    prompt_iter = iter(prompts) if prompts is not None else None
    now = 0.0
    submitted = 0
    in_flight = 0
    finished: list[SimRequest] = []
    cap = max_concurrency if max_concurrency is not None else num_requests
    arrivals: deque[float] = deque()
    if request_rate_rps is not None:
        at = 0.0
        for _ in range(num_requests):
            arrivals.append(at)
            at += arrival_rng.expovariate(request_rate_rps)

    def submit(arrival_s: float) -> None:
        nonlocal submitted, in_flight
        hashes: tuple[int, ...] = ()
        length = input_len
        if prompt_iter is not None:
            ids = next(prompt_iter)
            length = len(ids)
            hashes = block_hashes(ids, model.block_size)
        elif input_len_range is not None:
            length = arrival_rng.randint(*input_len_range)
        scheduler.add(SimRequest(f"r{submitted}", length, output_len, arrival_s, hashes))
        submitted += 1
        in_flight += 1

    def submit_due() -> None:
        if request_rate_rps is None:
            while submitted < num_requests and in_flight < cap:
                submit(now)
            return
        while arrivals and arrivals[0] <= now and in_flight < cap:
            submit(arrivals.popleft())

    submit_due()
    counters = dict.fromkeys((
        "vllm:prompt_tokens_total", "vllm:prompt_tokens_cached_total",
        "vllm:generation_tokens_total", "vllm:iteration_tokens_total_count",
        "vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
        "vllm:estimated_write_bytes_per_gpu_total"), 0.0)
    while scheduler.has_work or arrivals:
        if not scheduler.has_work:  # open loop, idle: jump to the next arrival
            now = max(now, arrivals[0])
            submit_due()
            continue
        plan = scheduler.schedule(now)
        next_admissible_s = scheduler.next_admissible_s()
        if plan is None and next_admissible_s is not None and next_admissible_s > now:
            now = next_admissible_s  # idle while the next request is on its way in
            submit_due()
            continue
        if plan is None:
            raise RuntimeError("scheduler stalled: a request does not fit the KV cache")
        estimate = vllm_mfu_estimate(model, [
            (take, request.num_computed_tokens + take, take > 1 or request.num_output_tokens == 0)
            for request, take in plan.scheduled])
        counters["vllm:iteration_tokens_total_count"] += 1
        counters["vllm:estimated_flops_per_gpu_total"] += estimate.flops
        counters["vllm:estimated_read_bytes_per_gpu_total"] += estimate.read_bytes
        counters["vllm:estimated_write_bytes_per_gpu_total"] += estimate.write_bytes
        step = plan.breakdown.total_s
        if noise_sigma > 0:
            step *= rng.lognormvariate(0.0, noise_sigma)
        now += step
        for event in scheduler.complete(plan, now):
            counters["vllm:generation_tokens_total"] += event.num_tokens
            if event.is_first:
                counters["vllm:prompt_tokens_total"] += event.request.num_prompt_tokens
                counters["vllm:prompt_tokens_cached_total"] += event.request.num_cached_tokens
            if event.is_finished:
                finished.append(event.request)
                in_flight -= 1
        submit_due()
    per_request: list[tuple[float, float]] = []
    for request in finished:
        if request.first_token_s is None or request.finished_s is None:
            continue
        ttft = request.first_token_s - request.arrival_s
        decode = request.finished_s - request.first_token_s
        tpot = decode / (request.max_tokens - 1) if request.max_tokens > 1 else 0.0
        per_request.append((ttft, tpot))
    ttfts = [t * 1e3 for t, _ in per_request]
    tpots = [t * 1e3 for _, t in per_request]
    goodput: float | None = None
    if slo_ttft_p99_ms is not None or slo_tpot_p99_ms is not None:
        num_good = sum(
            (slo_ttft_p99_ms is None or ttft <= slo_ttft_p99_ms)
            and (slo_tpot_p99_ms is None or tpot <= slo_tpot_p99_ms)
            for ttft, tpot in zip(ttfts, tpots, strict=True))
        goodput = num_good / now if now > 0 else 0.0
    return BenchmarkEstimate(
        num_requests=len(finished),
        duration_s=now,
        p99_ttft_ms=_quantile(ttfts, 0.99),
        request_throughput=len(finished) / now if now > 0 else 0.0,
        request_goodput=goodput,
        output_throughput=len(finished) * output_len / now if now > 0 else 0.0,
        mean_ttft_ms=sum(ttfts) / len(ttfts),
        median_ttft_ms=_quantile(ttfts, 0.5),
        mean_tpot_ms=sum(tpots) / len(tpots),
        median_tpot_ms=_quantile(tpots, 0.5),
        p99_tpot_ms=_quantile(tpots, 0.99),
        num_preemptions=scheduler.stats.num_preemptions,
        per_request=tuple(per_request),
        counters=counters,
        total_input_tokens=sum(r.num_prompt_tokens for r in finished),
        total_output_tokens=sum(r.max_tokens for r in finished),
        mean_e2el_ms=sum((r.finished_s or 0.0) - r.arrival_s for r in finished)
        / max(len(finished), 1) * 1e3,
    )
