"""The objectives a study can optimize, by name: each says its direction, its unit and how one
load level's figures give its value; a trial's operating point (`operating_step`, the one load
every figure of a trial describes); and the per-GPU rule (`per_gpu`): a rate is divided by the
GPUs the config uses, a latency is left as measured. A new objective is one entry of
`OBJECTIVES`."""

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
    needs_slo: bool = False  # meaningless without an SLO bound (ttft_p99_ms, tpot_p99_ms, e2el_ms)
    # A rate (requests/s, tokens/s): what a config gives grows with the GPUs it holds, so its
    # value is compared per GPU (`per_gpu`). A latency is what one request sees: as measured.
    is_per_gpu: bool = False

    @property
    def is_latency(self) -> bool:
        """A latency (minimized): over fixed levels its value is the worst level's, and it has
        none at a load the engine could not keep up with (unbounded there)."""
        return self.direction == "minimize"


def _latency(value_ms: float | None) -> float:
    """A latency objective's value; nan where the level has no sample (TPOT of one-token
    requests), which `objective_value` leaves out like any non-finite value."""
    return value_ms if value_ms is not None else math.nan


def _goodput(m: BenchmarkMetrics) -> float:
    return m.request_goodput if m.request_goodput is not None else 0.0


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    # requests/s meeting the SLO (vllm bench serve's request_goodput)
    Objective("goodput", "maximize", "req/s", _goodput, value_when_none_met_slo=0.0,
              is_offered_rate_at_capacity=True, needs_slo=True, is_per_gpu=True),
    Objective("throughput", "maximize", "tok/s", lambda m: m.output_throughput,
              value_when_none_met_slo=0.0, is_per_gpu=True),  # output tokens/s
    Objective("tpot", "minimize", "ms TPOT p99", lambda m: _latency(m.p99_tpot_ms)),
    Objective("ttft", "minimize", "ms TTFT p99", lambda m: _latency(m.p99_ttft_ms)),
)}


def get_objective(name: str) -> Objective:
    """The registered objective called `name`; ValueError naming the valid ones otherwise."""
    try:
        return OBJECTIVES[name]
    except KeyError:  # from None: a miss in our own registry; the message lists its names
        raise ValueError(f"unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}.") from None


def step_value(objective: str, step: StepMetrics) -> float:
    return metrics_value(objective, step.metrics)


def metrics_value(objective: str, m: BenchmarkMetrics) -> float:
    return get_objective(objective).value(m)


def is_capacity_search(steps: Sequence[StepMetrics]) -> bool:
    """Whether these levels are a capacity search's probes (each judged against the SLO)."""
    return any(s.meets_slo is not None for s in steps if s.metrics.completed > 0)


def _load(step: StepMetrics) -> float:
    """A probe's offered load on its search's axis (rate or concurrency; one of them is set)."""
    return float(step.level.request_rate_rps or step.level.max_concurrency or 0.0)


def operating_step(objective: str, steps: Sequence[StepMetrics]) -> StepMetrics | None:
    """The trial's operating point: the one load level every figure of the trial describes
    (its value, headline metrics, latencies, bottleneck label and advice). After a capacity
    search, the highest load that met the SLO (its hold, where one held it), or None when
    none did (the trial has no operating point: `described_step` gives the load to describe
    then). With fixed levels, the level that gave the objective its value (the best for a
    rate, the worst for a latency; a level with no sample, nan, never; a saturated one
    never), among the levels whose load was applied where there is one."""
    measured = [s for s in steps if s.metrics.completed > 0]
    if is_capacity_search(measured):
        within = [s for s in measured if s.meets_slo]
        # At one load a hold (a long window at that load) describes it better than the
        # short step it held.
        return max(within, key=lambda s: (_load(s), s.is_hold), default=None)
    # A level stopped as saturated (its queue kept growing) is a miss at that load: what it
    # completed before the stop is no figure of it (its goodput over the cut window counts
    # the requests that finished while the queue was still short, and its latencies omit
    # the ones that never did), so it is never the operating point.
    measured = [s for s in measured if not s.is_saturated]
    if not measured:
        return None
    # A level whose load was not applied describes a lighter load than its label: another
    # level speaks for the trial where one was applied (the conclusion says which were not).
    # Optuna is told that level's figure, a load we can name, though it may be lighter than
    # other trials' operating points: the unapplied level's figure is of no known load, and
    # a figure made up between the two would be no measurement. Every ratio printed of it is
    # taken at one load (`gains.same_load`, `at_load.AtLoads`), never across two.
    applied = [s for s in measured if not s.is_load_unapplied] or measured
    return max(applied, key=lambda s: _finite_or_lowest(step_value(objective, s)))


def described_step(objective: str, steps: Sequence[StepMetrics]) -> StepMetrics | None:
    """The level a trial's label and advice describe: its operating point, or, after a capacity
    search in which no load met the SLO, the lightest load probed (which missed it)."""
    step = operating_step(objective, steps)
    if step is not None:
        return step
    measured = [s for s in steps if s.metrics.completed > 0]
    return min(measured, key=_load, default=None) if is_capacity_search(measured) else None


def _finite_or_lowest(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


# The rule as the report and the export state it.
PER_GPU_RULE = ("Rates (goodput, throughput, capacity) are compared per GPU: a config's figure "
                "divided by the GPUs it uses (tensor x pipeline x data parallel), the defaults' "
                "by theirs; latencies as measured.")


def per_gpu(objective: str, value: float, num_gpus: int) -> float:
    """The one rule that makes trials on different GPU counts comparable: a rate objective's
    value divided by the GPUs the config uses (tensor x pipeline x data parallel), a latency's
    as measured. Optuna is told this, every gain and the pruner compare it."""
    return value / max(num_gpus, 1) if get_objective(objective).is_per_gpu else value


def on_all_gpus(objective: str, value: float, num_gpus: int) -> float:
    """`per_gpu` undone: a per-GPU value as the config gave it on all its `num_gpus` GPUs."""
    return value * max(num_gpus, 1) if get_objective(objective).is_per_gpu else value


def value_unit(objective: str) -> str:
    """The unit a trial's value (as Optuna holds it) is printed in: `req/s/GPU` for a rate,
    the objective's own unit for a latency; "" for an unknown name."""
    entry = OBJECTIVES.get(objective)
    if entry is None:
        return ""
    return f"{entry.unit}/GPU" if entry.is_per_gpu else entry.unit


def objective_value(objective: str, steps: Sequence[StepMetrics], num_gpus: int = 1, *,
                    primary: str | None = None) -> float | None:
    """A trial's value: its operating point's (`operating_step` for the study's first
    objective, `primary`, so that every objective of a trial reads one level), per GPU
    (`per_gpu`). With fixed levels that is the best level for goodput and throughput (the
    engine's capacity) and the worst for a latency (what a user at peak load sees). After a
    capacity search, the highest load that met the SLO; 0 for a rate when no load met it (None
    for a latency); on the request-rate axis, goodput is that probe's offered rate itself, the
    bracket's lower end (a probe's completed/duration reads it low by its drain time, or off by
    its Poisson count). The objective's entry says which of these rules it follows."""
    entry = get_objective(objective)
    is_search = is_capacity_search(steps)
    step = operating_step(primary or objective, steps)
    if step is None:
        return entry.value_when_none_met_slo if is_search else None
    if is_search and entry.is_offered_rate_at_capacity and \
            step.level.request_rate_rps is not None:
        return per_gpu(objective, step.level.request_rate_rps, num_gpus)
    value = step_value(objective, step)
    return per_gpu(objective, value, num_gpus) if math.isfinite(value) else None


def objective_values(objectives: Sequence[str], steps: Sequence[StepMetrics],
                     num_gpus: int = 1) -> list[float] | None:
    """Each objective's `objective_value` (per GPU) at the first one's operating point, or None
    when one has none."""
    values = [objective_value(o, steps, num_gpus, primary=objectives[0]) for o in objectives]
    if any(v is None for v in values):
        return None
    return [float(v) for v in values if v is not None]
