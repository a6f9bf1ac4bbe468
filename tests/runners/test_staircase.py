"""The steady staircase (runners/capacity/): how a step is sized, what it must show to meet the
SLO, and that one continuous stream walks every step of a trial on one server."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from runners.base import BenchmarkMetrics, EngineConfig
from runners.capacity.driver import StaircaseDriver
from runners.capacity.judge import Verdict, WindowCounts, is_in_flight_settled, judge_window
from runners.capacity.plan import StepPlan, lifetime_estimate_s, plan_hold, plan_step
from runners.capacity.search import CapacitySearch
from runners.capacity.slo import slo_miss
from runners.capacity.step import measure_step
from runners.capacity.stream_source import endless_requests
from runners.engine import EngineRunner
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.requests import RequestSpec, build_requests
from runners.simulated.launcher import SimulatedLauncher
from runners.workload import SLO, LengthDistribution, Workload
from tests.builders import benchmark_metrics, simulated_engine, staircase_workload

DECODE = Workload(input_len=LengthDistribution("uniform", 250, 100, 400),
                  output_len=LengthDistribution("uniform", 1000, 600, 1400),
                  slo=SLO(tpot_p99_ms=15))


def _metrics(*, completed: int = 200, failed: int = 0, p99_tpot_ms: float | None = 12.0,
             p99_ttft_ms: float | None = 200.0) -> BenchmarkMetrics:
    return benchmark_metrics(p99_tpot_ms=p99_tpot_ms, p99_ttft_ms=p99_ttft_ms,
                             completed=completed, failed=failed, duration_s=20.0,
                             request_throughput=completed / 20.0)


def _steady(num_sent: int = 200, num_ended: int = 200, in_flight: float = 150.0,
            rise: float | None = 0.0) -> WindowCounts:
    return WindowCounts(window_s=20.0, num_sent=num_sent, num_ended=num_ended,
                        mean_in_flight=in_flight, waiting_rise=rise)


def _judge(metrics: BenchmarkMetrics, counts: WindowCounts | None,
           **kw: object) -> Verdict:
    return judge_window(metrics, counts, DECODE.slo, max_failed_fraction=0.05,
                        tolerance=0.1, **kw)  # type: ignore[arg-type]


# -- sizing a step ------------------------------------------------------------------------------

def test_a_requests_life_is_sized_from_the_slo_bound_and_the_longest_answers() -> None:
    life = lifetime_estimate_s(DECODE)
    # 2 s for a first token nobody bounded, then 1359 more tokens at the 15 ms TPOT bound.
    assert math.isclose(life, 2.0 + (600 + 0.95 * 800 - 1) * 0.015)
    assert lifetime_estimate_s(DECODE, measured_e2el_s=40.0) == 40.0, \
        "a step that measured longer lives sizes the next warm-up by them"


def test_a_step_warms_up_two_lives_and_measures_enough_requests_in_a_bounded_window() -> None:
    search = CapacitySearch("request_rate", low=1, high=32, min_window_requests=200,
                            min_window_s=10, max_window_s=60)
    plan = plan_step(search, 10.0, 20.0)
    assert plan.warmup_s == 40.0 and plan.max_warmup_s == 80.0, "two lives, up to four"
    assert plan.window_s == 20.0 and plan.expected_requests == 200.0
    assert plan_step(search, 40.0, 20.0).window_s == 10.0, "at least min_window_s"
    assert plan_step(search, 1.0, 20.0).window_s == 60.0, "at most max_window_s"
    fixed = CapacitySearch("request_rate", low=1, high=32, warmup_s=5.0)
    assert plan_step(fixed, 10.0, 20.0).warmup_s == 5.0, "the user's warm-up wins"


def test_a_step_whose_in_flight_count_still_rises_is_not_settled() -> None:
    ramp = [(t * 0.5, min(150.0, t * 3.0)) for t in range(40)]  # still climbing at 20 s
    assert not is_in_flight_settled(ramp, lifetime_s=14.0)
    plateau = [(t * 0.5, min(150.0, t * 3.0)) for t in range(200)]
    assert is_in_flight_settled(plateau, lifetime_s=14.0)


def test_arrivals_offer_exactly_the_labelled_rate_over_each_block() -> None:
    driver = StaircaseDriver("http://127.0.0.1:9", "m", iter(()),
                             axis="request_rate", timeout_s=10, seed=3)
    gaps = [driver._gap_s(8.0) for _ in range(640)]
    for k in range(10):
        assert math.isclose(sum(gaps[64 * k:64 * (k + 1)]), 64 / 8.0), \
            "each block of 64 arrivals spans exactly 64 / rate seconds"
    assert 0.8 < float(np.std(gaps) / np.mean(gaps)) < 1.2, "Poisson-like within a block"


def test_close_stops_the_stream_even_where_the_cancel_never_reaches_its_loop() -> None:
    """Python 3.11's `asyncio.wait_for` swallows a cancel that lands as its wait ends (a
    request ended at that moment): the stream then ran on and `close` joined it for ever. The
    cancel's loss is forced here (no task to cancel); `close` must still end the thread."""
    import threading

    workload = Workload(input_len=LengthDistribution(mean=16),
                        output_len=LengthDistribution(mean=4))
    requests = endless_requests(lambda n, s: build_requests(workload, n, seed=s), 64, 0,
                                False)
    driver = StaircaseDriver("http://127.0.0.1:9", "m", requests, axis="request_rate",
                             timeout_s=5, seed=0)
    driver.start(200.0)  # port 9 refuses: every request ends at once, waking the loop
    driver._sending = None  # the cancel is lost, as wait_for loses it
    closer = threading.Thread(target=driver.close, daemon=True)
    closer.start()
    closer.join(timeout=60.0)
    assert not closer.is_alive(), "close returned: the sending loop stopped on its own"


def test_a_streams_requests_are_spread_over_clients_of_at_most_32_in_flight() -> None:
    """httpcore 1.0's pool walks every connection it holds for each queued request whenever a
    request starts or ends: on one client, a saturated step's 1,700 requests in flight cost
    2.7 ms of client CPU each against 1.9 spread over clients (bench/staircase_client_cpu.py)."""
    import asyncio

    import httpx

    from runners.loadgen.clients import REQUESTS_PER_CLIENT, ClientPool

    async def spread() -> None:
        made: list[httpx.AsyncClient] = []

        def make() -> httpx.AsyncClient:
            made.append(httpx.AsyncClient(trust_env=False))
            return made[-1]

        async with ClientPool(make, REQUESTS_PER_CLIENT) as clients:
            held = [clients.acquire() for _ in range(100)]
            assert len(made) == 4, "100 requests in flight on 4 clients of at most 32"
            counts = {id(c): sum(c is d for _, d in held) for c in made}
            assert max(counts.values()) <= REQUESTS_PER_CLIENT
            for index, _ in held[:40]:
                clients.release(index)
            index, client = clients.acquire()
            assert len(made) == 4 and client is made[index], "a freed place is taken again"
        assert all(c.is_closed for c in made), "every client closed with the stream"

    asyncio.run(spread())


# -- judging a window ---------------------------------------------------------------------------

def test_a_steady_step_within_the_slo_meets_it() -> None:
    assert _judge(_metrics(), _steady()).meets_slo


def test_a_step_whose_completions_fall_behind_its_arrivals_misses() -> None:
    verdict = _judge(_metrics(), _steady(num_sent=200, num_ended=150, in_flight=40.0))
    assert not verdict.meets_slo and "completed 7.5 of 10 req/s offered" in str(verdict.reason)
    noisy = _judge(_metrics(), _steady(num_sent=200, num_ended=185, in_flight=40.0))
    assert noisy.meets_slo, "within the tolerance and the count's noise"


def test_a_window_measured_on_a_ramp_misses_though_its_end_points_look_steady() -> None:
    """A ramp the end points hide: sends and ends differ by 8 of 147, inside the count's noise,
    but the in-flight count's least-squares line rose by more than the tolerance of its mean
    and its noise (2 sqrt(141) = 24): on the H100 a step measured on its ramp read TPOT p99
    14.0 ms where vLLM's client read 17.4 ms at the same rate (docs/h100-steady.md)."""
    ramp = WindowCounts(window_s=14.0, num_sent=147, num_ended=139,
                        mean_in_flight=141.0, waiting_rise=0.0, in_flight_rise=30.0)
    verdict = _judge(_metrics(), ramp)
    assert not verdict.meets_slo and "in-flight count rose by 30" in str(verdict.reason)


def test_a_steps_in_flight_line_rising_within_its_noise_is_not_a_ramp() -> None:
    """The H100's fp8 step at 12.2 req/s (fourteenth session): percentiles well within the SLO
    (TPOT p99 9.31 ms of 15), a line that rose by 18 at a mean of 115 in flight: over the
    tolerance (11.5) but within the line's noise (2 sqrt(115) = 21: bench/h100/rise_noise.py).
    It was judged a miss, and vLLM's own client met the SLO above it, at 12.65 req/s."""
    window = WindowCounts(window_s=12.3, num_sent=153, num_ended=137,
                          mean_in_flight=114.6, waiting_rise=0.0, in_flight_rise=17.8)
    assert _judge(_metrics(p99_tpot_ms=9.31), window).meets_slo
    rising = WindowCounts(window_s=12.3, num_sent=153, num_ended=137,
                          mean_in_flight=114.6, waiting_rise=0.0, in_flight_rise=22.0)
    assert not _judge(_metrics(p99_tpot_ms=9.31), rising).meets_slo


def test_a_step_whose_waiting_queue_grows_misses_whatever_its_percentiles() -> None:
    verdict = _judge(_metrics(p99_tpot_ms=9.0), _steady(rise=40.0))
    assert not verdict.meets_slo and "waiting queue grew by 40" in str(verdict.reason)
    assert not _judge(_metrics(), _steady(), is_saturated=True).meets_slo


def test_a_closed_loop_is_judged_on_its_queue_not_on_its_own_sends() -> None:
    behind = _steady(num_sent=200, num_ended=150, in_flight=40.0)
    assert _judge(_metrics(), behind, is_closed_loop=True).meets_slo


def test_a_closed_loop_whose_server_held_far_fewer_than_its_concurrency_has_not_met_it() -> None:
    """A starved client (a busy host) keeps its own count at the concurrency while the server
    runs far fewer: one CI run judged 256 concurrent requests met the SLO at a load the
    server never saw. The load was not applied, so the SLO is not shown at 256."""
    starved = WindowCounts(window_s=5.0, num_sent=300, num_ended=300, mean_in_flight=255.0,
                           waiting_rise=0.0, server_in_system=(52.0, 61.0, 70.0, 57.0, 60.0))
    verdict = _judge(_metrics(p99_tpot_ms=9.0), starved, is_closed_loop=True, concurrency=256)
    assert not verdict.meets_slo and not verdict.is_overload_errors
    assert verdict.reason == ("load not applied: the server held 60 of 256 requests (running + "
                              "waiting, 5 samples) over the 5 s window; the SLO is not shown "
                              "at 256"), verdict.reason
    # The modelled clock's spans (the simulated engine) are the server's own count.
    short = WindowCounts(window_s=2.0, num_sent=300, num_ended=300, mean_in_flight=200.0,
                         waiting_rise=0.0)
    verdict = _judge(_metrics(), short, is_closed_loop=True, concurrency=256)
    assert not verdict.meets_slo and "200 of 256 requests in flight" in str(verdict.reason)


def test_a_closed_loop_short_of_its_concurrency_within_the_tolerance_meets_it() -> None:
    """A healthy client's shortfall is its turnaround between a reply and the next send: up to
    the tolerance of the concurrency (one request at least) is the load applied; and a server
    sample that fell into a wave's gap is within the samples' noise."""
    near = WindowCounts(window_s=5.0, num_sent=300, num_ended=300, mean_in_flight=256.0,
                        waiting_rise=0.0, server_in_system=(231.0, 231.0, 231.0))
    assert _judge(_metrics(), near, is_closed_loop=True, concurrency=256).meets_slo
    assert not _judge(_metrics(), near, is_closed_loop=True, concurrency=258).meets_slo
    small = WindowCounts(window_s=5.0, num_sent=40, num_ended=40, mean_in_flight=3.1,
                         waiting_rise=0.0, server_in_system=(3.0, 4.0, 3.0))
    assert _judge(_metrics(), small, is_closed_loop=True, concurrency=4).meets_slo, \
        "one request short of 4 is within the floor"
    two = WindowCounts(window_s=1.12, num_sent=48, num_ended=48, mean_in_flight=8.0,
                       waiting_rise=0.0, server_in_system=(0.0, 0.0))
    assert _judge(_metrics(), two, is_closed_loop=True, concurrency=8).meets_slo, \
        "two samples (one degree of freedom, none where equal) are too few to judge the load by"
    gap = WindowCounts(window_s=10.0, num_sent=100, num_ended=100, mean_in_flight=64.0,
                       waiting_rise=0.0, server_in_system=(64.0,) * 7 + (0.0,))
    assert _judge(_metrics(), gap, is_closed_loop=True, concurrency=64).meets_slo, \
        "one sample of eight in a wave's gap: a mean of 56, within twice its standard error (8)"
    client = WindowCounts(window_s=10.0, num_sent=100, num_ended=100, mean_in_flight=57.0,
                          waiting_rise=0.0)
    assert not _judge(_metrics(), client, is_closed_loop=True, concurrency=64).meets_slo, \
        "the in-flight count is time-weighted, not sampled: no noise to allow"
    open_loop = _steady(in_flight=40.0)
    assert _judge(_metrics(), open_loop, concurrency=256).meets_slo, \
        "an open loop has no concurrency to apply"


def test_a_window_of_too_few_requests_or_seconds_is_no_measurement() -> None:
    """The held-out study (s05): the first step at concurrency 128 "met" the SLO on 2 requests
    in a 0.09 s window (its arrivals' span on the modelled clock) with min_window_requests 40
    and min_window_s 3; the claim rested on it."""
    two = WindowCounts(window_s=0.089, num_sent=2, num_ended=2, mean_in_flight=128.0,
                       waiting_rise=0.0, client_window_s=3.0)
    verdict = _judge(_metrics(completed=2), two, is_closed_loop=True, concurrency=128,
                     min_requests=40, min_window_s=3.0, max_window_s=180.0)
    assert not verdict.meets_slo and verdict.reason is not None
    assert verdict.reason.startswith("window too short: 2 requests in 0.089 s"), verdict.reason
    wave = WindowCounts(window_s=1e-9, num_sent=128, num_ended=128, mean_in_flight=128.0,
                        waiting_rise=0.0, client_window_s=3.2)
    assert "window too short: 128 requests" in str(_judge(
        _metrics(), wave, is_closed_loop=True, concurrency=128, min_requests=40,
        min_window_s=3.0).reason), "a wave refilled at one instant spans no time"
    # The modelled clock reads a window about a gap short: within 7 gaps is a measurement.
    near = WindowCounts(window_s=2.6, num_sent=40, num_ended=40, mean_in_flight=20.0,
                        waiting_rise=0.0, client_window_s=3.0)
    assert _judge(_metrics(), near, min_requests=40, min_window_s=3.0).meets_slo
    # A light step capped by max_window_s measures fewer, and says how many in its record.
    capped = WindowCounts(window_s=60.0, num_sent=30, num_ended=30, mean_in_flight=3.0,
                          waiting_rise=0.0, client_window_s=60.0)
    assert _judge(_metrics(completed=30), capped, min_requests=200, min_window_s=10.0,
                  max_window_s=60.0).meets_slo
    assert not _judge(_metrics(completed=30), replace(capped, client_window_s=20.0),
                      min_requests=200, min_window_s=10.0, max_window_s=60.0).meets_slo
    # One arrival spans no modelled time: a capped light step's length is the client's 3 s.
    lone = WindowCounts(window_s=1e-9, num_sent=1, num_ended=1, mean_in_flight=1.0,
                        waiting_rise=0.0, client_window_s=3.0)
    assert _judge(_metrics(completed=1), lone, min_requests=200, min_window_s=1.0,
                  max_window_s=3.0).meets_slo


def test_a_step_plan_carries_its_windows_minimums_and_a_hold_is_not_extended() -> None:
    search = CapacitySearch("concurrency", low=1, high=128, min_window_requests=40,
                            min_window_s=3.0, max_window_s=180.0)
    step = plan_step(search, 128, lifetime_s=6.65)
    assert (step.min_requests, step.min_window_s, step.max_window_s) == (40, 3.0, 180.0)
    hold = plan_hold(search, 128, lifetime_s=6.65)
    assert hold.min_requests == 0 and hold.max_window_s is None


def test_an_open_loop_whose_client_sent_late_did_not_apply_its_load() -> None:
    """The held-out study (s06) on a busy host: rate steps missed on "completed X of Y
    offered" with every p99 far inside the SLO and the queue empty; the client fell behind,
    not the server. Its sends show it: more than the tolerance of them late by more than a
    mean gap is a load not applied, not a miss of the config at that load."""
    late = WindowCounts(window_s=5.0, num_sent=300, num_ended=240, mean_in_flight=30.0,
                        waiting_rise=0.0, num_sent_late=90, late_bound_s=1 / 60)
    verdict = _judge(_metrics(p99_tpot_ms=9.0), late)
    assert not verdict.meets_slo and verdict.is_load_unapplied
    assert verdict.reason == ("load not applied: the client sent 30% of its requests more "
                              "than 17 ms late (90 of 300); the SLO is not shown at this "
                              "load"), verdict.reason
    on_time = replace(late, num_ended=298, num_sent_late=20)
    assert _judge(_metrics(), on_time).meets_slo, "7% of 300 late is within the tolerance"
    assert not _judge(_metrics(), replace(on_time, num_ended=240)).is_load_unapplied, \
        "a client on time that saw fewer complete: the server fell behind, a plain miss"


def test_a_starved_rate_client_records_how_late_each_request_was_sent() -> None:
    """The driver knows when each arrival was due: a client whose loop is blocked 30 ms per
    request cannot send 100 a second on time (a gap is 10 ms), and every send says how late
    it was; the requests need no server to be sent (they fail to connect)."""
    import time

    from runners.capacity.step import late_bound_s

    def starved() -> Iterator[RequestSpec]:
        while True:
            time.sleep(0.03)  # blocks the driver's event loop, as a starved host does
            yield RequestSpec(prompt=[1, 2, 3], prompt_len=3, output_len=4)

    driver = StaircaseDriver("http://127.0.0.1:9", "model", starved(), axis="request_rate",
                             timeout_s=1.0, seed=0)
    driver.start(100.0)
    try:
        time.sleep(1.0)
        sent = driver.sent_between(-math.inf, math.inf)
    finally:
        driver.close()
    bound = late_bound_s(100.0)
    assert bound == pytest.approx(0.01)
    late = [s for s in sent if s.late_s is not None and s.late_s > bound]
    assert len(sent) >= 5 and len(late) > 0.5 * len(sent), [s.late_s for s in sent]
    assert all(s.late_s is not None and s.late_s >= 0 for s in sent)


def test_overload_errors_are_a_missed_step_and_say_so() -> None:
    verdict = _judge(_metrics(completed=150, failed=50), _steady())
    assert not verdict.meets_slo and verdict.is_overload_errors
    assert "50 of 200 requests failed" in str(verdict.reason)


def test_a_p99_over_its_bound_misses_with_the_figure() -> None:
    verdict = _judge(_metrics(p99_tpot_ms=17.4), _steady())
    assert not verdict.meets_slo and verdict.reason == "TPOT p99 17.4 ms > 15 ms"


# -- one stream, one server ---------------------------------------------------------------------

@pytest.fixture
def simulated(tmp_path: Path) -> EngineRunner:
    return EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.01, seed=0),
                        tmp_path / "registry")


def _endless_requests() -> Iterator[RequestSpec]:
    """The stream a step draws from: 128-in / 64-out requests, built 64 at a time (seed 0)."""
    workload = Workload(input_len=LengthDistribution(mean=128),
                        output_len=LengthDistribution(mean=64))
    return endless_requests(lambda n, s: build_requests(workload, n, seed=s), 64, 0, False)


def test_arrivals_keep_flowing_until_every_measured_request_has_ended(tmp_path: Path) -> None:
    """No drain bias: the step's load still arrives after its window, while its measured
    requests end, and after the last of them has ended. (Read as sends in the window's tail
    and after the step returned, not as a send within 0.2 s of the last end: a host busy
    enough to stall the sender for 0.3 s failed that in CI, with or without the sender's turn
    of the loop between sends, 2-3 runs of 8 with three spinning processes on 2 cores.)"""
    with simulated_engine(tmp_path) as url:
        driver = StaircaseDriver(url, "model", _endless_requests(), axis="request_rate",
                                 timeout_s=30, seed=0)
        plan = StepPlan(load=30.0, warmup_s=0.5, window_s=1.0, lifetime_s=0.5,
                        expected_requests=30.0, max_warmup_s=0.5)
        driver.start(30.0)
        try:
            run = measure_step(driver, url, plan, repeats=1, request_timeout_s=30,
                               check_engine=lambda: None, is_first=True)
            returned = driver.clock()
            (outputs, counts), = run.windows
            assert outputs and all(o.success for o in outputs) and run.is_finished
            # The window ran until the step read its end (`extend_window`), past its plan.
            assert counts.client_window_s is not None
            window_end = run.window_start_s + counts.client_window_s
            measured = driver.sent_between(run.window_start_s, window_end)
            assert counts.num_sent == len(measured) == len(outputs)
            last_end = max(s.ended_s or math.inf for s in measured)
            assert driver.sent_between(window_end, last_end), \
                "requests were still being sent while the measured ones ended"
            deadline = returned + 10.0
            while not driver.sent_between(returned, math.inf) and driver.clock() < deadline:
                time.sleep(0.05)
            assert driver.sent_between(returned, math.inf), \
                "the step's load kept flowing after its last measured request ended"
        finally:
            driver.close()


def test_a_closed_loop_window_stays_open_until_it_has_sent_its_minimum(tmp_path: Path) -> None:
    """A closed loop sends only as its requests end: a window sized for lives shorter than the
    real ones sends too few. It stays open (up to max_window_s) until it has sent
    min_requests, so the step is judged on a measurement, not on a handful."""
    with simulated_engine(tmp_path) as url:
        driver = StaircaseDriver(url, "model", _endless_requests(), axis="concurrency",
                                 timeout_s=30, seed=0)
        # Two in flight over a 0.2 s window: a request or two, where 12 are asked for.
        plan = StepPlan(load=2.0, warmup_s=0.3, window_s=0.2, lifetime_s=0.3,
                        expected_requests=1.3, max_warmup_s=0.3, min_requests=12,
                        min_window_s=0.2, max_window_s=60.0)
        driver.start(2.0)
        try:
            run = measure_step(driver, url, plan, repeats=1, request_timeout_s=30,
                               check_engine=lambda: None, is_first=True)
            (outputs, counts), = run.windows
            assert counts.num_sent >= 12 and len(outputs) == counts.num_sent
            assert counts.client_window_s is not None and counts.client_window_s > 0.2
            assert all(o.success for o in outputs) and run.is_finished
        finally:
            driver.close()


def test_a_starved_client_on_the_simulated_engine_is_an_unapplied_load_not_a_met_slo(
        tmp_path: Path) -> None:
    """The fault CI hit, forced: the client's loop is blocked 20 ms at each send (a host whose
    other work starves it), so it refills at most 50 requests a second where 64 requests of
    well under a second each need over a hundred. The SLO is loose enough that only the
    unapplied load can miss it."""
    import time

    with simulated_engine(tmp_path) as url:
        def starved() -> Iterator[RequestSpec]:
            for spec in _endless_requests():
                time.sleep(0.02)  # blocks the driver's event loop, as a starved host does
                yield spec

        driver = StaircaseDriver(url, "model", starved(), axis="concurrency", timeout_s=30,
                                 seed=0)
        # A window of 4 s: the server is sampled about once a second, and two samples, one of
        # them the loop's first fill, are noise too wide to judge (a CI run on a loaded host:
        # samples 0 and 64, judged within their noise)
        plan = StepPlan(load=64, warmup_s=1.0, window_s=4.0, lifetime_s=0.5,
                        expected_requests=512.0)
        driver.start(64)
        try:
            run = measure_step(driver, url, plan, repeats=1, request_timeout_s=30,
                               check_engine=lambda: None, is_first=True)
        finally:
            driver.close()
        (outputs, counts), = run.windows
        assert outputs and all(o.success for o in outputs)
        loose = SLO(tpot_p99_ms=1000.0)
        metrics = compute_metrics(outputs, counts.window_s, loose)
        # its percentiles meet the SLO: only the load's shortfall can miss it (the waiting
        # queue may still grow under a starved client's bursts on a loaded host: a CI run)
        assert slo_miss(metrics, loose, 0.05) is None
        verdict = judge_window(metrics, counts, loose, max_failed_fraction=0.05,
                               tolerance=0.1, is_closed_loop=True, concurrency=64)
        assert not verdict.meets_slo and "load not applied" in str(verdict.reason), \
            (verdict, counts)


def test_a_capacity_search_walks_every_step_and_profiles_the_operating_point_in_one_stream(
        simulated: EngineRunner, tmp_path: Path) -> None:
    """A whole capacity search runs on one engine without a restart, every step after a
    warm-up and judged; and the label's trace and the headline describe one operating point:
    the profiled window is part of the same stream, at the highest load that met the SLO,
    after its warm-up (not a fresh batch into an emptied server), and the result says what it
    covered. (One search shows both: a search costs most of a minute of a 2-core host.)"""
    # `high` 80, twice the simulated engine's ~40 req/s: a first step at the default 400
    # floods the client host, whose late sends then leave later steps' loads unapplied.
    workload = staircase_workload({"profile": True, "profile_num_requests": 40}, hold_s=0,
                                  high=80)
    config = EngineConfig(model="qwen2.5-7b", load_format="dummy", skip_tokenizer_init=True)
    result = simulated.run(config, workload, tmp_path / "w")
    assert result.status == "complete", result.failure
    assert len(result.steps) >= 2 and result.capacity is not None
    for step in result.steps:
        assert step.meets_slo is not None
        assert step.server_metrics["steady.warmup_s"] > 0, "every step excludes a warm-up"
        if step.meets_slo:
            assert step.offered_rate_rps is not None and step.miss_reason is None
            assert step.metrics.completed >= 1
        else:
            assert step.miss_reason, "a missed step says why"
    met = [s for s in result.steps if s.meets_slo]
    assert met, "the search found a load within the SLO"
    operating = max(met, key=lambda s: s.level.request_rate_rps or 0.0)
    summary = result.trace_summary
    assert summary is not None and result.trace_path is not None and \
        result.trace_path.is_file(), "a trace was taken and read"
    assert summary["profile.request_rate_rps"] == operating.level.request_rate_rps, \
        "the profile ran at the operating point's load"
    assert summary["profile.is_in_stream"] == 1.0 and summary["profile.is_operating_point"]
    assert summary["profile.warmup_s"] >= 2 * summary["profile.lifetime_s"] > 0, \
        "the stream ran two request lives at that load before the window"
    assert summary["profile.num_sent"] >= 30 and summary["profile.window_s"] > 0
    assert summary["profile.mean_in_flight"] > 0, "the window was served under load"
    log = (tmp_path / "w" / "server.log").read_text()
    assert log.count("Application startup complete") <= 1, \
        "one engine for every step and the profile: the same stream"
