"""The objectives a study can optimize, by name: each says its direction, its unit and how one
load level's figures give its value. A new objective is one entry of `OBJECTIVES`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from runners.base import BenchmarkMetrics, StepMetrics

Direction = Literal["maximize", "minimize"]


@dataclass(frozen=True)
class Objective:
    """One objective. `value` reads a load level's figures; a trial's value over its levels is
    `objective_value` (the best level for a rate, the worst for a latency)."""

    name: str  # as the study file writes it (`objective: goodput`)
    direction: Direction
    unit: str  # printed after a value ("req/s"); "" where it has none
    value: Callable[[BenchmarkMetrics], float]
    # After a capacity search in which no probe met the SLO: the trial's value. 0 for a rate
    # (nothing was served within the SLO); None for a latency (nothing to say).
    value_when_none_met_slo: float | None = None
    # On the request-rate axis of a capacity search, the value is the highest offered rate that
    # met the SLO (the bracket's lower end) rather than a probe's measured figure.
    is_offered_rate_at_capacity: bool = False
    needs_slo: bool = False  # meaningless without slo.ttft_p99_ms and/or slo.tpot_p99_ms


def _latency(value_ms: float | None) -> float:
    """A latency objective's value; nan where the level has no sample (TPOT of one-token
    requests), which `objective_value` leaves out like any non-finite value."""
    return value_ms if value_ms is not None else math.nan


def _goodput(m: BenchmarkMetrics) -> float:
    return m.request_goodput if m.request_goodput is not None else 0.0


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    # requests/s meeting the SLO (vllm bench serve's request_goodput)
    Objective("goodput", "maximize", "req/s", _goodput, value_when_none_met_slo=0.0,
              is_offered_rate_at_capacity=True, needs_slo=True),
    Objective("throughput", "maximize", "tok/s", lambda m: m.output_throughput,
              value_when_none_met_slo=0.0),  # output tokens/s
    Objective("tpot", "minimize", "ms TPOT p99", lambda m: _latency(m.p99_tpot_ms)),
    Objective("ttft", "minimize", "ms TTFT p99", lambda m: _latency(m.p99_ttft_ms)),
)}


def get_objective(name: str) -> Objective:
    """The registered objective called `name`; ValueError naming the valid ones otherwise."""
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ValueError(f"unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}.") from None


def step_value(objective: str, step: StepMetrics) -> float:
    return metrics_value(objective, step.metrics)


def metrics_value(objective: str, m: BenchmarkMetrics) -> float:
    return get_objective(objective).value(m)


def objective_value(objective: str, steps: Sequence[StepMetrics]) -> float | None:
    """A trial's value over its load levels: the largest of them. For goodput and throughput
    that is the best level (the engine's capacity); for latencies, the worst level (what a
    user at peak load sees). After a capacity search only the probes within the SLO count:
    goodput at capacity, 0 when no load met the SLO; on the request-rate axis that is the
    bracket's lower end itself, the highest offered rate that met the SLO (a short probe's
    completed/duration reads it low by its drain time, or off by its Poisson count). The
    objective's entry says which of these rules it follows (`objectives.Objective`)."""
    entry = get_objective(objective)
    measured = [s for s in steps if s.metrics.completed > 0]
    if any(s.meets_slo is not None for s in measured):
        within = [s for s in measured if s.meets_slo]
        if not within:
            return entry.value_when_none_met_slo
        rates = [s.level.request_rate_rps for s in within]
        if entry.is_offered_rate_at_capacity and all(r is not None for r in rates):
            return max(r for r in rates if r is not None)
        measured = within
    values = [step_value(objective, s) for s in measured]
    values = [v for v in values if math.isfinite(v)]
    return max(values) if values else None


def objective_values(objectives: Sequence[str],
                     steps: Sequence[StepMetrics]) -> list[float] | None:
    values = [objective_value(o, steps) for o in objectives]
    if any(v is None for v in values):
        return None
    return [float(v) for v in values if v is not None]
