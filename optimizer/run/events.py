"""What the daemon tells its caller: a `TrialEvent` per trial event (the CLI's progress display
draws them; the core never draws), the figures an event carries (`first_value`,
`operating_metrics`), and the `DaemonSummary` of a run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from optimizer.results.objectives import objective_values, operating_step
from optimizer.results.trial_record import confirm_label
from optimizer.search.controller import SearchController
from optimizer.search.trials import Running
from runners.base import BenchmarkMetrics


@dataclass(frozen=True)
class TrialEvent:
    """What the CLI's progress display is told; the core never draws."""

    kind: Literal["started", "step", "finished", "study"]
    number: int = -1
    params: Mapping[str, Any] = field(default_factory=dict)
    state: str = "running"
    value: float | None = None
    tpot_p99_ms: float | None = None
    message: str = ""
    elapsed_s: float = 0.0
    label: str = ""  # the bottleneck classifier's verdict, once there is one
    confirm: str = ""  # "defaults" or "best": a final confirmation run, not a search trial
    # the requests the TPOT p99 is over, once the trial's record says (tail_samples.py)
    tpot_p99_num_requests: int | None = None
    # TTFT p99 at the operating point, and the completed requests it is over once the record
    # says: the live table shows the SLO's own p99s (`tail_samples.slo_latencies`)
    ttft_p99_ms: float | None = None
    ttft_p99_num_requests: int | None = None


def confirm_of(running: Running) -> str:
    return confirm_label(running.trial) or ""


@dataclass(frozen=True)
class DaemonSummary:
    finished: int  # trials finished by this daemon run
    total_finished: int  # in the whole study
    stopped_early: bool  # by a signal or `nightshift stop`
    best_number: int | None
    best_values: list[float] | None
    no_baseline: str = ""  # why the defaults could not be measured, when they could not
    # What MLflow lacks at the end (writes it refused, still refused by the closing catch-up),
    # as a sentence; "" when it holds everything. Optuna holds it all; the next start logs it.
    mlflow_incomplete: str = ""


def operating_metrics(policy: SearchController, running: Running) -> BenchmarkMetrics | None:
    """The figures at the trial's operating point so far (`objectives.operating_step`), the
    load its value describes, never a later probe's that missed the SLO: the live table's TTFT
    and TPOT p99s; None before a level has one."""
    step = operating_step(policy.cfg.objectives[0], running.steps)
    return step.metrics if step is not None else None


def first_value(policy: SearchController | None, running: Running) -> float | None:
    if policy is None:
        return None
    values = objective_values(policy.cfg.objectives, running.steps, running.config.num_gpus)
    return values[0] if values else None
