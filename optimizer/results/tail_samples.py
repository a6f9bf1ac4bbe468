"""How many requests a p99 rests on, and the one rule that calls it thin: what the status
table, the report, MLflow's tags and the conclusion say beside a trial's headline p99s.

A p99 is numpy's linear percentile, as vLLM's (`vllm bench serve`): over n requests it is
interpolated at 0.99 (n - 1), i.e. between the ceil(n / 100)-th and the next slowest, so it
rests on the top ceil(n / 100) values. Over 2,000 requests that is the 20 slowest; over 150 the
2nd-slowest; under 100 the slowest alone. A p99 of fewer than `THIN_P99_REQUESTS` requests is
"thin": it says what the slowest request did, not what one request in a hundred sees, and a
second run can move it by as much as one request varies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THIN_P99_REQUESTS = 100  # below this a p99 is set by the slowest request alone

# (words, the p99's metric, the metric counting the requests it is over) of each headline p99,
# in vLLM's names (`BenchmarkMetrics`): TTFT and E2E latency are over every completed request,
# TPOT over those with a second token.
HEADLINE_P99S = (("TTFT p99", "p99_ttft_ms", "completed"),
                 ("TPOT p99", "p99_tpot_ms", "num_tpot_samples"),
                 ("E2E latency p99", "p99_e2el_ms", "completed"))

THIN_RULE = (f"a p99 over fewer than {THIN_P99_REQUESTS} requests is thin: it is set by the "
             "slowest request alone (over n requests a p99 rests on its ceil(n/100) slowest)")


@dataclass(frozen=True)
class P99Basis:
    """The requests one p99 was computed over."""

    num_requests: int

    @property
    def num_tail(self) -> int:
        """The slowest requests the p99 rests on: ceil(n / 100)."""
        return max(1, math.ceil(self.num_requests / 100))

    @property
    def is_thin(self) -> bool:
        return self.num_requests < THIN_P99_REQUESTS

    @property
    def cell(self) -> str:
        """A table cell's suffix: `n=2,000`, `n=37 thin`."""
        return f"n={self.num_requests:,}" + (" thin" if self.is_thin else "")

    def words(self, name: str) -> str:
        """`TPOT p99 over 150 requests (about the 2nd-slowest)`; `TTFT p99 over 37 requests:
        thin, about the slowest one`."""
        head = f"{name} over {self.num_requests:,} request" + \
            ("" if self.num_requests == 1 else "s")
        if self.is_thin:
            return f"{head}: thin, about the slowest one"
        return f"{head} (about the {_ordinal(self.num_tail)}-slowest)" \
            if self.num_tail > 1 else f"{head}"


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
    `TTFT p99 over 150 requests (about the 2nd-slowest); TPOT p99 over 150 ...`."""
    return "; ".join(basis.words(name) for name, _, basis in headline_bases(metrics))


def thin_note(metrics: Mapping[str, Any]) -> str:
    """A conclusion's sentence where a headline p99 is thin, "" otherwise; p99s over the same
    requests said together: `Its TTFT, TPOT and E2E latency p99s are over 64 requests: thin,
    each about its slowest request (a p99 needs 100 requests or more to say what one request
    in a hundred sees).`"""
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
                     f"{'' if n == 1 else 's'}: thin, {'each ' if plural else ''}about "
                     "its slowest request")
    return (f"Its {'; its '.join(parts)} (a p99 needs {THIN_P99_REQUESTS} requests or more "
            "to say what one request in a hundred sees).")
