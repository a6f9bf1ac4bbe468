"""Steady-state capacity on one running server: a continuous stream of requests whose offered
load steps from one level to the next (a staircase), each step judged on a measured window.

What an operator checks a capacity claim by (GuideLLM's warm-up/cool-down exclusion, MLPerf's
server scenario, `vllm bench serve` at a constant rate): a step's first `warmup_s` is excluded
(the server fills up to the step's load); the requests *sent* in the next `window_s` are the
measured ones; arrivals keep flowing at the same load until every measured request has ended,
so the last measured requests are served under the same load as the first (no drain bias);
then the next step's load starts at once (no restart, no idle drain between steps). A step
meets the SLO only when its measured requests' p99s are within it, its requests succeeded,
the requests that ended in the window kept up with those sent in it (completed rate equal to
the offered rate, within the tolerance and the count's noise) and the server's waiting queue
stayed flat. A step that missed has its backlog cancelled (the requests are ours), so the next
step starts from an empty server, not from a drain.

`StaircaseDriver` sends the requests (a thread running an event loop); `plan_step`,
`lifetime_estimate_s` and `judge_window` are pure and decide what to measure and what it showed.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import functools
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from runners import arrivals
from runners.base import BenchmarkMetrics
from runners.capacity import failures_miss, slo_miss
from runners.capacity_search import CapacitySearch
from runners.credentials import auth_headers
from runners.loadgen.client import RequestOutput, send_request
from runners.loadgen.requests import RequestSpec
from runners.workload import SLO, LengthDistribution, Workload

logger = logging.getLogger(__name__)

STOPPED_ERROR = "stopped"  # a request of ours cancelled at a missed step's end
STALLED_ERROR = "stalled"
_CONNECT_TIMEOUT_S = 10.0
_WATCH_INTERVAL_S = 0.05
_MIN_LIFETIME_S = 1.0  # s; the least warm-up a step gets
_UNKNOWN_TPOT_S = 0.05  # s a token, where the SLO sets no TPOT bound
_UNKNOWN_TTFT_S = 2.0  # s, likewise for the first token
_LIFETIME_QUANTILE = 0.95  # a step's warm-up is this quantile of a request's life
_GAP_BLOCK = 64  # arrivals whose gaps sum to exactly their count over the rate
# A step's warm-up, in request lives. One life fills an empty server to the step's count in
# theory, but the count keeps climbing as the batch grows and each request's life with it: on
# the H100 (Qwen3-8B shape, 10.8 req/s, 2026-12-06) a step after a cancelled backlog ran 137
# requests one life in and 145 after 1.7 lives, where `vllm bench serve` held 152-170 for three
# minutes; a window measured on the ramp read TPOT p99 14.0 ms against vLLM's 17.4 ms.
_WARMUP_LIVES = 2.0
_MAX_WARMUP_LIVES = 4.0
_SETTLED_TOLERANCE = 0.05  # of the count, over one life: the in-flight count has settled


# ---------------------------------------------------------------------------------------------
# Sizing a step


@dataclass(frozen=True)
class StepPlan:
    """How one step is measured: `warmup_s` excluded, then the requests sent in `window_s`."""

    load: float  # requests/s or concurrent requests
    warmup_s: float  # s of load before the window (two request lives), so the server is full
    window_s: float  # s in which the measured requests are sent
    lifetime_s: float  # s, the request life that sized the warm-up
    expected_requests: float  # requests the window should send (rate x window; a closed loop's
    # concurrency x window / life)
    # s; an open loop's warm-up goes on past `warmup_s`, up to this, while its in-flight count
    # still rises (`is_in_flight_settled`)
    max_warmup_s: float = 0.0


def _quantile_tokens(dist: LengthDistribution, q: float) -> float:
    """The q-quantile of a length distribution (its upper clip wins)."""
    if dist.kind == "fixed":
        value = float(dist.mean)
    elif dist.kind == "uniform":  # the bounds `loadgen.sample_length` draws between
        low = dist.low if dist.low is not None else 1
        high = dist.high if dist.high is not None else 2 * dist.mean - low
        value = low + q * (max(low, high) - low)
    elif dist.kind == "normal":
        value = dist.mean + 1.645 * dist.std
    elif dist.kind == "lognormal":
        value = dist.mean * math.exp(1.645 * dist.std - dist.std ** 2 / 2)
    else:
        value = float(dist.mean)
    if dist.high is not None:
        value = min(value, float(dist.high))
    return max(value, 1.0)


def lifetime_estimate_s(workload: Workload, *,
                        measured_e2el_s: float | None = None) -> float:
    """How long a request lives near the capacity, at the 95th percentile: its first token
    within the TTFT bound and each further token within the TPOT bound (a config that meets
    the SLO serves no slower; where the SLO sets no bound, 2 s and 50 ms), with the longest
    answers (512 tokens for a trace's or a dataset's, whose lengths are not known here), never
    shorter than the last step that met the SLO (its p90 end-to-end latency)."""
    slo = workload.slo
    tpot_s = slo.tpot_p99_ms / 1000.0 if slo.tpot_p99_ms is not None else _UNKNOWN_TPOT_S
    ttft_s = slo.ttft_p99_ms / 1000.0 if slo.ttft_p99_ms is not None else _UNKNOWN_TTFT_S
    out_tokens = 512.0 if workload.trace is not None or workload.dataset is not None else \
        _quantile_tokens(workload.output_len, _LIFETIME_QUANTILE)
    estimate = ttft_s + max(out_tokens - 1.0, 0.0) * tpot_s
    if slo.e2el_ms is not None:
        estimate = min(estimate, slo.e2el_ms / 1000.0)
    if measured_e2el_s is not None and math.isfinite(measured_e2el_s):
        estimate = max(estimate, measured_e2el_s)
    return min(max(estimate, _MIN_LIFETIME_S), workload.request_timeout_s)


def plan_step(search: CapacitySearch, load: float, lifetime_s: float) -> StepPlan:
    """The warm-up and window of a step at `load`: the warm-up two request lives (the server's
    in-flight count settles once every request it held before the step has ended, and then the
    lives lengthen as its batch grows: see _WARMUP_LIVES), up to four for an open loop whose
    count still rises; the window
    long enough to send `search.min_window_requests` requests and at least
    `search.min_window_s`, at most `search.max_window_s` (a light step must not take many
    minutes: it then measures fewer requests, and its record says how many)."""
    # A closed loop sends its concurrency once a request life.
    per_s = load if search.axis == "request_rate" else load / lifetime_s
    window_s = max(search.min_window_s, search.min_window_requests / per_s)
    if search.max_window_s is not None:
        window_s = min(window_s, search.max_window_s)
    warmup_s = search.warmup_s if search.warmup_s is not None else \
        _WARMUP_LIVES * lifetime_s
    return StepPlan(load=load, warmup_s=warmup_s, window_s=window_s, lifetime_s=lifetime_s,
                    expected_requests=per_s * window_s,
                    max_warmup_s=max(warmup_s, _MAX_WARMUP_LIVES * lifetime_s))


# ---------------------------------------------------------------------------------------------
# Judging a window


@dataclass(frozen=True)
class WindowCounts:
    """What the client and the server saw over one step's window."""

    window_s: float  # s
    num_sent: int  # requests sent in the window: the measured ones
    num_ended: int  # requests (any step's, any outcome) that ended in the window
    mean_in_flight: float  # requests, time-weighted over the window
    waiting_rise: float | None  # requests: the least-squares rise of the server's waiting
    # queue over the window; None without three samples
    max_waiting: float | None = None  # requests
    # requests: the least-squares rise of the client's in-flight count over the window (an open
    # loop on the client's clock; None elsewhere)
    in_flight_rise: float | None = None


@dataclass(frozen=True)
class Verdict:
    """A step's verdict: whether it met the SLO in steady state, and if not, why (one line)."""

    meets_slo: bool
    reason: str | None = None  # why it missed; None when it met
    is_overload_errors: bool = False  # it missed because requests failed


def judge_window(metrics: BenchmarkMetrics, counts: WindowCounts | None, slo: SLO, *,
                 max_failed_fraction: float, tolerance: float,
                 is_saturated: bool = False, is_closed_loop: bool = False) -> Verdict:
    """A step against the SLO and steady state.

    Missed when: the server's queue kept growing (the step was stopped early); more requests
    failed than `max_failed_fraction` (at a load the server cannot keep up with, refused
    connections and timeouts are a missed SLO, not a broken config); a p99 is over its bound
    (a TPOT bound holds where no request had a second token, as in vLLM's goodput); the
    requests that ended in the window fell short of those sent in it by more than the
    tolerance or the count's noise (2 sqrt(n) for a mean of n in flight), whichever is larger,
    i.e. the in-flight count grew; its least-squares line rose by more than the tolerance of
    its mean (4 at least) over the window (a slow ramp the end points hide); or the
    waiting queue rose by more than the tolerance of the requests sent (4 at least) over the
    window. A closed loop cannot fall behind its own sends: only the queue counts there."""
    if is_saturated:
        return Verdict(False, "the waiting queue kept growing (stopped early: saturated)")
    failed = failures_miss(metrics, max_failed_fraction)
    if failed is not None:
        return Verdict(False, failed, is_overload_errors=True)
    missed = slo_miss(metrics, slo, max_failed_fraction)
    if missed is not None:
        return Verdict(False, missed)
    if counts is None:
        return Verdict(True)
    allowed = max(tolerance * counts.num_sent, 2.0 * math.sqrt(max(counts.mean_in_flight, 1.0)))
    if not is_closed_loop and counts.num_sent - counts.num_ended > allowed:
        offered = counts.num_sent / counts.window_s
        ended = counts.num_ended / counts.window_s
        return Verdict(False, f"completed {ended:.3g} of {offered:.3g} req/s offered (not "
                              "steady: the in-flight count grew)")
    if not is_closed_loop and counts.in_flight_rise is not None and \
            counts.in_flight_rise > max(tolerance * counts.mean_in_flight, 4.0):
        return Verdict(False, f"the in-flight count rose by {counts.in_flight_rise:.0f} over "
                              f"the {counts.window_s:.0f} s window (not steady)")
    if counts.waiting_rise is not None and \
            counts.waiting_rise > max(tolerance * counts.num_sent, 4.0):
        return Verdict(False, f"the waiting queue grew by {counts.waiting_rise:.0f} requests "
                              f"over the {counts.window_s:.0f} s window")
    return Verdict(True)


def least_squares_rise(points: Sequence[tuple[float, float]]) -> float | None:
    """The rise of the least-squares line through (time, value) points over their span; None
    with fewer than three points or no span."""
    if len(points) < 3:
        return None
    times = np.array([t for t, _ in points])
    span = float(times[-1] - times[0])
    if span <= 0:
        return None
    slope = float(np.polyfit(times - times[0], [v for _, v in points], 1)[0])
    return slope * span


def counter_rate_per_s(points: Sequence[tuple[float, float]]) -> float | None:
    """A counter's rate over (time, value) points: last minus first over their span."""
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


# ---------------------------------------------------------------------------------------------
# The driver


@dataclass
class _Sent:
    spec: RequestSpec
    sent_s: float  # time.monotonic()
    task: asyncio.Task[RequestOutput]
    ended_s: float | None = None


class StaircaseDriver:
    """One continuous stream of requests to one server, whose offered load `set_load` changes
    (a request rate, Poisson or gamma arrivals; or a closed loop of a concurrency).

    Runs an event loop on a thread of its own; every public method may be called from another
    thread. Times are `time.monotonic()`. Requests come from `requests` (an endless iterator).
    `close` cancels whatever is in flight and joins the thread: nothing outlives it."""

    def __init__(self, base_url: str, model: str, requests: Iterator[RequestSpec], *,
                 axis: str, timeout_s: float, seed: int, burstiness: float = 1.0,
                 stall_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 api_key: str | None = None) -> None:
        if axis not in ("request_rate", "concurrency"):
            raise ValueError(f"axis must be request_rate or concurrency but got {axis!r}.")
        arrivals.check_burstiness(burstiness)
        self.base_url = base_url
        self.model = model
        self.axis = axis
        self.timeout_s = timeout_s
        self.burstiness = burstiness
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.api_key = api_key  # the engine's, sent as a bearer token (runners/credentials.py)
        self._requests = requests
        self._rng = np.random.default_rng(seed)
        self._gaps: collections.deque[float] = collections.deque()
        self._gap_rate: float | None = None
        self._lock = threading.Lock()
        self._sent: list[_Sent] = []  # in send order
        self._ended: list[float] = []  # end times, sorted
        self._in_flight_changes: list[tuple[float, int]] = []  # (time, count after)
        self._num_in_flight = 0
        self._load = 0.0
        self._last_progress = clock()
        self.stalled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._changed: asyncio.Event | None = None
        self._main: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    # -- life cycle --------------------------------------------------------------------------

    def start(self, load: float) -> None:
        self._check_load(load)
        self._load = load
        self._thread = threading.Thread(target=self._run_thread, name="staircase", daemon=True)
        self._thread.start()
        self._ready.wait()

    def close(self) -> None:
        """Cancel the requests in flight and stop sending; returns once the thread is gone."""
        loop, main = self._loop, self._main
        if loop is not None and main is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended on its own
                loop.call_soon_threadsafe(main.cancel)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> StaircaseDriver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run_thread(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._amain())
        except BaseException as exc:  # kept for the caller; the thread must end
            self._error = exc
        finally:
            with contextlib.suppress(Exception):  # the streams' generators, closed in order
                loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            self._ready.set()  # a thread that failed before it was ready frees `start`

    async def _amain(self) -> None:
        self._changed = asyncio.Event()
        self._main = asyncio.current_task()
        self._ready.set()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(None, connect=_CONNECT_TIMEOUT_S)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False,
                                     headers=auth_headers(self.api_key)) as client:
            watch = asyncio.create_task(self._watch())
            try:
                await self._issue(client)
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # the caller's check_engine reads it
                self._error = exc
            finally:
                watch.cancel()
                tasks = [s.task for s in self._sent if not s.task.done()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, watch, return_exceptions=True)

    # -- control (any thread) ----------------------------------------------------------------

    def set_load(self, load: float) -> None:
        """Change the offered load from now on."""
        self._check_load(load)
        with self._lock:
            self._load = load
        self._notify()

    def cancel_in_flight(self) -> int:
        """Cancel every request in flight (a missed step's backlog): they end failed with the
        error "stopped". Returns how many were cancelled."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return 0
        future = asyncio.run_coroutine_threadsafe(self._cancel_all(), loop)
        return future.result(timeout=30.0)

    async def _cancel_all(self) -> int:
        tasks = [s.task for s in self._sent if not s.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)

    def _notify(self) -> None:
        loop, changed = self._loop, self._changed
        if loop is not None and changed is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(changed.set)

    def _check_load(self, load: float) -> None:
        if not (math.isfinite(load) and load > 0):
            raise ValueError(f"a step's load must be a positive number but got {load}.")
        if self.axis == "concurrency" and load != int(load):
            raise ValueError(f"a concurrency is a whole number but got {load}.")

    # -- what happened (any thread) ----------------------------------------------------------

    def now(self) -> float:
        return self.clock()

    def sent_between(self, start_s: float, end_s: float) -> list[_Sent]:
        with self._lock:
            return [s for s in self._sent if start_s <= s.sent_s < end_s]

    def num_ended_between(self, start_s: float, end_s: float) -> int:
        with self._lock:
            return bisect.bisect_left(self._ended, end_s) - bisect.bisect_left(self._ended,
                                                                               start_s)

    def mean_in_flight(self, start_s: float, end_s: float) -> float:
        """The in-flight count, time-weighted over [start_s, end_s)."""
        if end_s <= start_s:
            return 0.0
        with self._lock:
            changes = list(self._in_flight_changes)
        count = 0
        for t, n in changes:
            if t > start_s:
                break
            count = n
        area, last = 0.0, start_s
        for t, n in changes:
            if t <= start_s:
                continue
            if t >= end_s:
                break
            area += count * (t - last)
            count, last = n, t
        area += count * (end_s - last)
        return area / (end_s - start_s)

    def num_in_flight(self) -> int:
        with self._lock:
            return self._num_in_flight

    def is_done(self, sent: Sequence[_Sent]) -> bool:
        return all(s.ended_s is not None for s in sent)

    def wait_done(self, sent: Sequence[_Sent], timeout_s: float,
                  should_stop: Callable[[], bool] | None = None) -> bool:
        """Block until every request of `sent` has ended (the load keeps flowing meanwhile);
        False after `timeout_s`, when the driver stalled, or when `should_stop` says so."""
        deadline = self.clock() + timeout_s
        while not self.is_done(sent):
            if self.stalled or self.clock() >= deadline or (should_stop and should_stop()) or \
                    self._thread is None or not self._thread.is_alive():
                return False
            time.sleep(0.05)
        return True

    def outputs(self, sent: Sequence[_Sent]) -> list[RequestOutput]:
        out: list[RequestOutput] = []
        for s in sent:
            task = s.task
            if not task.done() or task.cancelled():
                out.append(RequestOutput(success=False, error=STOPPED_ERROR,
                                         prompt_len=s.spec.prompt_len,
                                         client_prompt_len=s.spec.prompt_len))
            elif task.exception() is not None:
                exc = task.exception()
                out.append(RequestOutput(success=False, error=f"{type(exc).__name__}: {exc}",
                                         prompt_len=s.spec.prompt_len,
                                         client_prompt_len=s.spec.prompt_len))
            else:
                out.append(task.result())
        return out

    @property
    def error(self) -> BaseException | None:
        """A bug of ours that ended the sending thread (None while it runs or after `close`)."""
        return self._error

    # -- sending (the loop's thread) ---------------------------------------------------------

    async def _issue(self, client: httpx.AsyncClient) -> None:
        assert self._changed is not None
        next_send: float | None = None
        while True:
            with self._lock:
                load = self._load
            if self.axis == "concurrency":
                if self._num_in_flight >= load:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                self._send(client, next(self._requests))
                continue
            if next_send is None:
                next_send = self.clock()
            wait_s = next_send - self.clock()
            if wait_s > 0:
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=wait_s)
                except TimeoutError:
                    pass
                else:  # a request ended, or the rate changed: then the gap is drawn again
                    with self._lock:
                        if self._load != load:
                            next_send = self._last_send_locked() + self._gap_s(self._load)
                    continue
            self._send(client, next(self._requests))
            # A host that wakes late does not make up for it with a burst.
            next_send = max(next_send, self.clock() - 1.0) + self._gap_s(load)

    def prune(self, before_s: float) -> None:
        """Forget the requests sent before `before_s` that have ended (their outputs were read):
        a night's stream must not hold every reply's timings."""
        with self._lock:
            self._sent = [s for s in self._sent if s.sent_s >= before_s or s.ended_s is None]
            cut = bisect.bisect_left(self._in_flight_changes, (before_s, -1))
            self._in_flight_changes = self._in_flight_changes[max(0, cut - 1):]
            self._ended = self._ended[bisect.bisect_left(self._ended, before_s):]

    def _last_send_locked(self) -> float:
        return self._sent[-1].sent_s if self._sent else self.clock()

    def _gap_s(self, rate: float) -> float:
        """The next gap at `rate`: gamma gaps (Poisson at burstiness 1, as `vllm bench serve`
        draws them) in blocks of `_GAP_BLOCK` whose sum is exactly their count over the rate,
        i.e. a Poisson process conditioned on its count over each block. Arrivals stay as
        bursty as vLLM's within a block, and a window offers the rate it is labelled with
        (a free Poisson count over 200 requests is off by 7% at one standard deviation)."""
        if self._gap_rate != rate:
            self._gaps.clear()
            self._gap_rate = rate
        if not self._gaps:
            shape = self.burstiness
            block = self._rng.gamma(shape, 1.0, size=_GAP_BLOCK)
            block *= _GAP_BLOCK / rate / float(block.sum())
            self._gaps.extend(float(g) for g in block)
        return self._gaps.popleft()

    def _send(self, client: httpx.AsyncClient, spec: RequestSpec) -> None:
        now = self.clock()
        task = asyncio.create_task(send_request(
            client, self.base_url, self.model, spec, self.timeout_s, on_chunk=self._heartbeat))
        record = _Sent(spec=spec, sent_s=now, task=task)
        with self._lock:
            if self._num_in_flight == 0:
                self._last_progress = now
            self._num_in_flight += 1
            self._in_flight_changes.append((now, self._num_in_flight))
            self._sent.append(record)
        task.add_done_callback(functools.partial(self._ended_one, record))

    def _ended_one(self, record: _Sent, _task: object = None) -> None:
        now = self.clock()
        with self._lock:
            record.ended_s = now
            bisect.insort(self._ended, now)
            self._num_in_flight -= 1
            self._in_flight_changes.append((now, self._num_in_flight))
            self._last_progress = now
        if self._changed is not None:
            self._changed.set()  # a closed loop refills the slot

    def _heartbeat(self) -> None:
        self._last_progress = self.clock()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_INTERVAL_S)
            if self.stall_timeout_s is None or self.stalled:
                continue
            with self._lock:
                busy = self._num_in_flight > 0
                quiet_s = self.clock() - self._last_progress
            if busy and quiet_s > self.stall_timeout_s:
                logger.warning("no chunk from any of %d in-flight requests for %.1f s: the "
                               "server stalled", self.num_in_flight(), quiet_s)
                self.stalled = True


def endless_requests(build: Callable[[int, int], list[RequestSpec]], chunk: int, seed: int,
                     is_finite_source: bool) -> Iterator[RequestSpec]:
    """Requests for a stream without end: synthesised ones drawn afresh in chunks of `chunk`
    (seeds `seed`, `seed + 1`, ...: no prompt repeats, so a prefix cache is not flattered);
    a file's, a dataset's or a trace's requests cycled (with the loader's own warning)."""
    if is_finite_source:
        yield from itertools.cycle(build(chunk, seed))
        return
    for k in itertools.count():
        yield from build(chunk, seed + k)


# ---------------------------------------------------------------------------------------------
# One step


@dataclass(frozen=True)
class StepRun:
    """What one step of the staircase measured, before it is judged."""

    plan: StepPlan
    windows: tuple[tuple[list[RequestOutput], WindowCounts], ...]  # one per repeat; none when
    # the step was stopped before its window (saturated in its warm-up)
    early_outputs: list[RequestOutput]  # a step stopped early: the requests it had sent
    early_duration_s: float  # s from the step's start to its stop
    server: dict[str, float]  # /metrics over the window(s): counter growth and gauge figures
    is_saturated: bool  # the waiting queue kept growing: stopped early
    is_finished: bool  # every measured request ended (else the wait ran out)
    window_start_s: float  # time.monotonic()
    warmup_s: float = 0.0  # s the step ran before its window (or before it was stopped)
    is_settled: bool = True  # an open loop's in-flight count had stopped rising by its window


def measure_step(driver: StaircaseDriver, base_url: str, plan: StepPlan, *, repeats: int,
                 request_timeout_s: float, check_engine: Callable[[], None],
                 is_first: bool = False) -> StepRun:
    """Walk one step: set the load (the stream goes on from the step before), wait out the
    warm-up, measure `repeats` consecutive windows, then keep the load flowing until every
    measured request has ended. `check_engine` is called every 0.2 s and raises to abort (the
    engine died or stalled). A rate step whose waiting queue keeps growing is stopped at once:
    saturated. The caller cancels a missed step's backlog."""
    from runners import prometheus

    api_key = driver.api_key  # /metrics asks for it as the completions do
    step_start = driver.now()
    if not is_first:
        driver.set_load(plan.load)
    saturated = threading.Event() if driver.axis == "request_rate" else None

    def is_saturated() -> bool:
        return saturated is not None and saturated.is_set()

    poller = prometheus.MetricsPoller(
        base_url, saturated=saturated,
        saturation_rise_requests=max(16.0, 0.1 * plan.expected_requests), api_key=api_key)
    poller.start()
    bounds: list[tuple[float, float]] = []
    is_settled = True
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    is_finished = True
    try:
        _sleep_until(driver, step_start + plan.warmup_s, check_engine, saturated)
        if driver.axis == "request_rate":
            is_settled = _settle(driver, step_start, plan, check_engine, saturated)
        if not is_saturated():
            before = prometheus.scrape(base_url, api_key=api_key)
            for k in range(max(1, repeats)):
                start = driver.now() if k == 0 else bounds[-1][1]
                _sleep_until(driver, start + plan.window_s, check_engine, saturated)
                bounds.append((start, driver.now()))
                if is_saturated():
                    break
            after = prometheus.scrape(base_url, api_key=api_key)
            measured_sent = [s for a, b in bounds for s in driver.sent_between(a, b)]

            def should_stop() -> bool:
                check_engine()  # raises to abort
                return is_saturated()

            is_finished = driver.wait_done(measured_sent, request_timeout_s, should_stop)
    finally:
        poller.stop()
    check_engine()
    samples = list(poller.samples)
    # Every request that may have ended inside a window: those still held (the driver forgets
    # a step's requests only once the step after it has been measured).
    recent = driver.outputs(driver.sent_between(-math.inf, math.inf))
    windows = []
    for a, b in bounds:
        outputs = driver.outputs(driver.sent_between(a, b))
        windows.append((outputs, _counts(driver, samples, a, b, outputs, recent)))
    server: dict[str, float] = {}
    if before and after and not is_saturated():
        server.update(prometheus.delta(before, after))
    window_samples = [(t, v) for t, v in samples
                      if bounds and bounds[0][0] <= t <= bounds[-1][1]]
    server.update(prometheus.summarize(window_samples or samples))
    early: list[RequestOutput] = []
    early_s = driver.now() - step_start
    if is_saturated():
        early = driver.outputs(driver.sent_between(step_start, driver.now()))
        server.update(_saturated_rates(samples))
    driver.prune(step_start)
    window_start = bounds[0][0] if bounds else driver.now()
    return StepRun(plan=plan, windows=tuple(windows), early_outputs=early,
                   early_duration_s=early_s, server=server, is_saturated=is_saturated(),
                   is_finished=is_finished,
                   window_start_s=window_start, warmup_s=window_start - step_start,
                   is_settled=is_settled)


def _sleep_until(driver: StaircaseDriver, deadline_s: float, check_engine: Callable[[], None],
                 saturated: threading.Event | None) -> None:
    while driver.now() < deadline_s:
        check_engine()
        if saturated is not None and saturated.is_set():
            return
        time.sleep(min(0.2, max(0.0, deadline_s - driver.now())))


def is_in_flight_settled(points: Sequence[tuple[float, float]], lifetime_s: float,
                         tolerance: float = _SETTLED_TOLERANCE) -> bool:
    """Whether an open loop's in-flight count (time, count) has stopped rising: its
    least-squares slope over the last half life (5 s at least) would add less than
    `tolerance` of the count (2 requests at least) over a whole life."""
    span_s = max(5.0, lifetime_s / 2.0)
    if not points:
        return True
    recent = [(t, n) for t, n in points if t >= points[-1][0] - span_s]
    if len(recent) < 3 or recent[-1][0] - recent[0][0] < span_s * 0.8:
        return False
    rise = least_squares_rise(recent)
    if rise is None:
        return False
    slope = rise / (recent[-1][0] - recent[0][0])
    mean = float(np.mean([n for _, n in recent]))
    return slope * lifetime_s <= max(2.0, tolerance * mean)


def _settle(driver: StaircaseDriver, step_start: float, plan: StepPlan,
            check_engine: Callable[[], None], saturated: threading.Event | None) -> bool:
    """Extend an open loop's warm-up, up to `plan.max_warmup_s`, while its in-flight count
    still rises (sampled every 0.5 s since the step began)."""
    points: list[tuple[float, float]] = []
    t = step_start
    while True:  # the count since the step began, read back from the driver's log
        points.append((t, driver.mean_in_flight(t, t + 0.5)))
        t += 0.5
        if t >= driver.now():
            break
    while driver.now() < step_start + plan.max_warmup_s:
        if is_in_flight_settled(points, plan.lifetime_s):
            return True
        check_engine()
        if saturated is not None and saturated.is_set():
            return True
        time.sleep(0.5)
        now = driver.now()
        points.append((now, float(driver.num_in_flight())))
    logger.info("step at %g: the in-flight count still rose after %.0f s of warm-up (%.1f "
                "lives): not steady", plan.load, plan.max_warmup_s,
                plan.max_warmup_s / plan.lifetime_s)
    return is_in_flight_settled(points, plan.lifetime_s)


def _counts(driver: StaircaseDriver, samples: Sequence[tuple[float, dict[str, float]]],
            start: float, end: float, sent: Sequence[RequestOutput],
            recent: Sequence[RequestOutput]) -> WindowCounts:
    """A window's counts on the client's clock, or on the server's modelled clock where every
    measured success carries it (the simulated engine: its latencies are on that clock, and a
    busy host that delays the server's wall time must not read as falling behind)."""
    from runners import prometheus

    waiting = [(t, s[prometheus.NUM_REQUESTS_WAITING]) for t, s in samples
               if start <= t <= end and prometheus.NUM_REQUESTS_WAITING in s]
    rise = least_squares_rise(waiting)
    max_waiting = max((w for _, w in waiting), default=None)
    arrivals_m = [o.modelled_span_s[0] for o in sent if o.modelled_span_s is not None]
    if sent and len(arrivals_m) == sum(o.success for o in sent) and arrivals_m:
        gap = (max(arrivals_m) - min(arrivals_m)) / max(len(arrivals_m) - 1, 1)
        t0, t1 = min(arrivals_m), max(arrivals_m) + gap
        spans = [o.modelled_span_s for o in recent if o.modelled_span_s is not None]
        ended = sum(t0 <= b < t1 for _, b in spans)
        area = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)
        window = max(t1 - t0, 1e-9)
        return WindowCounts(window_s=window, num_sent=len(sent), num_ended=ended,
                            mean_in_flight=area / window, waiting_rise=rise,
                            max_waiting=max_waiting)
    grid = np.arange(start, end, 0.25)
    in_flight = [(float(t), driver.mean_in_flight(float(t), float(t) + 0.25)) for t in grid]
    return WindowCounts(window_s=max(end - start, 1e-9), num_sent=len(sent),
                        num_ended=driver.num_ended_between(start, end),
                        mean_in_flight=driver.mean_in_flight(start, end),
                        waiting_rise=rise, max_waiting=max_waiting,
                        in_flight_rise=least_squares_rise(in_flight)
                        if driver.axis == "request_rate" else None)


def _saturated_rates(samples: Sequence[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """A saturated step's token counters over the second half of its samples, when the engine
    ran full: what it could serve (`CapacitySearch.served_of` reads them)."""
    from runners import prometheus

    if len(samples) < 4:
        return {}
    half = samples[len(samples) // 2:]
    out: dict[str, float] = {}
    for name, key in ((prometheus.PROMPT_TOKENS, "served_prompt_tokens_per_s"),
                      (prometheus.GENERATION_TOKENS, "served_generation_tokens_per_s")):
        rate = counter_rate_per_s([(t, s[name]) for t, s in half if name in s])
        if rate is not None and rate > 0:
            out[key] = rate
    return out

