"""The inner loop of a trial: the highest load one running server sustains within the SLO.

A monotone bracketing search over one load axis (concurrency or request rate), as a capacity
test is run by hand: probe at the highest load the user cares about; if the SLO holds there,
that is the capacity. Else probe the lowest; if the SLO fails even there, the config has none.
Else bisect (geometrically: latency curves bend by octaves) between the best load that met the
SLO and the least one that missed it, until they are within the tolerance. Every probe is a
load level of the same server, so a trial pays one start-up for its whole latency-vs-load curve.
Pure: the runner measures, this decides what to measure next.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from runners.base import SLO, BenchmarkMetrics, LoadLevel


@dataclass(frozen=True)
class CapacitySearch:
    axis: Literal["concurrency", "request_rate"]
    low: float  # the lightest load probed (a concurrency or requests/s)
    high: float  # the heaviest load of interest
    tolerance: float = 0.05  # stop when the bracket is this narrow (relative)
    max_probes: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high:
            raise ValueError(f"capacity search needs 0 < low < high but got {self.low} and "
                             f"{self.high}.")
        if self.axis == "concurrency" and (self.low != int(self.low)
                                           or self.high != int(self.high)):
            raise ValueError("concurrency bounds are whole numbers of requests.")

    def level(self, load: float) -> LoadLevel:
        if self.axis == "concurrency":
            return LoadLevel(max_concurrency=int(load))
        return LoadLevel(request_rate_rps=load)

    def load_of(self, level: LoadLevel) -> float:
        value = level.max_concurrency if self.axis == "concurrency" else level.request_rate_rps
        return float(value or 0.0)

    def next_load(self, history: Sequence[tuple[float, bool]]) -> float | None:
        """The load to probe next given (load, met the SLO) so far, or None when done."""
        if len(history) >= self.max_probes:
            return None
        if not history:
            return self.high
        passed = [load for load, ok in history if ok]
        failed = [load for load, ok in history if not ok]
        if self.high in passed:
            return None  # the SLO holds at the heaviest load of interest
        if not passed:
            return None if self.low in failed else self.low
        lo = max(passed)
        above = [load for load in failed if load > lo]
        if not above:
            return None
        hi = min(above)
        if hi <= lo * (1.0 + self.tolerance):
            return None
        mid = math.sqrt(lo * hi)
        if self.axis == "concurrency":
            mid = float(round(mid))
            if mid <= lo or mid >= hi:  # neighbours: nothing left between them
                return None
        return mid

    @staticmethod
    def capacity(history: Sequence[tuple[float, bool]]) -> float:
        """The highest load that met the SLO (0 when none did)."""
        return max((load for load, ok in history if ok), default=0.0)


def meets_slo(metrics: BenchmarkMetrics, slo: SLO, max_failed_fraction: float,
              is_saturated: bool = False) -> bool:
    """Whether a level's p99 latencies are within the SLO and its requests succeeded (a level
    stopped for saturation never is)."""
    if is_saturated:
        return False
    total = metrics.completed + metrics.failed
    if not metrics.completed or (total and metrics.failed / total > max_failed_fraction):
        return False
    if slo.ttft_p99_ms is not None and not metrics.p99_ttft_ms <= slo.ttft_p99_ms:
        return False
    if slo.tpot_p99_ms is not None and not metrics.p99_tpot_ms <= slo.tpot_p99_ms:
        return False
    return not (slo.e2el_ms is not None and not metrics.p99_e2el_ms <= slo.e2el_ms)
