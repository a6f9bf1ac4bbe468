"""The simulated engine's /metrics: vLLM's metric names, help texts and bucket edges on a private
registry (`EngineMetrics`), and how a step, its tokens and the schedulers' state count in them."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from runners.simulated.mfu import vllm_mfu_estimate
from runners.simulated.performance import PerformanceModel
from runners.simulated.scheduler import Scheduler, StepPlan, TokenEvent

# Bucket edges copied from vLLM 0.26's metrics so histogram quantiles compare like for like.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class EngineMetrics:
    """vLLM's /metrics names on a private registry (several engines may share a test process)."""

    def __init__(self, model_name: str, *, is_mfu_enabled: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("vllm:num_requests_running", "Requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix-cache queries, in tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS_S)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS_S)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS_S)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase.", REQUEST_BUCKETS_S)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          ITERATION_TOKEN_BUCKETS)
        # vLLM registers these only under --enable-mfu-metrics (vllm/v1/metrics/perf.py).
        self.mfu: tuple[Counter, Counter, Counter] | None = None
        if is_mfu_enabled:
            self.mfu = (
                counter("vllm:estimated_flops_per_gpu", "Estimated number of floating point "
                        "operations per GPU (for Model Flops Utilization calculations)."),
                counter("vllm:estimated_read_bytes_per_gpu", "Estimated number of bytes read "
                        "from memory per GPU (for Model Flops Utilization calculations)."),
                counter("vllm:estimated_write_bytes_per_gpu", "Estimated number of bytes "
                        "written to memory per GPU (for Model Flops Utilization calculations)."))
        for metric in (self.running, self.waiting, self.kv_usage, self.preemptions,
                       self.prompt_tokens, self.prompt_tokens_cached, self.generation_tokens,
                       self.prefix_queries, self.prefix_hits, self.ttft, self.itl, self.e2e,
                       self.queue, self.iteration_tokens, *(self.mfu or ())):
            metric.labels(model_name=model_name)  # present from the start, as vLLM's are
        self.model_name = model_name
        self._reported_queries = 0  # prefix-cache tokens the counters hold already
        self._reported_hits = 0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def count_step(self, model: PerformanceModel, plan: StepPlan, *,
                   data_parallel_size: int) -> None:
        """A step about to be applied: its tokens, its preemptions and, with MFU metrics, what
        vLLM's estimator adds for it (per GPU, from what was scheduled, before it ran)."""
        name = self.model_name
        self.iteration_tokens.labels(model_name=name).observe(plan.num_tokens)
        if self.mfu is not None:
            estimate = vllm_mfu_estimate(
                model, [(take, request.num_computed_tokens + take,
                         take > 1 or request.num_output_tokens == 0)
                        for request, take in plan.scheduled],
                data_parallel_size=data_parallel_size)
            for counter, value in zip(self.mfu, (estimate.flops, estimate.read_bytes,
                                                 estimate.write_bytes), strict=True):
                counter.labels(model_name=name).inc(value)
        if plan.num_preempted:
            self.preemptions.labels(model_name=name).inc(plan.num_preempted)

    def count_tokens(self, events: Sequence[TokenEvent], now: float) -> None:
        """The tokens a step produced, ended at `now` (modelled seconds)."""
        name = self.model_name
        self.generation_tokens.labels(model_name=name).inc(sum(e.num_tokens for e in events))
        for event in events:
            request = event.request
            if event.is_first:
                # As vLLM: the whole prompt counts once, cached or recomputed after preemption.
                self.prompt_tokens.labels(model_name=name).inc(request.num_prompt_tokens)
                self.prompt_tokens_cached.labels(model_name=name).inc(request.num_cached_tokens)
                # vLLM's histograms start when the request reached the engine: the trip
                # through the API server and the client (admissible_s) is the client's alone.
                self.ttft.labels(model_name=name).observe(now - request.admissible_s)
                if request.first_scheduled_s is not None:
                    self.queue.labels(model_name=name).observe(
                        request.first_scheduled_s - request.admissible_s)

    def set_gauges(self, schedulers: Sequence[Scheduler]) -> None:
        """The schedulers' state now. One series for the whole server: counts add up over
        replicas; KV usage is the fullest replica's, the one that preempts first."""
        name = self.model_name
        self.running.labels(model_name=name).set(sum(len(s.running) for s in schedulers))
        self.waiting.labels(model_name=name).set(sum(len(s.waiting) for s in schedulers))
        self.kv_usage.labels(model_name=name).set(max(s.kv_cache_usage for s in schedulers))
        # The schedulers keep running totals; counters take the increments since last time.
        queries = sum(s.stats.prefix_cache_queries for s in schedulers)
        hits = sum(s.stats.prefix_cache_hits for s in schedulers)
        self.prefix_queries.labels(model_name=name).inc(queries - self._reported_queries)
        self.prefix_hits.labels(model_name=name).inc(hits - self._reported_hits)
        self._reported_queries = queries
        self._reported_hits = hits
