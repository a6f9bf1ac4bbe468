"""The driver of one load level (`LevelDriver`, run by `runners/loadgen/level.py`): its issuer
sends the requests on their schedule, its request tasks keep the in-flight count and the send
log, and its watchdog cancels them on a stop request or a stall. Also the words a cancelled
request ends with, which the conversations' driver (runners/conversations.py) shares."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from typing import Final, Protocol
from urllib.parse import urlsplit

from runners import arrivals
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput, failed_output, send_request
from runners.loadgen.clients import ClientPool
from runners.loadgen.requests import RequestSpec
from runners.loadgen.send_log import SendLog

logger = logging.getLogger(__name__)

STALLED_ERROR: Final = "stalled"
STOPPED_ERROR: Final = "stopped"
SERVER_GONE_ERROR: Final = "server gone"

_WATCH_INTERVAL_S = 0.05  # how often the watchdog looks at stop_event and the stall clock
# While the issuer waits this long or longer for its next arrival (a sparse rate: 8 requests
# at 0.0001 req/s wait hours), the watchdog checks this often that the server still listens:
# an engine killed meanwhile (a "stop now" kills it) otherwise left the level waiting out its
# schedule (nothing in flight fails, nothing stalls).
_LISTEN_CHECK_INTERVAL_S = 1.0
_LISTEN_CHECK_TIMEOUT_S = 5.0  # a connect not answered in this long proves nothing


class StopFlag(Protocol):
    """`asyncio.Event` or `threading.Event`: anything that can say it was set."""

    def is_set(self) -> bool: ...


class LevelDriver:
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
        self.sends = SendLog()  # on time.monotonic(), as the server's /metrics samples
        self._free_from_s: float | None = None  # monotonic: the cap last freed a waited slot
        self._is_waiting_long = False  # the issuer sleeps >= _LISTEN_CHECK_INTERVAL_S
        self.num_listen_checks = 0

    def _heartbeat(self) -> None:
        self.last_progress = time.perf_counter()

    async def run(self, clients: ClientPool) -> tuple[list[RequestOutput], float]:
        start = time.perf_counter()
        self.issuer = asyncio.create_task(self._issue(clients, start))
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

    async def _issue(self, clients: ClientPool, start: float) -> None:
        rate = self.level.request_rate_rps
        start_mono = time.monotonic() - (time.perf_counter() - start)
        is_scheduled = rate is not None or self.send_offsets_s is not None
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
                self._is_waiting_long = delay >= _LISTEN_CHECK_INTERVAL_S
                try:
                    await asyncio.sleep(delay)
                finally:
                    self._is_waiting_long = False
            # Acquire here, not in the task, so a concurrency-bound level never piles up
            # waiting tasks; order and timing match vLLM's FIFO semaphore inside the task.
            if self.semaphore is not None:
                waited = self.semaphore.locked()
                await self.semaphore.acquire()
                if waited:
                    self._free_from_s = time.monotonic()
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
            self.sends.record_send(time.monotonic(),
                                   start_mono + offset if is_scheduled else None,
                                   self._free_from_s)
            task = asyncio.create_task(self._one(
                clients, spec, is_refilled, burst,
                len(self.requests) - len(self.tasks) - 1 if closed else None))
            self.sent_offsets_s.append(offset)
            self.tasks.append((task, spec, time.perf_counter()))
            # A turn of the loop between two sends, however late: an issuer behind its
            # schedule (sends costing more than their gaps: a starved host, tracemalloc) sent
            # every late arrival in one turn and their work filled the next (turns of 11-21 s,
            # connects timed out on an accepting server); the requests' chunks, connects and
            # the watchdog share this loop.
            await asyncio.sleep(0)

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

    async def _one(self, clients: ClientPool, spec: RequestSpec,
                   is_refilled: bool = False, burst_size: int = 0,
                   num_remaining: int | None = None) -> RequestOutput:
        if self.num_in_flight == 0:
            self._heartbeat()  # the stall clock runs only while something is in flight
        self.num_in_flight += 1
        self.sends.record_in_flight(time.monotonic(), self.num_in_flight)
        self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        sent = time.perf_counter()
        index, client = clients.acquire()
        try:
            return await send_request(client, self.base_url, self.model, spec, self.timeout_s,
                                      on_chunk=self._heartbeat, is_refilled=is_refilled,
                                      burst_size=burst_size, num_remaining=num_remaining)
        finally:
            self.slowest_latency_s = max(self.slowest_latency_s or 0.0,
                                         time.perf_counter() - sent)
            clients.release(index)
            self.num_in_flight -= 1
            self.sends.record_in_flight(time.monotonic(), self.num_in_flight)
            self._heartbeat()
            if self.semaphore is not None:
                self.semaphore.release()

    def _is_stop_requested(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    async def _watch(self) -> None:
        checked_at = time.perf_counter()
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self._is_stop_requested():
                self._abort(STOPPED_ERROR)
                return
            if self._is_waiting_long and \
                    time.perf_counter() - checked_at >= _LISTEN_CHECK_INTERVAL_S:
                checked_at = time.perf_counter()
                if await self._is_server_gone():
                    logger.warning("the server at %s refuses connections: ending %s before "
                                   "its next arrival", self.base_url, self.level.label)
                    self._abort(SERVER_GONE_ERROR)
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

    async def _is_server_gone(self) -> bool:
        """Whether nothing listens at the server's address any more (a refused connect: its
        process is gone); a connect that times out or fails otherwise proves nothing."""
        self.num_listen_checks += 1
        url = urlsplit(self.base_url)
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(url.hostname, port), _LISTEN_CHECK_TIMEOUT_S)
        except ConnectionRefusedError:
            return True
        except (OSError, ValueError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return False

    def _abort(self, reason: str) -> None:
        self.abort_reason = reason
        if self.issuer is not None:
            self.issuer.cancel()
        for task, _, _ in self.tasks:
            task.cancel()
