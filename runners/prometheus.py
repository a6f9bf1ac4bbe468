"""Reads an engine's Prometheus `/metrics` into flat `{vLLM sample name: value}` dicts, and
samples it in the background during a load level (queue growth, KV-cache pressure)."""

from __future__ import annotations

import functools
import logging
import math
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from runners.credentials import auth_headers

logger = logging.getLogger(__name__)

NUM_REQUESTS_RUNNING: Final = "vllm:num_requests_running"
NUM_REQUESTS_WAITING: Final = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC: Final = "vllm:kv_cache_usage_perc"  # 0-1
NUM_PREEMPTIONS: Final = "vllm:num_preemptions_total"
PROMPT_TOKENS: Final = "vllm:prompt_tokens_total"
GENERATION_TOKENS: Final = "vllm:generation_tokens_total"
PREFIX_CACHE_QUERIES: Final = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS: Final = "vllm:prefix_cache_hits_total"
# Prompt tokens served from a cache (local prefix cache + external KV), not computed: vLLM 0.26
# (vllm/v1/metrics/loggers.py). `PROMPT_TOKENS` counts every prompt token once, cached or not.
PROMPT_TOKENS_CACHED: Final = "vllm:prompt_tokens_cached_total"
# Speculative decoding (vLLM 0.26, vllm/v1/spec_decode/metrics.py): drafts proposed, draft tokens
# in them, and the draft tokens the target model accepted. Absent without a speculative method.
SPEC_DECODE_DRAFTS: Final = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_DRAFT_TOKENS: Final = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS: Final = "vllm:spec_decode_num_accepted_tokens_total"
# One observation per engine step that reached the API server: its count is the step count.
ITERATION_TOKENS_COUNT: Final = "vllm:iteration_tokens_total_count"
# `--enable-mfu-metrics` (vLLM 0.26, vllm/v1/metrics/perf.py): per-GPU analytic estimates of
# each step, summed over the data-parallel engines by `parse` (one label set per engine).
ESTIMATED_FLOPS: Final = "vllm:estimated_flops_per_gpu_total"
ESTIMATED_READ_BYTES: Final = "vllm:estimated_read_bytes_per_gpu_total"
ESTIMATED_WRITE_BYTES: Final = "vllm:estimated_write_bytes_per_gpu_total"

# Cumulative series: a delta over a window means something; a gauge's does not.
_CUMULATIVE_SUFFIXES: Final = ("_total", "_sum", "_count")


def parse(text: str, prefix: str = "vllm:") -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over labels}.

    Keys are the sample names vLLM exposes: counters keep `_total` (prometheus_client strips it
    from the family name only), histograms and summaries give `<name>_sum` and `<name>_count`
    (buckets are dropped), `_created` timestamps are dropped. Fractions (`*_perc`) take the
    largest value instead of the sum: with several engines (data parallel) the fullest KV
    cache is the one that preempts. Only families whose name starts with `prefix` are kept.
    Raises ValueError on malformed text.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix):
            continue
        if family.type in ("histogram", "summary", "gaugehistogram"):
            keep: tuple[str, ...] = (family.name + "_sum", family.name + "_count")
        elif family.type in ("info", "stateset"):
            continue
        else:
            keep = ()
        for sample in family.samples:
            name = sample.name
            if name.endswith("_created") or (keep and name not in keep):
                continue
            value = float(sample.value)
            if name not in values:
                values[name] = value
            elif name.endswith("_perc"):
                values[name] = max(values[name], value)
            else:
                values[name] += value
    return values


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """httpx's default context, made once: each client would load the CA bundle again (20 ms of
    CPU), and a step makes three (its poller, and the scrapes before and after its window)."""
    return httpx.create_ssl_context()


def scrape(
    base_url: str, client: httpx.Client | None = None, timeout_s: float = 5.0,
    api_key: str | None = None,
) -> dict[str, float]:
    """GET `<base_url>/metrics` and `parse` it; {} (logged) when the server cannot be read.

    Never raises: a missing scrape must not fail a measurement.
    """
    url = base_url.rstrip("/") + "/metrics"
    try:
        if client is None:
            with httpx.Client(timeout=timeout_s, trust_env=False, verify=_ssl_context(),
                              headers=auth_headers(api_key)) as own_client:
                response = own_client.get(url)
        else:
            response = client.get(url, timeout=timeout_s)
        if response.status_code != 200:
            logger.warning("GET %s answered HTTP %d; no server metrics this time",
                           url, response.status_code)
            return {}
        return parse(response.text)
    except httpx.HTTPError as exc:
        logger.warning("could not read %s (%s); no server metrics this time", url, exc)
    except ValueError as exc:
        logger.warning("%s is not Prometheus text (%s); no server metrics this time", url, exc)
    return {}


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Growth of every cumulative series (`_total`, `_sum`, `_count`) present in both scrapes.

    A series that went down was reset (the engine restarted): its growth is its new value, as
    Prometheus' `increase()` takes it. Gauges are left out.
    """
    out: dict[str, float] = {}
    for name, new in after.items():
        if not name.endswith(_CUMULATIVE_SUFFIXES) or name not in before:
            continue
        old = before[name]
        out[name] = new - old if new >= old else new
    return out


class MetricsPoller:
    """Samples `/metrics` every `interval_s` on a daemon thread during one load level.

    `start()` takes the first sample at once; `stop()` takes a last one, joins the thread and
    returns the summary (see `summary`). One poller measures one level: make a new one for
    the next.
    """

    def __init__(self, base_url: str, interval_s: float = 1.0, *, timeout_s: float = 5.0,
                 min_rise_requests: float = 1.0,
                 saturated: threading.Event | None = None,
                 saturation_rise_requests: float = 16.0,
                 api_key: str | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 but got {interval_s}.")
        self.base_url = base_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.api_key = api_key  # the engine's, sent as a bearer token
        self.min_rise_requests = min_rise_requests  # least rise of the waiting line to count
        # Set, when given, once the queue has grown by `saturation_rise_requests` over at least
        # five samples: the offered load is above what the engine serves and will not settle.
        self.saturated = saturated
        self.saturation_rise_requests = saturation_rise_requests
        self.samples: list[tuple[float, dict[str, float]]] = []  # (monotonic s, scrape)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("MetricsPoller.start() was called twice; make a new poller.")
        self._thread = threading.Thread(target=self._loop, name="metrics-poller", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        return self.summary()

    def __enter__(self) -> MetricsPoller:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _loop(self) -> None:
        with httpx.Client(timeout=self.timeout_s, trust_env=False, verify=_ssl_context(),
                          headers=auth_headers(self.api_key)) as client:
            while True:
                self._sample(client)
                if self._stop.wait(self.interval_s):
                    break
            # The end of the level decides whether the queue was still growing.
            self._sample(client)

    def _sample(self, client: httpx.Client) -> None:
        values = scrape(self.base_url, client=client, timeout_s=self.timeout_s)
        if values:
            self.samples.append((time.monotonic(), values))
            if self.saturated is not None and not self.saturated.is_set() and \
                    self._is_saturating():
                self.saturated.set()

    def _is_saturating(self) -> bool:
        points = [(t, s[NUM_REQUESTS_WAITING]) for t, s in self.samples[-10:]
                  if NUM_REQUESTS_WAITING in s]
        if len(points) < 5:
            return False
        times = np.array([t for t, _ in points]) - points[0][0]
        waiting = [w for _, w in points]
        slope = float(np.polyfit(times, waiting, 1)[0])
        return slope * float(times[-1]) >= self.saturation_rise_requests and \
            waiting[-1] >= self.saturation_rise_requests

    def summary(self) -> dict[str, float]:
        """`summarize` over the samples taken so far."""
        return summarize(self.samples, self.min_rise_requests)


def summarize(samples: Sequence[tuple[float, Mapping[str, float]]],
              min_rise_requests: float = 1.0) -> dict[str, float]:
    """Figures over /metrics samples (time, scrape), by name (absent when never reported):

    `num_samples`; `max_num_requests_running`, `max_num_requests_waiting`;
    `max_kv_cache_usage_perc`, `mean_kv_cache_usage_perc` (0-1); `waiting_slope_per_s`
    (least-squares slope of num_requests_waiting over time) and `is_waiting_rising`
    (1.0 when that line rises by at least `min_rise_requests` over the level, else 0.0):
    the queue grew, the offered load is above what the engine serves; `num_preemptions`
    and `prefix_cache_hit_rate` over the level, from the counters.
    """
    out: dict[str, float] = {"num_samples": float(len(samples))}
    if not samples:
        return out

    def series(name: str) -> tuple[list[float], list[float]]:
        points = [(t, s[name]) for t, s in samples if name in s]
        return [t for t, _ in points], [v for _, v in points]

    _, running = series(NUM_REQUESTS_RUNNING)
    if running:
        out["max_num_requests_running"] = max(running)
    _, kv = series(KV_CACHE_USAGE_PERC)
    if kv:
        out["max_kv_cache_usage_perc"] = max(kv)
        out["mean_kv_cache_usage_perc"] = float(np.mean(kv))
    times, waiting = series(NUM_REQUESTS_WAITING)
    if waiting:
        out["max_num_requests_waiting"] = max(waiting)
        span_s = times[-1] - times[0] if times else 0.0
        slope = 0.0
        if len(waiting) >= 2 and span_s > 0:
            slope = float(np.polyfit(np.array(times) - times[0], waiting, 1)[0])
        out["waiting_slope_per_s"] = slope
        # Three points at least: two say nothing about a trend against noise.
        is_rising = len(waiting) >= 3 and slope * span_s >= min_rise_requests
        out["is_waiting_rising"] = 1.0 if is_rising else 0.0
    growth = delta(samples[0][1], samples[-1][1])
    if NUM_PREEMPTIONS in growth:
        out["num_preemptions"] = growth[NUM_PREEMPTIONS]
    hit_rate = prefix_cache_hit_rate(growth)
    if hit_rate is not None:
        out["prefix_cache_hit_rate"] = hit_rate
    return out




def prefix_cache_hit_rate(growth: Mapping[str, float]) -> float | None:
    """Prefix-cache hits over queries (both in tokens) from counter growth over a window:
    vLLM 0.26's `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries` (vllm/v1/metrics/
    loggers.py:584-601; the local cache only, not `vllm:external_prefix_cache_*`). None when the
    engine counted no query (prefix caching off: vLLM then records no stats)."""
    queries = growth.get(PREFIX_CACHE_QUERIES)
    if queries is None or not math.isfinite(queries) or queries <= 0:
        return None
    hits = growth.get(PREFIX_CACHE_HITS, 0.0)
    return min(max(hits / queries, 0.0), 1.0) if math.isfinite(hits) else None


def spec_decode_acceptance(growth: Mapping[str, float]) -> dict[str, float]:
    """Speculative decoding over a window, as vLLM's own dashboard reads its counters
    (vllm/v1/spec_decode/metrics.py): `spec_decode_acceptance_rate` = accepted / draft tokens,
    `spec_decode_mean_acceptance_length` = 1 + accepted / drafts (tokens a verification step
    yields, the bonus token included). Empty without the counters (no speculative method);
    `spec_decode_num_drafts` 0 alone where they exist and no draft was proposed over the window
    (ngram proposes only where the output repeats the prompt)."""
    drafts = growth.get(SPEC_DECODE_DRAFTS)
    draft_tokens = growth.get(SPEC_DECODE_DRAFT_TOKENS)
    accepted = growth.get(SPEC_DECODE_ACCEPTED_TOKENS)
    values = (drafts, draft_tokens, accepted)
    if any(v is None or not math.isfinite(v) for v in values):
        return {}
    if not drafts or not draft_tokens:
        return {"spec_decode_num_drafts": float(drafts or 0.0)}
    assert drafts is not None and draft_tokens is not None and accepted is not None
    return {"spec_decode_acceptance_rate": min(max(accepted / draft_tokens, 0.0), 1.0),
            "spec_decode_mean_acceptance_length": 1.0 + max(accepted, 0.0) / drafts,
            "spec_decode_num_drafts": drafts}


@dataclass(frozen=True)
class LevelCounters:
    """What the engine did over one load level, from the growth of its counters (`delta`):
    every figure is None where the engine did not expose the counter."""

    prompt_tokens: float | None  # every prompt token of the requests that started
    cached_prompt_tokens: float | None  # of those, served from a cache (not computed)
    generation_tokens: float | None
    num_steps: float | None  # engine steps, summed over data-parallel engines
    estimated_flops_per_gpu: float | None  # vLLM's MFU estimate, summed over DP engines
    estimated_read_bytes_per_gpu: float | None
    estimated_write_bytes_per_gpu: float | None

    @property
    def computed_prompt_tokens(self) -> float | None:
        if self.prompt_tokens is None:
            return None
        return max(self.prompt_tokens - (self.cached_prompt_tokens or 0.0), 0.0)

    @property
    def has_mfu(self) -> bool:
        """vLLM filled its MFU counters (they exist but stay 0 without --enable-mfu-metrics)."""
        return bool(self.estimated_flops_per_gpu or self.estimated_read_bytes_per_gpu)


def level_counters(growth: Mapping[str, float]) -> LevelCounters:
    """`LevelCounters` from a level's counter growth (a step's `server_metrics`). Cached prompt
    tokens come from `vllm:prompt_tokens_cached_total` (vLLM 0.26), else from the prefix-cache
    hits (in tokens), which miss external KV transfers only."""

    def get(name: str) -> float | None:
        value = growth.get(name)
        if value is None or isinstance(value, bool):
            return None
        value = float(value)
        return value if math.isfinite(value) and value >= 0 else None

    cached = get(PROMPT_TOKENS_CACHED)
    if cached is None:
        cached = get(PREFIX_CACHE_HITS)
    return LevelCounters(
        prompt_tokens=get(PROMPT_TOKENS), cached_prompt_tokens=cached,
        generation_tokens=get(GENERATION_TOKENS), num_steps=get(ITERATION_TOKENS_COUNT),
        estimated_flops_per_gpu=get(ESTIMATED_FLOPS),
        estimated_read_bytes_per_gpu=get(ESTIMATED_READ_BYTES),
        estimated_write_bytes_per_gpu=get(ESTIMATED_WRITE_BYTES))
