"""Walking one step of the staircase on the running stream: the load set, the warm-up
(and an open loop's settling wait, cut short where the step has already missed the SLO), the
measured window(s), the load kept flowing until every measured request has ended; what the
window showed, counted on the client's clock or on the server's modelled one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from runners.capacity.driver import STOPPED_ERROR, StaircaseDriver
from runners.capacity.judge import (
    WindowCounts,
    counter_rate_per_s,
    is_in_flight_settled,
    least_squares_rise,
)
from runners.capacity.plan import StepPlan
from runners.capacity.slo import WarmupSoFar
from runners.capacity.spans import modelled_spans
from runners.loadgen.client import RequestOutput

logger = logging.getLogger(__name__)


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
    # a hold cut short: why it had missed whatever its remaining requests would do (None: not)
    decided_early: str | None = None
    # a step stopped in its warm-up, before any window: why its requests ended so far had
    # already missed the SLO (`slo.missed_in_warmup`; None: not). `early_outputs` are theirs.
    missed_in_warmup: str | None = None


def measure_step(driver: StaircaseDriver, base_url: str, plan: StepPlan, *, repeats: int,
                 request_timeout_s: float, check_engine: Callable[[], None],
                 is_first: bool = False,
                 decide: Callable[[list[RequestOutput], int], str | None] | None = None,
                 warmup_decide: Callable[[WarmupSoFar], str | None] | None = None,
                 ) -> StepRun:
    """Walk one step: set the load (the stream goes on from the step before), wait out the
    warm-up, measure `repeats` consecutive windows, then keep the load flowing until every
    measured request has ended. `check_engine` is called every 0.2 s and raises to abort (the
    engine died or stalled). A rate step whose waiting queue keeps growing is stopped at once:
    saturated. The caller cancels a missed step's backlog. A hold on a rate is cut short once
    `decide` (given the window's ended requests so far and the most it can send) says it has
    missed whatever its remaining requests do; its measured requests still end under load.
    An open loop's step (not a hold) is stopped in its warm-up, with no window, once
    `warmup_decide` (given what it has shown so far, every `_DECIDE_EVERY_S`) says it has
    already missed (`slo.missed_in_warmup`); the caller cancels its backlog as for any miss."""
    from runners import prometheus

    api_key = driver.api_key  # /metrics asks for it as the completions do
    step_start = driver.now()
    watch = WarmupWatch(driver, step_start, plan.load, warmup_decide) if \
        warmup_decide is not None and driver.axis == "request_rate" and not plan.is_hold \
        else None
    if not is_first or plan.is_hold:
        driver.set_load(plan.load, gap_block=plan.gap_block)
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
    decided: str | None = None
    missed: str | None = None  # stopped in its warm-up: why (`WarmupWatch`)
    try:
        sleep_until(driver, step_start + plan.warmup_s, check_engine, saturated, stop=watch)
        if driver.axis == "request_rate" and not (watch and watch.reason):
            is_settled = settle(driver, step_start, plan, check_engine, saturated, stop=watch)
        missed = watch.reason if watch is not None else None
        if not is_saturated() and missed is None:
            before = prometheus.scrape(base_url, api_key=api_key)
            for k in range(max(1, repeats)):
                start = driver.now() if k == 0 else bounds[-1][1]
                if plan.is_hold and driver.axis == "request_rate":
                    # The window starts a block of arrivals: it offers its load over each
                    # whole block, with one partial block at its end (ArrivalGaps).
                    driver.set_load(plan.load, gap_block=plan.gap_block)
                    decided = hold_until(driver, start, plan, check_engine, saturated,
                                         decide=decide)
                else:
                    sleep_until(driver, start + plan.window_s, check_engine, saturated)
                    extend_window(driver, start, plan, check_engine, saturated)
                bounds.append((start, driver.now()))
                if is_saturated() or decided is not None:
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
        records = driver.sent_between(a, b)
        outputs = driver.outputs(records)
        counts = _counts(driver, samples, a, b, outputs, recent)
        if driver.axis == "request_rate":
            bound = late_bound_s(plan.load)
            late = sum((r.late_s or 0.0) > bound for r in records)
            counts = replace(counts, num_sent_late=late, late_bound_s=bound)
        windows.append((outputs, counts))
    server: dict[str, float] = {}
    if before and after and not is_saturated():
        server.update(prometheus.delta(before, after))
    window_samples = [(t, v) for t, v in samples
                      if bounds and bounds[0][0] <= t <= bounds[-1][1]]
    server.update(prometheus.summarize(window_samples or samples))
    early: list[RequestOutput] = []
    early_s = driver.now() - step_start
    if is_saturated() or missed is not None:  # what the step had sent until its stop
        early = driver.outputs(driver.sent_between(step_start, driver.now()))
    if is_saturated():
        server.update(_saturated_rates(samples))
    elif missed is not None:  # its server figures are its warm-up's, not a window's
        server["steady.is_missed_in_warmup"] = 1.0
    driver.prune(step_start)
    window_start = bounds[0][0] if bounds else driver.now()
    return StepRun(plan=plan, windows=tuple(windows), early_outputs=early,
                   early_duration_s=early_s, server=server, is_saturated=is_saturated(),
                   is_finished=is_finished,
                   window_start_s=window_start, warmup_s=window_start - step_start,
                   is_settled=is_settled, decided_early=decided, missed_in_warmup=missed)


def sleep_until(driver: StaircaseDriver, deadline_s: float, check_engine: Callable[[], None],
                saturated: threading.Event | None,
                stop: Callable[[], bool] | None = None) -> None:
    """Wait on the driver's clock until `deadline_s`, calling `check_engine` every 0.2 s (it
    raises to abort); back early once `saturated` is set or `stop` says so."""
    while driver.now() < deadline_s:
        check_engine()
        if (saturated is not None and saturated.is_set()) or (stop is not None and stop()):
            return
        time.sleep(min(0.2, max(0.0, deadline_s - driver.now())))


def extend_window(driver: StaircaseDriver, start: float, plan: StepPlan,
                  check_engine: Callable[[], None], saturated: threading.Event | None) -> None:
    """Keep a step's window (or a profiled one: runners/capacity/profile_window.py) open past
    its planned end while it has sent fewer than `plan.min_requests`, up to
    `plan.max_window_s` from `start` (a light step's cap: it then measures fewer, and says how
    many). A closed loop sends only as its requests end: past its
    knee they outlive the life its window was sized from, and a window of the planned length
    sent 2 requests at concurrency 128 (the held-out study, 2026-12-06)."""
    end = math.inf if plan.max_window_s is None else start + plan.max_window_s
    if len(driver.sent_between(start, driver.now())) >= plan.min_requests or \
            driver.now() >= end:
        return
    while len(driver.sent_between(start, driver.now())) < plan.min_requests and \
            driver.now() < end and not (saturated is not None and saturated.is_set()):
        sleep_until(driver, min(end, driver.now() + 0.2), check_engine, saturated)
    logger.info("window at %g extended to %.1f s (planned %.1f s) for %d requests sent",
                plan.load, driver.now() - start, plan.window_s,
                len(driver.sent_between(start, driver.now())))


_MIN_LATE_S = 0.01  # s; a send this late is within the client's timer granularity


def late_bound_s(rate: float) -> float:
    """How late an arrival at `rate` may be sent before it counts as late: one mean gap (a
    send that late has moved past where the next arrival was due: the process is no longer the
    one offered), 10 ms at least."""
    return max(_MIN_LATE_S, 1.0 / rate)


_OFFERED_OFF = 0.02  # a window that offered this far off its load says so (`offered_note`)


def offered_note(load: float, num_sent: int, window_s: float) -> str | None:
    """"offered 15.8 req/s over its 98 s" where a hold's window offered more than 2% off its
    `load`, else None: a reason read as the load's must say when the window tested another.
    A hold at 14.6 req/s on the H100 (2026-12-06) offered 15.8 over the 98 s it ran, with its
    arrivals then free, and its miss was read as one at 14.6."""
    offered = num_sent / window_s if window_s > 0 else 0.0
    if load <= 0 or abs(offered / load - 1.0) <= _OFFERED_OFF:
        return None
    return f"offered {offered:.3g} req/s over its {window_s:.0f} s"


_DECIDE_EVERY_S = 2.0  # how often a hold looks at its ended requests
_COUNT_SIGMAS = 6.0  # the arrivals a hold may still send: their mean plus this many deviations


def most_requests(sent: int, rate: float, remaining_s: float, burstiness: float) -> int:
    """The most requests a window that has sent `sent` can hold once `remaining_s` more of
    arrivals at `rate` have come: the mean plus `_COUNT_SIGMAS` deviations of a free gamma
    process's count (gaps of shape `burstiness`, Poisson at 1: its variance is about its mean /
    burstiness), plus a few, a bound a draw passes far less than once in a million. A hold's
    arrivals, conditioned on their count over blocks (`ArrivalGaps`), have the same mean and
    at most that variance (a partial block's count is binomial for Poisson gaps, about so for
    gamma): the bound holds for them."""
    mean = max(0.0, rate * remaining_s)
    return sent + math.ceil(mean + _COUNT_SIGMAS * math.sqrt(mean / max(burstiness, 1e-3)) + 6)


def hold_until(driver: StaircaseDriver, start: float, plan: StepPlan,
               check_engine: Callable[[], None], saturated: threading.Event | None, *,
               decide: Callable[[list[RequestOutput], int], str | None] | None) -> str | None:
    """A hold's window from `start`: wait out `plan.window_s` as `sleep_until` does, asking
    `decide` every `_DECIDE_EVERY_S` with the window's ended requests and the most it can
    send (`most_requests`); its reason once it has missed whatever the rest do (the window
    ends there), else None."""
    end = start + plan.window_s
    while True:
        sleep_until(driver, min(end, driver.now() + _DECIDE_EVERY_S), check_engine, saturated)
        now = driver.now()
        if now >= end or decide is None or (saturated is not None and saturated.is_set()):
            return None
        sent = driver.sent_between(start, now)
        ended = [o for o in driver.outputs([x for x in sent if x.ended_s is not None])
                 if o.error != STOPPED_ERROR]
        reason = decide(ended, most_requests(len(sent), plan.load, end - now,
                                             driver.burstiness))
        if reason is not None:
            logger.info("hold at %g: stopped after %.0f of %.0f s: %s", plan.load,
                        now - start, plan.window_s, reason)
            return reason


class WarmupWatch:
    """Whether an open loop's step has already missed in its warm-up: called while it waits,
    it asks `decide` every `_DECIDE_EVERY_S` about the requests sent since the step began
    (`WarmupSoFar`), and is True (with `reason`) once `decide` has said why."""

    def __init__(self, driver: StaircaseDriver, step_start: float, load: float,
                 decide: Callable[[WarmupSoFar], str | None]) -> None:
        self.driver, self.step_start, self.load, self.decide = driver, step_start, load, decide
        self.in_flight_at_start = driver.mean_in_flight(step_start - 1.0, step_start)
        self.reason: str | None = None
        self._next_s = step_start + _DECIDE_EVERY_S

    def __call__(self) -> bool:
        now = self.driver.now()
        if self.reason is not None or now < self._next_s:
            return self.reason is not None
        self._next_s = now + _DECIDE_EVERY_S
        sent = self.driver.sent_between(self.step_start, now)
        ended = [o for o in self.driver.outputs([x for x in sent if x.ended_s is not None])
                 if o.error != STOPPED_ERROR]
        bound = late_bound_s(self.load)
        self.reason = self.decide(WarmupSoFar(
            ended=ended, num_sent=len(sent),
            num_sent_late=sum((x.late_s or 0.0) > bound for x in sent),
            in_flight_at_start=self.in_flight_at_start,
            in_flight_now=self.driver.mean_in_flight(now - 1.0, now),
            elapsed_s=now - self.step_start))
        if self.reason is not None:
            logger.info("step at %g: stopped after %.0f s of warm-up: %s", self.load,
                        now - self.step_start, self.reason)
        return self.reason is not None


def settle(driver: StaircaseDriver, step_start: float, plan: StepPlan,
           check_engine: Callable[[], None], saturated: threading.Event | None,
           stop: Callable[[], bool] | None = None) -> bool:
    """Extend an open loop's warm-up, up to `plan.max_warmup_s`, while its in-flight count
    still rises (sampled every 0.5 s since the step began); False at once where `stop` says
    so (the step has missed: `WarmupWatch`)."""
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
        if stop is not None and stop():
            return False
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
    busy host that delays the server's wall time must not read as falling behind).

    On the modelled clock the window runs from its first to its last arrival plus one mean gap,
    and the requests that ended and the time in flight are counted over that span, so the
    rates and the in-flight count are all of the load the modelled engine saw. That clock is
    the loop's wall time less the lag the engine's loop could not catch up
    (runners/simulated/engine.py `CATCH_UP_S`): where the host cannot run the engine in real
    time it runs slower than the client's, and the same sends read as denser arrivals over a
    shorter window (before the catch-up, 10 s sent read as 8.95 s modelled on 2 cores); a host
    starved further delivers them ever later, and they read as sparser arrivals over a longer
    one. So the span of the same requests' sends on the client's clock goes with it
    (`WindowCounts.sent_span_s`, `modelled_spans`), measured alike, for the length rule and for
    the rate the engine received against the rate sent (`judge.modelled_load_off`)."""
    from runners import prometheus

    waiting = [(t, s[prometheus.NUM_REQUESTS_WAITING]) for t, s in samples
               if start <= t <= end and prometheus.NUM_REQUESTS_WAITING in s]
    rise = least_squares_rise(waiting)
    max_waiting = max((w for _, w in waiting), default=None)
    in_system = tuple(s[prometheus.NUM_REQUESTS_RUNNING]
                      + s.get(prometheus.NUM_REQUESTS_WAITING, 0.0) for t, s in samples
                      if start <= t <= end and prometheus.NUM_REQUESTS_RUNNING in s)
    spans_m = modelled_spans(sent)
    if spans_m is not None:
        t0, window = spans_m.start_s, spans_m.window_s
        t1 = t0 + window
        spans = [o.modelled_span_s for o in recent if o.modelled_span_s is not None]
        ended = sum(t0 <= b < t1 for _, b in spans)
        area = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)
        window = max(window, 1e-9)
        return WindowCounts(window_s=window, num_sent=len(sent), num_ended=ended,
                            mean_in_flight=area / window, waiting_rise=rise,
                            max_waiting=max_waiting, server_in_system=in_system,
                            client_window_s=end - start,
                            sent_span_s=spans_m.sent_span_s)
    grid = np.arange(start, end, 0.25)
    in_flight = [(float(t), driver.mean_in_flight(float(t), float(t) + 0.25)) for t in grid]
    return WindowCounts(window_s=max(end - start, 1e-9), num_sent=len(sent),
                        num_ended=driver.num_ended_between(start, end),
                        mean_in_flight=driver.mean_in_flight(start, end),
                        waiting_rise=rise, max_waiting=max_waiting,
                        in_flight_rise=least_squares_rise(in_flight)
                        if driver.axis == "request_rate" else None,
                        server_in_system=in_system, client_window_s=end - start)


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
