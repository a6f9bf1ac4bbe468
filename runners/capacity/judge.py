"""Judging a staircase step's window: the SLO and steady state (completions keep up with
arrivals, the in-flight count and the waiting queue stay flat; a closed loop's concurrency was
applied), and whether an open loop's in-flight count has settled before its window. Pure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from runners.base import BenchmarkMetrics
from runners.capacity.slo import failures_miss, slo_miss
from runners.workload import SLO

_SETTLED_TOLERANCE = 0.05  # of the count, over one life: the in-flight count has settled
# sqrt(n)s: how far a step's in-flight line may rise by chance over a window of about one life.
# A step's arrivals are Poisson conditioned on their count per block of 64. Modelled as an
# M/G/inf queue at the H100's loads (bench/h100/rise_noise.py: n = 113-172 in flight, windows
# of 11-14 s, lives of 5.5-19 s), the line's rise had a standard deviation of 0.7-0.9 sqrt(n)
# and a 99th percentile of 1.6-2.0 sqrt(n) (free Poisson arrivals: 1.4-1.7 and 3.3-3.8
# sqrt(n)). 2 sqrt(n) is the completions' noise floor too. The
# tolerance alone (10% of the mean) failed two steps on the H100 whose percentiles met, with
# rises of 17 and 18 at means of 167 and 115 (1.3 and 1.7 sqrt(n)); vLLM's own client later met
# the SLO at 12.65 req/s, above the 12.2 the second one "missed" (docs/h100-steady.md).
_RISE_NOISE = 2.0


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
    # requests: the server's own count of the requests it held (`vllm:num_requests_running` +
    # `vllm:num_requests_waiting`) at each of the window's /metrics samples
    server_in_system: tuple[float, ...] = ()
    # s: the window on the client's clock (its sends' bounds), where `window_s` is on the
    # server's modelled one (the simulated engine); None: the same as `window_s`
    client_window_s: float | None = None
    # s: where `window_s` is read from the modelled arrivals, the same requests' sends on the
    # client's clock, read alike (first to last, plus one mean gap); None: not read (a real
    # engine's window: its server stamps no modelled clock)
    sent_span_s: float | None = None
    # An open loop's sends: how many of the window's requests the client sent later than their
    # scheduled arrival by more than `late_bound_s` (None: no schedule, a closed loop)
    num_sent_late: int = 0
    late_bound_s: float | None = None

    @property
    def server_mean_in_system(self) -> float | None:
        """The server's running + waiting, averaged over the window's samples (None: none)."""
        return float(np.mean(self.server_in_system)) if self.server_in_system else None


@dataclass(frozen=True)
class Verdict:
    """A step's verdict: whether it met the SLO in steady state, and if not, why (one line)."""

    meets_slo: bool
    reason: str | None = None  # why it missed; None when it met
    is_overload_errors: bool = False  # it missed because requests failed
    # the load was not applied (the client fell behind, or a closed loop's server held fewer):
    # not a measurement of the config at that load
    is_load_unapplied: bool = False


def judge_window(metrics: BenchmarkMetrics, counts: WindowCounts | None, slo: SLO, *,
                 max_failed_fraction: float, tolerance: float,
                 is_saturated: bool = False, is_closed_loop: bool = False,
                 concurrency: float | None = None,
                 min_requests: int = 0, min_window_s: float = 0.0,
                 max_window_s: float | None = None) -> Verdict:
    """A step against the SLO and steady state.

    Missed when: the server's queue kept growing (the step was stopped early); more requests
    failed than `max_failed_fraction` (at a load the server cannot keep up with, refused
    connections and timeouts are a missed SLO, not a broken config); a p99 is over its bound
    (a TPOT bound holds where no request had a second token, as in vLLM's goodput); the
    requests that ended in the window fell short of those sent in it by more than the
    tolerance or the count's noise (2 sqrt(n) for a mean of n in flight), whichever is larger,
    i.e. the in-flight count grew; its least-squares line rose by more than the tolerance of
    its mean or the line's noise (2 sqrt(n)), whichever is larger (4 at least), over the window
    (a slow ramp the end points hide; the warm-up waits out a ramp first); or the
    waiting queue rose by more than the tolerance of the requests sent (4 at least) over the
    window. A closed loop cannot fall behind its own sends: only the queue counts there. A
    hold's line is judged as a step's: its arrivals keep a Poisson process's swings within a
    life but their count is pinned over blocks of four lives (runners/capacity/
    stream_source.py), and over a 224 s hold at the H100's decode load (n = 214, blocks of
    1308, modelled: bench/h100/hold_offered_spread.py) the line's chance rise has a standard
    deviation of about 0.6 sqrt(n) and a 99th percentile of 1.35 sqrt(n), never past the bound
    in 2000 draws (with the free arrivals holds drew until the fifteenth session, 0.9 and 2.1
    sqrt(n), 1.2% past it, which is why their line was not judged). Only that load is
    modelled: at a light one, where four lives hold fewer than 64 arrivals, the block's floor
    makes it many lives long and the line's noise nearer the free case's. On the H100 the
    holds that met had lines that fell (-17, -4, -12 requests) and the two that missed rose
    by 51 (3.4-4.3 sqrt(n)).

    An open loop whose client sent more than the tolerance of its requests late
    (`late_sends`) did not apply its load: the host fell behind, not the server. Nor, on the
    simulated engine, did one whose modelled clock received its requests at a rate off the
    rate they were sent at by more than the tolerance (`modelled_load_off`), unless the
    verdict holds at the label all the same. Latency does not fall as load rises: a window
    that met at a heavier load (arrivals crowded on a clock that fell behind) met at its label.
    A window spread out by a busy host was delivered late and bunched, so neither its met nor
    its miss is shown. A kernel JIT the engine models while serving (fp8_per_block) is slept
    time-scaled, so its clock runs far ahead of the client's (`STALL_SPREAD`): its arrivals are
    dilated evenly, and a miss there, on the SLO or steadiness (not on failures, which the
    client's clock counts), is a miss at the label too; its reason says so. A met there is
    still no measurement.

    A window too short to be a measurement (`short_window`: fewer than `min_requests` sent, or
    shorter than `min_window_s`) has not met the SLO, whatever its percentiles.

    A closed loop at `concurrency` whose load was not applied (`unapplied_load`: the server, or
    the client, held fewer requests than that over the window) has not met the SLO at that
    concurrency, whatever its percentiles, which are of a lighter load."""
    if is_saturated:
        return Verdict(False, "the waiting queue kept growing (stopped early: saturated)")
    if counts is not None:
        short = short_window(counts, min_requests, min_window_s, max_window_s)
        if short is not None:
            return Verdict(False, short)
        late = None if is_closed_loop else late_sends(counts, tolerance)
        if late is not None:
            return Verdict(False, late, is_load_unapplied=True)
    verdict = _judge_applied(metrics, counts, slo, max_failed_fraction=max_failed_fraction,
                             tolerance=tolerance, is_closed_loop=is_closed_loop,
                             concurrency=concurrency)
    off = None if counts is None or is_closed_loop else modelled_load_off(counts, tolerance)
    if off is None or verdict.is_load_unapplied or counts is None:
        return verdict
    sent_span_s = counts.sent_span_s or 0.0
    if counts.window_s < sent_span_s:
        # Crowded (the engine's clock fell behind): latency does not fall as load rises, so a
        # met at that heavier load is a met at the label; a miss there says nothing of it.
        return verdict if verdict.meets_slo else Verdict(False, off, is_load_unapplied=True)
    if verdict.meets_slo or verdict.is_overload_errors or \
            counts.window_s <= STALL_SPREAD * sent_span_s:
        # Spread out as a busy host delivers requests: late and bunched, so neither a met nor a
        # miss (bunching raises TTFT; the failures are on the client's busy clock) is shown.
        return Verdict(False, off, is_load_unapplied=True)
    # Spread past any host's reach: the engine's own stall, slept time-scaled, dilated the
    # arrivals evenly, and a lighter load of the same shape missed: a miss at the label too.
    received, sent = counts.num_sent / counts.window_s, counts.num_sent / sent_span_s
    return replace(verdict, reason=(
        f"{verdict.reason}; at a lighter load than its label (the engine received "
        f"{received:.3g} req/s of the {sent:.3g} sent, on a modelled clock ahead of the wall: "
        "a stall it sleeps time-scaled), and latency does not fall as load rises"))


def _judge_applied(metrics: BenchmarkMetrics, counts: WindowCounts | None, slo: SLO, *,
                   max_failed_fraction: float, tolerance: float, is_closed_loop: bool,
                   concurrency: float | None) -> Verdict:
    """`judge_window` past its checks of the window (saturated, too short, sent late): the
    failures, a closed loop's load, the SLO and steadiness."""
    failed = failures_miss(metrics, max_failed_fraction)
    if failed is not None:
        return Verdict(False, failed, is_overload_errors=True)
    if is_closed_loop and concurrency is not None and counts is not None:
        unapplied = unapplied_load(counts, concurrency, tolerance)
        if unapplied is not None:
            return Verdict(False, unapplied, is_load_unapplied=True)
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
            counts.in_flight_rise > max(tolerance * counts.mean_in_flight,
                                        _RISE_NOISE * math.sqrt(max(counts.mean_in_flight, 1.0)),
                                        4.0):
        return Verdict(False, f"the in-flight count rose by {counts.in_flight_rise:.0f} over "
                              f"the {counts.window_s:.0f} s window (not steady)")
    if counts.waiting_rise is not None and \
            counts.waiting_rise > max(tolerance * counts.num_sent, 4.0):
        return Verdict(False, f"the waiting queue grew by {counts.waiting_rise:.0f} requests "
                              f"over the {counts.window_s:.0f} s window")
    return Verdict(True)


def short_window(counts: WindowCounts, min_requests: int, min_window_s: float,
                 max_window_s: float | None) -> str | None:
    """Why a window is too short to be a measurement, or None: it sent fewer than
    `min_requests` (unless it ran to `max_window_s` on the client's clock: a light step's cap,
    whose record says how many it measured), or it lasted less than `min_window_s` on its own
    clock. On the simulated engine's modelled clock a window is read from its first and last
    arrival, which falls short of its true length by about one mean gap (1/n of it) with a
    spread of about 1.4 gaps: the rule allows 7 gaps (half the window at most); under 8
    arrivals the client's clock gives the length. A closed loop whose requests all refill at
    one step's end reads as a window of no length.

    That clock runs slower than the client's where the host cannot run the engine in real time
    (it leaves out the lag the engine's loop could not catch up; before the catch-up, every
    late wake-up: 10 s of sends read as 8.95 s of arrivals on a 2-core host, a miss at 12 req/s
    whose TPOT p99 was 6.3 ms of 15). So the window lasts
    the longer of its arrivals' span and its sends' on the client's clock (`sent_span_s`, read
    alike: a wave sent at one instant spans no time on either); the real engine's window is
    on the client's clock alone, as before."""
    client_s = counts.client_window_s if counts.client_window_s is not None else \
        counts.window_s
    is_capped = max_window_s is not None and client_s >= max_window_s
    slack = max(0.5, 1.0 - 7.0 / max(counts.num_sent, 1))
    # A span of a few arrivals says little of the window's length (one arrival spans none):
    # below MIN_SPAN_ARRIVALS the client's clock measures it.
    length = max(counts.window_s, counts.sent_span_s or 0.0) \
        if counts.num_sent >= MIN_SPAN_ARRIVALS else \
        client_s
    if (counts.num_sent < min_requests and not is_capped) or length < min_window_s * slack:
        return (f"window too short: {counts.num_sent} requests in {counts.window_s:.3g} s "
                f"(a measurement needs {min_requests} and {min_window_s:g} s)")
    return None


# The fewest arrivals whose span measures a window's length (one arrival spans none).
MIN_SPAN_ARRIVALS = 8

# A window whose modelled arrivals span more than this many times their sends was dilated by
# the simulated engine's own stall (a kernel JIT while serving, modelled in full and slept
# time-scaled: 20x at 4 req/s), not by a host: hosts have spread them by about 11% at most
# (one core shared with three spinning processes, 2026-12-06).
STALL_SPREAD = 2.0

# s: how far the simulated engine may stamp one end of a window's arrivals off the wall less
# its lag without a host that failed to keep up: an arrival while its loop catches up a late
# wake-up is stamped at the end of the step in flight, up to CATCH_UP_S (0.25 s,
# runners/simulated/engine.py) and a step early. Twice that, so a short window's span is
# never read finer than the stamps allow (tests/runners/test_modelled_load.py ties the two).
MODELLED_STAMP_SLACK_S = 0.5


def modelled_load_off(counts: WindowCounts, tolerance: float) -> str | None:
    """Why an open loop on the simulated engine did not apply its load, or None: the rate its
    requests reached the engine at, on the engine's modelled clock (`num_sent` over
    `window_s`), is off the rate its client sent them at (over `sent_span_s`, read alike) by
    more than the tolerance, in either direction, and the two spans differ by more than the
    engine's stamps can (`MODELLED_STAMP_SLACK_S`: it governs windows under 5 s at a 10%
    tolerance). Only a window that carries both spans is judged: the real vLLM has no
    modelled clock, so its windows have no `sent_span_s` and never read so.

    The sends are the window's load as a real engine receives it: the label, up to the
    arrivals' chance, which every step carries and its record keeps. The engine's clock moves
    that load where the host cannot keep pace: a clock that falls behind (the lag the engine's
    loop could not catch up) crowds the arrivals, and a host starved further delivers the
    requests ever later and spreads them out (one core shared with three spinning processes,
    12 req/s, 2026-12-06: 10% sparser than sent), so a step that met did so at a lighter load
    than its label. A stall the engine models in full but sleeps time-scaled (a kernel JIT
    while serving) runs its clock ahead of the wall and spreads them out too, by far more.
    Both rates are of the same requests, so the count's Poisson (or gamma)
    noise is common to both and drops out: on a host that keeps up they agree within 0.1%
    (2.1% with both cores of a 2-core host spun), whatever the draw. Against the label
    instead, a step's window of 200 arrivals (conditioned over blocks of 64) is off by chance
    by 2.7% at one standard deviation and by up to 10.5% (modelled: 4000 windows of 10 s at
    20 req/s drawn by `ArrivalGaps`), so a bound that no quiet host passes could not read a
    10% error at all. The tolerance is the search's: its
    bracket stops when its ends are that close, so a load off its label by less is one the
    search could not tell from it."""
    sent_span_s = counts.sent_span_s
    if sent_span_s is None or sent_span_s <= 0 or counts.window_s < 1e-6 or \
            counts.num_sent < MIN_SPAN_ARRIVALS:
        # a span of a few arrivals says little (`short_window`); nor does one of no length,
        # where `step._counts` floors a window whose arrivals were stamped at one instant
        return None
    sent = counts.num_sent / sent_span_s
    received = counts.num_sent / counts.window_s
    if abs(received / sent - 1.0) <= tolerance or \
            abs(counts.window_s - sent_span_s) <= MODELLED_STAMP_SLACK_S:
        return None
    spread = counts.window_s / sent_span_s - 1.0
    cause = ("the requests reached it late (a busy host), or its clock ran ahead of the wall "
             "(a stall it sleeps time-scaled)") if spread > 0 else \
        "its clock fell behind the wall (a host too busy to run the model in real time)"
    return (f"load not applied: the simulated engine received {received:.3g} req/s on its "
            f"modelled clock where the client sent {sent:.3g} (its arrivals spanned "
            f"{abs(spread):.0%} {'more' if spread > 0 else 'less'} than their sends: {cause}); "
            "the SLO is not shown at this load")


def late_sends(counts: WindowCounts, tolerance: float) -> str | None:
    """Why an open loop did not apply its load, or None: more than the tolerance of the
    window's requests (one at least) were sent later than due by more than
    `counts.late_bound_s`. A client starved of CPU sends late and bunched (on a busy host the
    simulated engine's rate steps missed on "completed 58 of 60 req/s offered" with every p99
    far inside the SLO and the queue empty); its percentiles are of a load nobody offered."""
    if counts.late_bound_s is None or counts.num_sent <= 0:
        return None
    if counts.num_sent_late > max(tolerance * counts.num_sent, 1.0):
        share = counts.num_sent_late / counts.num_sent
        return (f"load not applied: the client sent {share:.0%} of its requests more than "
                f"{counts.late_bound_s * 1000:.0f} ms late ({counts.num_sent_late} of "
                f"{counts.num_sent}); the SLO is not shown at this load")
    return None


_MIN_SERVER_SAMPLES = 3  # /metrics samples of a window before the server's count judges it


def unapplied_load(counts: WindowCounts, concurrency: float, tolerance: float) -> str | None:
    """Why a closed loop at `concurrency` did not apply its load over the window, or None when
    it did: the requests in flight (time-weighted: on the client's clock, or on the simulated
    engine's modelled clock, where they are the server's own spans) fell short of the
    concurrency by more than the tolerance of it (one request at least); or the server's own
    count (running + waiting, three /metrics samples at least) did, by more than that and twice
    its samples' standard error. A client starved of CPU sends late and reads its replies
    late: its own count stays near the concurrency while the server runs far fewer.

    The tolerance, as for an open loop that completed less than it offered: a claim at the
    concurrency would overstate what the server was shown to serve by more than the search's
    own resolution. The standard error, as the open loop's count noise: the gauges are
    instants, and a closed loop of equal requests runs in waves whose gaps (the client's
    turnaround, milliseconds against a life of seconds on a GPU) one sample in ten may hit.
    """
    allowed = max(tolerance * concurrency, 1.0)
    if concurrency - counts.mean_in_flight > allowed:
        return (f"load not applied: {counts.mean_in_flight:.3g} of {concurrency:.0f} requests "
                f"in flight on average over the {counts.window_s:.3g} s window; the SLO is not "
                f"shown at {concurrency:.0f}")
    samples = counts.server_in_system
    # Three samples at least: two have one degree of freedom for their own noise, and two
    # equal ones none at all (two reads of 0 running + waiting, scraped as a short window of 8
    # concurrent requests closed on a starved 2-core host, failed a confirmation round whose
    # 48 requests had all completed, 2026-12-07).
    if len(samples) >= _MIN_SERVER_SAMPLES:
        mean = float(np.mean(samples))
        error = float(np.std(samples, ddof=1)) / math.sqrt(len(samples))
        if concurrency - mean > max(allowed, 2.0 * error):
            return (f"load not applied: the server held {mean:.3g} of {concurrency:.0f} "
                    f"requests (running + waiting, {len(samples)} samples) over the "
                    f"{counts.window_s:.3g} s window; the SLO is not shown at "
                    f"{concurrency:.0f}")
    return None


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
