"""A window's spans on two clocks: its requests' arrivals on a server's modelled clock (the
simulated engine's) and their sends on the client's, each read as a window
(`arrival_span_s`), for the length rule and the modelled-load rule (runners/capacity/judge.py)
of a staircase's step (step.py) and of a fixed level (runners/applied_load.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from runners.loadgen.client import RequestOutput


def arrival_span_s(times: Sequence[float]) -> float:
    """The span of a run of arrivals (or sends), read as a window: first to last plus one mean
    gap, so n arrivals at a steady rate span n over it; 0 under two."""
    if len(times) < 2:
        return 0.0
    return (max(times) - min(times)) * len(times) / (len(times) - 1)


class ModelledSpans(NamedTuple):
    """A run of requests on a server's modelled clock: its first arrival, the span of its
    arrivals (`arrival_span_s`), how many it stamped, and the span of their sends on the
    client's clock (None under two)."""

    start_s: float
    window_s: float
    num_arrivals: int
    sent_span_s: float | None


def modelled_spans(outputs: Sequence[RequestOutput]) -> ModelledSpans | None:
    """The requests' arrivals on a server's modelled clock and their sends on the client's,
    each read by `arrival_span_s`, over the requests the server stamped; None unless exactly
    the successes carry the modelled times (a real vLLM server stamps none:
    runners/loadgen/client.py reads them only where the server declared its clock)."""
    arrivals = [o.modelled_span_s[0] for o in outputs if o.modelled_span_s is not None]
    if not arrivals or len(arrivals) != sum(o.success for o in outputs):
        return None
    sends = [o.start_time for o in outputs if o.modelled_span_s is not None and o.start_time]
    return ModelledSpans(min(arrivals), arrival_span_s(arrivals), len(arrivals),
                         arrival_span_s(sends) if len(sends) > 1 else None)
