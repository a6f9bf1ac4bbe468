"""A staircase window on the simulated engine's modelled clock (runners/capacity/step.py
`_counts`, runners/capacity/judge.py `short_window`): that clock leaves out the engine loop's
late wake-ups, so on a host that cannot run the engine in real time it runs slower than the
client's, and the same sends read as denser arrivals over a shorter window. The outputs here
are built as the client reads them: a send time on its clock (`start_time`) and the server's
modelled arrival and last token (`modelled_span_s`)."""

from __future__ import annotations

from runners.capacity.driver import StaircaseDriver
from runners.capacity.judge import judge_window, short_window
from runners.capacity.step import _counts
from runners.loadgen.client import RequestOutput
from runners.workload import SLO
from tests.builders import benchmark_metrics

_RATE = 12.0  # req/s the client sends, one every 1/12 s
_LIFE_S = 12.0  # each request's modelled life
_CLIENT_T0 = 5000.0  # the client's clock (time.perf_counter()) at the window's first send
_MODELLED_T0 = 70.0  # the modelled clock at that request's arrival


def _stream(first: int, last: int, clock_rate: float) -> list[RequestOutput]:
    """Requests `first`..`last - 1` of a steady stream at `_RATE`, whose modelled clock runs at
    `clock_rate` of the client's (1: in step; 0.9: 10% slow)."""
    outputs = []
    for i in range(first, last):
        arrival = _MODELLED_T0 + clock_rate * i / _RATE
        outputs.append(RequestOutput(success=True, start_time=_CLIENT_T0 + i / _RATE,
                                     modelled_span_s=(arrival, arrival + _LIFE_S)))
    return outputs


def test_a_window_whose_modelled_clock_ran_slow_is_judged_on_the_clients_sends() -> None:
    """The lead's dry run (2026-12-06, 2 cores): 116 requests sent over 10 s read as 8.95 s of
    modelled arrivals, and the step at 12 req/s missed on "window too short" with its TPOT p99
    at 6.3 ms of 15 (about 8% slow). Sent over 10 s and read 8% short on the modelled clock, a
    window of 120 is a measurement; its counts stay on the modelled clock, where the engine
    kept up."""
    window = _stream(0, 120, clock_rate=0.92)
    recent = _stream(-300, 120, clock_rate=0.92)  # the warm-up's requests end in the window
    with StaircaseDriver("http://127.0.0.1:9", "model", iter(()), axis="request_rate",
                         timeout_s=1.0, seed=0) as driver:
        counts = _counts(driver, [], 0.0, 10.0, window, recent)
    assert counts.window_s < 9.3, "the modelled arrivals span 9.2 s: the premise"
    assert short_window(counts, min_requests=40, min_window_s=10.0, max_window_s=60.0) is None
    assert counts.sent_span_s is not None and abs(counts.sent_span_s - 10.0) < 1e-6
    # Sends and ends are counted on one clock: the engine completed what it was offered.
    assert counts.num_ended == counts.num_sent == 120
    slo = SLO(tpot_p99_ms=15)
    metrics = benchmark_metrics(p99_tpot_ms=6.3, p99_ttft_ms=80.0, completed=120)
    verdict = judge_window(metrics, counts, slo, max_failed_fraction=0.05, tolerance=0.1,
                           min_requests=40, min_window_s=10.0, max_window_s=60.0)
    assert verdict.meets_slo, verdict.reason


def test_a_window_short_on_both_clocks_is_still_no_measurement() -> None:
    """The length rule keeps its meaning: sends over 5 s of a 10 s minimum are too short
    whichever clock reads them, and a wave sent at one instant spans no time on either."""
    with StaircaseDriver("http://127.0.0.1:9", "model", iter(()), axis="request_rate",
                         timeout_s=1.0, seed=0) as driver:
        half = _counts(driver, [], 0.0, 5.0, _stream(0, 60, clock_rate=1.0), [])
        wave = [RequestOutput(success=True, start_time=_CLIENT_T0 + i * 1e-3,
                              modelled_span_s=(_MODELLED_T0, _MODELLED_T0 + _LIFE_S))
                for i in range(128)]
        burst = _counts(driver, [], 0.0, 10.0, wave, wave)
    short = short_window(half, min_requests=40, min_window_s=10.0, max_window_s=60.0)
    assert short is not None and short.startswith("window too short: 60 requests in 5 s")
    assert short_window(burst, min_requests=40, min_window_s=3.0, max_window_s=60.0) \
        is not None, "a wave sent at one instant spans no time on the client's clock either"

