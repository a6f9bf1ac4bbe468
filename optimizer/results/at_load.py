"""A trial's figures at each fixed load level whose load was applied (`AtLoads`), so that two
trials are compared at one load: a level judged "load not applied" can move a trial's operating
point to a lighter level than another trial's, and a ratio across two loads is no gain."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any

from optimizer.results.objectives import metrics_value, operating_step, per_gpu
from runners.applied_load import UNAPPLIED_KEY
from runners.base import BenchmarkMetrics, StepMetrics
from runners.load_level import LoadLevel

if TYPE_CHECKING:
    from optimizer.results.trial_record import TrialRecord


@dataclass(frozen=True)
class LevelFigures:
    """One applied fixed level of a trial: its load and what it measured there."""

    label: str  # `LoadLevel.label`: "concurrency=8", "rate=4"
    value: float  # the study's first objective there, per GPU (as Optuna holds a value)
    tpot_p99_ms: float | None  # TPOT p99 there; None where the level has no sample
    goodput_per_gpu: float | None  # request goodput there per GPU; None without an SLO
    # Its repeats' spread of the objective there, (max - min) / median (`trial_record.spread`);
    # None where it ran once (or its record, older than TTFT's spread, kept none).
    spread: float | None = None


@dataclass(frozen=True)
class AtLoads:
    """A trial's applied fixed levels by label, and which of them is its operating point
    (`objectives.operating_step`). Empty after a capacity search (its brackets compare)."""

    operating: str | None  # the operating point's label; None where unknown
    levels: Mapping[str, LevelFigures]  # label -> figures, applied levels only
    # Levels whose load was not applied: where a trial has one, its operating point may be a
    # lighter load than its best (the unapplied level was not measured), so it is compared
    # with another trial at one load (`gains.gain_over`).
    unapplied: frozenset[str] = frozenset()
    # The operating point's label where its own load was not applied (every level's was not:
    # `objectives.operating_step` then takes one of them); None otherwise.
    operating_unapplied: str | None = None

    @property
    def is_moved(self) -> bool:
        """Whether a level of its was not applied, so its operating point is no best-to-best
        comparison point."""
        return bool(self.unapplied) or (self.operating is None and bool(self.levels))

    @property
    def moved_to(self) -> str:
        """Where its operating point moved (`is_moved`): the label of the level its figures
        are of ("concurrency=8"); where no level's load was applied (`is_unplaced`), the level
        `objectives.operating_step` took, whose figures are at another load than it names;
        "" where it did not move, or the level is not known."""
        if not self.is_moved:
            return ""
        return self.operating or self.operating_unapplied or ""

    @property
    def is_unplaced(self) -> bool:
        """No level's load was applied: its figures are at no load a level names."""
        return self.operating is None and self.operating_unapplied is not None

    @property
    def figures_at(self) -> str:
        """Where its figures are, after "trial 11" (`status`'s note under its table): "at
        concurrency=8" where its operating point moved, "(no level's load was applied: its
        figures are concurrency=32's, at another load)" where none was; "" where it did not
        move, or the load is not known."""
        if self.is_unplaced:
            return f"({_unplaced(self.moved_to)})"
        return f"at {self.moved_to}" if self.moved_to else ""

    def moved_phrase(self, whose: str = "") -> str:
        """After a trial's figures, the load they are at where its operating point moved: " at
        concurrency=8 (the load of concurrency=32 was not applied)", `whose` first in the
        parentheses ("its operating point; the load of ..."); " (no level's load was applied:
        its figures are concurrency=32's, at another load)" where none was; "" where it did
        not move, or the load is not known. The recommendation line and the export header."""
        if self.is_unplaced:
            return f" {self.figures_at}"
        if not self.moved_to:
            return ""
        unapplied = sorted(self.unapplied)
        plural = len(unapplied) > 1
        return (f" at {self.moved_to} ({f'{whose}; ' if whose else ''}the load"
                f"{'s' if plural else ''} of {', '.join(unapplied)} "
                f"{'were' if plural else 'was'} not applied)")

    def value_at(self, label: str) -> float | None:
        figures = self.levels.get(label)
        return figures.value if figures is not None else None


def _metrics(data: Mapping[str, Any]) -> BenchmarkMetrics:
    """A step record's metrics back as `BenchmarkMetrics` (a figure the record left out, a
    p99 with no sample, reads None), so one objective rule reads records and live steps."""
    return BenchmarkMetrics(**{f.name: data.get(f.name, None if f.default is MISSING
                                                else f.default) for f in fields(BenchmarkMetrics)})


def _fixed_levels(steps: Sequence[Mapping[str, Any]]
                  ) -> Iterator[tuple[Mapping[str, Any], LoadLevel, bool]]:
    """Each fixed level of step records that completed a request (a capacity search's probes
    are none), with its load level and whether its load was applied."""
    for step in steps:
        data = step.get("metrics") or {}
        if step.get("meets_slo") is not None or not data.get("completed"):
            continue  # a capacity probe, or a level that completed nothing
        level = LoadLevel(**{k: v for k, v in (step.get("level") or {}).items()
                             if k in {f.name for f in fields(LoadLevel)}})
        yield step, level, not (step.get("server") or {}).get(UNAPPLIED_KEY, 0.0) > 0


def at_loads(objective: str, steps: Sequence[Mapping[str, Any]], num_gpus: int,
             operating_step: int | None) -> AtLoads:
    """`AtLoads` of a trial from its step records (`trial_record.step_records`: each with its
    `level`, `metrics`, `server` and `meets_slo`) and the step number of its operating point
    (the record's `headline_level`). A capacity search's probes give none."""
    levels: dict[str, LevelFigures] = {}
    unapplied: set[str] = set()
    operating = operating_unapplied = None
    for step, level, is_applied in _fixed_levels(steps):
        if not is_applied:
            unapplied.add(level.label)
            if operating_step is not None and step.get("step") == operating_step:
                operating_unapplied = level.label
            continue  # its figures are of another load than its label
        metrics = _metrics(step["metrics"])
        value = metrics_value(objective, metrics)
        if not math.isfinite(value):
            continue
        goodput = metrics.request_goodput
        spread = step["metrics"].get(f"spread.{objective}")
        levels[level.label] = LevelFigures(
            level.label, per_gpu(objective, value, num_gpus), metrics.p99_tpot_ms,
            goodput / max(num_gpus, 1) if goodput is not None else None,
            float(spread) if isinstance(spread, int | float) and math.isfinite(spread)
            else None)
        if operating_step is not None and step.get("step") == operating_step:
            operating = level.label
    return AtLoads(operating, levels, frozenset(unapplied), operating_unapplied)


def at_loads_of_run(objective: str, steps: Sequence[StepMetrics], num_gpus: int) -> AtLoads:
    """`at_loads` of a run's levels as the runner handed them (before its record is written):
    what the search passes `conclusion.conclude` as the trial's `loads`."""
    from optimizer.results.trial_record import step_records

    step = operating_step(objective, steps)
    return at_loads(objective, step_records(steps), num_gpus,
                    step.step if step is not None else None)


def at_loads_of_record(objective: str, record: TrialRecord) -> AtLoads:
    """`at_loads` of a trial's record: its steps on its GPUs, its operating point the record's
    `headline_level` (None where a record has none)."""
    headline = record.metrics.get("headline_level")
    return at_loads(objective, record.steps, record.num_gpus,
                    int(headline) if headline is not None else None)


def compared_loads(objective: str | None, record: TrialRecord | None) -> AtLoads | None:
    """`at_loads_of_record` where the record names its operating point (`headline_level`),
    else None: a trial with none (a record of a config never measured, an older record) is
    compared by its value alone (`gains.gain_over`)."""
    if record is None or objective is None or "headline_level" not in record.metrics:
        return None
    return at_loads_of_record(objective, record)


def _unplaced(label: str) -> str:
    return f"no level's load was applied: its figures are {label}'s, at another load"


def level_metrics(record: TrialRecord, label: str) -> Mapping[str, Any] | None:
    """The figures of the fixed level `label` of a trial's record (its step record's metrics:
    p99s, goodput, throughput), where that level's load was applied; None otherwise (no such
    level, a level that completed nothing, or one whose load was not applied)."""
    return next((step["metrics"] for step, level, is_applied in _fixed_levels(record.steps)
                 if is_applied and level.label == label), None)
