"""What the search policy tells Optuna of each trial, and the types a trial passes through
(`Waiting`, `Running`, `Told`, the `TrialLog` that hears it): a finished run made into its
record (the state through the one mapping, `study.state_of`; the objective values, the SLO
constraint, the bottleneck verdict, the conclusion against the defaults and the best, the
per-level figures MLflow logs), a repeat of a measured config, a config refused before launch."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import optuna
from optuna.trial import TrialState

from optimizer import bottleneck, quality
from optimizer.conclusions import baseline_trial, conclude, reference_of
from optimizer.objectives import (
    described_step,
    is_capacity_search,
    objective_values,
    operating_step,
)
from optimizer.records import (
    ATTR_CONFIRM,
    ATTR_DUPLICATE_OF,
    ATTR_RECORD,
    ATTR_SEED_SOURCE,
    ATTR_SEED_TITLE,
    TrialRecord,
    record_of,
    step_records,
    summary_metrics,
)
from optimizer.startup import startup_metrics, startup_record
from optimizer.study import CONFIG_FAILURES, STATE_NAMES, best_trial, state_of, tell_config_failure
from runners.base import (
    EngineConfig,
    EngineInfo,
    Failure,
    FailureReason,
    RunResult,
    StepMetrics,
)
from runners.capacity import meets_slo
from runners.simulated.launcher import is_simulated_argv
from runners.vllm.compile_cache import CompileKey

if TYPE_CHECKING:
    from optimizer.config import StudyConfig
    from runners.hardware import HardwareProfile
    from runners.model_info import ModelInfo
    from runners.workload import Workload
    from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

# This many proposals in a row of configs already measured: the sampler has nothing new to offer.
MAX_CONSECUTIVE_DUPLICATES = 200


def record_result(policy: PolicyState, item: Running, result: RunResult) -> TrialRecord:
    """Write `item`'s record from its run's `result` and tell Optuna; returns the record."""
    cfg, study, workload = policy.cfg, policy.study, policy.workload
    state = state_of(result)
    values = objective_values(cfg.objectives, result.steps, item.config.num_gpus) \
        if state == TrialState.COMPLETE else None
    failure = result.failure
    if state == TrialState.COMPLETE and values is None:
        # Requests completed, yet no value: a latency objective after a capacity search that
        # met the SLO at no load (a probe missed for overload is such a miss, not an error).
        why = "no probed load met the SLO, so a latency objective has no value" if any(
            s.metrics.completed > 0 for s in result.steps) else \
            "no load level completed a request"
        state, failure = TrialState.FAIL, Failure(FailureReason.TOO_MANY_ERRORS, f"{why}.")
    state_name = STATE_NAMES[state]
    primary = values[0] if values else None
    if state == TrialState.PRUNED and item.steps:
        pruned_values = objective_values(cfg.objectives, item.steps, item.config.num_gpus)
        primary = pruned_values[0] if pruned_values else None
    metrics = summary_metrics(result, cfg.objectives, item.config.num_gpus)
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
    assessed = quality.assess(cfg, is_baseline=item.is_baseline, params=item.params,
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
        best=reference_of(best_trial(study), axis),
        baseline=reference_of(defaults, axis),
        # The baseline runs the study's fixed flags too: they are no trial's change.
        vllm_defaults={**policy.space.vllm_defaults, **policy.space.study_fixed},
        capacity=result.capacity,
        tolerance=search.tolerance if search is not None else None,
        pruned_at=item.pruned_at, prune_reason=item.prune_reason,
        verdict=verdict if state != TrialState.FAIL else None,
        confirm_label=item.trial.user_attrs.get(ATTR_CONFIRM),
        note=" ".join(n for n in (
            f"Unstable: its {cfg.objectives[0]} varied {objective_spread:.0%} "
            f"across {workload.repeats} repeats (limit "
            f"{cfg.spec.workload.max_spread:.0%}); re-measure before trusting it."
            if is_unstable and objective_spread is not None else "",
            speculation_note(item.params, metrics)
            if state == TrialState.COMPLETE and not is_simulated_argv(result.argv) else "",
            "" if item.is_baseline else
            implied_changes_note(item.params, result.engine, _engine_of(defaults)),
            no_operating_point_note(cfg.objectives[0], result.steps))
            if n),
        quality_failed=assessed.failed if assessed is not None else (),
        template=str(item.trial.user_attrs.get(ATTR_SEED_TITLE, "")),
        num_gpus=item.config.num_gpus)
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
        seed_source=str(item.trial.user_attrs.get(ATTR_SEED_SOURCE) or ""),
        startup=startup,
    )
    item.trial.set_user_attr(ATTR_RECORD, record.to_user_attr())
    if assessed is not None and assessed.status == "scored":
        # Outside the limits: infeasible for the sampler, never the best (study.best_trial).
        item.trial.set_constraint(quality.CONSTRAINT, 1.0 if assessed.is_violation else 0.0)
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
    return asdict(result.engine)


def _step_records(policy: PolicyState, steps: Sequence[StepMetrics],
                  config: EngineConfig) -> list[dict[str, Any]]:
    """Each level's record, with its step-mix roofline (`roofline.*`, `vllm_mfu.*`): the
    per-level figures MLflow logs at step = level."""
    out = step_records(steps)
    for record, figures in zip(out, bottleneck.level_metrics(steps, config, policy.hardware,
                                                              policy.model), strict=True):
        record["metrics"].update(figures)
    return out


@dataclass
class Running:
    """A trial handed out to run: what the policy needs to judge its steps and record it."""

    trial: optuna.Trial
    params: dict[str, Any]  # as sampled (fixed params included)
    config: EngineConfig
    is_baseline: bool
    retries: int
    started: float = field(default_factory=time.monotonic)
    run_id: str | None = None  # the tracker's run, set by whoever launches it
    steps: list[StepMetrics] = field(default_factory=list)
    pruned_at: int | None = None
    prune_reason: str | None = None
    compile_key: CompileKey | None = None  # the estimated compile-cache key (optimizer.startup)
    prediction: str = "none"  # what the policy expected of its compile cache at launch


@dataclass
class Waiting:
    """A trial asked of Optuna whose GPUs are not free yet."""

    trial: optuna.Trial
    params: dict[str, Any]
    config: EngineConfig
    overtaken: int = 0  # later trials launched while this one waited


@dataclass(frozen=True)
class Told:
    """A trial the policy has told Optuna about, for the log: `kind` "measured" (it ran),
    "rejected" (refused before launch: it has a run of its own) or "duplicate" (no run)."""

    kind: str
    number: int
    record: TrialRecord
    run_id: str | None = None
    result: RunResult | None = None
    running: Running | None = None


class TrialLog(Protocol):
    """Hears what the policy tells Optuna (the daemon: MLflow and the progress display)."""

    def open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        """Give a trial that never launched its run, before it is told (the run id can then
        still be stored on the trial); None when the tracker refuses."""
        ...

    def told(self, told: Told) -> None: ...


class NoLog:
    """A `TrialLog` that keeps nothing (the replay)."""

    def open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        return None

    def told(self, told: Told) -> None:
        return None


class PolicyState(Protocol):
    """What telling Optuna needs of the search policy (`search.SearchPolicy` is the one)."""

    cfg: StudyConfig
    study: optuna.Study
    workload: Workload
    space: ResolvedSpace
    hardware: HardwareProfile | None
    model: ModelInfo | None
    log: TrialLog
    duplicates_in_a_row: int
    is_exhausted: bool

    @property
    def has_slo(self) -> bool: ...

    def verdict(self, steps: Sequence[StepMetrics], config: EngineConfig,
                result: RunResult | None = None) -> bottleneck.Verdict: ...

    def remember(self, number: int, record: TrialRecord | None) -> None: ...


def config_key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def tell_duplicate(policy: PolicyState, trial: optuna.Trial, params: dict[str, Any],
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


def tell_without_run(policy: PolicyState, trial: optuna.Trial, params: dict[str, Any],
                      failure: Failure) -> None:
    # Refused for what the config is, or not launched for what happened to the daemon (it
    # stopped while the trial waited for GPUs): only the first is a verdict on the config.
    what = "rejected before launch" if failure.reason in CONFIG_FAILURES else "not launched"
    conclusion = f"{what} ({failure.reason.value}): {failure.message}"
    record = replace(TrialRecord.failed(params, failure.reason.value, failure.message,
                                        conclusion),
                     seed_source=str(trial.user_attrs.get(ATTR_SEED_SOURCE) or ""))
    trial.set_user_attr(ATTR_RECORD, record.to_user_attr())
    policy.remember(trial.number, record)
    run_id = policy.log.open_run(trial, params)
    if failure.reason in CONFIG_FAILURES:
        tell_config_failure(policy.study, trial, policy.cfg.objectives, policy.has_slo)
    else:
        policy.study.tell(trial, state=TrialState.FAIL)
    logger.info("trial %d %s", trial.number, conclusion)
    policy.log.told(Told("rejected", trial.number, record, run_id=run_id))

# -- steps and pruning ----------------------------------------------------------------------


def speculation_note(params: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
    """What speculative decoding did at the headline level, from vLLM's counters: the share of
    draft tokens accepted and the tokens a verification step yielded; that the counters show
    no draft proposed (prompt lookup finds nothing the output repeats); or that no counter was
    read, so nothing is said of the drafts."""
    method = params.get("spec_method")
    if method in (None, "none"):
        return ""
    rate = metrics.get("server.spec_decode_acceptance_rate")
    length = metrics.get("server.spec_decode_mean_acceptance_length")
    if rate is not None and length is not None:
        return (f"Speculation ({method}): {rate:.0%} of draft tokens accepted, {length:.1f} "
                "tokens per verification step at the headline level.")
    if metrics.get("server.spec_decode_num_drafts") == 0:
        return f"Speculation ({method}): vLLM proposed no draft at the headline level."
    return (f"Speculation ({method}): vLLM's spec-decode counters were not read at the "
            "headline level, so what the drafts did is unknown.")


def no_operating_point_note(objective: str, steps: Sequence[StepMetrics]) -> str:
    """After a capacity search in which no load met the SLO, that the trial has no operating
    point, and why the lightest load probed missed where the runner says (its `miss_reason`,
    read with getattr until `StepMetrics` has it); "" otherwise."""
    if not is_capacity_search(steps) or operating_step(objective, steps) is not None:
        return ""
    lightest = described_step(objective, steps)
    if lightest is None:
        return ""
    level = lightest.level
    load = f"{level.request_rate_rps:.3g} req/s" if level.request_rate_rps is not None \
        else f"concurrency {level.max_concurrency}"
    why = getattr(lightest, "miss_reason", None)
    return (f"No operating point: no probed load met the SLO; the lightest, {load}, missed it"
            + (f" ({why})." if why else "."))


def _engine_of(trial: optuna.trial.FrozenTrial | None) -> Mapping[str, Any] | None:
    """A trial's engine as its record keeps it (`EngineInfo`), or None (no trial, no record)."""
    record = record_of(trial) if trial is not None else None
    return dict(record.engine or {}) if record is not None else None


def implied_changes_note(params: Mapping[str, Any], engine: EngineInfo,
                         baseline: Mapping[str, Any] | None) -> str:
    """What vLLM changed by itself for this config, beyond what the trial asked for, so that
    the change a conclusion names is not taken for the whole of it (vLLM 0.26, with CPU ngram
    speculation: async scheduling off, config/vllm.py:1059-1107; the V1 model runner instead
    of V2, config/vllm.py:576-588). Each is said where the defaults' engine is known to have
    run otherwise, or where the defaults were not measured yet (then of this config alone); a
    defaults' record that does not say (written before these were read) says nothing."""
    said = []
    if engine.async_scheduling is False and params.get("async_scheduling") is not False and \
            (baseline is None or baseline.get("async_scheduling") is True):
        said.append("turned async scheduling off (its log: \"Asynchronous scheduling is "
                    "disabled\")")
    if engine.model_runner == "V1" and (baseline is None or baseline.get("model_runner") == "V2"):
        said.append("ran the V1 model runner instead of V2 (its log: \"using the V1 model "
                    "runner instead\")")
    if not said:
        return ""
    return f"vLLM {' and '.join(said)} for this config, so the result includes that."

