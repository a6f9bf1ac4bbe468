"""What a trial's MLflow run is given, from its record: its name (`run_name`: the flags it
changed in a few characters), its description, tags, metrics (the per-level series and the
`headline.*` copies) and artifacts (`tracking_payload`); and `TrialLog`, a finished trial as
`Tracker.catch_up` replays it. The daemon and the catch-up both build from here, so a replayed
run is the same run."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from optimizer.results.baseline_words import DEFAULTS, BaselineWords, baseline_words
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.tail_samples import bases_text, headline_bases
from optimizer.results.trial_record import TrialRecord
from optimizer.search.startup import startup_tags
from optimizer.tracking.tags import (
    ENGINE_SIMULATED,
    KIND_CONFIRMATION,
    SERVER_LOG,
    SIMULATED_DESCRIPTION,
    SIMULATED_NAME_MARK,
    SIMULATED_VERSION_PREFIX,
    TAG_CONFIRM,
    TAG_ENGINE,
    TAG_KIND,
    TAG_P99_BASIS,
    TAG_P99_THIN,
    TRACE_FILE,
)
from runners.base import BenchmarkMetrics, RunResult
from runners.simulated.launcher import is_simulated_argv


@dataclass(frozen=True)
class TrialLog:
    """A finished trial, as `Tracker.catch_up` brings its MLflow run up to date."""

    number: int
    run_id: str | None  # the run Optuna recorded for it; None if the store refused it then
    params: Mapping[str, Any]
    payload: Mapping[str, Any]  # `Tracker.finish_trial`'s arguments, from the trial's record
    workdir: Path | None = None  # its server log and trace, when it ran on this machine


def with_workdir_files(trial: TrialLog) -> dict[str, Any]:
    """`finish_trial`'s arguments for a catch-up: the record's, plus the server log's tail and
    the trimmed trace from the trial's workdir where they are on this machine (a trial that ran
    on another node of a cluster left them there)."""
    from runners.process import tail
    from runners.session import LOG_TAIL_BYTES

    payload = dict(trial.payload)
    if trial.workdir is None:
        return payload
    texts = dict(payload.get("texts") or {})
    log = trial.workdir / SERVER_LOG
    if SERVER_LOG not in texts and log.is_file():
        texts[SERVER_LOG] = tail(log, LOG_TAIL_BYTES)
    files = list(payload.get("files") or [])
    trace = trial.workdir / TRACE_FILE
    if trace.is_file() and all(f.name != TRACE_FILE for f in files):
        files.append(trace)
    return {**payload, "texts": texts, "files": files}


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
                        {f"spread.{o}" for o in OBJECTIVES})
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
    study's fixed flags; `t000 defaults` (`t000 baseline` where the study fixes flags);
    `c014 confirm best` for a confirmation run. A run of the simulated engine says so after
    its number: `t003 sim fp8+kv-fp8`."""
    head = f"{'c' if confirm else 't'}{number:03d}" + \
        (SIMULATED_NAME_MARK if is_simulated_argv(record.argv) else "")
    if confirm:
        return f"{head} confirm {confirm}"
    changed = [short_change(k, v) for k, v in record.flags.items()
               if k not in fixed_flags or fixed_flags[k] != v]
    if record.is_baseline and not changed:
        return f"{head} {baseline_words(fixed_flags).short}"
    shown: list[str] = []
    for i, change in enumerate(changed):
        rest = len(changed) - i - 1
        text = f"{head} " + "+".join([*shown, change]) + (f" +{rest}" if rest else "")
        if shown and len(text) > RUN_NAME_CHARS:
            break
        shown.append(change)
    hidden = len(changed) - len(shown)
    return head + (" " + "+".join(shown) if shown else "") + \
        (f" +{hidden}" if hidden else "")


SIMULATED_TIMING = ("simulated engine: engine.* and startup.* seconds are the modelled "
                    "real-world start-up; the run's Duration is this simulation's wall time, "
                    "which sleeps only a fraction of it (simulated.startup_time_scale)")


def description_of(conclusion: str, *, is_simulated: bool = False,
                   words: BaselineWords = DEFAULTS) -> str:
    """A run's MLflow description: the conclusion with its figure first (`goodput 37 req/s,
    1.12x the vLLM defaults ...`) and the flag list after it, so that a cut-off description
    still shows the result; a conclusion without a flag list, or a quality refusal, as it
    is. `is_simulated`: the run's figures are the simulated engine's, and it starts by saying
    so (SIMULATED_DESCRIPTION), never as a measurement. `words` names the baseline as the
    conclusion does (`conclusion.conclude`'s `baseline_words`)."""
    mark = SIMULATED_DESCRIPTION if is_simulated else ""
    head, sep, rest = conclusion.partition(f" vs {words.the}: ")
    if not sep or conclusion.startswith("refused"):  # a refusal's verdict is its first fact
        return mark + conclusion
    return f"{mark}{rest} Changes from {words.the}: {head}."


def tracking_payload(record: TrialRecord, result: RunResult | None, *, number: int,
                     fixed_flags: Mapping[str, Any] = {},
                     confirm: str | None = None) -> dict[str, Any]:
    """Arguments of `Tracker.finish_trial` from a trial record (and its fresh result, whose
    files exist only the first time): the run's name and description, its kind (a trial or a
    confirmation), and the metrics. A load level's figures are series over the levels (step =
    level); the headline level's copies of them are named `headline.<name>`
    (`headline.request_goodput`), never a second point at step 0 on top of level 0's. The
    daemon and the catch-up both call it, so a replayed run is the same run."""
    is_simulated = is_simulated_argv(record.argv)
    tags = {"conclusion": record.conclusion, "mlflow.runName": run_name(
        number, record, fixed_flags, confirm)}
    if is_simulated:  # its figures are a model's: the run says so wherever it is listed
        tags[TAG_ENGINE] = ENGINE_SIMULATED
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
        tags["mlflow.note.content"] = description_of(
            record.conclusion, is_simulated=is_simulated, words=baseline_words(fixed_flags))
    basis = bases_text(record.metrics)
    if basis:  # the requests each headline p99 is over; "thin" where too few to be a p99
        tags[TAG_P99_BASIS] = basis
        tags[TAG_P99_THIN] = "true" if any(
            b.is_thin for _, _, b in headline_bases(record.metrics)) else "false"
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
    if is_simulated:
        # MLflow's Duration column is the run's wall time; the simulated engine sleeps only a
        # fraction of the start-up it models (simulated.startup_time_scale).
        tags["timing"] = SIMULATED_TIMING
    for key in ("attention_backend", "engine_version"):  # what the engine chose, as tags
        if record.engine.get(key):
            tags[f"engine.{key}"] = str(record.engine[key])
    if is_simulated and record.engine.get("engine_version"):
        # The vLLM version the model imitates, never read as a vLLM that ran (the record and
        # the fingerprint keep their own forms; nothing reads this tag back).
        tags["engine.engine_version"] = SIMULATED_VERSION_PREFIX + str(
            record.engine["engine_version"]).removeprefix(SIMULATED_VERSION_PREFIX)
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
