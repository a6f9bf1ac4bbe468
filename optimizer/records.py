"""A finished trial as data: `TrialRecord`, kept in Optuna's user attributes (the source of truth
MLflow, the report and `export` are rebuilt from), its headline metrics, and what the tracker
is given of it."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from optimizer.objectives import (
    OBJECTIVES,
    metrics_value,
    objective_value,
    operating_step,
    per_gpu,
)
from optimizer.search.startup import startup_tags
from optimizer.tracking import KIND_CONFIRMATION, TAG_CONFIRM, TAG_KIND
from runners.base import BenchmarkMetrics, EngineConfig, RunResult, StepMetrics
from runners.simulated.launcher import is_simulated_argv

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

# The trial user attribute holding its `TrialRecord` (the source of truth the tracker, the report
# and export are rebuilt from).
ATTR_RECORD = "record"
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
    # `QualityAssessment.to_dict()` (optimizer/quality.py): scored, the reference, or why not
    quality: Mapping[str, Any] | None = None
    # "template:hopper" (a hardware template) or "warm_start:<study>" (an earlier study's best,
    # optimizer/memory.py): a seed measured here like any other trial; "" for every other trial.
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


def record_of(trial: FrozenTrial) -> TrialRecord | None:
    """The trial's record, or None for a trial that has none yet (queued, running)."""
    data = trial.user_attrs.get(ATTR_RECORD)
    return TrialRecord.from_user_attr(data) if isinstance(data, Mapping) and data else None

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
            for objective in ("goodput", "throughput", "tpot"):
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




# A run's name: `t003 fp8+kv-fp8`, the flags a trial changed in a few characters each.
_SHORT_PREFIX = {
    "kv_cache_dtype": "kv-", "tensor_parallel_size": "tp", "data_parallel_size": "dp",
    "pipeline_parallel_size": "pp", "max_num_batched_tokens": "mnbt", "max_num_seqs": "seqs",
    "gpu_memory_utilization": "gmu", "max_model_len": "len", "block_size": "block",
    "compilation_config.cudagraph_mode": "cg-", "max_cudagraph_capture_size": "cgmax",
    "cpu_offload_gb": "offload", "dtype": "dtype-",
}
_VALUE_ONLY = frozenset({"quantization", "attention_backend"})  # `fp8`, `flashinfer`
RUN_NAME_CHARS = 48  # beyond this the rest is counted (`+3`): the runs table's name column
_LEVEL_KEYS = frozenset({f.name for f in fields(BenchmarkMetrics)} |
                        {f"spread.{o}" for o in ("goodput", "throughput", "tpot")})
HEADLINE_PREFIX = "headline."  # the headline level's figures, apart from the per-level series


def _short_value(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024 \
            and value % 1024 == 0:
        return f"{value // 1024}k"
    return str(value).lower().replace("_", "-")


def short_change(name: str, value: Any) -> str:
    """One changed flag in a few characters: `kv-fp8`, `tp2`, `mnbt2k`, `eager`."""
    if isinstance(value, bool):
        base = name.removeprefix("no_")
        negated = name.startswith("no_") == value  # `no_x: true` and `x: false` both drop x
        return ("no-" if negated else "") + base.replace("_", "-")
    if name in _VALUE_ONLY:
        return _short_value(value)
    prefix = _SHORT_PREFIX.get(name)
    if prefix is None:
        return f"{name.rsplit('.', 1)[-1].replace('_', '-')}={_short_value(value)}"
    return prefix + _short_value(value)


def run_name(number: int, record: TrialRecord, fixed_flags: Mapping[str, Any] = {},
             confirm: str | None = None) -> str:
    """`t003 fp8+kv-fp8`: the trial number and the flags it set beyond vLLM's defaults and the
    study's fixed flags; `t000 defaults`; `c014 confirm best` for a confirmation run."""
    if confirm:
        return f"c{number:03d} confirm {confirm}"
    changed = [short_change(k, v) for k, v in record.flags.items()
               if k not in fixed_flags or fixed_flags[k] != v]
    if record.is_baseline and not changed:
        return f"t{number:03d} defaults"
    shown: list[str] = []
    for i, change in enumerate(changed):
        rest = len(changed) - i - 1
        text = f"t{number:03d} " + "+".join([*shown, change]) + (f" +{rest}" if rest else "")
        if shown and len(text) > RUN_NAME_CHARS:
            break
        shown.append(change)
    hidden = len(changed) - len(shown)
    return f"t{number:03d}" + (" " + "+".join(shown) if shown else "") + \
        (f" +{hidden}" if hidden else "")


_CHANGES_HEAD = " vs the vLLM defaults: "
SIMULATED_TIMING = ("simulated engine: engine.* and startup.* seconds are the modelled "
                    "real-world start-up; the run's Duration is this simulation's wall time, "
                    "which sleeps only a fraction of it (simulated.startup_time_scale)")


def description_of(conclusion: str) -> str:
    """A run's MLflow description: the conclusion with its figure first (`goodput 37 req/s,
    1.12x the vLLM defaults ...`) and the flag list after it, so that a cut-off description
    still shows the result; a conclusion without a flag list, or a quality refusal, as it
    is."""
    head, sep, rest = conclusion.partition(_CHANGES_HEAD)
    if not sep or conclusion.startswith("refused"):  # a refusal's verdict is its first fact
        return conclusion
    return f"{rest} Changes from the vLLM defaults: {head}."


def tracking_payload(record: TrialRecord, result: RunResult | None, *, number: int,
                     fixed_flags: Mapping[str, Any] = {},
                     confirm: str | None = None) -> dict[str, Any]:
    """Arguments of `Tracker.finish_trial` from a trial record (and its fresh result, whose
    files exist only the first time): the run's name and description, its kind (a trial or a
    confirmation), and the metrics. A load level's figures are series over the levels (step =
    level); the headline level's copies of them are named `headline.<name>`
    (`headline.request_goodput`), never a second point at step 0 on top of level 0's. The
    daemon and the catch-up both call it, so a replayed run is the same run."""
    tags = {"conclusion": record.conclusion, "mlflow.runName": run_name(
        number, record, fixed_flags, confirm)}
    if confirm:
        tags[TAG_KIND] = KIND_CONFIRMATION
        tags[TAG_CONFIRM] = confirm
    if record.argv:
        tags["launch_command"] = shlex.join(record.argv)
    if record.failure_reason:
        tags["failure_reason"] = record.failure_reason
    if record.is_baseline:
        tags["baseline"] = "true"
    if record.seed_source:
        tags["seed.source"] = record.seed_source
    if record.host:
        tags["host"] = str(record.host)
    if record.is_unstable:
        tags["unstable"] = "true"
    if record.seed_source:
        tags["seed.source"] = record.seed_source
    if record.quality and record.quality.get("summary"):  # the quality gate's one line
        tags["quality"] = str(record.quality["summary"])[:5000]
    if record.conclusion:  # the run's description: its figure first, then what it changed
        tags["mlflow.note.content"] = description_of(record.conclusion)
    capacity = record.capacity or {}
    if capacity.get("status"):
        tags["capacity.status"] = str(capacity["status"])
        if capacity["status"] == "unresolved":
            tags["unresolved"] = "true"
    verdict = record.verdict or {}
    if verdict.get("label"):
        tags["bottleneck"] = str(verdict["label"])
        tags["bottleneck.reason"] = str(verdict.get("reason", ""))[:5000]
        tags["bottleneck.sources"] = ",".join(verdict.get("sources") or [])
    for key, when in (("started", record.engine_started_unix_s),
                      ("ended", record.engine_ended_unix_s)):
        if when is not None:  # "engine.started" / "engine.ended", UTC
            tags[f"engine.{key}"] = datetime.fromtimestamp(float(when), UTC).isoformat(
                timespec="milliseconds")
    if record.startup:
        tags.update(startup_tags(record.startup))
    if is_simulated_argv(record.argv):
        # MLflow's Duration column is the run's wall time; the simulated engine sleeps only a
        # fraction of the start-up it models (simulated.startup_time_scale).
        tags["timing"] = SIMULATED_TIMING
    for key in ("attention_backend", "engine_version"):  # what the engine chose, as tags
        if record.engine.get(key):
            tags[f"engine.{key}"] = str(record.engine[key])
    texts: dict[str, str] = {}
    files: list[Path] = []
    if result is not None:
        if result.server_log:
            texts["server.log"] = result.server_log
        if result.trace_path is not None:
            files.append(result.trace_path)
    launch = {"argv": list(record.argv), "env": dict(record.env), "flags": dict(record.flags)}
    step_metrics = [(s["step"], s["metrics"]) for s in record.steps]
    # A fixed rule, so a name means one thing in every run: every figure a load level has
    # (vLLM's benchmark keys, `spread.*`) and anything else some level of this trial logged.
    per_level = {k for _, values in step_metrics for k in values} | _LEVEL_KEYS
    # `objective.*` is the trial's value (`.per_gpu`: as Optuna holds it): a complete trial's
    # only (a failed or pruned one has none, whatever its levels measured before it ended).
    metrics = {(HEADLINE_PREFIX + k if k in per_level else k): v
               for k, v in record.metrics.items()
               if record.state == "complete" or not k.startswith("objective.")}
    return {
        "state": record.state,
        "metrics": metrics,
        "step_metrics": step_metrics,
        "tags": tags,
        "texts": texts,
        "dicts": {"launch.json": launch, "record.json": record.to_user_attr()},
        "files": files,
    }
