"""What a load's client did, on one clock: each request's send (and, where it had a schedule,
when it was due) and the in-flight count's changes. Read to judge whether a level applied the
load it is labelled with (runners/applied_load.py): a client starved of CPU sends late and
reads its replies late, so the server sees less than the label says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def time_weighted_mean(changes: Sequence[tuple[float, int]], start_s: float,
                       end_s: float) -> float:
    """A count over [start_s, end_s), time-weighted, from its changes (time, count after),
    in time order; 0 before the first change."""
    if end_s <= start_s:
        return 0.0
    count = 0
    for t, n in changes:
        if t > start_s:
            break
        count = n
    area, last = 0.0, start_s
    for t, n in changes:
        if t <= start_s:
            continue
        if t >= end_s:
            break
        area += count * (t - last)
        count, last = n, t
    area += count * (end_s - last)
    return area / (end_s - start_s)


@dataclass
class SendLog:
    """A bounded level's sends and in-flight count, times on `time.monotonic()` (the clock
    `prometheus.MetricsPoller` stamps its samples with). One event loop's thread writes it."""

    sent_s: list[float] = field(default_factory=list)  # each request's send, in issue order
    # When each was due by its schedule (a rate's arrivals, a trace's times); None where it had
    # none (a closed loop sends as a slot frees). Parallel to `sent_s`.
    due_s: list[float | None] = field(default_factory=list)
    # How much later than it could have been sent each was: after its due time and after the
    # concurrency cap freed a slot for it (a capped rate's wait for a slot is the load's own
    # rule, not the client falling behind); None without a schedule. Parallel to `sent_s`.
    late_s: list[float | None] = field(default_factory=list)
    in_flight_changes: list[tuple[float, int]] = field(default_factory=list)  # (t, count after)
    # A closed loop whose slots stop at different times (conversations: a slot out of them, or
    # past the time bound): when each slot stopped sending, on this clock, and the end of its
    # last request on the server's modelled clock (None: it sent none, or the server stamped
    # none). Empty for a loop that stops at its last send (a fixed level's list ran out).
    slot_ends_s: list[float] = field(default_factory=list)
    slot_ends_modelled_s: list[float | None] = field(default_factory=list)
    num_clients: int = 0  # the httpx clients the requests went out on (runners/loadgen/clients.py)

    def record_send(self, sent_s: float, due_s: float | None,
                    free_from_s: float | None = None) -> None:
        """A request sent at `sent_s`, due at `due_s`; `free_from_s`: when the concurrency cap
        last let the sender go on after it had to wait for a slot (None: it never waited)."""
        self.sent_s.append(sent_s)
        self.due_s.append(due_s)
        if due_s is None:
            self.late_s.append(None)
        else:
            ready_s = due_s if free_from_s is None else max(due_s, free_from_s)
            self.late_s.append(max(0.0, sent_s - ready_s))

    def record_in_flight(self, t_s: float, count: int) -> None:
        self.in_flight_changes.append((t_s, count))

    def record_slot_end(self, t_s: float, modelled_s: float | None = None) -> None:
        """A closed loop's slot stopped sending at `t_s`; its last request ended at
        `modelled_s` on the server's modelled clock (None: no such time)."""
        self.slot_ends_s.append(t_s)
        self.slot_ends_modelled_s.append(modelled_s)

    def full_until_s(self) -> float:
        """Until when a closed loop (one that sent) could hold its concurrency: the first slot
        to stop sending, else (a fixed level) its last send."""
        return min(self.slot_ends_s) if self.slot_ends_s else self.sent_s[-1]

    def modelled_full_until_s(self) -> float | None:
        """`full_until_s` on the server's modelled clock, for a loop whose slots stop at
        different times: the first of their last requests' ends; None where a slot has none
        (or the loop's end is its last send: read from the requests' own arrivals)."""
        ends = self.slot_ends_modelled_s
        if not ends or any(e is None for e in ends):
            return None
        return min(e for e in ends if e is not None)

    def mean_in_flight(self, start_s: float, end_s: float) -> float:
        """The client's in-flight count, time-weighted over [start_s, end_s)."""
        return time_weighted_mean(self.in_flight_changes, start_s, end_s)
