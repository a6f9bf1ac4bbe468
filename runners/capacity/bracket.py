"""What a capacity search showed (`Bracket`: the highest load that met the SLO and the lowest
above it that missed, with its status and how it is logged) and a logged bracket read back from
a trial's metrics (`bracket_from_metrics`). Plain data: a `RunResult` (runners/base.py) holds
one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

BracketStatus = Literal["resolved", "at_least", "none", "unresolved"]


@dataclass(frozen=True)
class Bracket:
    """Where the capacity lies after a search, in the search's load unit.

    `met_load`: the highest probed load that met the SLO (None when none did); `missed_load`:
    the lowest probed load above it that missed (None when none did). The capacity is at least
    `met_load` and below `missed_load`.
    """

    axis: Literal["concurrency", "request_rate"]
    met_load: float | None  # requests/s or concurrent requests
    missed_load: float | None  # requests/s or concurrent requests
    status: BracketStatus  # resolved: within tolerance; at_least: met at `high`; none: missed
    # at `low`; unresolved: wider than the tolerance when the probes ran out
    num_probes: int = 0
    # Whether `met_load` was held (`CapacitySearch.hold_s`): met over a long window of
    # arrivals, not only a step's short one. None: no hold was asked for or none could run.
    held: bool | None = None
    # The heaviest load of interest (`CapacitySearch.high`), for "no load in [low, high] met
    # the SLO"; None where not known (an older record). Not part of what was measured.
    search_high: float | None = field(default=None, compare=False)
    # The lowest load between the two ends whose probe did not apply its load (the client
    # fell behind): no end of the bracket, named beside it. None: none.
    unapplied_load: float | None = None

    @property
    def unit(self) -> str:
        return "req/s" if self.axis == "request_rate" else "concurrent requests"

    @property
    def is_resolved(self) -> bool:
        return self.status != "unresolved"

    @property
    def width(self) -> float | None:
        """missed / met - 1 (relative width); None when an end is open."""
        if self.met_load is None or self.missed_load is None or self.met_load <= 0:
            return None
        return self.missed_load / self.met_load - 1.0

    def describe(self) -> str:
        """`[8.9, 18.9) req/s`, `>= 64 req/s` (met at every probe), `below low (1 req/s): no
        load in [1, 64] req/s met the SLO` (missed at `low` itself), `< 3.17 req/s` (met at
        none, `low` not probed): what was shown, nothing more."""
        text = self._describe_ends()
        if self.unapplied_load is not None:
            text += (f" ({_num(self.unapplied_load)} {self.unit} not measured: the load was "
                     "not applied)")
        return text

    def _describe_ends(self) -> str:
        unit = self.unit
        if self.met_load is None and self.missed_load is None:
            return "not measured: no probe applied its load"
        if self.met_load is None and self.status == "none":
            low = _num(self.missed_load or 0.0)
            span = f"[{low}, {_num(self.search_high)}] {unit}" if self.search_high else \
                f"[{low} {unit}, high]"
            return f"below low ({low} {unit}): no load in {span} met the SLO"
        if self.met_load is None:
            return f"< {_num(self.missed_load or 0.0)} {unit}"
        if self.missed_load is None:
            return f">= {_num(self.met_load)} {unit}"
        return f"[{_num(self.met_load)}, {_num(self.missed_load)}) {unit}"

    def as_metrics(self) -> dict[str, float]:
        """`capacity.bracket_low` (0 when no load met the SLO) and `capacity.bracket_high`
        (left out when no load missed it), with the probe count."""
        out = {"capacity.bracket_low": float(self.met_load or 0.0),
               "capacity.num_probes": float(self.num_probes),
               "capacity.is_resolved": 1.0 if self.is_resolved else 0.0}
        if self.held is not None:
            out["capacity.is_held"] = 1.0 if self.held else 0.0
        if self.missed_load is not None:
            out["capacity.bracket_high"] = float(self.missed_load)
        if self.search_high is not None:
            out["capacity.search_high"] = float(self.search_high)
        if self.unapplied_load is not None:
            out["capacity.unapplied_load"] = float(self.unapplied_load)
        return out

    def to_dict(self) -> dict[str, object]:
        return {"axis": self.axis, "met_load": self.met_load, "missed_load": self.missed_load,
                "status": self.status, "num_probes": self.num_probes, "held": self.held,
                "search_high": self.search_high, "unapplied_load": self.unapplied_load}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Bracket | None:
        axis, status = data.get("axis"), data.get("status")
        if axis not in ("concurrency", "request_rate") or status not in (
                "resolved", "at_least", "none", "unresolved"):
            return None
        met, missed, count = data.get("met_load"), data.get("missed_load"), data.get("num_probes")
        held, high, unapplied = data.get("held"), data.get("search_high"), \
            data.get("unapplied_load")
        return cls(axis=axis, status=status,
                   met_load=float(met) if isinstance(met, int | float) else None,
                   missed_load=float(missed) if isinstance(missed, int | float) else None,
                   num_probes=int(count) if isinstance(count, int | float) else 0,
                   held=held if isinstance(held, bool) else None,
                   search_high=float(high) if isinstance(high, int | float) else None,
                   unapplied_load=float(unapplied) if isinstance(unapplied, int | float)
                   else None)


def _num(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


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
