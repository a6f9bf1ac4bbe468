"""One load level: `run_level` sends a level's requests at its rate or concurrency (or a
trace's times), watches for stalls and stop requests, and returns its figures (`LevelResult`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import httpx

from runners import arrivals
from runners.base import BenchmarkMetrics
from runners.credentials import auth_headers
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput, failed_output, send_request
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.modelled_clock import modelled_level_duration_s
from runners.loadgen.requests import RequestSpec
from runners.workload import SLO

logger = logging.getLogger(__name__)

STALLED_ERROR: Final = "stalled"
STOPPED_ERROR: Final = "stopped"

_CONNECT_TIMEOUT_S = 10.0
_WATCH_INTERVAL_S = 0.05  # how often the watchdog looks at stop_event and the stall clock


class StopFlag(Protocol):
    """`asyncio.Event` or `threading.Event`: anything that can say it was set."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class LevelResult:
    """One load level: its figures and every request's output, in issue order."""

    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]
    stalled: bool = False  # no chunk from any in-flight request for stall_timeout_s: a hang
    stopped: bool = False  # stop_event ended the level early; not a measurement
    # The server declared a modelled clock (the simulated engine) and the figures, duration
    # included, are on it: a model's times, never a measurement.
    is_modelled_clock: bool = False


class _LevelDriver:
    """State of one running level: the issuer, the request tasks and the watchdog share it."""

    def __init__(
        self,
        base_url: str,
        model: str,
        requests: Sequence[RequestSpec],
        level: LoadLevel,
        *,
        timeout_s: float,
        seed: int,
        duration_s: float | None,
        stop_event: StopFlag | None,
        stall_timeout_s: float | None,
        max_duration_s: float | None = None,
        burstiness: float = 1.0,
        send_offsets_s: Sequence[float] | None = None,
    ) -> None:
        self.base_url = base_url
        self.burstiness = burstiness
        self.send_offsets_s = send_offsets_s
        self.model = model
        self.requests = requests
        self.level = level
        self.timeout_s = timeout_s
        self.seed = seed
        self.duration_s = duration_s
        self.max_duration_s = max_duration_s
        self.stop_event = stop_event
        self.stall_timeout_s = stall_timeout_s
        cap = level.max_concurrency
        self.semaphore = asyncio.Semaphore(cap) if cap is not None else None
        self.tasks: list[tuple[asyncio.Task[RequestOutput], RequestSpec, float]] = []
        self.issuer: asyncio.Task[None] | None = None
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.last_progress = time.perf_counter()
        self.abort_reason: str | None = None
        self.slowest_latency_s: float | None = None  # wall, of the requests ended so far
        # s from the level's start to each request's send as scheduled, in issue order (the
        # tasks'): the arrivals the level offered, whatever a busy host did to them
        self.sent_offsets_s: list[float] = []

    def _heartbeat(self) -> None:
        self.last_progress = time.perf_counter()

    async def run(self, client: httpx.AsyncClient) -> tuple[list[RequestOutput], float]:
        start = time.perf_counter()
        self.issuer = asyncio.create_task(self._issue(client, start))
        watchdog = asyncio.create_task(self._watch())
        try:
            await asyncio.gather(self.issuer, return_exceptions=True)
            if not self.issuer.cancelled() and self.issuer.exception() is not None:
                self._abort(STOPPED_ERROR)  # a bug of ours: leave nothing running, then raise
                await asyncio.gather(*(t for t, _, _ in self.tasks), return_exceptions=True)
                self.issuer.result()
            # The issuer is done, so the list is final (cancelled tasks count as done).
            await asyncio.gather(*(task for task, _, _ in self.tasks), return_exceptions=True)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
        duration = time.perf_counter() - start
        return [self._output_of(task, spec, t) for task, spec, t in self.tasks], duration

    def _output_of(self, task: asyncio.Task[RequestOutput], spec: RequestSpec,
                   issued_at: float) -> RequestOutput:
        if task.cancelled():
            return failed_output(spec, issued_at, self.abort_reason or STOPPED_ERROR)
        exc = task.exception()
        if exc is not None:  # send_request never raises; this is a bug of ours, kept visible
            logger.error("request task raised %r", exc)
            return failed_output(spec, issued_at, f"{type(exc).__name__}: {exc}")
        return task.result()

    def _is_past_duration(self, start: float) -> bool:
        limit = self.duration_s if self.duration_s is not None else self.max_duration_s
        return limit is not None and time.perf_counter() - start >= limit

    async def _issue(self, client: httpx.AsyncClient, start: float) -> None:
        rate = self.level.request_rate_rps
        specs: Iterator[RequestSpec]
        offsets: Iterator[float]
        if self.send_offsets_s is not None:  # a trace replay: its times, its requests once
            specs = iter(self.requests)
            offsets = iter(self.send_offsets_s)
        elif self.duration_s is None:
            specs = iter(self.requests)
            offsets = iter(arrivals.arrival_offsets_s(len(self.requests), rate, self.seed,
                                             self.burstiness))
        else:
            specs = itertools.cycle(self.requests)
            offsets = arrivals.open_ended_offsets_s(rate, self.seed, self.burstiness)
        for spec, offset in zip(specs, offsets, strict=False):
            limit = self.duration_s if self.duration_s is not None else self.max_duration_s
            if limit is not None and offset >= limit:
                return
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            # Acquire here, not in the task, so a concurrency-bound level never piles up
            # waiting tasks; order and timing match vLLM's FIFO semaphore inside the task.
            if self.semaphore is not None:
                await self.semaphore.acquire()
            if self._is_past_duration(start) or self._is_stop_requested():
                if self.semaphore is not None:
                    self.semaphore.release()
                return
            is_refilled = self._is_refilled(start)
            burst = 0
            if rate is None and self.level.max_concurrency is not None \
                    and len(self.tasks) < self.level.max_concurrency:
                burst = min(self.level.max_concurrency, len(self.requests))
            closed = rate is None and self.level.max_concurrency is not None \
                and self.duration_s is None
            task = asyncio.create_task(self._one(
                client, spec, is_refilled, burst,
                len(self.requests) - len(self.tasks) - 1 if closed else None))
            self.sent_offsets_s.append(offset)
            self.tasks.append((task, spec, time.perf_counter()))

    def _is_refilled(self, start: float) -> bool:
        """Whether the request about to be sent will be followed at once, in its slot, by
        another: a closed loop over a fixed list with a slot's worth of requests left, and, on a
        time-bound level, ending (by the slowest latency seen so far, x1.5) before the limit."""
        cap = self.level.max_concurrency
        if self.level.request_rate_rps is not None or cap is None or self.duration_s is not None:
            return False
        if len(self.tasks) + cap >= len(self.requests):
            return False
        if self.max_duration_s is None:
            return True
        if self.slowest_latency_s is None:
            return False
        ends_s = time.perf_counter() - start + 1.5 * self.slowest_latency_s
        return ends_s < self.max_duration_s

    async def _one(self, client: httpx.AsyncClient, spec: RequestSpec,
                   is_refilled: bool = False, burst_size: int = 0,
                   num_remaining: int | None = None) -> RequestOutput:
        if self.num_in_flight == 0:
            self._heartbeat()  # the stall clock runs only while something is in flight
        self.num_in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        sent = time.perf_counter()
        try:
            return await send_request(client, self.base_url, self.model, spec, self.timeout_s,
                                      on_chunk=self._heartbeat, is_refilled=is_refilled,
                                      burst_size=burst_size, num_remaining=num_remaining)
        finally:
            self.slowest_latency_s = max(self.slowest_latency_s or 0.0,
                                         time.perf_counter() - sent)
            self.num_in_flight -= 1
            self._heartbeat()
            if self.semaphore is not None:
                self.semaphore.release()

    def _is_stop_requested(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self._is_stop_requested():
                self._abort(STOPPED_ERROR)
                return
            if (self.stall_timeout_s is not None and self.num_in_flight > 0
                    and time.perf_counter() - self.last_progress > self.stall_timeout_s):
                logger.warning(
                    "no chunk from any of %d in-flight requests for %.1f s at %s: "
                    "cancelling them as stalled",
                    self.num_in_flight, self.stall_timeout_s, self.level.label,
                )
                self._abort(STALLED_ERROR)
                return

    def _abort(self, reason: str) -> None:
        self.abort_reason = reason
        if self.issuer is not None:
            self.issuer.cancel()
        for task, _, _ in self.tasks:
            task.cancel()


def _check_level_args(requests: Sequence[RequestSpec], level: LoadLevel, timeout_s: float,
                      duration_s: float | None, stall_timeout_s: float | None) -> None:
    if not requests:
        raise ValueError("run_level needs at least one request but got none.")
    rate = level.request_rate_rps
    if rate is not None and not rate > 0:
        raise ValueError(f"request_rate_rps must be > 0 (None = all at once) but got {rate}.")
    if level.max_concurrency is not None and level.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 but got {level.max_concurrency}.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 but got {timeout_s}.")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0 but got {stall_timeout_s}.")
    if duration_s is not None:
        if not duration_s > 0:
            raise ValueError(f"duration_s must be > 0 but got {duration_s}.")
        if (rate is None or math.isinf(rate)) and level.max_concurrency is None:
            raise ValueError(
                "a duration-bound level needs a request rate or a max concurrency, "
                "but got neither; set one of them."
            )


async def run_level(
    base_url: str,
    model: str,
    requests: Sequence[RequestSpec],
    level: LoadLevel,
    slo: SLO,
    *,
    timeout_s: float,
    seed: int,
    stop_event: StopFlag | None = None,
    stall_timeout_s: float | None = None,
    duration_s: float | None = None,
    max_duration_s: float | None = None,
    burstiness: float | None = None,
    send_offsets_s: Sequence[float] | None = None,
    api_key: str | None = None,
) -> LevelResult:
    """Drive one load level against an OpenAI-compatible server and measure it.

    Requests arrive at `level.request_rate_rps` (all at once when None), with gamma gaps of
    shape `burstiness` (default: the level's, else 1 = Poisson; runners/arrivals.py), at most
    `level.max_concurrency` in flight. `send_offsets_s` (a trace replay) gives each request's
    send time instead, in seconds from the level's start, one per request, non-decreasing.
    Without `duration_s` each request is sent once; with it, requests cycle and no new one is
    sent after `duration_s` (those in flight finish).
    `max_duration_s` bounds a request-bound level by time too: each request is sent at most
    once, and none after `max_duration_s` (a light capacity probe must not take minutes).
    `stop_event` (checked every 50 ms) or a stall (no chunk from any in-flight request for
    `stall_timeout_s`) cancels the requests in flight; they come back failed, with the error
    "stopped" or "stalled", and the result says which. `api_key` is the engine's (sent as a
    bearer token). Raises only ValueError, for bad arguments.
    """
    _check_level_args(requests, level, timeout_s, duration_s, stall_timeout_s)
    if max_duration_s is not None and not max_duration_s > 0:
        raise ValueError(f"max_duration_s must be > 0 but got {max_duration_s}.")
    if burstiness is None:
        burstiness = level.burstiness if level.burstiness is not None else 1.0
    arrivals.check_burstiness(burstiness)
    if send_offsets_s is not None:
        if duration_s is not None:
            raise ValueError("a trace replay sends each request once; bound it with "
                             "max_duration_s, not duration_s.")
        if len(send_offsets_s) != len(requests) or any(
                not math.isfinite(t) or t < 0 for t in send_offsets_s) or any(
                b < a for a, b in itertools.pairwise(send_offsets_s)):
            raise ValueError(f"send_offsets_s must hold {len(requests)} finite, non-negative, "
                             "non-decreasing times, one per request.")
    cap = level.max_concurrency
    # httpx defaults (100 connections, 5 s timeouts) would queue requests in the client and
    # cut long streams: size the pool to the load and leave reads unbounded; the per-request
    # timeout and the stall watchdog bound them instead.
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    timeout = httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S)
    driver = _LevelDriver(base_url, model, requests, level, timeout_s=timeout_s, seed=seed,
                          duration_s=duration_s, stop_event=stop_event,
                          stall_timeout_s=stall_timeout_s, max_duration_s=max_duration_s,
                          burstiness=burstiness, send_offsets_s=send_offsets_s)
    # trust_env=False: an http_proxy from the environment must not capture 127.0.0.1.
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                 headers=auth_headers(api_key)) as client:
        outputs, duration = await driver.run(client)
    modelled_s = modelled_level_duration_s(outputs, driver.sent_offsets_s)
    is_modelled = modelled_s is not None
    if modelled_s is not None:
        duration = modelled_s
    metrics = compute_metrics(outputs, duration, slo, max_concurrency_seen=driver.max_in_flight)
    logger.info(
        "level %s: %d completed, %d failed in %.1f s%s, %.2f req/s, %.1f output tok/s%s",
        level.label, metrics.completed, metrics.failed, duration,
        " (the server's modelled clock)" if is_modelled else "", metrics.request_throughput,
        metrics.output_throughput,
        f" ({driver.abort_reason})" if driver.abort_reason else "",
    )
    return LevelResult(
        metrics=metrics,
        outputs=outputs,
        stalled=driver.abort_reason == STALLED_ERROR,
        stopped=driver.abort_reason == STOPPED_ERROR,
        is_modelled_clock=is_modelled,
    )


def run_level_sync(
    base_url: str,
    model: str,
    requests: Sequence[RequestSpec],
    level: LoadLevel,
    slo: SLO,
    *,
    timeout_s: float,
    seed: int,
    stop_event: StopFlag | None = None,
    stall_timeout_s: float | None = None,
    duration_s: float | None = None,
    max_duration_s: float | None = None,
    burstiness: float | None = None,
    send_offsets_s: Sequence[float] | None = None,
    api_key: str | None = None,
) -> LevelResult:
    """`run_level` on a fresh event loop, for callers that are threads (runners, Ray actors).
    Pass a `threading.Event` as `stop_event` to stop it from another thread."""
    return asyncio.run(run_level(
        base_url, model, requests, level, slo, timeout_s=timeout_s, seed=seed,
        stop_event=stop_event, stall_timeout_s=stall_timeout_s, duration_s=duration_s,
        max_duration_s=max_duration_s, burstiness=burstiness, send_offsets_s=send_offsets_s,
        api_key=api_key,
    ))
