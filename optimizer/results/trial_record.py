"""A finished trial as data: `TrialRecord`, kept in Optuna's user attributes (the source of truth
MLflow, the report and `export` are rebuilt from), its headline metrics, and what the tracker
is given of it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Protocol

from optimizer.results.objectives import (
    OBJECTIVES,
    metrics_value,
    objective_value,
    operating_step,
    per_gpu,
)
from optimizer.tuning_memory.fingerprint import Fingerprint
from runners.base import EngineConfig, RunResult, StepMetrics

# The trial user attribute holding its `TrialRecord` (the source of truth the tracker, the report
# and export are rebuilt from).
ATTR_RECORD = "record"
# The other marks a trial carries in Optuna's user attributes, read through the accessors below.
ATTR_CONFIRM = "confirm"  # "defaults" or "best": a final re-measurement, not a search trial
ATTR_DUPLICATE_OF = "duplicate_of"  # the sampler asked again for a config already measured
ATTR_BASELINE = "baseline"
ATTR_RETRY_OF = "retry_of"
ATTR_CUT_SHORT = "sampling_cut_short"  # its daemon died mid-ask: no config, nothing launched
# The daemon stopped while it waited for GPUs: failed without a launch, its config re-queued.
ATTR_NOT_LAUNCHED = "stopped_before_launch"
ATTR_MLFLOW_RUN = "mlflow_run_id"
ATTR_RETRIES = "retries"
# Times a daemon died with this config in flight (kill -9, a host reboot): the infrastructure's
# losses, counted apart from `retries` (the config's own failures) and capped on their own.
ATTR_DAEMON_LOSSES = "daemon_losses"
ATTR_SEEDED = "seeded"  # enqueued from seed_trials, a hardware template or the warm start
# Where a seed came from: "template:hopper" (a hardware template) or "warm_start:<study>" (an
# earlier study's best, optimizer/tuning_memory/earlier_studies.py)
ATTR_SEED_SOURCE = "seed.source"
ATTR_SEED_TITLE = "seed.title"  # "the Hopper template (fp8 weights + ...)", for its conclusion
# The bottleneck verdict (`bottleneck.Verdict.as_user_attr()`), set at each step the pruner
# judges, so a running trial carries it before its record exists.
ATTR_VERDICT = "verdict"
# The study's own user attributes, each written once by the module named.
STUDY_ATTR_CONFIRM = "confirm"  # `confirmation.confirm_summary`: the final re-measured gain
STUDY_ATTR_FINGERPRINT = "fingerprint"  # `Fingerprint.to_dict()` (runtime, at each start)
STUDY_ATTR_WARM_START = "warm_start"  # the lines the warm start printed (runtime)
# vLLM's value of each searched param on the study's host, the study's fixed flags over them
# (`ResolvedSpace.vllm_defaults`), as of the daemon's last start: what "no change" means when a
# report compares trials (an explicit value equal to it is none).
STUDY_ATTR_VLLM_DEFAULTS = "vllm_defaults"
# The key that ties the Optuna study to its MLflow parent run (tracking.TAG_STUDY_KEY).
STUDY_ATTR_MLFLOW_KEY = "mlflow_study_key"
RECORD_VERSION = 1  # bump when a field changes meaning; `from_user_attr` reads every version
RecordState = Literal["complete", "pruned", "failed"]
_NULLABLE = frozenset({"values", "capacity", "verdict", "failure_reason", "failure_message",
                       "engine_started_unix_s", "engine_ended_unix_s", "quality"})


@dataclass(frozen=True)
class TrialRecord:
    """What one trial ran and what came of it; written once per trial (by the search policy),
    read by every report. Version 0 records (before this type) have the same keys, some absent."""

    state: RecordState  # a config failure is "failed" here though Optuna holds it COMPLETE
    params: Mapping[str, Any]  # the config as sampled (fixed params included)
    conclusion: str  # one line: MLflow's `conclusion` tag and the run's description
    conclusion_short: str = ""  # the same, as a table cell
    flags: Mapping[str, Any] = field(default_factory=dict)  # what vLLM was given
    values: tuple[float, ...] | None = None  # the objectives, as told to Optuna
    metrics: Mapping[str, float] = field(default_factory=dict)  # headline, engine, gpu, ...
    steps: tuple[Mapping[str, Any], ...] = ()  # `step_records`: one per load level or probe
    failure_reason: str | None = None  # a `FailureReason` value
    failure_message: str | None = None
    capacity: Mapping[str, Any] | None = None  # `Bracket.to_dict()` after a capacity search
    argv: tuple[str, ...] = ()  # the engine's command line
    env: Mapping[str, str] = field(default_factory=dict)
    engine: Mapping[str, Any] = field(default_factory=dict)  # `EngineInfo`: what vLLM chose
    verdict: Mapping[str, Any] | None = None  # `Verdict.as_user_attr()`
    wall_s: float = 0.0  # the trial's wall time, start-up included
    engine_started_unix_s: float | None = None  # the engine process's life: which trials
    engine_ended_unix_s: float | None = None  # really ran side by side
    is_baseline: bool = False  # the vLLM defaults
    host: str = ""  # where it ran (host, Ray node, GPUs)
    is_unstable: bool = False  # its repeats spread beyond workload.max_spread
    # `QualityAssessment.to_dict()` (optimizer/results/quality_gate.py): scored, the reference,
    # or why not
    quality: Mapping[str, Any] | None = None
    # "template:hopper" (a hardware template) or "warm_start:<study>" (an earlier study's best,
    # optimizer/tuning_memory/earlier_studies.py): a seed measured here like any other trial;
    # "" for the rest.
    seed_source: str = ""
    # `optimizer.search.startup.startup_record`: the compile cache predicted and seen, seconds
    # by part
    startup: Mapping[str, Any] = field(default_factory=dict)
    version: int = RECORD_VERSION

    @classmethod
    def failed(cls, params: Mapping[str, Any], reason: str, message: str, conclusion: str,
               *, is_baseline: bool = False) -> TrialRecord:
        """A trial that produced no measurement (rejected, lost, interrupted)."""
        return cls(state="failed", params=dict(params), conclusion=conclusion,
                   failure_reason=reason, failure_message=message, is_baseline=is_baseline)

    @property
    def num_gpus(self) -> int:
        """The GPUs the config ran on (tensor x pipeline x data parallel; `EngineConfig`), from
        what vLLM was given, else from the params (a record of a config never launched)."""
        return gpus_of(self.flags or self.params)

    def to_user_attr(self) -> dict[str, Any]:
        """JSON for `trial.set_user_attr(ATTR_RECORD, ...)`."""
        out = asdict(self)
        out["values"] = list(self.values) if self.values is not None else None
        out["steps"] = [dict(s) for s in self.steps]
        out["argv"] = list(self.argv)
        return out

    @classmethod
    def from_user_attr(cls, data: Mapping[str, Any]) -> TrialRecord:
        """A stored record of any version; keys this version does not know are ignored."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items()
                  if k in known and (v is not None or k in _NULLABLE)}
        if kwargs.get("values") is not None:
            kwargs["values"] = tuple(float(v) for v in kwargs["values"])
        kwargs["steps"] = tuple(kwargs.get("steps") or ())
        kwargs["argv"] = tuple(kwargs.get("argv") or ())
        kwargs.setdefault("version", 0)
        kwargs.setdefault("conclusion", "")
        kwargs.setdefault("params", {})
        kwargs.setdefault("state", "failed")
        return cls(**kwargs)


def gpus_of(flags: Mapping[str, Any]) -> int:
    """The GPUs a config with these flags (or params) uses, as `EngineConfig.num_gpus` counts."""
    parallel = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
    return EngineConfig(model="", flags={k: flags[k] for k in parallel if k in flags}).num_gpus


class HasUserAttrs(Protocol):
    """What the accessors below read: a trial (`FrozenTrial`, a live `optuna.Trial`) or a
    study, with the attributes Optuna stores for it."""

    @property
    def user_attrs(self) -> dict[str, Any]: ...


def record_of(trial: HasUserAttrs) -> TrialRecord | None:
    """The trial's record, or None for a trial that has none yet (queued, running)."""
    data = trial.user_attrs.get(ATTR_RECORD)
    return TrialRecord.from_user_attr(data) if isinstance(data, Mapping) and data else None


def verdict_of(trial: HasUserAttrs) -> Mapping[str, Any] | None:
    """The verdict the trial stored (`bottleneck.Verdict.as_user_attr()`), or None; the
    pruners read it, on a running trial too."""
    verdict = trial.user_attrs.get(ATTR_VERDICT)
    return verdict if isinstance(verdict, Mapping) else None


def is_baseline(trial: HasUserAttrs) -> bool:
    """A run of the vLLM defaults: the baseline trial, or the final confirmation's re-run of
    it (`confirm_label` tells them apart)."""
    return bool(trial.user_attrs.get(ATTR_BASELINE))


def confirm_label(trial: HasUserAttrs) -> str | None:
    """"defaults" or "best" for a final confirmation run (a re-measurement, not a trial of
    the search), None for every other trial."""
    label = trial.user_attrs.get(ATTR_CONFIRM)
    return str(label) if label else None


def is_repeat(trial: HasUserAttrs) -> bool:
    """The sampler asked again for a config already measured: this trial launched nothing."""
    return ATTR_DUPLICATE_OF in trial.user_attrs


def is_cut_short(trial: HasUserAttrs) -> bool:
    """Its daemon died while its config was sampled (or before it launched): nothing ran."""
    return ATTR_CUT_SHORT in trial.user_attrs


def is_stopped_before_launch(trial: HasUserAttrs) -> bool:
    """A stop failed it while it waited for GPUs; its config was queued again."""
    return ATTR_NOT_LAUNCHED in trial.user_attrs


def ran_nothing(trial: HasUserAttrs) -> bool:
    """A trial that launched nothing: a repeat of a config already measured, one whose
    sampling a dying daemon cut short, or one a stop failed while it waited for GPUs."""
    return is_repeat(trial) or is_cut_short(trial) or is_stopped_before_launch(trial)


def retry_of(trial: HasUserAttrs) -> int | None:
    """The trial number this one re-runs (a copy queued after a loss), or None."""
    number = trial.user_attrs.get(ATTR_RETRY_OF)
    return int(number) if number is not None else None


def retries_of(trial: HasUserAttrs) -> int:
    """How many of the config's retries its earlier runs spent."""
    return int(trial.user_attrs.get(ATTR_RETRIES, 0))


def daemon_losses_of(trial: HasUserAttrs) -> int:
    """How many times a daemon died with this config in flight (`ATTR_DAEMON_LOSSES`)."""
    return int(trial.user_attrs.get(ATTR_DAEMON_LOSSES, 0))


def seed_source_of(trial: HasUserAttrs) -> str:
    """"template:<name>" or "warm_start:<study>" for a seed from there, "" for the rest."""
    return str(trial.user_attrs.get(ATTR_SEED_SOURCE) or "")


def seed_title_of(trial: HasUserAttrs) -> str:
    """The hardware template's title for a seed from one, "" for the rest."""
    return str(trial.user_attrs.get(ATTR_SEED_TITLE, ""))


def mlflow_run_of(trial: HasUserAttrs) -> str | None:
    """The id of the trial's MLflow run, None before one was opened (or where it failed)."""
    run_id = trial.user_attrs.get(ATTR_MLFLOW_RUN)
    return str(run_id) if run_id else None


def requeue_marks(trial: HasUserAttrs) -> dict[str, Any]:
    """The marks a copy of the trial queued again keeps: what it was (the defaults, a seed)
    and the daemon losses it carries."""
    attrs = trial.user_attrs
    return {key: attrs[key] for key in (ATTR_BASELINE, ATTR_SEEDED, ATTR_SEED_SOURCE,
                                        ATTR_SEED_TITLE, ATTR_DAEMON_LOSSES) if key in attrs}


def mlflow_study_key(study: HasUserAttrs) -> str | None:
    """The study's MLflow key, None for a study that has none yet."""
    key = study.user_attrs.get(STUDY_ATTR_MLFLOW_KEY)
    return key if isinstance(key, str) and key else None


def stored_vllm_defaults(study: HasUserAttrs) -> Mapping[str, Any] | None:
    """vLLM's defaults on the study's host as its last start stored them
    (`STUDY_ATTR_VLLM_DEFAULTS`), or None (a study from before them)."""
    kept = study.user_attrs.get(STUDY_ATTR_VLLM_DEFAULTS)
    return kept if isinstance(kept, Mapping) else None


@dataclass(frozen=True)
class StoredConfirmation:
    """The final confirmation as `confirmation.confirm` stored it on the study
    (`confirmation.confirm_summary`): the recommended trial against the defaults, interleaved."""

    sentence: str  # the one line a report and `status` print
    best_trial: int | None  # the trial re-measured against the defaults
    # mean of the rounds' ratios (geometric; arithmetic where one is 0), > 1 better; None where
    # a round had no ratio (the defaults measured 0), never 0 or inf in its place
    gain: float | None
    ci_low: float | None  # 95% interval of the gain; None from one round
    ci_high: float | None
    num_rounds: int  # the rounds the gain averages
    is_confirmed: bool  # never on the simulated engine: its repeats are a model's
    is_simulated: bool = False  # the rounds ran the simulated engine (confirm_summary)
    load: str | None = None  # where each averaged round compared them; None: operating points
    rounds_each: int | None = None  # the rounds measured, where more than `num_rounds`


def confirmation_of(study: HasUserAttrs) -> StoredConfirmation | None:
    """The study's final confirmation, or None where none ran (or it stored nothing)."""
    data = study.user_attrs.get(STUDY_ATTR_CONFIRM)
    if not isinstance(data, Mapping) or not data:
        return None

    def number(key: str) -> float | None:
        value = data.get(key)
        return float(value) if isinstance(value, int | float) else None

    best, load, averaged = data.get("best_trial"), data.get("load"), data.get("num_rounds")
    measured = len(data.get("ratios") or [])  # one a round; all averaged before num_rounds
    num_rounds = averaged if isinstance(averaged, int) else measured
    return StoredConfirmation(
        sentence=str(data.get("sentence") or ""),
        best_trial=int(best) if isinstance(best, int) else None,
        gain=number("gain"), ci_low=number("ci_low"), ci_high=number("ci_high"),
        num_rounds=num_rounds, is_confirmed=bool(data.get("is_confirmed")),
        is_simulated=bool(data.get("is_simulated")),
        load=load if isinstance(load, str) else None,
        rounds_each=measured if measured > num_rounds else None)


def stored_fingerprint(study: HasUserAttrs) -> Fingerprint | None:
    """The fingerprint the study's last start stored, or None (a study from before them)."""
    data = study.user_attrs.get(STUDY_ATTR_FINGERPRINT)
    return Fingerprint.from_dict(data)[0] if isinstance(data, Mapping) else None

def objective_unit(objective: str) -> str:
    """The unit an objective's value is printed in ("" where it has none)."""
    return OBJECTIVES[objective].unit if objective in OBJECTIVES else ""


def summary_metrics(result: RunResult, objectives: Sequence[str],
                    num_gpus: int = 1) -> dict[str, float]:
    """Flat metrics for the tracker: the operating point (`objectives.operating_step`: every
    figure of it from that one level) in vLLM's names, the objectives (`objective.<name>` the
    config's figure on all its `num_gpus` GPUs, `objective.<name>.per_gpu` the value Optuna is
    told), what the engine told at start, telemetry and (later) bottleneck shares. A capacity
    search in which no load met the SLO has no operating point: no level's figures then."""
    out: dict[str, float] = {"num_gpus": float(num_gpus)}
    step = operating_step(objectives[0], result.steps)
    if step is not None:
        out.update(step.metrics.as_dict())
        out["headline_level"] = float(step.step)
        for objective in objectives:
            value = spread(objective, step)
            if value is not None:
                out[f"spread.{objective}"] = value
        for k, v in step.server_metrics.items():
            out[f"server.{k.replace(':', '_')}"] = float(v)
    for objective in objectives:
        # On all the config's GPUs, at the one operating point.
        value = objective_value(objective, result.steps, primary=objectives[0])
        if value is not None:
            out[f"objective.{objective}"] = value
            if OBJECTIVES[objective].is_per_gpu:  # the trial's value, as Optuna has it
                out[f"objective.{objective}.per_gpu"] = per_gpu(objective, value, num_gpus)
    out.update({f"engine.{k}": v for k, v in result.engine.as_metrics().items()})
    out.update({f"gpu.{k}": float(v) for k, v in result.telemetry.items()})
    if result.trace_summary:
        out.update({f"trace.{k}": float(v) for k, v in result.trace_summary.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)})
    if result.capacity is not None:  # where the capacity lies: the bracket's two ends
        out.update(result.capacity.as_metrics())
    probes = [s for s in result.steps if s.meets_slo is not None]
    if probes:  # a capacity search: the highest load within the SLO (0 when none was)
        within = [s for s in probes if s.meets_slo]
        out["capacity.concurrency"] = float(max(
            (s.level.max_concurrency or 0 for s in within), default=0))
        out["capacity.request_rate_rps"] = float(max(
            (s.level.request_rate_rps or 0.0 for s in within), default=0.0))
        out.setdefault("capacity.num_probes", float(len(probes)))
    out["trial_wall_s"] = result.wall_s
    return out


def spread(objective: str, step: StepMetrics) -> float | None:
    """How much a repeated level's objective varied: (max - min) / median; None when the level
    ran once (or its median is 0)."""
    if len(step.repeats) < 2:
        return None
    values = sorted(v for m in step.repeats
                    if math.isfinite(v := metrics_value(objective, m)))
    if len(values) < 2:
        return None
    median = values[len(values) // 2]
    return (values[-1] - values[0]) / abs(median) if median else None


def step_records(steps: Sequence[StepMetrics]) -> list[dict[str, Any]]:
    """Each load level (or capacity probe) with its offered load, so the latency-vs-load curve
    is in the record and in MLflow (metrics at step = level)."""
    out = []
    for s in steps:
        metrics = s.metrics.as_dict()
        if s.level.max_concurrency is not None:
            metrics["offered_concurrency"] = float(s.level.max_concurrency)
        if s.level.request_rate_rps is not None:
            metrics["offered_rate_rps"] = s.level.request_rate_rps
        if s.meets_slo is not None:
            metrics["meets_slo"] = float(s.meets_slo)
        hit_rate = s.server_metrics.get("prefix_cache_hit_rate")
        if hit_rate is not None:  # hits / queries over the level, from vLLM's counters
            metrics["prefix_cache.hit_rate"] = float(hit_rate)
        for name in ("acceptance_rate", "mean_acceptance_length"):  # speculative decoding
            value = s.server_metrics.get(f"spec_decode_{name}")
            if value is not None:
                metrics[f"spec_decode.{name}"] = float(value)
        if s.repeats:
            metrics["repeats"] = float(len(s.repeats))
            for objective in OBJECTIVES:  # each, so a gain at this level has its spread
                value = spread(objective, s)
                if value is not None:
                    metrics[f"spread.{objective}"] = value
        # The runner's measured window (issue 32's steady-state probes), where it says; read
        # with getattr until runners.base.StepMetrics has these fields (all optional).
        for name in ("offered_rate_rps", "completed_rate_rps"):
            value = getattr(s, name, None)
            if isinstance(value, int | float) and math.isfinite(value):
                metrics[f"window.{name}"] = float(value)
        record = {"step": s.step, "level": asdict(s.level), "metrics": metrics,
                  "server": dict(s.server_metrics), "elapsed_s": s.elapsed_s,
                  "meets_slo": s.meets_slo}
        miss_reason = getattr(s, "miss_reason", None)
        if miss_reason:  # why the probe missed: "overload: 12 connect timeouts", ...
            record["miss_reason"] = str(miss_reason)
        out.append(record)
    return out
