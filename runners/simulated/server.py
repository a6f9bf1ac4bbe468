"""The simulated engine's HTTP server: vLLM's OpenAI-compatible endpoints, /metrics and the
profiler endpoints over an asyncio continuous-batching loop driven by `PerformanceModel`.

Step times are slept in real time so client-side latencies (and SLO checks) hold; only start-up
is time-scaled. Log lines use vLLM's wording so the same log parsers read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gzip
import hashlib
import hmac
import json
import logging
import os
import random
import socket
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runners.base import EngineConfig, Failure, FailureReason
from runners.hardware import HardwareProfile
from runners.loadgen.client import (
    MODELLED_ARRIVAL_FIELD,
    MODELLED_BURST_HEADER,
    MODELLED_CLOCK_HEADER,
    MODELLED_REFILL_HEADER,
    MODELLED_REMAINING_HEADER,
    MODELLED_TIME_FIELD,
    MODELLED_TIME_HEADER,
)
from runners.simulated import quality as sim_quality
from runners.simulated.faults import Faults

if TYPE_CHECKING:
    from runners.tokenizer import PromptTokenizer
from runners.simulated.model import (
    ATTENTION_BACKENDS,
    ENGINE_VERSION,
    GIB,
    JIT_STEP_STALL_S,
    PerformanceModel,
    Scheduler,
    SimRequest,
    StepBreakdown,
    StepPlan,
    TokenEvent,
    block_hashes,
    vllm_mfu_estimate,
)
from runners.vllm.compile_cache import compile_key

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
# Every stream says its times are the model's: the load generator then reads TTFT/ITL/latency
# from the chunks' modelled times, which a busy host CPU cannot stretch (runners/loadgen.py).
MODELLED_CLOCK_HEADERS = {MODELLED_CLOCK_HEADER: "modelled"}
# After a step that ended requests whose client promised the next one at once (a closed loop:
# MODELLED_REFILL_HEADER), the engine holds its modelled clock up to this long (wall seconds)
# for those arrivals, and stamps them at the step's end: the model of a client that reacts at
# once, whatever the host's scheduling delay. A promise not kept costs this much wall time.
REFILL_GRACE_S = 10.0
# Likewise a burst the client sends at once (MODELLED_BURST_HEADER: its size, the first requests
# of a closed-loop level) is admitted together, stamped at its first request's arrival.
DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
DEFAULT_NOISE_SIGMA = 0.025  # lognormal sigma on step times: run-to-run jitter of a real GPU
MAX_TRACE_EVENTS = 4000  # keeps a trace small enough for tests and the trace summariser
# Bucket edges copied from vLLM 0.26's metrics so histogram quantiles compare like for like.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                     60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FAKE_WORDS = ("the", "model", "serves", "tokens", "quickly", "while", "batching", "requests",
              "under", "load", "and", "memory", "bound", "decode", "steps", "run")


@dataclass(frozen=True)
class ServerSettings:
    """One simulated engine process."""

    config: EngineConfig
    hardware: HardwareProfile
    port: int
    host: str = HOST  # loopback only (the command line allows nothing else)
    profile_dir: Path | None = None
    startup_time_scale: float = 0.01  # slept seconds per modelled start-up second
    seed: int = 0
    faults: Faults = field(default_factory=Faults)
    noise_sigma: float = DEFAULT_NOISE_SIGMA
    # Every route but /health asks for `Authorization: Bearer <api_key>` when set (vLLM, given
    # --api-key or VLLM_API_KEY, asks it of its /v1 routes only).
    api_key: str | None = None


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

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class _Stream:
    """A request's mailbox: the engine loop puts token events, the handler takes them."""

    request: SimRequest
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class _ProfiledStep:
    start_us: float
    breakdown: StepBreakdown
    num_tokens: int
    num_decode_seqs: int


def _flag_on(value: object) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in {"1", "true", "yes", "on"}
    return bool(value)


def _tokenize(text: str, vocab_size: int) -> list[int]:
    """A stand-in tokenizer: one token per whitespace-separated word, stable across runs."""
    return [zlib.crc32(word.encode()) % vocab_size for word in text.split()] or [0]


def _compile_cache_marker(config: EngineConfig) -> Path | None:
    """Where a warm compile cache is remembered, only when the config names VLLM_CACHE_ROOT (so
    tests never write under the user's home)."""
    root = config.env.get("VLLM_CACHE_ROOT")
    if not root:
        return None
    # Keyed as vLLM 0.26 keys its cache, as far as nightshift's estimate knows it (modelled:
    # runners/vllm/compile_cache.py); the simulated faults are no part of a config.
    plain = dataclasses.replace(config, flags={k: v for k, v in config.flags.items()
                                               if not k.startswith("sim_")})
    key = compile_key(plain)
    if key is None:
        return None
    digest = key.digest if key.is_cached else hashlib.sha256(str(time.time_ns()).encode()
                                                             ).hexdigest()
    return Path(root) / "torch_compile_cache" / "torch_aot_compile" / f"simulated-{digest}" / \
        "rank_0_0" / "model"


@dataclasses.dataclass
class _Replica:
    """One engine core: its scheduler and the loop that steps it. `data_parallel_size` of
    them sit behind the one API server, as vLLM's data-parallel engines do."""

    index: int
    scheduler: Scheduler
    wakeup: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # The modelled clock (seconds, the loop's time base): it advances by modelled step times
    # only, so a busy host CPU that wakes the loop late stretches no latency. `lag_s` is how
    # far the loop's clock has run ahead of it (the lateness of every wake-up, summed).
    clock_s: float = 0.0  # modelled time at the end of the last step (or of the idle wait)
    lag_s: float = 0.0
    step_start_s: float | None = None  # modelled span of the step in flight, if any
    step_end_s: float = 0.0
    is_idle: bool = False  # waiting for a request with none queued: its clock is free to move

    def modelled_now(self, loop_time_s: float) -> float:
        """The modelled time of an event the loop sees at `loop_time_s` (a request arriving):
        inside the step in flight while one runs, never before the last step's end."""
        now = loop_time_s - self.lag_s
        if self.step_start_s is not None:
            return min(max(now, self.step_start_s), self.step_end_s)
        return max(now, self.clock_s)

    @property
    def load(self) -> int:
        # vLLM's data-parallel coordinator scores engines by waiting x 4 + running.
        return len(self.scheduler.waiting) * 4 + len(self.scheduler.running)


class SimulatedEngine:
    """Owns the schedulers, metrics, fault state and the start-up sequence of one process."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        config = settings.config
        marker = _compile_cache_marker(config)
        self._compile_marker = marker
        self.model = PerformanceModel.from_config(
            config, settings.hardware, is_compile_cache_warm=bool(marker and marker.is_file()))
        self.faults = settings.faults
        self.metrics = EngineMetrics(
            config.served_model_name,
            is_mfu_enabled=_flag_on(config.flags.get("enable_mfu_metrics")))
        self.replicas = [_Replica(i, Scheduler(self.model))
                         for i in range(config.data_parallel_size)]
        self.is_ready = False
        self.is_hung = False
        self._rng = random.Random(settings.seed)
        self._error_rng = random.Random(settings.seed + 1)
        self._neighbour_rng = random.Random(settings.seed + 2)  # the `unstable` fault's draws
        self._streams: dict[SimRequest, _Stream] = {}
        self._num_requests_started = 0
        # > 1 under the `unstable` and `step_slowdown` faults
        self._slowdown = 1.0 + float(settings.faults.step_slowdown)
        self._profile: list[_ProfiledStep] | None = None
        self._profile_events = 0
        self._reported_queries = 0
        self._reported_hits = 0
        self._epoch_offset_s = 0.0  # wall epoch of modelled time 0, set when the loops start
        self._refilled: set[SimRequest] = set()  # their client sends another when they end
        self._num_remaining = 0  # requests the refilling client still sends, as it last said
        self._num_arrivals = 0
        self._arrived = asyncio.Event()
        self._burst_until = 0  # arrivals counted when the current burst is complete
        # The loop time of the burst's first arrival: each replica stamps the burst on its own
        # modelled clock (replicas' clocks differ: fp8_per_block's stall runs a busy one ahead).
        self._burst_loop_s = 0.0

    # --- start-up ------------------------------------------------------------------------------
    async def _sleep_scaled(self, modelled_s: float) -> None:
        await asyncio.sleep(max(0.0, modelled_s * self.settings.startup_time_scale))

    def _fail(self, failure: Failure, exception: str = "ValueError") -> int:
        logger.error("%s: %s", exception, failure.message)
        logger.error("RuntimeError: Engine core initialization failed. See root cause above. "
                     "Failed core proc(s): {}")
        return 1

    async def start(self) -> int | None:
        """Walk through vLLM's start-up, logging its lines; None when ready, else an exit code."""
        model, faults, scale = self.model, self.faults, self.settings.startup_time_scale
        times = model.startup()
        started = time.monotonic()
        logger.info("vLLM API server version %s", ENGINE_VERSION)
        logger.info("Simulated engine: latencies come from a roofline model of %s on %s, "
                    "not from a GPU measurement.", model.model.name, model.hardware.gpu_name)
        await self._sleep_scaled(times.process_start_s)
        candidates = [b for b in ATTENTION_BACKENDS if b != "FLEX_ATTENTION"] + ["FLEX_ATTENTION"]
        logger.info("Using %s attention backend out of potential backends: %s",
                    model.attention_backend, candidates)
        await self._sleep_scaled(times.model_load_s)
        logger.info("Loading weights took %.2f seconds", times.model_load_s * 0.95)
        logger.info("Model loading took %.4f GiB memory and %.6f seconds",
                    model.weight_bytes_per_gpu / GIB, times.model_load_s)
        if faults.oom_at_start:
            await self._sleep_scaled(times.profile_s)
            return self._fail(Failure(
                FailureReason.OOM_AT_START,
                "No available memory for the cache blocks. Try increasing "
                "`gpu_memory_utilization` when initializing the engine."))
        if times.compile_s:
            marker = self._compile_marker
            if not model.is_compile_cache_warm and \
                    _flag_on(self.settings.config.env.get("VLLM_FORCE_AOT_LOAD")):
                # As vLLM 0.26 with VLLM_FORCE_AOT_LOAD=1 and no artefact
                # (compilation/decorators.py:293-327): the load raises, the engine dies.
                logger.error("FileNotFoundError: [Errno 2] No such file or directory: '%s'",
                             marker or "torch_compile_cache/torch_aot_compile/?/rank_0_0/model")
                logger.error("RuntimeError: Engine core initialization failed. See root cause "
                             "above. Failed core proc(s): {}")
                return 1
            await self._sleep_scaled(times.compile_s)
            if model.is_compile_cache_warm:
                logger.info("Directly load AOT compilation from path %s", marker)
            else:
                logger.info("Compiling a graph for compile range (1, %d) takes %.2f s",
                            model.max_num_batched_tokens, times.compile_s * 0.6)
                if marker is not None:
                    logger.info("saved AOT compiled function to %s", marker)
            logger.info("torch.compile took %.2f s in total", times.compile_s)
        await self._sleep_scaled(times.profile_s)
        failure = model.check_memory()
        if failure is not None:
            return self._fail(failure)
        logger.info("Available KV cache memory: %.2f GiB", model.kv_cache_bytes_per_gpu / GIB)
        logger.info("GPU KV cache size: %s tokens", f"{model.kv_cache_tokens:,}")
        logger.info("Maximum concurrency for %s tokens per request: %.2fx",
                    f"{model.max_model_len:,}", model.max_concurrency_at_max_len)
        if times.graph_capture_s:
            logger.info("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 0%")
            if faults.graph_capture_fail:
                await self._sleep_scaled(times.graph_capture_s / 3)
                logger.error(
                    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                    "GPU 0 has a total capacity of %.2f GiB of which 1.12 GiB is free.",
                    model.hardware.gpu_memory_gib)
                logger.error("RuntimeError: Engine core initialization failed. See root cause "
                             "above. Failed core proc(s): {}")
                return 1
            await self._sleep_scaled(times.graph_capture_s)
            logger.info("Graph capturing finished in %.0f secs, took %.2f GiB",
                        times.graph_capture_s, model.cuda_graph_bytes_per_gpu / GIB)
        logger.info("init engine (profile, create kv cache, warmup model) took %.2f seconds "
                    "(compilation: %.2f s)", times.init_engine_s, times.compile_s)
        if self._compile_marker is not None and times.compile_s:
            self._compile_marker.parent.mkdir(parents=True, exist_ok=True)
            self._compile_marker.touch()
        await self._sleep_scaled(times.misc_s)
        if faults.slow_start_s:
            await asyncio.sleep(float(faults.slow_start_s))  # real seconds, on purpose
        if faults.hang_at_start:
            logger.info("Simulated fault: never becoming healthy (sim_hang_at_start).")
            await asyncio.Event().wait()
        logger.info("Simulated engine ready: modelled start-up %.1f s (slept %.2f s at "
                    "startup_time_scale %g)", times.total_s, time.monotonic() - started, scale)
        logger.info("Starting vLLM API server 0 on http://%s:%d", self.settings.host,
                    self.settings.port)
        logger.info("Application startup complete.")
        for replica in self.replicas:
            replica.task = asyncio.create_task(self._run_loop(replica))
        self._epoch_offset_s = time.time() - asyncio.get_running_loop().time()
        self.is_ready = True
        return None

    # --- engine loop ---------------------------------------------------------------------------
    async def _run_loop(self, replica: _Replica) -> None:
        """Step the replica's scheduler on its modelled clock. Each step is slept to its
        deadline so tokens stream in real time, but every time the engine reports (token times,
        TTFT/ITL histograms, the trace) is modelled: a wake-up the busy host delays is added to
        `lag_s`, not to any latency."""
        loop = asyncio.get_running_loop()
        while True:
            if not replica.scheduler.has_work:
                await self._idle(replica)
            if self.is_hung:
                await asyncio.Event().wait()  # a wedged engine: alive, silent
            plan = replica.scheduler.schedule(replica.clock_s)
            admissible_s = replica.scheduler.next_admissible_s()
            if plan is None and admissible_s is not None and admissible_s > replica.clock_s:
                # Idle while the next request is on its way through the API server
                # (model.API_LAG_PER_STREAM_S): later arrivals reach it later still.
                await asyncio.sleep(max(0.0, admissible_s + replica.lag_s - loop.time()))
                replica.clock_s = admissible_s
                continue
            if plan is None:  # work that cannot be scheduled yet: wait for a change
                await self._idle(replica)
                continue
            # A step starts now on the wall, whatever moved the modelled clock since the last
            # one (an idle replica that took a stamp from ahead of its own clock): the wall
            # sleep is this step's, never the gap between two clocks.
            replica.lag_s = min(replica.lag_s, loop.time() - replica.clock_s)
            step_s = plan.breakdown.total_s * self._slowdown * \
                self._rng.lognormvariate(0.0, self._sigma)
            replica.step_start_s, replica.step_end_s = replica.clock_s, replica.clock_s + step_s
            if replica.index == 0:  # the trace is rank 0's, as vLLM's first worker writes it
                self._record_profile(plan, step_s, replica.clock_s)
            if self.model.is_jit_while_serving:
                # The JIT stall is modelled in full but slept time-scaled, as start-up is: the
                # figures read the modelled clock, and a dry run need not wait out the JIT.
                replica.lag_s -= min(step_s, JIT_STEP_STALL_S) * (
                    1.0 - self.settings.startup_time_scale)
            deadline = replica.step_end_s + replica.lag_s
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            replica.lag_s += max(0.0, loop.time() - deadline)
            if self.is_hung:
                await asyncio.Event().wait()
            replica.clock_s, replica.step_start_s = replica.step_end_s, None
            arrivals_before = self._num_arrivals
            num_refills = min(self._complete(replica.scheduler, plan, replica.clock_s),
                              self._num_remaining)
            if num_refills:
                await self._await_refills(replica, arrivals_before + num_refills)

    async def _idle(self, replica: _Replica) -> None:
        """Wait for a request. Idle time passes on the modelled clock as on the wall, up to the
        first waiting request's arrival: the engine starts then, however late the loop woke."""
        loop = asyncio.get_running_loop()
        replica.wakeup.clear()
        replica.is_idle = not replica.scheduler.has_work
        try:
            await replica.wakeup.wait()
            if self._burst_until > self._num_arrivals:
                await self._await_arrivals(self._burst_until)
        finally:
            replica.is_idle = False
        waiting = replica.scheduler.waiting
        start_s = (min(r.arrival_s for r in waiting) if waiting
                   else replica.modelled_now(loop.time()))
        replica.clock_s = max(replica.clock_s, start_s)
        replica.lag_s = max(replica.lag_s, loop.time() - replica.clock_s)

    async def _await_refills(self, replica: _Replica, num_arrivals: int) -> None:
        """Hold the modelled clock at the step's end until `num_arrivals` requests have arrived
        (closed-loop refills) or REFILL_GRACE_S of wall time passed; the wait is lag."""
        loop = asyncio.get_running_loop()
        waited_from = loop.time()
        replica.step_start_s = replica.step_end_s = replica.clock_s  # arrivals stamp here
        try:
            await self._await_arrivals(num_arrivals)
        finally:
            replica.step_start_s = None
            replica.lag_s += loop.time() - waited_from

    async def _await_arrivals(self, num_arrivals: int) -> None:
        """Until `num_arrivals` requests have arrived in all, or REFILL_GRACE_S passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REFILL_GRACE_S
        while self._num_arrivals < num_arrivals and loop.time() < deadline:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
        if self._num_arrivals < num_arrivals:
            logger.warning("Simulated engine: %d announced request(s) did not arrive within "
                           "%g s; the modelled clock goes on without them.",
                           num_arrivals - self._num_arrivals, REFILL_GRACE_S)

    @property
    def _sigma(self) -> float:
        return self.settings.noise_sigma

    def _complete(self, scheduler: Scheduler, plan: StepPlan, now: float) -> int:
        """Apply a finished step; the number of ended requests whose client refills at once."""
        m, name = self.metrics, self.metrics.model_name
        m.iteration_tokens.labels(model_name=name).observe(plan.num_tokens)
        if m.mfu is not None:
            # Counted as vLLM counts a step: per GPU, from what was scheduled (before it ran).
            estimate = vllm_mfu_estimate(
                self.model, [(take, request.num_computed_tokens + take,
                              take > 1 or request.num_output_tokens == 0)
                             for request, take in plan.scheduled],
                data_parallel_size=len(self.replicas))
            for counter, value in zip(m.mfu, (estimate.flops, estimate.read_bytes,
                                              estimate.write_bytes), strict=True):
                counter.labels(model_name=name).inc(value)
        if plan.num_preempted:
            m.preemptions.labels(model_name=name).inc(plan.num_preempted)
        events = scheduler.complete(plan, now)
        num_refills = 0
        m.generation_tokens.labels(model_name=name).inc(sum(e.num_tokens for e in events))
        for event in events:
            request = event.request
            if event.is_first:
                # As vLLM: the whole prompt counts once, cached or recomputed after preemption.
                m.prompt_tokens.labels(model_name=name).inc(request.num_prompt_tokens)
                m.prompt_tokens_cached.labels(model_name=name).inc(request.num_cached_tokens)
                # vLLM's histograms start when the request reached the engine: the trip
                # through the API server and the client (admissible_s) is the client's alone.
                m.ttft.labels(model_name=name).observe(now - request.admissible_s)
                if request.first_scheduled_s is not None:
                    m.queue.labels(model_name=name).observe(
                        request.first_scheduled_s - request.admissible_s)
            stream = self._streams.get(request)
            if stream is not None:
                stream.events.put_nowait(event)
            if event.is_finished and request in self._refilled:
                self._refilled.discard(request)
                num_refills += 1
        self._update_gauges()
        return num_refills

    def _update_gauges(self) -> None:
        m, name = self.metrics, self.metrics.model_name
        schedulers = [r.scheduler for r in self.replicas]
        # One series for the whole server: counts add up over replicas; KV usage is the
        # fullest replica's, the one that preempts first.
        m.running.labels(model_name=name).set(sum(len(s.running) for s in schedulers))
        m.waiting.labels(model_name=name).set(sum(len(s.waiting) for s in schedulers))
        m.kv_usage.labels(model_name=name).set(max(s.kv_cache_usage for s in schedulers))
        # The schedulers keep running totals; counters take the increments since last time.
        queries = sum(s.stats.prefix_cache_queries for s in schedulers)
        hits = sum(s.stats.prefix_cache_hits for s in schedulers)
        m.prefix_queries.labels(model_name=name).inc(queries - self._reported_queries)
        m.prefix_hits.labels(model_name=name).inc(hits - self._reported_hits)
        self._reported_queries = queries
        self._reported_hits = hits

    # --- requests ------------------------------------------------------------------------------
    def request_started(self) -> None:
        """Count an arriving request and fire the request-count faults."""
        self._num_requests_started += 1
        count, faults = self._num_requests_started, self.faults
        if faults.crash_after_requests is not None and count > int(faults.crash_after_requests):
            logger.error("Simulated fault: engine core died after %d requests "
                         "(sim_crash_after_requests).", count - 1)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)  # abrupt on purpose: no cleanup, as a segfaulting worker
        if faults.hang_after_requests is not None and count > int(faults.hang_after_requests):
            if not self.is_hung:
                logger.warning("Simulated fault: engine hangs after %d requests "
                               "(sim_hang_after_requests).", count - 1)
            self.is_hung = True

    async def compile_on_first_request(self) -> None:
        """The `slow_first_request_s` fault: the first request waits while a thread keeps a
        core busy, as an engine JIT-compiling kernels on first use (the API answers meanwhile)."""
        seconds = float(self.faults.slow_first_request_s)
        if seconds and self._num_requests_started == 1:
            logger.info("Simulated fault: compiling kernels for %.1f s on the first request "
                        "(sim_slow_first_request_s).", seconds)
            await asyncio.to_thread(_spin_cpu, seconds)

    def should_fail_request(self) -> bool:
        return self._error_rng.random() < float(self.faults.error_rate)

    def modelled_time_s(self) -> float:
        """The modelled time now, on the furthest replica's clock: when an error answer
        refused a request (the level's duration spans it, as a wall clock's would)."""
        loop_time_s = asyncio.get_running_loop().time()
        return max(r.modelled_now(loop_time_s) for r in self.replicas)

    def note_arrival(self, burst_size: int = 0, num_remaining: int | None = None) -> None:
        """A completion request arrived (served, or answered with an error): an announced
        refill or burst member the engine waits for is kept either way."""
        if num_remaining is not None:
            self._num_remaining = num_remaining
        if burst_size > 1 and self._num_arrivals >= self._burst_until:  # a new burst
            self._burst_until = self._num_arrivals + burst_size
            self._burst_loop_s = asyncio.get_running_loop().time()
        self._num_arrivals += 1
        self._arrived.set()

    def _modelled_now(self, replica: _Replica, loop_time_s: float) -> float:
        """The modelled time at which `replica` takes a request arriving at `loop_time_s`.

        Each replica keeps its own modelled clock, and they drift apart: fp8_per_block's stall
        is modelled in full but slept time-scaled, so a busy replica's clock runs far ahead of
        an idle one's. An idle replica, which no step or token depends on, takes the furthest
        clock's time, so the replicas' stamps stay on one time line (a level's duration spans
        them); a busy one keeps its own, so no request is stamped after the step that serves
        it starts."""
        now = replica.modelled_now(loop_time_s)
        if replica.is_idle:
            now = max(now, *(r.modelled_now(loop_time_s) for r in self.replicas))
        return now

    async def generate(self, prompt_ids: list[int], max_tokens: int,
                       is_refilled: bool = False, burst_size: int = 0,
                       num_remaining: int | None = None) -> AsyncIterator[TokenEvent]:
        """The request's tokens as the engine produces them; each event's request carries its
        modelled arrival (`arrival_s`) and token time (`last_token_s`)."""
        loop = asyncio.get_running_loop()
        replica = min(self.replicas, key=lambda r: (r.load, r.index))
        arrival_s = self._modelled_now(replica, loop.time())
        self.note_arrival(burst_size, num_remaining)
        if burst_size > 1:  # a burst is stamped at its first request's arrival
            arrival_s = max(self._modelled_now(replica, self._burst_loop_s), replica.clock_s)
        request = SimRequest(uuid.uuid4().hex, len(prompt_ids), max_tokens, arrival_s,
                             block_hashes(prompt_ids, self.model.block_size))
        stream = _Stream(request)
        self._streams[request] = stream
        if is_refilled:
            self._refilled.add(request)
        replica.scheduler.add(request)
        self._update_gauges()
        replica.wakeup.set()
        last_s = request.arrival_s
        try:
            while True:
                event = await stream.events.get()
                now = event.time_s
                if not event.is_first:
                    self.metrics.itl.labels(model_name=self.metrics.model_name).observe(
                        now - last_s)
                last_s = now
                yield event
                if event.is_finished:
                    self.metrics.e2e.labels(model_name=self.metrics.model_name).observe(
                        now - request.admissible_s)
                    return
        finally:
            self._streams.pop(request, None)
            self._refilled.discard(request)
            if not request.is_finished:
                replica.scheduler.abort(request)  # the client went away
                self._update_gauges()

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.scheduler.reset_prefix_cache()
        if self.faults.unstable:  # a new level: the noisy neighbour draws again
            self._slowdown = 1.0 + float(self.faults.step_slowdown) + \
                self._neighbour_rng.uniform(0.0, float(self.faults.unstable))

    # --- profiler ------------------------------------------------------------------------------
    def start_profile(self) -> None:
        self._profile = []
        self._profile_events = 0

    def _record_profile(self, plan: StepPlan, step_s: float, start_s: float) -> None:
        if self._profile is None or self._profile_events >= MAX_TRACE_EVENTS:
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
        self._profile.append(_ProfiledStep((self._epoch_offset_s + start_s) * 1e6, breakdown,
                                           plan.num_tokens, plan.num_decode_seqs))
        self._profile_events += _events_per_step(self.model)

    def stop_profile(self) -> Path | None:
        steps, self._profile = self._profile or [], None
        directory = self.settings.profile_dir
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


# --- chrome trace ------------------------------------------------------------------------------
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
    kv = ("unsigned char, (vllm::Fp8KVCacheDataType)1" if model.kv_cache_dtype.startswith("fp8")
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
    gate_up = 2 * m.hidden_size * m.intermediate_size
    down = m.hidden_size * m.intermediate_size
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
                       steps: list[_ProfiledStep]) -> list[dict[str, Any]]:
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


# --- HTTP ----------------------------------------------------------------------------------------
def _stamped(response: JSONResponse, engine: SimulatedEngine) -> JSONResponse:
    """An error answer to a completion, stamped with the modelled time it was given at."""
    response.headers.update({**MODELLED_CLOCK_HEADERS,
                             MODELLED_TIME_HEADER: repr(engine.modelled_time_s())})
    return response


def _error(message: str, status: int, kind: str) -> JSONResponse:
    return JSONResponse({"object": "error", "message": message, "type": kind, "param": None,
                         "code": status}, status_code=status)


def build_app(engine: SimulatedEngine) -> Any:
    """vLLM's OpenAI-compatible routes; profiler routes only with a profile dir, as in vLLM."""
    config = engine.settings.config
    served = config.served_model_name
    created = int(time.time())
    vocab = engine.model.model.vocab_size
    # Text prompts are counted with the model's own tokenizer where its directory has one, as
    # the load generator counts them; else the word stand-in `_tokenize`.
    text_tokenizer = _model_tokenizer(config)
    logits = sim_quality.LogitModel(vocab, sim_quality.noise_sigma(config.flags),
                                    sim_quality.numerics_seed(config.flags))
    in_flight = [0]  # logprob requests being answered

    async def health(_: Request) -> Response:
        if engine.is_hung:
            await asyncio.Event().wait()  # a wedged API server never answers
        return Response(status_code=200 if engine.is_ready else 503)

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": served, "object": "model", "created": created, "owned_by": "vllm",
            "root": config.model, "parent": None, "max_model_len": engine.model.max_model_len,
            "permission": []}]})

    async def metrics(_: Request) -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request) -> Response:
        if not engine.is_ready:
            return _error("The engine is not ready yet.", 503, "ServiceUnavailableError")
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return _error(f"Request body must be JSON: {exc}.", 400, "BadRequestError")
        if not isinstance(body, dict):
            return _error("Request body must be a JSON object.", 400, "BadRequestError")
        checked = _check_completion(body, served, config.model, vocab,
                                    engine.model.max_model_len, text_tokenizer)
        burst_size = _int_or_zero(request.headers.get(MODELLED_BURST_HEADER))
        is_refilled = request.headers.get(MODELLED_REFILL_HEADER) == "1"
        remaining_text = request.headers.get(MODELLED_REMAINING_HEADER)
        num_remaining = _int_or_zero(remaining_text) if remaining_text is not None else None
        if isinstance(checked, JSONResponse):
            engine.note_arrival(burst_size, num_remaining=num_remaining)
            return _stamped(checked, engine)
        prompt_ids, max_tokens = checked
        engine.request_started()
        await engine.compile_on_first_request()
        if engine.should_fail_request():
            engine.note_arrival(burst_size, num_remaining=num_remaining)
            return _stamped(_error("Simulated internal error (sim_error_rate).", 500,
                                   "InternalServerError"), engine)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        model_name = str(body.get("model") or served)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            include_usage = bool(options.get("include_usage")) if isinstance(
                options, Mapping) else False
            return StreamingResponse(
                _sse(engine, prompt_ids, max_tokens, request_id, model_name, include_usage,
                     is_refilled, burst_size, num_remaining),
                media_type="text/event-stream", headers=MODELLED_CLOCK_HEADERS)
        if sim_quality.wants_logprobs(body):  # the quality evaluation's requests
            in_flight[0] += 1
            try:
                batch_key = in_flight[0]  # 1 = alone; batching moves logprobs a little
                async for _event in engine.generate(prompt_ids, max_tokens):
                    pass
                choice = sim_quality.completion_choice(logits, prompt_ids, body, max_tokens,
                                                       batch_key)
            finally:
                in_flight[0] -= 1
            return JSONResponse({
                "id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_name, "choices": [choice],
                "usage": _usage(len(prompt_ids), max_tokens)})
        words: list[str] = []
        async for event in engine.generate(prompt_ids, max_tokens):
            last = event.request.num_output_tokens
            words.extend(_word(i) for i in range(last - event.num_tokens + 1, last + 1))
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "text": "".join(words), "logprobs": None,
                         "finish_reason": "length", "stop_reason": None,
                         "prompt_logprobs": None}],
            "usage": _usage(len(prompt_ids), len(words))})

    async def start_profile(_: Request) -> Response:
        engine.start_profile()
        return Response(status_code=200)

    async def reset_prefix_cache(_: Request) -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    async def stop_profile(_: Request) -> Response:
        await asyncio.to_thread(engine.stop_profile)
        return Response(status_code=200)

    routes = [Route("/health", health, methods=["GET"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"]),
              # vLLM serves it under VLLM_SERVER_DEV_MODE=1, which nightshift sets.
              Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"])]
    if engine.settings.profile_dir is not None:
        routes += [Route("/start_profile", start_profile, methods=["POST"]),
                   Route("/stop_profile", stop_profile, methods=["POST"])]
    app = Starlette(routes=routes)
    api_key = engine.settings.api_key
    return _BearerAuth(app, api_key) if api_key else app


class _BearerAuth:
    """ASGI wrapper: every HTTP route but /health answers 401 without the engine's key (a pure
    ASGI layer, so streamed completions pass through untouched)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


def _spin_cpu(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def _model_tokenizer(config: EngineConfig) -> PromptTokenizer | None:
    from runners.model_info import resolve_model_dir
    from runners.tokenizer import load_tokenizer, tokenizer_dir_for

    return load_tokenizer(tokenizer_dir_for(resolve_model_dir(config.model),
                                            skip_tokenizer_init=config.skip_tokenizer_init))


def _check_completion(body: Mapping[str, Any], served: str, model_path: str, vocab: int,
                      max_model_len: int, tokenizer: PromptTokenizer | None = None,
                      ) -> tuple[list[int], int] | JSONResponse:
    name = body.get("model")
    if name is not None and name not in {served, model_path}:
        return _error(f"The model `{name}` does not exist.", 404, "NotFoundError")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt_ids = tokenizer.tokenizer.encode(prompt).ids if tokenizer is not None \
            else _tokenize(prompt, vocab)
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = [int(t) for t in prompt]
    else:
        return _error("prompt must be a string or a non-empty list of token ids.", 400,
                      "BadRequestError")
    raw_max = body.get("max_tokens")
    if raw_max is None:
        raw_max = DEFAULT_MAX_TOKENS
    if not isinstance(raw_max, int) or isinstance(raw_max, bool) or raw_max < 1:
        return _error(f"max_tokens must be at least 1, got {raw_max}.", 400, "BadRequestError")
    if len(prompt_ids) + raw_max > max_model_len:
        return _error(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt_ids) + raw_max} tokens ({len(prompt_ids)} in the messages, "
            f"{raw_max} in the completion). Please reduce the length of the messages or "
            "completion.", 400, "BadRequestError")
    return prompt_ids, raw_max


def _int_or_zero(text: str | None) -> int:
    return int(text) if text is not None and text.isdigit() else 0


def _word(index: int) -> str:
    return " " + FAKE_WORDS[(index * 7 + 3) % len(FAKE_WORDS)]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


async def _sse(engine: SimulatedEngine, prompt_ids: list[int], max_tokens: int, request_id: str,
               model_name: str, include_usage: bool,
               is_refilled: bool = False, burst_size: int = 0,
               num_remaining: int | None = None) -> AsyncIterator[str]:
    created = int(time.time())
    num_tokens = 0
    async for event in engine.generate(prompt_ids, max_tokens, is_refilled, burst_size,
                                       num_remaining):
        num_tokens += event.num_tokens
        last = event.request.num_output_tokens
        text = "".join(_word(i) for i in range(last - event.num_tokens + 1, last + 1))
        chunk = {"id": request_id, "object": "text_completion", "created": created,
                 "model": model_name,
                 "choices": [{"index": 0, "text": text,
                              "logprobs": None,
                              "finish_reason": "length" if event.is_finished else None,
                              "stop_reason": None}],
                 # Not in vLLM's schema: the modelled clock's times (MODELLED_CLOCK_HEADER).
                 MODELLED_ARRIVAL_FIELD: event.request.arrival_s,
                 MODELLED_TIME_FIELD: event.time_s}
        yield f"data: {json.dumps(chunk)}\n\n"
    if include_usage:
        final = {"id": request_id, "object": "text_completion", "created": created,
                 "model": model_name, "choices": [],
                 "usage": _usage(len(prompt_ids), num_tokens)}
        yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


# --- process -------------------------------------------------------------------------------------
async def serve(settings: ServerSettings) -> int:
    """Run one engine until SIGINT/SIGTERM; the exit code vLLM would give (0 or 1)."""
    try:
        engine = SimulatedEngine(settings)
    except ValueError as exc:
        logger.error("ValueError: %s", exc)
        return 1
    failure = engine.model.check_arguments()
    if failure is not None:
        logger.error("ValueError: %s", failure.message)
        return 1
    # vLLM 0.26 exposes no `*_created` samples; prometheus_client's switch is process-wide,
    # which is right here: this process is one engine.
    disable_created_metrics()  # type: ignore[no-untyped-call]
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        logger.error("OSError: [Errno %s] error while attempting to bind on address "
                     "('%s', %d): %s", exc.errno, settings.host, settings.port, exc.strerror)
        return 1
    server = uvicorn.Server(uvicorn.Config(
        build_app(engine), log_level="warning", access_log=False, lifespan="off",
        timeout_graceful_shutdown=1))
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    start_task = asyncio.create_task(engine.start())
    await asyncio.wait({serve_task, start_task}, return_when=asyncio.FIRST_COMPLETED)
    if start_task.done() and start_task.result() is not None:
        server.should_exit = True
        await serve_task
        return int(start_task.result() or 1)
    await serve_task
    start_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await start_task
    return 0
