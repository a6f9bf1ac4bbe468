"""The load the simulated engine received against the load its client sent
(runners/capacity/judge.py `modelled_load_off`): a window whose arrivals, on the engine's
modelled clock, span more or less than the same requests' sends on the client's clock by more
than the tolerance was offered another load than its label's, in either direction. A step is
"load not applied" (the path a client's late sends take) unless its verdict holds at the label
all the same: a met at a heavier load, or a miss on the SLO at a load dilated past any host's
reach by the engine's own stall. The rule on
recorded spans, then on a fixed level's sends and replies (runners/applied_load.py), where any
such level is not applied: its figures, not a verdict, are what it reports."""

from __future__ import annotations

import pytest

from runners.applied_load import UNAPPLIED_KEY, judge_level_load
from runners.capacity.judge import (
    MIN_SPAN_ARRIVALS,
    MODELLED_STAMP_SLACK_S,
    STALL_SPREAD,
    WindowCounts,
    judge_window,
    modelled_load_off,
)
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput
from runners.loadgen.send_log import SendLog
from runners.simulated.engine import CATCH_UP_S
from runners.workload import SLO
from tests.builders import benchmark_metrics

_N = 120  # a window's requests: 12 req/s sent over 10 s
_SENT_SPAN_S = 10.0


def _counts(window_s: float, sent_span_s: float | None = _SENT_SPAN_S,
            num_sent: int = _N) -> WindowCounts:
    """A window of `num_sent` requests whose modelled arrivals span `window_s` and whose sends
    span `sent_span_s` (None: a real engine's window, with no modelled clock); every request
    ended in it, the in-flight count flat."""
    return WindowCounts(window_s=window_s, num_sent=num_sent, num_ended=num_sent,
                        mean_in_flight=20.0, waiting_rise=0.0, in_flight_rise=0.0,
                        sent_span_s=sent_span_s, client_window_s=_SENT_SPAN_S,
                        num_sent_late=0, late_bound_s=1.0 / 12.0)


def _judged(counts: WindowCounts, p99_tpot_ms: float = 6.3) -> tuple[bool, bool, str | None]:
    """(met, load not applied, reason) of a window whose percentiles meet the SLO (TPOT p99
    <= 15 ms) well, or at `p99_tpot_ms` miss it."""
    metrics = benchmark_metrics(p99_tpot_ms=p99_tpot_ms, p99_ttft_ms=80.0,
                                completed=counts.num_sent)
    verdict = judge_window(metrics, counts, SLO(tpot_p99_ms=15, ttft_p99_ms=1000),
                           max_failed_fraction=0.05, tolerance=0.1, min_requests=40,
                           min_window_s=10.0, max_window_s=60.0)
    return verdict.meets_slo, verdict.is_load_unapplied, verdict.reason


def test_arrivals_spread_wider_than_their_sends_past_the_tolerance_are_a_load_not_applied(
) -> None:
    """A host starved further delivers the requests ever later (one core shared with three
    spinning processes, 12 req/s, 2026-12-06: arrivals 10% sparser than sent): the engine
    received a lighter load than the step's, and its met SLO is not one at the label. Sent over
    10 s, arriving over 11.2 s: 10.7 req/s received of 12 sent (11% off), past a 10% tolerance;
    over 10.9 s (8% off), within it, and judged on its percentiles."""
    met, unapplied, reason = _judged(_counts(window_s=11.2))
    assert not met and unapplied, reason
    assert reason == ("load not applied: the simulated engine received 10.7 req/s on its "
                      "modelled clock where the client sent 12 (its arrivals spanned 12% more "
                      "than their sends: the requests reached it late (a busy host), or its "
                      "clock ran ahead of the wall (a stall it sleeps time-scaled)); the SLO is "
                      "not shown at this load")
    assert _judged(_counts(window_s=10.9)) == (True, False, None)


def test_a_miss_spread_out_by_a_busy_host_is_no_miss_at_its_label() -> None:
    """A busy host delivers the requests late and bunched: bunching raises TTFT, and the
    failures are counted on the client's busy clock, so a miss there (on the SLO or on
    failures) is not shown at the label either: load not applied."""
    met, unapplied, reason = _judged(_counts(window_s=11.2), p99_tpot_ms=460.0)
    assert not met and unapplied and reason is not None and \
        reason.startswith("load not applied: the simulated engine received 10.7 req/s"), reason
    failing = benchmark_metrics(p99_tpot_ms=6.3, completed=110, failed=10)
    verdict = judge_window(failing, _counts(window_s=11.2), SLO(tpot_p99_ms=15),
                           max_failed_fraction=0.05, tolerance=0.1, min_requests=40,
                           min_window_s=10.0)
    assert verdict.is_load_unapplied and not verdict.is_overload_errors, verdict


def test_a_miss_dilated_by_the_engines_own_stall_stands_and_says_so() -> None:
    """fp8_per_block's JIT stall is modelled in full and slept time-scaled, so the engine's
    clock runs far ahead of the wall (20x at 4 req/s): its arrivals are dilated evenly, past
    anything a host did (STALL_SPREAD), and a miss on its 450 ms steps at that lighter load is
    a miss at the label too. Its failures, counted on the client's clock, are not; nor is a
    met there."""
    counts = _counts(window_s=STALL_SPREAD * _SENT_SPAN_S + 1.0)
    met, unapplied, reason = _judged(counts, p99_tpot_ms=460.0)
    assert not met and not unapplied, reason
    assert reason == (
        "TPOT p99 460 ms > 15 ms; at a lighter load than its label (the engine received "
        "5.71 req/s of the 12 sent, on a modelled clock ahead of the wall: a stall it sleeps "
        "time-scaled), and latency does not fall as load rises"), reason
    assert _judged(counts)[:2] == (False, True)
    failing = judge_window(benchmark_metrics(p99_tpot_ms=460.0, completed=110, failed=10),
                           counts, SLO(tpot_p99_ms=15), max_failed_fraction=0.05,
                           tolerance=0.1, min_requests=40, min_window_s=10.0)
    assert failing.is_load_unapplied and not failing.is_overload_errors, failing


def test_arrivals_crowded_closer_than_their_sends_unmake_a_miss_but_not_a_met() -> None:
    """The other way: the engine's clock fell behind (lag it could not catch up), and the same
    sends landed closer together on it: a heavier load than the step's. Over 8.9 s, 13.5 req/s
    received of 12 (12% off) is past a 10% tolerance, so a miss there is no miss at the label;
    a met at that heavier load is a met at the label. Over 9.2 s (8.7% off), within it, the
    miss stands as measured."""
    met, unapplied, reason = _judged(_counts(window_s=8.9), p99_tpot_ms=16.0)
    assert not met and unapplied, reason
    assert reason is not None and reason.startswith(
        "load not applied: the simulated engine received 13.5 req/s on its modelled clock "
        "where the client sent 12 (its arrivals spanned 11% less than their sends: its clock "
        "fell behind the wall (a host too busy to run the model in real time))")
    assert _judged(_counts(window_s=8.9)) == (True, False, None)
    met, unapplied, reason = _judged(_counts(window_s=9.2), p99_tpot_ms=16.0)
    assert not met and not unapplied and reason is not None and "lighter" not in reason


def test_a_window_without_a_modelled_clock_is_never_judged_by_its_arrivals() -> None:
    """A real vLLM stamps no modelled clock: its window has no sends' span beside it, so the
    rule reads nothing; nor does a closed loop,
    whose load is its concurrency (judged by the requests it held)."""
    assert modelled_load_off(_counts(window_s=12.0, sent_span_s=None), 0.1) is None
    assert _judged(_counts(window_s=12.0, sent_span_s=None)) == (True, False, None)
    closed = judge_window(benchmark_metrics(p99_tpot_ms=6.3, completed=_N),
                          _counts(window_s=8.0), SLO(tpot_p99_ms=15), max_failed_fraction=0.05,
                          tolerance=0.1, is_closed_loop=True, concurrency=20.0)
    assert closed.meets_slo, closed.reason


def test_arrivals_stamped_at_one_instant_or_too_few_are_not_judged_by_their_span() -> None:
    """A window whose arrivals the engine stamped at one instant (floored to 1e-9 s by the
    staircase's counts) or with fewer than MIN_SPAN_ARRIVALS has no span to read a rate from:
    not a 100% error."""
    assert modelled_load_off(_counts(window_s=1e-9), 0.1) is None
    assert modelled_load_off(_counts(window_s=5.0, num_sent=MIN_SPAN_ARRIVALS - 1), 0.1) is None
    assert modelled_load_off(_counts(window_s=5.0, num_sent=MIN_SPAN_ARRIVALS), 0.1) is not None


def test_a_short_windows_spans_differ_past_the_tolerance_only_beyond_the_stamps_slack() -> None:
    """The engine stamps an arrival made while its loop catches up a late wake-up at the end of
    the step in flight, up to CATCH_UP_S early: a 2 s window read 20% long (0.4 s) is within
    what the stamps alone can do; read 0.6 s long it is not."""
    assert MODELLED_STAMP_SLACK_S >= 2 * CATCH_UP_S, "the slack covers the engine's catch-up"
    assert modelled_load_off(_counts(window_s=2.4, sent_span_s=2.0, num_sent=40), 0.1) is None
    assert modelled_load_off(_counts(window_s=2.6, sent_span_s=2.0, num_sent=40), 0.1) \
        is not None


@pytest.mark.parametrize(("clock_rate", "is_applied"), [(1.0, True), (1.15, False),
                                                         (0.85, False), (1.05, True)])
def test_a_fixed_rate_level_on_a_modelled_clock_is_judged_by_its_arrivals_against_its_sends(
        clock_rate: float, is_applied: bool) -> None:
    """A fixed level at 10 req/s, sent on time over 10 s, on the simulated engine: its arrivals
    spread over `clock_rate` of that on the modelled clock. 15% either way is a load not
    applied, with the two spans in its record; 5% is within the tolerance (10%)."""
    sends = SendLog()
    outputs = []
    for k in range(100):
        sends.record_send(k * 0.1, k * 0.1)
        arrival = 50.0 + clock_rate * k * 0.1
        outputs.append(RequestOutput(success=True, start_time=1000.0 + k * 0.1,
                                     modelled_span_s=(arrival, arrival + 2.0)))
    applied = judge_level_load(LoadLevel(request_rate_rps=10.0), sends, outputs, (), 0.1)
    assert (applied.reason is None) == is_applied, applied.reason
    figures = applied.as_server_metrics()
    assert figures["applied.sent_span_s"] == pytest.approx(10.0)
    assert figures["applied.modelled_span_s"] == pytest.approx(10.0 * clock_rate)
    assert (UNAPPLIED_KEY in figures) == (not is_applied)
    # The same level's replies without the modelled clock (a real vLLM's): not judged so.
    real = [RequestOutput(success=True, start_time=o.start_time) for o in outputs]
    assert judge_level_load(LoadLevel(request_rate_rps=10.0), sends, real, (), 0.1).reason \
        is None
