"""Judging a measured level against the SLO: the checks every capacity probe and staircase
window share (too many failed requests, none completed, a p99 over its bound), whether a
window still running has already missed it whatever its remaining requests do, and whether a
step has already missed it in its warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from runners.base import BenchmarkMetrics
from runners.loadgen.client import RequestOutput
from runners.loadgen.metrics import tpot_s
from runners.workload import SLO


def meets_slo(metrics: BenchmarkMetrics, slo: SLO, max_failed_fraction: float,
              is_saturated: bool = False) -> bool:
    """Whether a level's p99 latencies are within the SLO and its requests succeeded (a level
    stopped for saturation never is): `slo_miss` finds nothing."""
    return not is_saturated and slo_miss(metrics, slo, max_failed_fraction) is None


def failures_miss(metrics: BenchmarkMetrics, max_failed_fraction: float) -> str | None:
    """Why a level failed on its errors (more failed than `max_failed_fraction`), else None."""
    total = metrics.completed + metrics.failed
    if total and metrics.failed / total > max_failed_fraction:
        return f"{metrics.failed} of {total} requests failed (allowed {max_failed_fraction:.0%})"
    return None


def slo_miss(metrics: BenchmarkMetrics, slo: SLO, max_failed_fraction: float) -> str | None:
    """Why a level missed the SLO (one line), else None: too many failed requests, none
    completed, or a p99 over its bound. A TPOT bound holds where no request had a second token
    (the p99 is undefined, and vLLM's goodput counts such a request's TPOT as 0)."""
    failed = failures_miss(metrics, max_failed_fraction)
    if failed is not None:
        return failed
    if not metrics.completed:
        return "no request completed"
    for name, bound_ms, p99_ms, is_vacuous in (
            ("TTFT", slo.ttft_p99_ms, metrics.p99_ttft_ms, False),
            ("TPOT", slo.tpot_p99_ms, metrics.p99_tpot_ms, True),
            ("E2E latency", slo.e2el_ms, metrics.p99_e2el_ms, False)):
        if bound_ms is None:
            continue
        if p99_ms is None:
            if not is_vacuous:
                return f"no {name} measured"
        elif not p99_ms <= bound_ms:
            return f"{name} p99 {p99_ms:.3g} ms > {bound_ms:g} ms"
    return None


def p99_over_at_most(num_over: int, max_count: int) -> bool:
    """Whether the p99 (numpy's linear percentile, as `compute_metrics` and vLLM take it) of
    any n <= `max_count` values, `num_over` of which are over a bound, is over it: both ranks
    it interpolates between, floor and ceil of 0.99 (n - 1), then hold such values. n minus
    that floor never falls as n grows, so the largest n is the hardest case."""
    return max_count >= 1 and num_over >= max_count - math.floor(0.99 * (max_count - 1))


def certain_miss(outputs: Sequence[RequestOutput], slo: SLO, max_failed_fraction: float,
                 max_count: int) -> str | None:
    """Why a window whose ended `outputs` so far are some of its at most `max_count` requests
    misses the SLO whatever the rest do (one line), or None while it could still meet it:
    more failed than `max_failed_fraction` of `max_count`, or enough requests over a bound
    that the p99 is over it at any count up to `max_count` (`p99_over_at_most`). A request
    still running is not passed: it can only add to a miss."""
    failed = sum(not o.success for o in outputs)
    if failed > max_failed_fraction * max_count:
        return (f"{failed} requests failed, over {max_failed_fraction:.0%} of the at most "
                f"{max_count} it sends")
    ok = [o for o in outputs if o.success]
    for name, bound_ms, values in (
            ("TTFT", slo.ttft_p99_ms, [o.ttft_s for o in ok]),
            ("TPOT", slo.tpot_p99_ms, [t for o in ok if (t := tpot_s(o)) is not None]),
            ("E2E latency", slo.e2el_ms, [o.latency_s for o in ok])):
        if bound_ms is None:
            continue
        over = sum(v * 1000.0 > bound_ms for v in values)
        if p99_over_at_most(over, max_count):
            return (f"{over} requests over the {name} bound of {bound_ms:g} ms, more than a "
                    f"p99 allows of the at most {max_count} it sends")
    return None


# A step that misses in its warm-up (`missed_in_warmup`): every percentile the SLO bounds is a
# p99. Its ended requests must be at least this many (a p99 of fewer rests on their largest one
# or two), more than this margin over a bound, and more of them than a p99's 1% tail would put
# there by chance more often than once in `_WARMUP_CHANCE`.
_SLO_PERCENTILE = 0.99
MIN_WARMUP_REQUESTS = max(20, round(1.0 / (1.0 - _SLO_PERCENTILE)))
WARMUP_MARGIN = 0.10  # of the bound
_WARMUP_CHANCE = 1e-6


@dataclass(frozen=True)
class WarmupSoFar:
    """What an open loop's step has shown since its load was set, before its window."""

    ended: Sequence[RequestOutput]  # the requests sent since the load was set that have ended
    num_sent: int  # requests sent since the load was set (ended or not)
    num_sent_late: int  # of them, sent later than due by more than one mean gap
    in_flight_at_start: float  # requests in flight when the load was set
    in_flight_now: float  # requests in flight now (averaged over the last second)
    elapsed_s: float  # s since the load was set


def tail_count(num: int, fraction: float = 1.0 - _SLO_PERCENTILE,
               chance: float = _WARMUP_CHANCE) -> int:
    """The fewest of `num` independent draws, each over a bound with probability `fraction`,
    that are over it together with probability at most `chance` (a binomial upper tail;
    `num` + 1 where even all of them are not that rare)."""
    log_ratio = math.log(fraction) - math.log1p(-fraction)
    log_pmf = num * math.log1p(-fraction)  # k = 0
    below = 0.0  # P(X <= k)
    for k in range(num + 1):
        below += math.exp(log_pmf)
        if 1.0 - below <= chance:
            return k + 1
        log_pmf += math.log((num - k) / (k + 1)) + log_ratio if k < num else 0.0
    return num + 1


def missed_in_warmup(so_far: WarmupSoFar, slo: SLO, *, tolerance: float,
                     is_ttft_judged: bool = True) -> str | None:
    """Why an open loop's step has missed the SLO before its window (one line), or None while
    its warm-up cannot say.

    The requests sent since the load was set lived under that load or a lighter one while the
    in-flight count rose toward its steady count: each saw a batch, and a queue ahead of its
    first token, no larger than the steady window's would, so its TPOT, TTFT and end-to-end
    latency are at most what the window would read (a server whose steps slow as its batch
    grows; and the first to end are the short answers, which saw the lightest batches).
    Where at least `MIN_WARMUP_REQUESTS` of them have ended and more of them are over
    (1 + `WARMUP_MARGIN`) x a bound than a 1% tail would put there by chance once in a
    million (`tail_count`), the steady p99 is over the bound: the step has missed. (A
    batch's requests share its steps, so they are not independent draws: hence the margin
    as well as the count, and only a clear miss is decided here.)

    It cannot say (None) when the count has fallen since the load was set (the step began
    above its steady count: a heavier backlog that was not cancelled), or when the client sent
    more than `tolerance` of its requests late (a starved client reads its replies late too:
    its latencies may be its own). With `is_ttft_judged` False only TPOT is judged: where the
    first requests' first tokens may come later than the steady ones' (a stream's first step
    starts on an emptied prefix cache, which prompts that share prefixes fill as it runs)."""
    if so_far.in_flight_now < so_far.in_flight_at_start:
        return None
    if so_far.num_sent_late > max(tolerance * so_far.num_sent, 1.0):
        return None
    ok = [o for o in so_far.ended if o.success]
    for name, bound_ms, values in (
            ("TPOT", slo.tpot_p99_ms, [t for o in ok if (t := tpot_s(o)) is not None]),
            ("TTFT", slo.ttft_p99_ms if is_ttft_judged else None, [o.ttft_s for o in ok]),
            ("E2E latency", slo.e2el_ms if is_ttft_judged else None,
             [o.latency_s for o in ok])):
        if bound_ms is None or len(values) < MIN_WARMUP_REQUESTS:
            continue
        clear_ms = (1.0 + WARMUP_MARGIN) * bound_ms
        over = sum(v * 1000.0 > clear_ms for v in values)
        if over < tail_count(len(values)):
            continue
        p99_ms = float(np.percentile(values, 100.0 * _SLO_PERCENTILE)) * 1000.0
        return (f"missed in its warm-up: {name} p99 {p99_ms:.3g} ms > {bound_ms:g} ms over "
                f"{len(values)} requests ended in the {so_far.elapsed_s:.0f} s since the load "
                f"was set ({over} over {clear_ms:.3g} ms), while the in-flight count rose "
                f"from {so_far.in_flight_at_start:.0f} to {so_far.in_flight_now:.0f}")
    return None
