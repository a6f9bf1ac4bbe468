"""Judging a measured level against the SLO, and reading a logged capacity bracket back: the
measuring side of the capacity search, whose pure decisions (`CapacitySearch`, `Bracket`) are
plain data in runners/workload.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from runners.base import BenchmarkMetrics
from runners.capacity_search import Bracket, BracketStatus
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


def bracket_from_metrics(axis: Literal["concurrency", "request_rate"],
                         metrics: Mapping[str, float]) -> Bracket | None:
    """The bracket a trial logged (`Bracket.as_metrics`), read back; None when it has none."""
    met = metrics.get("capacity.bracket_low")
    if met is None:
        return None
    missed = metrics.get("capacity.bracket_high")
    is_resolved = bool(metrics.get("capacity.is_resolved", 0.0))
    status: BracketStatus
    if met <= 0:
        status = "none" if is_resolved else "unresolved"
    elif missed is None:
        status = "at_least" if is_resolved else "unresolved"
    else:
        status = "resolved" if is_resolved else "unresolved"
    return Bracket(axis, float(met) if met > 0 else None,
                   float(missed) if missed is not None else None, status,
                   int(metrics.get("capacity.num_probes", 0)))
