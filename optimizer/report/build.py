"""The report's data: one `TrialRow` per trial and the study's `Report` (best, defaults, gain
with its bounds, Pareto front, importances, failures), built by `build_report` from the trial
records in Optuna's storage."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import StudyConfig
from optimizer.report.knobs import KnobEffect, finite_or_none, importances, one_knob
from optimizer.results import gains
from optimizer.results.at_load import AtLoads, compared_loads
from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.quality_gate import table_cell
from optimizer.results.recommendation import (
    best_trial,
    confirmation_sentence,
    has_measurement,
    no_baseline_reason,
    no_slo_met,
    params_of,
    recommendation_note,
    recommended_trial,
    vllm_defaults_of,
)
from optimizer.results.tail_samples import basis_of
from optimizer.results.trial_record import (
    confirm_label,
    gpus_of,
    is_baseline,
    record_of,
)
from optimizer.storage.study import count_trials, is_search_trial
from runners.capacity.bracket import Bracket, bracket_from_metrics
from runners.simulated.launcher import is_simulated_argv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialRow:
    """One trial as the report shows it."""

    number: int
    state: str  # complete, pruned, failed, running, waiting
    changes: Mapping[str, Any]  # flags that differ from the defaults baseline's
    value: float | None  # the first objective, per GPU for a rate, as Optuna holds it
    output_throughput: float | None  # tok/s at the headline level
    p99_tpot_ms: float | None
    p99_ttft_ms: float | None
    startup_s: float | None
    wall_s: float | None
    label: str  # bottleneck label, "" when unclassified
    conclusion: str
    failure_reason: str
    is_baseline: bool
    capacity: Bracket | None = None  # after a capacity search: where its capacity lies
    conclusion_short: str = ""  # the conclusion for a table cell (<= ~70 characters)
    quality: str = ""  # the quality gate's cell (optimizer/results/quality_gate.py `table_cell`)
    num_gpus: int = 1  # the GPUs its config used; `value` is per GPU (`objectives.per_gpu`)
    # the requests each p99 is over (optimizer/results/tail_samples.py); None: not recorded
    tpot_p99_num_requests: int | None = None
    ttft_p99_num_requests: int | None = None
    # Its objective at each applied fixed level (`at_load.at_loads`): a gain compares one load.
    loads: AtLoads | None = None

    @property
    def output_throughput_per_gpu(self) -> float | None:
        """Output tok/s at the operating point per GPU: what the Pareto front compares."""
        return self.output_throughput / max(self.num_gpus, 1) \
            if self.output_throughput is not None else None



@dataclass(frozen=True)
class Report:
    study: str
    objective: str
    is_maximize: bool
    is_simulated: bool  # figures from the simulated engine: never measurements
    rows: tuple[TrialRow, ...]
    baseline: TrialRow | None
    best: TrialRow | None
    pareto: tuple[int, ...]  # trial numbers on the throughput / TPOT p99 front
    importances: Mapping[str, float]
    failures: Mapping[str, int]  # failure reason -> trials
    slo: Mapping[str, float]
    confirm: str = ""  # the interleaved re-measurement of best vs defaults, when it ran
    queued: int = 0  # configs enqueued (seeds, a grid) that no worker has started yet
    confirmation_runs: int = 0  # the final re-measurements: counted apart, never as trials
    repeats: int = 0  # the sampler asked again for a config already held: nothing launched
    recommended: TrialRow | None = None  # what `export` writes, when it is not the best
    recommended_why: str = ""  # why it is not the best (recommendation.recommendation_note)
    no_baseline: str = ""  # why the defaults could not be measured (no gain is stated then)
    # Where no trial met the SLO (recommendation.no_slo_met): that, the closest miss, and what
    # to do; then there is no best to report and nothing is recommended.
    no_slo_met: str = ""
    knob_effects: tuple[KnobEffect, ...] = ()  # one-change trials, largest effect first
    # One-change trials left out of `knob_effects`: compared with the baseline at no one load
    # (trial number, why; `knobs.OneKnob`).
    knobs_not_comparable: tuple[tuple[int, str], ...] = ()
    generated: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    # How the baseline is named: the vLLM defaults, or them + the study's fixed flags.
    baseline_words: BaselineWords = DEFAULTS

    @property
    def gain(self) -> float | None:
        """How many times better the best is than the defaults (>1 = better), or None: the
        point only; `gain_bounds` says what bounds it."""
        bounds = self.gain_bounds
        return bounds.value if bounds is not None else None

    @property
    def gain_bounds(self) -> gains.Gain | None:
        """The best's gain over the defaults per GPU with its bounds: the ratio their capacity
        brackets allow after a capacity search, else one measurement each (no bounds)."""
        if self.best is None or self.baseline is None:
            return None
        return gains.gain_over(self.best.value, self.baseline.value, self.best.capacity,
                               self.baseline.capacity, maximize=self.is_maximize,
                               num_gpus=self.best.num_gpus,
                               defaults_num_gpus=self.baseline.num_gpus,
                               loads=self.best.loads, defaults_loads=self.baseline.loads)

    @property
    def gain_as_measured(self) -> gains.Gain | None:
        """The same on all of each side's GPUs (not per GPU); None where both used one GPU
        (the two agree) or there is no comparison."""
        per_gpu = self.gain_bounds
        if self.best is None or self.baseline is None or per_gpu is None:
            return None
        return gains.as_measured(per_gpu, self.objective, self.best.value, self.baseline.value,
                                 self.best.capacity, self.baseline.capacity,
                                 num_gpus=self.best.num_gpus,
                                 defaults_num_gpus=self.baseline.num_gpus)


def _row(trial: FrozenTrial, baseline_flags: Mapping[str, Any],
         axis: str | None = None, objective: str | None = None) -> TrialRow:
    record = record_of(trial)
    metrics: Mapping[str, Any] = record.metrics if record is not None else {}
    flags: Mapping[str, Any] = record.flags if record is not None else {}
    changes = {k: v for k, v in flags.items() if baseline_flags.get(k) != v}
    # A failure held complete in Optuna (a config failure, `saturated`) was told the worst
    # value to teach the sampler: no value of its own.
    values = (record.values if record is not None else None) or \
        (trial.values if has_measurement(trial) else None)
    value = finite_or_none(values[0]) if values else None
    if value is None and trial.state == TrialState.PRUNED:
        last = max(trial.intermediate_values, default=0)
        value = finite_or_none(trial.intermediate_values.get(last))
    verdict = (record.verdict if record is not None else None) or {}
    return TrialRow(
        number=trial.number,
        state=record.state if record is not None else trial.state.name.lower(),
        changes=changes, value=value,
        output_throughput=finite_or_none(metrics.get("output_throughput")),
        p99_tpot_ms=finite_or_none(metrics.get("p99_tpot_ms")),
        p99_ttft_ms=finite_or_none(metrics.get("p99_ttft_ms")),
        startup_s=finite_or_none(metrics.get("engine.startup_s")),
        wall_s=finite_or_none(record.wall_s) if record is not None else None,
        label=str(verdict.get("label") or ""),
        conclusion=record.conclusion if record is not None else "",
        failure_reason=(record.failure_reason if record is not None else None) or "",
        is_baseline=(record is not None and record.is_baseline) or is_baseline(trial),
        capacity=bracket_from_metrics(axis, metrics)  # type: ignore[arg-type]
        if axis in ("concurrency", "request_rate") else None,
        conclusion_short=record.conclusion_short if record is not None else "",
        quality=table_cell(record.quality if record is not None else None),
        num_gpus=gpus_of(flags or params_of(trial)),
        tpot_p99_num_requests=_count(metrics, "num_tpot_samples"),
        ttft_p99_num_requests=_count(metrics, "completed"),
        loads=compared_loads(objective, record),
    )


def _count(metrics: Mapping[str, Any], key: str) -> int | None:
    basis = basis_of(metrics, key)
    return basis.num_requests if basis is not None else None


def pareto_front(rows: Sequence[TrialRow]) -> tuple[int, ...]:
    """Complete trials no other beats on both output throughput per GPU (higher) and TPOT p99
    (lower)."""
    points: list[tuple[int, float, float]] = [
        (r.number, r.output_throughput_per_gpu, r.p99_tpot_ms) for r in rows
        if r.state == "complete" and r.output_throughput_per_gpu is not None
        and r.p99_tpot_ms is not None]
    front = []
    for number, tput, tpot in points:
        dominated = any(t2 >= tput and p2 <= tpot and (t2 > tput or p2 < tpot)
                        for n2, t2, p2 in points if n2 != number)
        if not dominated:
            front.append(number)
    return tuple(sorted(front))


def build_report(study: optuna.Study, cfg: StudyConfig, *,
                 with_importances: bool = True) -> Report:
    # A repeat of a measured config launched nothing: its original stands for it. The final
    # interleaved re-measurements are reported as the confirmation, not as trials.
    # Enqueued configs no worker has started (a grid's or the seeds' tail) are counted, not rows.
    counts = count_trials(study.get_trials(deepcopy=False))
    trials = [t for t in study.get_trials(deepcopy=False) if is_search_trial(t)]
    queued = sum(t.state == TrialState.WAITING for t in trials)
    trials = [t for t in trials if t.state != TrialState.WAITING]
    baseline_trial = next((t for t in trials if is_baseline(t)
                           and t.state == TrialState.COMPLETE), None)
    base_record = record_of(baseline_trial) if baseline_trial is not None else None
    baseline_flags = base_record.flags if base_record is not None else {}
    capacity = cfg.spec.workload.capacity
    axis = capacity.axis if capacity is not None else None
    objective = cfg.objectives[0]
    rows = tuple(_row(t, baseline_flags, axis, objective) for t in trials)
    is_max = OBJECTIVES[objective].direction == "maximize"
    # The study's own best: one that met the SLO somewhere, when any did (constraint "slo").
    chosen = best_trial(study)
    best = next((r for r in rows if chosen is not None and r.number == chosen.number
                 and r.state == "complete"), None)
    baseline = next((r for r in rows if r.is_baseline and r.state == "complete"), None)
    pick = recommended_trial(study)
    recommended = next((r for r in rows if pick is not None and r.number == pick.number
                        and best is not None and r.number != best.number), None)
    slo = {k: float(v) for k, v in cfg.spec.slo.model_dump().items() if v is not None}
    knobs = one_knob(trials, baseline_trial, objective, axis, vllm_defaults_of(study))
    return Report(
        study=cfg.name, objective=objective, is_maximize=is_max,
        is_simulated=any(record is not None and is_simulated_argv(record.argv)
                         for record in map(record_of, trials)),
        rows=rows, baseline=baseline, best=best,
        # a config the quality gate refused is no point to deploy
        pareto=pareto_front([r for r in rows if not r.quality.startswith("REFUSED")]),
        importances=importances(study) if with_importances else {},
        failures=dict(Counter(r.failure_reason for r in rows
                              if r.state == "failed" and r.failure_reason)),
        slo=slo, confirm=_confirmation(study, axis, cfg.baseline_words),
        queued=queued, confirmation_runs=counts.confirmation_runs, repeats=counts.repeats,
        recommended=recommended,
        recommended_why=recommendation_note(study, pick) if recommended is not None and
        pick is not None else "",
        no_baseline=no_baseline_reason(study) or "",
        no_slo_met=no_slo_met(study, slo) or "",
        knob_effects=knobs.effects, knobs_not_comparable=knobs.not_comparable,
        baseline_words=cfg.baseline_words)


def _confirmation(study: optuna.Study, axis: str | None,
                  words: BaselineWords = DEFAULTS) -> str:
    """The re-measurement's sentence; after a capacity search, also the capacity ratio every
    round's two brackets allow (each round's runs re-bracket both configs, so the ratio lies
    in each round's range, hence in their overlap)."""
    sentence = confirmation_sentence(study)
    if not sentence or axis not in ("concurrency", "request_rate"):
        return sentence
    runs = sorted((t for t in study.get_trials(deepcopy=False)
                   if confirm_label(t) and has_measurement(t)),
                  key=lambda t: t.number)
    brackets: dict[str, list[Bracket]] = {"defaults": [], "best": []}
    for t in runs:
        record = record_of(t)
        bracket = bracket_from_metrics(
            axis, record.metrics if record is not None else {})  # type: ignore[arg-type]
        label = confirm_label(t)
        # compared per GPU, as every gain is
        if bracket is not None and label is not None and label in brackets:
            brackets[label].append(gains.per_gpu_bracket(bracket, gpus_of(
                (record.flags if record is not None else None) or params_of(t))))
    rounds = [gains.capacity_gain(b, d) for d, b in zip(brackets["defaults"], brackets["best"],
                                                         strict=False)]
    if not rounds:
        return sentence
    lows = [g.low for g in rounds if g.low is not None]
    highs = [g.high for g in rounds if g.high is not None]
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    if low is not None and high is not None and low > high:
        return (f"{sentence}; the re-measured capacity brackets disagree between rounds "
                "(no common ratio): noise beyond the brackets")
    overlap = gains.format_gain(gains.Gain(None, low, high, "capacity"), words.the)
    return f"{sentence}; re-measured capacity brackets, in every one of {len(rounds)} " \
        f"rounds: {overlap}"
