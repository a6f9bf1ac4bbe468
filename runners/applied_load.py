"""Whether a bounded load level (a fixed level, a trace's or conversations' probe) applied the
load it is labelled with, by the staircase's own rules (runners/capacity/judge.py): an open
loop whose client sent more than the tolerance of its requests late (`late_sends`), or a closed
loop whose server, or client, held fewer requests than its concurrency (`unapplied_load`), did
not; its figures are of a load nobody offered, so it is no measurement at its label.

On the simulated engine, whose replies carry its modelled clock, an open loop whose requests
reached the engine at a rate off the rate they were sent at by more than the tolerance
(`modelled_load_off`: the host delivered them ever later, the engine's clock fell behind, or
it ran ahead through a stall slept time-scaled) did not apply its load either, whatever its
figures: a level reports figures, not a verdict, so none is kept at its label, where a
staircase's step keeps a verdict that holds at its label all the same (`judge_window`). A
real vLLM stamps no modelled clock and is never judged so.

A closed loop over a bounded list holds its concurrency only between the send that filled it
and the last send (the first requests go out at once; after the last the loop drains): that is
the span judged. A level that sends all its requests at once never refills, and a level with
neither a schedule nor a cap ("all at once") has no load to hold: neither is judged.

A multi-turn level's slots each run conversations until none is left or the time bound has
passed, so they stop at different times and its last send does not end the full loop: its span
ends when the first slot stopped sending. Over a span with fewer refills than slots most slots
never turned around in it, so their time in flight says nothing of the client that refills
them: such a level is not judged, and its record says so (`TOO_SHORT_KEY`, `AppliedLoad.note`),
rather than read as applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runners import prometheus
from runners.capacity.judge import WindowCounts, late_sends, modelled_load_off, unapplied_load
from runners.capacity.spans import modelled_spans
from runners.capacity.step import late_bound_s
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput
from runners.loadgen.send_log import SendLog

# A StepMetrics.server_metrics key (the staircase's too): 1.0 where the load was not applied.
UNAPPLIED_KEY = "steady.is_load_unapplied"
# 1.0 where a loop whose slots stop at different times (conversations) was full too briefly to
# judge: neither applied nor not, and its figures claim no more than that.
TOO_SHORT_KEY = "applied.is_too_short_to_judge"


@dataclass(frozen=True)
class AppliedLoad:
    """A level's applied-load verdict: why its load was not applied (None: it was, or there
    was nothing to judge) and the figures it rests on, for the level's record."""

    reason: str | None
    figures: dict[str, float]
    note: str | None = None  # why it was not judged, where it had a load to judge

    def as_server_metrics(self) -> dict[str, float]:
        """The figures, and `UNAPPLIED_KEY` where the load was not applied."""
        out = dict(self.figures)
        if self.reason is not None:
            out[UNAPPLIED_KEY] = 1.0
        return out


def judge_level_load(level: LoadLevel, sends: SendLog | None,
                     outputs: Sequence[RequestOutput],
                     samples: Sequence[tuple[float, dict[str, float]]],
                     tolerance: float) -> AppliedLoad:
    """Whether `level` applied its load: `sends` the client's log, `outputs` its requests (in
    any order), `samples` the server's /metrics over the level (time.monotonic(), scrape),
    `tolerance` the capacity search's (relative)."""
    if sends is None or not sends.sent_s:
        return AppliedLoad(None, {})
    if level.request_rate_rps is None and level.max_concurrency is not None:
        return _closed_loop(level.max_concurrency, sends, outputs, samples, tolerance)
    if any(d is not None for d in sends.due_s):
        return _open_loop(sends, outputs, tolerance)
    return AppliedLoad(None, {})


def _open_loop(sends: SendLog, outputs: Sequence[RequestOutput],
               tolerance: float) -> AppliedLoad:
    """Late sends on the client's schedule; and, on a server's modelled clock (the simulated
    engine's), the rate its requests arrived at against the rate they were sent at
    (`modelled_load_off`)."""
    due = [d for d in sends.due_s if d is not None]
    span_s = due[-1] - due[0]
    if len(due) < 2 or span_s <= 0:
        return AppliedLoad(None, {})
    bound = late_bound_s((len(due) - 1) / span_s)  # one mean gap of the schedule
    late = sum(1 for x in sends.late_s if x is not None and x > bound)
    counts = WindowCounts(window_s=span_s, num_sent=len(due), num_ended=0, mean_in_flight=0.0,
                          waiting_rise=None, num_sent_late=late, late_bound_s=bound)
    figures = {"applied.num_sent_late": float(late), "applied.late_bound_s": bound}
    reason = late_sends(counts, tolerance)
    spans = modelled_spans(outputs)
    if spans is not None and spans.sent_span_s is not None:
        figures["applied.modelled_span_s"] = spans.window_s
        figures["applied.sent_span_s"] = spans.sent_span_s
        modelled = WindowCounts(
            window_s=spans.window_s, num_sent=spans.num_arrivals, num_ended=0,
            mean_in_flight=0.0, waiting_rise=None, sent_span_s=spans.sent_span_s)
        reason = reason or modelled_load_off(modelled, tolerance)
    return AppliedLoad(reason, figures)


def _closed_loop(concurrency: int, sends: SendLog, outputs: Sequence[RequestOutput],
                 samples: Sequence[tuple[float, dict[str, float]]],
                 tolerance: float) -> AppliedLoad:
    if len(sends.sent_s) <= concurrency:
        if sends.slot_ends_s:  # conversations: none sent after the loop filled
            return _too_short(concurrency, 0.0, 0)
        return AppliedLoad(None, {})  # sent at once, never refilled: no full span to judge
    start, end = sends.sent_s[concurrency - 1], sends.full_until_s()
    num_refills = sum(1 for t in sends.sent_s[concurrency:] if t <= end)
    if sends.slot_ends_s and (end <= start or num_refills < concurrency):
        return _too_short(concurrency, max(0.0, end - start), num_refills)
    if end <= start:
        return AppliedLoad(None, {})
    in_system = tuple(
        s[prometheus.NUM_REQUESTS_RUNNING] + s.get(prometheus.NUM_REQUESTS_WAITING, 0.0)
        for t, s in samples if start <= t <= end and prometheus.NUM_REQUESTS_RUNNING in s)
    window_s, mean = end - start, sends.mean_in_flight(start, end)
    modelled = _modelled_in_flight(concurrency, outputs, sends)
    if modelled is not None:  # the simulated engine's clock, on which its latencies are
        window_s, mean = modelled
    counts = WindowCounts(window_s=window_s, num_sent=num_refills,
                          num_ended=0, mean_in_flight=mean, waiting_rise=None,
                          server_in_system=in_system, client_window_s=end - start)
    figures = {"applied.window_s": window_s, "applied.mean_in_flight": mean}
    if counts.server_mean_in_system is not None:
        figures["applied.server_mean_in_system"] = counts.server_mean_in_system
    return AppliedLoad(unapplied_load(counts, float(concurrency), tolerance), figures)


def _too_short(concurrency: int, full_s: float, num_refills: int) -> AppliedLoad:
    """A loop whose slots stopped at different times, full for too short a span to judge: it
    is not judged, and its record says so (`TOO_SHORT_KEY`, `note`)."""
    note = (f"applied load not judged: the loop held its {concurrency} slots for "
            f"{full_s:.3g} s with {num_refills} refill(s), fewer than one per slot, before a "
            "slot stopped sending (out of conversations or time): too short to judge")
    return AppliedLoad(None, {TOO_SHORT_KEY: 1.0, "applied.window_s": full_s,
                              "applied.num_refills": float(num_refills)}, note=note)


def _modelled_in_flight(concurrency: int, outputs: Sequence[RequestOutput],
                        sends: SendLog) -> tuple[float, float] | None:
    """(span, mean in flight) of a closed loop's full span on a server's modelled clock: from
    the arrival that filled the loop to the last arrival (or, where its slots stop at
    different times, to the end of the first slot's last request), over every request's
    modelled span; None unless every success carries one and every slot its end (then the
    client's clock stands)."""
    spans = [o.modelled_span_s for o in outputs if o.modelled_span_s is not None]
    if not spans or len(spans) < sum(o.success for o in outputs):
        return None
    arrivals = sorted(a for a, _ in spans)
    if len(arrivals) <= concurrency:
        return None
    t0 = arrivals[concurrency - 1]
    t1 = sends.modelled_full_until_s() if sends.slot_ends_s else arrivals[-1]
    if t1 is None or t1 <= t0:
        return None
    area = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans)
    return t1 - t0, area / (t1 - t0)
