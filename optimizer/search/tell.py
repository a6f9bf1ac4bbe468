"""What Optuna is told of each trial: a finished run made into its record (the state through
the one mapping, `study.state_of`; the objective values, the SLO constraint, the bottleneck
verdict, the conclusion against the defaults and the best, the per-level figures MLflow logs), a
repeat of a measured config, a config refused before launch."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Protocol

import optuna
from optuna.trial import TrialState

from optimizer import bottleneck
from optimizer.results import quality_gate
from optimizer.results.at_load import at_loads_of_run
from optimizer.results.conclusion import baseline_trial, conclude, reference_of
from optimizer.results.objectives import get_objective, is_capacity_search, objective_values
from optimizer.results.recommendation import best_trial
from optimizer.results.tail_samples import thin_note
from optimizer.results.trial_record import (
    ATTR_DUPLICATE_OF,
    ATTR_RECORD,
    TrialRecord,
    confirm_label,
    record_of,
    seed_source_of,
    seed_title_of,
    step_records,
    summary_metrics,
)
from optimizer.search.notes import (
    engine_of,
    implied_changes_note,
    no_operating_point_note,
    no_value_failure,
    saturated_levels,
    saturated_note,
    speculation_note,
    unapplied_levels_note,
    unbounded_latency_levels,
)
from optimizer.search.startup import startup_metrics, startup_record
from optimizer.search.trials import Running, Told, TrialLog
from optimizer.storage.study import (
    CONFIG_FAILURES,
    REPEATED_FAILURES,
    STATE_NAMES,
    state_of,
    tell_config_failure,
)
from runners.base import (
    EngineConfig,
    Failure,
    RunResult,
    StepMetrics,
)
from runners.capacity.slo import meets_slo
from runners.simulated.launcher import is_simulated_argv

if TYPE_CHECKING:
    from optimizer.config import StudyConfig
    from runners.hardware import HardwareProfile
    from runners.model_info import ModelInfo
    from runners.workload import Workload
    from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

# This many proposals in a row of configs already measured: the sampler has nothing new to offer.
MAX_CONSECUTIVE_DUPLICATES = 200


def record_result(policy: RecordState, item: Running, result: RunResult) -> TrialRecord:
    """Write `item`'s record from its run's `result` and tell Optuna; returns the record."""
    cfg, study, workload = policy.cfg, policy.study, policy.workload
    state = state_of(result)
    failure = result.failure
    saturated = saturated_levels(result.steps)
    # A latency read at (or over) a level that saturated has no value (`no_value_failure`).
    unbounded = unbounded_latency_levels(cfg.objectives, result.steps) \
        if state == TrialState.COMPLETE else []
    values = objective_values(cfg.objectives, result.steps, item.config.num_gpus) \
        if state == TrialState.COMPLETE and not unbounded else None
    if state == TrialState.COMPLETE and values is None and saturated and not unbounded and \
            not any(s.metrics.completed > 0 and not s.is_saturated for s in result.steps):
        # Every level that completed a request was stopped as saturated (its queue kept
        # growing; the client cancelled its requests, none failed): a measured miss at that
        # load, not errors; the trial served no load steadily. A rate is 0 there (what a
        # saturated level completed before its stop is no steady figure).
        values = _values_at_no_load(cfg.objectives)
    if state == TrialState.COMPLETE and values is None:
        # No value: a latency read at a level that saturated, or after a capacity search that
        # met the SLO at no load, or no level completed a request.
        state, failure = TrialState.FAIL, no_value_failure(cfg.objectives, result.steps)
    state_name = STATE_NAMES[state]
    primary = values[0] if values else None
    if state == TrialState.PRUNED and item.steps:
        pruned_values = objective_values(cfg.objectives, item.steps, item.config.num_gpus)
        primary = pruned_values[0] if pruned_values else None
    # A latency with no value has no operating point whose figures the trial would state.
    metrics = summary_metrics(replace(result, steps=()) if unbounded else result,
                              cfg.objectives, item.config.num_gpus)
    # A launched engine's start-up (one never launched has none to record).
    startup = startup_record(item.compile_key, item.prediction, result) \
        if result.argv or result.engine.startup_s else {}
    metrics.update(startup_metrics(startup))
    objective_spread = metrics.get(f"spread.{cfg.objectives[0]}")
    is_unstable = objective_spread is not None and \
        objective_spread > cfg.spec.workload.max_spread
    verdict = None
    if result.steps:
        verdict = policy.verdict(result.steps, item.config, result)
        metrics.update(verdict.as_metrics())
    assessed = quality_gate.assess(cfg, is_baseline=item.is_baseline, params=item.params,
                              defaults=policy.space.defaults(), result=result,
                              trial_number=item.trial.number) \
        if state == TrialState.COMPLETE else None
    if assessed is not None:
        metrics.update(assessed.metrics())
    search = cfg.spec.workload.capacity
    axis = search.axis if search is not None else None
    defaults = baseline_trial(study)
    told = conclude(
        params=item.params, state=state_name, objective=cfg.objectives[0],
        value=primary, failure_reason=failure.reason.value if failure else None,
        failure_message=failure.message if failure else None,
        is_baseline=item.is_baseline, number=item.trial.number,
        best=reference_of(best_trial(study), axis, cfg.objectives[0]),
        baseline=reference_of(defaults, axis, cfg.objectives[0]),
        # The baseline runs the study's fixed flags too: they are no trial's change.
        vllm_defaults={**policy.space.vllm_defaults, **policy.space.study_fixed},
        capacity=result.capacity,
        tolerance=search.tolerance if search is not None else None,
        pruned_at=item.pruned_at, prune_reason=item.prune_reason,
        verdict=verdict if state != TrialState.FAIL else None,
        confirm_label=confirm_label(item.trial),
        note=" ".join(n for n in (
            f"Unstable: its {cfg.objectives[0]} varied {objective_spread:.0%} "
            f"across {workload.repeats} repeats (limit "
            f"{cfg.spec.workload.max_spread:.0%}); re-measure before trusting it."
            if is_unstable and objective_spread is not None else "",
            speculation_note(item.params, metrics)
            if state == TrialState.COMPLETE and not is_simulated_argv(result.argv) else "",
            "" if item.is_baseline else
            implied_changes_note(item.params, result.engine, engine_of(defaults)),
            no_operating_point_note(cfg.objectives[0], result.steps),
            # (a capacity search's probes say it in their own miss reasons)
            f"Saturated at {saturated_note(saturated)}." if saturated and
            state != TrialState.FAIL and not is_capacity_search(result.steps) else "",
            unapplied_levels_note(result.steps),
            thin_note(metrics))
            if n),
        quality_failed=assessed.failed if assessed is not None else (),
        template=seed_title_of(item.trial),
        num_gpus=item.config.num_gpus, baseline_words=cfg.baseline_words,
        # Compared with the defaults and the best at one load (at_load.AtLoads).
        loads=at_loads_of_run(cfg.objectives[0], result.steps, item.config.num_gpus))
    record = TrialRecord(
        state=state_name,  # type: ignore[arg-type]
        params=item.params,
        flags=dict(item.config.flags),
        values=tuple(values) if values is not None else None,
        metrics=metrics,
        steps=tuple(_step_records(policy, result.steps, item.config)),
        failure_reason=failure.reason.value if failure else None,
        failure_message=failure.message if failure else None,
        conclusion=told.text,
        conclusion_short=told.short,
        capacity=result.capacity.to_dict() if result.capacity is not None else None,
        argv=tuple(result.argv),
        env=dict(result.env),
        engine=_engine_dict(result),
        verdict=verdict.as_user_attr() if verdict is not None else None,
        wall_s=result.wall_s,
        engine_started_unix_s=result.engine_started_unix_s,
        engine_ended_unix_s=result.engine_ended_unix_s,
        is_baseline=item.is_baseline,
        host=result.host or "",
        is_unstable=is_unstable,
        quality=assessed.to_dict() if assessed is not None else None,
        seed_source=seed_source_of(item.trial),
        startup=startup,
    )
    item.trial.set_user_attr(ATTR_RECORD, record.to_user_attr())
    if assessed is not None and assessed.status == "scored":
        # Outside the limits: infeasible for the sampler, never the best
        # (recommendation.best_trial).
        item.trial.set_constraint(quality_gate.CONSTRAINT, 1.0 if assessed.is_violation else 0.0)
    if state == TrialState.COMPLETE and policy.has_slo:
        # The sampler learns where configs miss the SLO at every load: infeasible for
        # Optuna's constrained TPE (and never the study's best while one meets it).
        # A level whose load was not applied met nothing at its load (`is_load_unapplied`).
        met = any(s.meets_slo if s.meets_slo is not None else
                  not s.is_load_unapplied and
                  meets_slo(s.metrics, workload.slo, workload.max_failed_fraction,
                            s.is_saturated)
                  for s in result.steps if s.metrics.completed > 0)
        item.trial.set_constraint("slo", 0.0 if met else 1.0)
    if state == TrialState.COMPLETE:
        study.tell(item.trial, values)
    elif failure is not None and failure.reason in REPEATED_FAILURES:
        tell_config_failure(study, item.trial, cfg.objectives, policy.has_slo,
                            has_run=failure.reason not in CONFIG_FAILURES)
    else:
        study.tell(item.trial, state=state)
    return record


def _values_at_no_load(objectives: Sequence[str]) -> list[float] | None:
    """Each objective's value where no load met the SLO (`value_when_none_met_slo`: 0 for a
    rate), or None where one has none (a latency)."""
    values = [get_objective(o).value_when_none_met_slo for o in objectives]
    return [float(v) for v in values if v is not None] if None not in values else None


def _engine_dict(result: RunResult) -> dict[str, Any]:
    return asdict(result.engine)


def _step_records(policy: RecordState, steps: Sequence[StepMetrics],
                  config: EngineConfig) -> list[dict[str, Any]]:
    """Each level's record, with its step-mix roofline (`roofline.*`, `vllm_mfu.*`): the
    per-level figures MLflow logs at step = level."""
    out = step_records(steps)
    for record, figures in zip(out, bottleneck.level_metrics(steps, config, policy.hardware,
                                                              policy.model), strict=True):
        record["metrics"].update(figures)
    return out


class RecordState(Protocol):
    """What writing a run's record needs of the search (`SearchController` is the one)."""

    cfg: StudyConfig
    study: optuna.Study
    workload: Workload
    space: ResolvedSpace
    hardware: HardwareProfile | None
    model: ModelInfo | None

    @property
    def has_slo(self) -> bool: ...

    def verdict(self, steps: Sequence[StepMetrics], config: EngineConfig,
                result: RunResult | None = None) -> bottleneck.Verdict: ...


class TellState(Protocol):
    """What telling Optuna of a trial that never ran needs (`Searcher` is the one): it keeps
    the configs held and counts the repeats in a row."""

    cfg: StudyConfig
    study: optuna.Study
    log: TrialLog
    duplicates_in_a_row: int
    is_exhausted: bool

    @property
    def has_slo(self) -> bool: ...

    def remember(self, number: int, record: TrialRecord | None) -> None: ...


def tell_duplicate(policy: TellState, trial: optuna.Trial, params: dict[str, Any],
                    earlier: int) -> None:
    """The sampler proposed (or the queue held) a config another trial holds: launch
    nothing. A measured original's outcome is reused: the trial tells the sampler the same
    value (so TPE keeps learning). One still queued or running has no outcome yet: the
    repeat fails (the sampler already sees the original as running). Either way it counts
    for no budget; a long run of them ends the study, the space being exhausted."""
    frozen = policy.study.get_trials(deepcopy=False)[earlier]
    original = record_of(frozen)
    if frozen.state.is_finished() and original is not None:
        record = replace(original, is_baseline=False, engine_started_unix_s=None,
                         engine_ended_unix_s=None,  # no engine of its own ran
                         conclusion=f"same config as trial {earlier}: not launched again; "
                                    f"its outcome stands ({original.state}).")
    else:
        stage = "queued" if frozen.state == TrialState.WAITING else "in flight"
        record = TrialRecord.failed(
            params, "duplicate", f"trial {earlier} holds this config ({stage}).",
            f"same config as trial {earlier}, {stage}: not launched; trial {earlier} "
            "measures it.")
    trial.set_user_attr(ATTR_RECORD, record.to_user_attr())
    trial.set_user_attr(ATTR_DUPLICATE_OF, earlier)
    for key, value in frozen.constraints.items():
        trial.set_constraint(key, value)
    if not frozen.state.is_finished():
        policy.study.tell(trial, state=TrialState.FAIL)
    elif frozen.state == TrialState.COMPLETE and frozen.values is not None:
        policy.study.tell(trial, frozen.values)
    else:
        policy.study.tell(trial, state=frozen.state)
    policy.log.told(Told("duplicate", trial.number, record))
    policy.duplicates_in_a_row += 1
    if policy.duplicates_in_a_row >= MAX_CONSECUTIVE_DUPLICATES:
        policy.is_exhausted = True
        logger.warning("the sampler proposed %d measured configs in a row: the space is "
                       "exhausted; the study ends", policy.duplicates_in_a_row)
    logger.debug("trial %d repeats trial %d: not launched", trial.number, earlier)


def tell_without_run(policy: TellState, trial: optuna.Trial, params: dict[str, Any],
                      failure: Failure) -> None:
    # Refused for what the config is, or not launched for what happened to the daemon (it
    # stopped while the trial waited for GPUs): only the first is a verdict on the config.
    what = "rejected before launch" if failure.reason in CONFIG_FAILURES else "not launched"
    conclusion = f"{what} ({failure.reason.value}): {failure.message}"
    record = replace(TrialRecord.failed(params, failure.reason.value, failure.message,
                                        conclusion),
                     seed_source=seed_source_of(trial))
    trial.set_user_attr(ATTR_RECORD, record.to_user_attr())
    policy.remember(trial.number, record)
    run_id = policy.log.open_run(trial, params)
    if failure.reason in CONFIG_FAILURES:
        tell_config_failure(policy.study, trial, policy.cfg.objectives, policy.has_slo)
    else:
        policy.study.tell(trial, state=TrialState.FAIL)
    logger.info("trial %d %s", trial.number, conclusion)
    policy.log.told(Told("rejected", trial.number, record, run_id=run_id))
