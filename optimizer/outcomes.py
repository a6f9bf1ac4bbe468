"""A finished run made into its trial's record and told to Optuna: the state (through the one
mapping, `study.state_of`), the objective values, the SLO constraint, the bottleneck verdict,
the conclusion against the defaults and the best, and the per-level figures MLflow logs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from optuna.trial import TrialState

from optimizer import bottleneck
from optimizer.conclusions import baseline_trial, conclude, reference_of
from optimizer.records import TrialRecord, step_records, summary_metrics
from optimizer.study import (
    ATTR_CONFIRM,
    ATTR_RECORD,
    CONFIG_FAILURES,
    best_trial,
    objective_values,
    state_of,
    tell_config_failure,
)
from runners.base import EngineConfig, Failure, FailureReason, RunResult, StepMetrics
from runners.capacity import meets_slo

if TYPE_CHECKING:
    from collections.abc import Sequence

    from optimizer.search import Running, SearchPolicy

_STATE_NAMES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned",
                TrialState.FAIL: "failed"}


def record_result(policy: SearchPolicy, item: Running, result: RunResult) -> TrialRecord:
    """Write `item`'s record from its run's `result` and tell Optuna; returns the record."""
    cfg, study, workload = policy.cfg, policy.study, policy.workload
    state = state_of(result)
    values = objective_values(cfg.objectives, result.steps) \
        if state == TrialState.COMPLETE else None
    failure = result.failure
    if state == TrialState.COMPLETE and values is None:
        state, failure = TrialState.FAIL, Failure(
            FailureReason.TOO_MANY_ERRORS, "no load level completed a request.")
    state_name = _STATE_NAMES[state]
    primary = values[0] if values else None
    if state == TrialState.PRUNED and item.steps:
        pruned_values = objective_values(cfg.objectives, item.steps)
        primary = pruned_values[0] if pruned_values else None
    metrics = summary_metrics(result, cfg.objectives)
    objective_spread = metrics.get(f"spread.{cfg.objectives[0]}")
    is_unstable = objective_spread is not None and \
        objective_spread > cfg.spec.workload.max_spread
    verdict = None
    if result.steps:
        verdict = policy.verdict(result.steps, item.config, result)
        metrics.update(verdict.as_metrics())
    search = cfg.spec.workload.capacity
    axis = search.axis if search is not None else None
    told = conclude(
        params=item.params, state=state_name, objective=cfg.objectives[0],
        value=primary, failure_reason=failure.reason.value if failure else None,
        failure_message=failure.message if failure else None,
        is_baseline=item.is_baseline, number=item.trial.number,
        best=reference_of(best_trial(study), axis),
        baseline=reference_of(baseline_trial(study), axis),
        vllm_defaults=policy.space.vllm_defaults, capacity=result.capacity,
        tolerance=search.tolerance if search is not None else None,
        pruned_at=item.pruned_at, prune_reason=item.prune_reason,
        verdict=verdict if state != TrialState.FAIL else None,
        confirm_label=item.trial.user_attrs.get(ATTR_CONFIRM),
        note=(f"Unstable: its {cfg.objectives[0]} varied {objective_spread:.0%} "
              f"across {workload.repeats} repeats (limit "
              f"{cfg.spec.workload.max_spread:.0%}); re-measure before trusting it."
              if is_unstable and objective_spread is not None else ""))
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
    )
    item.trial.set_user_attr(ATTR_RECORD, record.to_user_attr())
    if state == TrialState.COMPLETE and policy.has_slo:
        # The sampler learns where configs miss the SLO at every load: infeasible for
        # Optuna's constrained TPE (and never the study's best while one meets it).
        met = any(s.meets_slo if s.meets_slo is not None else
                  meets_slo(s.metrics, workload.slo, workload.max_failed_fraction,
                            s.server_metrics.get("is_saturated", 0.0) > 0)
                  for s in result.steps if s.metrics.completed > 0)
        item.trial.set_constraint("slo", 0.0 if met else 1.0)
    if state == TrialState.COMPLETE:
        study.tell(item.trial, values)
    elif failure is not None and failure.reason in CONFIG_FAILURES:
        tell_config_failure(study, item.trial, cfg.objectives, policy.has_slo)
    else:
        study.tell(item.trial, state=state)
    return record


def _engine_dict(result: RunResult) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(result.engine)


def _step_records(policy: SearchPolicy, steps: Sequence[StepMetrics],
                  config: EngineConfig) -> list[dict[str, Any]]:
    """Each level's record, with its step-mix roofline (`roofline.*`, `vllm_mfu.*`): the
    per-level figures MLflow logs at step = level."""
    out = step_records(steps)
    for record, figures in zip(out, bottleneck.level_metrics(steps, config, policy.hardware,
                                                              policy.model), strict=True):
        record["metrics"].update(figures)
    return out


def state_name(state: TrialState) -> str:
    return _STATE_NAMES.get(state, state.name.lower())
