"""Reading a logged capacity bracket back from a trial's metrics (`Bracket.as_metrics`, the
search's pure decisions being plain data in runners/workload.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from runners.capacity_search import Bracket, BracketStatus


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
    held, high = metrics.get("capacity.is_held"), metrics.get("capacity.search_high")
    unapplied = metrics.get("capacity.unapplied_load")
    return Bracket(axis, float(met) if met > 0 else None,
                   float(missed) if missed is not None else None, status,
                   int(metrics.get("capacity.num_probes", 0)),
                   held=None if held is None else held > 0,
                   search_high=None if high is None else float(high),
                   unapplied_load=None if unapplied is None else float(unapplied))
