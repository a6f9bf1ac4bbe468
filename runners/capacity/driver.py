"""`StaircaseDriver`: one continuous stream of requests to one server, on a thread of its
own, whose offered load (a request rate or a concurrency) is set step by step. What it draws
from (its requests, its arrivals' gaps) is runners/capacity/stream_source.py.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from runners import arrivals
from runners.capacity.stream_loop import cancel_and_wait, close_loop
from runners.capacity.stream_source import GAP_BLOCK, ArrivalGaps
from runners.loadgen.client import RequestOutput, send_request
from runners.loadgen.clients import REQUESTS_PER_CLIENT, ClientPool, client_pool
from runners.loadgen.requests import RequestSpec
from runners.loadgen.send_log import time_weighted_mean

logger = logging.getLogger(__name__)

STOPPED_ERROR = "stopped"  # a request of ours cancelled at a missed step's end
_CANCEL_WAIT_S = 10.0  # s a missed step's cancel waits for its requests to end
_WATCH_INTERVAL_S = 0.05
# Requests in flight on one httpx client at most (runners/loadgen/clients.py says why); a name
# of this module so that bench/staircase_client_cpu.py can set it.
_REQUESTS_PER_CLIENT = REQUESTS_PER_CLIENT


@dataclass
class _Sent:
    spec: RequestSpec
    sent_s: float  # time.monotonic()
    task: asyncio.Task[RequestOutput]
    ended_s: float | None = None
    # time.monotonic() at which its arrival was due (a rate's schedule); None: a closed loop,
    # which sends as a slot frees
    scheduled_s: float | None = None

    @property
    def late_s(self) -> float | None:
        """How much later than due it was sent (s); None without a schedule."""
        return None if self.scheduled_s is None else max(0.0, self.sent_s - self.scheduled_s)


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
        self._arrival_gaps = ArrivalGaps(seed, burstiness)
        self._lock = threading.Lock()
        self._sent: list[_Sent] = []  # in send order
        self._clients: ClientPool | None = None  # the stream's clients, once its loop runs
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
        # The task that sends (`_issue`): `close` cancels it, and only it. A cancel of the
        # whole stream could land in its clean-up (the requests' cancel sweep, the clients'
        # close) once the sending had already stopped on `_closing`.
        self._sending: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        # Set by `close`: the sending loop stops at its next turn. A cancel alone is not
        # enough: Python 3.11's `asyncio.wait_for` swallows a cancel that lands as its wait
        # ends (a request ended at that moment), and the stream then ran on at its load with
        # `close` joining it for ever (seen at 38 req/s on the simulated engine, 2026-12-06).
        self._closing = threading.Event()

    # -- life cycle --------------------------------------------------------------------------

    def start(self, load: float) -> None:
        self._check_load(load)
        self._load = load
        self._thread = threading.Thread(target=self._run_thread, name="staircase", daemon=True)
        self._thread.start()
        self._ready.wait()

    def close(self) -> None:
        """Cancel the requests in flight and stop sending; returns once the thread is gone."""
        self._closing.set()
        self._notify()
        self._cancel_sending()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _cancel_sending(self) -> None:
        """Cancel the sending task from any thread: a cancel that arrives once it has ended
        (it stopped on `_closing`, and the clean-up runs) is a no-op."""
        loop, sending = self._loop, self._sending
        if loop is not None and sending is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended on its own
                loop.call_soon_threadsafe(sending.cancel)

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
            close_loop(loop, self._clients.aclose if self._clients is not None else None)
            self._ready.set()  # a thread that failed before it was ready frees `start`

    async def _amain(self) -> None:
        self._changed = asyncio.Event()
        self._clients = client_pool(self.api_key, _REQUESTS_PER_CLIENT)
        async with self._clients as clients:
            watch = asyncio.create_task(self._watch())
            self._sending = asyncio.create_task(self._issue(clients))
            self._ready.set()
            try:
                await self._sending
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

    def set_load(self, load: float, *, gap_block: int = GAP_BLOCK) -> None:
        """Change the offered load from now on. `gap_block`: a rate's gaps conditioned on
        their count over blocks of this many arrivals (`ArrivalGaps`), the first block starting
        after the arrival already due: a step's 64, so its short window offers its label up to
        its partial end blocks; a hold's about four request lives' worth (`hold_gap_block`), so
        its window offers its label while the batch swings within a life."""
        self._check_load(load)
        with self._lock:
            self._arrival_gaps.set_block(gap_block)  # refuses a bad block before the load
            self._load = load
        self._notify()

    def cancel_in_flight(self) -> int:
        """Cancel every request in flight (a missed step's backlog): they end failed with the
        error "stopped". Returns how many were cancelled. Waits for them `_CANCEL_WAIT_S` at
        most (`cancel_and_wait`): a request still running then (a starved host's loop) runs on
        into the next step, by its warm-up or later (not counted), and the stream goes on."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return 0
        future = asyncio.run_coroutine_threadsafe(self._cancel_all(), loop)
        try:
            return future.result(timeout=_CANCEL_WAIT_S + 10.0)
        except concurrent.futures.TimeoutError:
            logger.warning("the stream's loop did not run the cancel of the requests in "
                           "flight within %g s (a starved host); the stream goes on",
                           _CANCEL_WAIT_S + 10.0)
            return 0

    async def _cancel_all(self) -> int:
        tasks = [s.task for s in self._sent if not s.task.done()]
        left = await cancel_and_wait(tasks, _CANCEL_WAIT_S)
        if left:
            logger.warning("%d of %d cancelled requests had not ended after %g s; they run on "
                           "into the next step", len(left), len(tasks), _CANCEL_WAIT_S)
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
        with self._lock:
            changes = list(self._in_flight_changes)
        return time_weighted_mean(changes, start_s, end_s)

    def num_in_flight(self) -> int:
        with self._lock:
            return self._num_in_flight

    @property
    def load(self) -> float:
        """The offered load now (`start`'s or the last `set_load`'s)."""
        with self._lock:
            return self._load

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

    async def _issue(self, clients: ClientPool) -> None:
        assert self._changed is not None
        next_send: float | None = None
        while not self._closing.is_set():
            with self._lock:
                load = self._load
            if self.axis == "concurrency":
                if self._num_in_flight >= load:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                self._send(clients, next(self._requests))
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
            self._send(clients, next(self._requests), scheduled_s=next_send)
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
        """The next gap at `rate` (`ArrivalGaps`: conditioned on their count over each block
        of the last `set_load`'s `gap_block`)."""
        return self._arrival_gaps.next_s(rate)

    def _send(self, clients: ClientPool, spec: RequestSpec,
              scheduled_s: float | None = None) -> None:
        now = self.clock()
        index, client = clients.acquire()
        task = asyncio.create_task(send_request(
            client, self.base_url, self.model, spec, self.timeout_s, on_chunk=self._heartbeat))
        task.add_done_callback(lambda _: clients.release(index))
        record = _Sent(spec=spec, sent_s=now, task=task, scheduled_s=scheduled_s)
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
