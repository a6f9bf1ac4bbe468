"""Judging a measured level against the SLO: the checks every capacity probe and staircase
window share (too many failed requests, none completed, a p99 over its bound), and whether a
window still running has already missed it whatever its remaining requests do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
