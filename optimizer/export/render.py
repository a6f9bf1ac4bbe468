"""The export as text: its header (the trial, model, GPUs, engine, workload, SLO, gain and
quality, one fact a line) and the three formats (`render`)."""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import yaml

from optimizer.config import StudyConfig
from optimizer.errors import ConfigError
from optimizer.export.choice import default_flags, minimal_drops
from optimizer.export.launch import (
    deploy_extra_args,
    deploy_flags,
    deploy_model,
    launched,
    serve_argv,
    trial_env,
)
from optimizer.results import gains
from optimizer.results.at_load import (
    AtLoads,
    at_loads_of_record,
    compared_loads,
    level_metrics,
)
from optimizer.results.conclusion import baseline_trial, reference_of
from optimizer.results.confirmation import SIMULATED_VERDICT
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.quality_gate import header_line
from optimizer.results.recommendation import (
    SLO_CONSTRAINT,
    no_baseline_reason,
    no_slo_met,
    noise_pick,
    params_of,
    stored_gain,
)
from optimizer.results.trial_record import (
    TrialRecord,
    confirmation_of,
    gpus_of,
    is_baseline,
    objective_unit,
    record_of,
    stored_fingerprint,
)
from optimizer.storage.study import startup_saver_env
from optimizer.tuning_memory.fingerprint import describe_workload
from runners.credentials import is_secret_name
from runners.vllm.flags import flag_table
from search_spaces import to_flags
from search_spaces.engine.render import to_config_dict

FORMATS = ("yaml", "sh", "env")


def _flag_text(name: str) -> str:
    return "--" + name.replace("_", "-")


def export_header(study: optuna.Study, trial: optuna.trial.FrozenTrial, cfg: StudyConfig,
           model: str, model_note: str, level: str | None = None) -> list[str]:
    """The export's header, one fact a line: the trial and its figure, the model, the GPUs,
    the vLLM version, the engine (real or SIMULATED), the workload, the SLO, the gain as its
    interval with what the final confirmation found, and the quality verdict. Its figures are
    the trial's operating point's (named where it moved: a level's load not applied), or with
    `level` (the fixed level `export --max-tpot-ms` picked it at) that level's, each line."""
    fp = stored_fingerprint(study)
    record = record_of(trial)
    flags: Mapping[str, Any] = record.flags if record is not None else {}
    # A rate's value is per GPU (objectives.per_gpu): said so, with the GPUs it ran on.
    num_gpus = gpus_of(flags or trial.params)
    figures: list[tuple[str, float | None]] = list(zip(cfg.objectives, trial.values or [],
                                                       strict=False))
    if level is not None and record is not None:
        figures = [(o, at_loads_of_record(o, record).value_at(level)) for o in cfg.objectives]
    values = ", ".join(
        (f"{o} {v:.3g} {objective_unit(o)}".rstrip()
         + (f" per GPU on {num_gpus} GPU{'s' if num_gpus > 1 else ''}"
            if o in OBJECTIVES and OBJECTIVES[o].is_per_gpu else ""))
        if v is not None else f"{o} not measured there" for o, v in figures)
    loads = compared_loads(cfg.objectives[0], record)
    moved = loads.moved_phrase("its operating point") if loads is not None else ""
    lines = [f"nightshift study {cfg.name!r}, trial {trial.number}"
             + (_picked_at(loads, level) + f": {values}" if level is not None
                else f": {values}{moved}")]
    lines.append(f"model: {model}" + (f" ({model_note.removeprefix('model: ')})"
                                       if model_note else ""))
    tp = int(flags.get("tensor_parallel_size") or 1)
    dp = int(flags.get("data_parallel_size") or 1)
    card = fp.gpu_model if fp is not None and fp.gpu_model else "unknown GPU"
    layout = f"tensor parallel {tp} x {dp} replica{'s' if dp > 1 else ''}"
    lines.append(f"gpus: {tp * dp} x {card} ({layout}; the study's host: "
                 f"{fp.card if fp is not None else 'unknown'})")
    engine = fp.engine if fp is not None else None
    version = str((record.engine if record is not None else {}).get("engine_version") or
                  (fp.engine_version if fp is not None else "") or "unknown")
    if engine == "simulated":
        lines.append(f"vllm: none ran (the simulated engine models vLLM "
                     f"{version.removeprefix('simulated ')})")
        lines.append("engine: SIMULATED: every figure here comes from a model of the GPU, "
                     "never a measurement")
    else:
        lines.append(f"vllm: {version}")
        lines.append("engine: vLLM on real GPUs" if engine == "vllm" else
                     "engine: unknown (a study from before fingerprints)")
    if fp is not None:
        lines.append(f"workload: {describe_workload(fp)}")
        metrics = record.metrics if record is not None else {}
        if level is not None and record is not None:
            metrics = level_metrics(record, level) or {}
        lines.append(slo_line({"ttft_p99_ms": fp.slo_ttft_p99_ms,
                               "tpot_p99_ms": fp.slo_tpot_p99_ms, "e2el_ms": fp.slo_e2el_ms},
                              metrics, f"{level}'s" if level is not None else
                              "the operating point's"))
    lines.append("gain: " + gain_line(study, trial, cfg, level))
    return lines


def _picked_at(loads: AtLoads | None, level: str) -> str:
    """" at concurrency=8 (the level picked; its operating point is concurrency=32)": every
    figure of the header is the picked level's."""
    operating = loads.operating if loads is not None else None
    if operating == level:
        return f" at {level} (the level picked, its operating point too)"
    if loads is not None and loads.is_unplaced:
        return (f" at {level} (the level picked; its operating point is "
                f"{loads.operating_unapplied}, whose load was not applied)")
    return f" at {level} (the level picked; its operating point " + \
        (f"is {operating})" if operating else "not known)")


def _operating(record: TrialRecord | None, objective: str) -> str | None:
    """The label of a trial's operating point, where its record names one at an applied load
    (`AtLoads.operating`); else None."""
    loads = compared_loads(objective, record)
    return loads.operating if loads is not None else None


# (words, the SLO's field, the operating point's p99 metric) of each bound.
_SLO_P99S = (("TTFT p99", "ttft_p99_ms", "p99_ttft_ms"),
             ("TPOT p99", "tpot_p99_ms", "p99_tpot_ms"),
             ("E2E latency p99", "e2el_ms", "p99_e2el_ms"))


def _ms(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def slo_line(slo: Mapping[str, float | None], metrics: Mapping[str, Any],
             whose: str = "the operating point's") -> str:
    """The header's SLO line: each bound with the p99 of the level `metrics` are of (`whose`:
    the operating point's, or "concurrency=8's") and whether it met it, and the share of that
    level's requests within every bound. Goodput counts the requests meeting the bounds (vLLM's
    --goodput), so the level with the most goodput can miss a p99: "TTFT p99 <= 2500 ms" alone
    read as a p99 that held (held-out check s17 #5)."""
    bounds: list[tuple[str, float, float | None]] = []
    for name, field_, metric in _SLO_P99S:
        bound, p99 = slo.get(field_), metrics.get(metric)
        if bound is not None:
            recorded = float(p99) if isinstance(p99, int | float) and math.isfinite(p99) \
                else None
            bounds.append((name, bound, recorded))
    if not bounds:
        return "slo: none"
    is_any_recorded = any(p99 is not None for _, _, p99 in bounds)
    parts = []
    for name, bound, p99 in bounds:
        part = f"{name} <= {bound:g} ms"
        if p99 is not None:
            part += (f" ({whose} p99: {_ms(p99)} ms, "
                     f"{'met' if p99 <= bound else 'missed'})")
        elif is_any_recorded:
            part += f" ({whose} p99 not recorded)"
        parts.append(part)
    if not is_any_recorded:
        parts[-1] += f" ({whose} p99{'s' if len(parts) > 1 else ''} not recorded)"
    goodput, throughput = metrics.get("request_goodput"), metrics.get("request_throughput")
    within = ""
    if isinstance(goodput, int | float) and isinstance(throughput, int | float) and \
            math.isfinite(goodput) and math.isfinite(throughput) and throughput > 0:
        which = "the bound" if len(parts) == 1 else "every bound"
        within = (f"; {goodput / throughput:.0%} of its requests within {which} (goodput "
                  "counts those)")
    return "slo: " + ", ".join(parts) + within


def gain_line(study: optuna.Study, trial: optuna.trial.FrozenTrial, cfg: StudyConfig,
              level: str | None = None) -> str:
    """The trial's gain over the baseline with what bounds it: the header's first mention of
    the baseline, so named with the study's fixed flags where it has any. The final
    confirmation's interval wins where it re-measured this trial (a search measurement's
    bounds never stand beside an interval that contradicts them); else the search's own, not
    confirmed. With `level` (the fixed level `export --max-tpot-ms` picked it at), the two at
    that level (`gains.at_level`), unless the confirmation compared the two there: at that
    load (`StoredConfirmation.load`), or at their operating points where the level is this
    trial's."""
    objective = cfg.objectives[0]
    words = cfg.baseline_words
    what = words.the_full
    confirmed = confirmation_of(study)
    is_remeasured = confirmed is not None and confirmed.best_trial == trial.number
    is_there = level is None or (confirmed is not None and (
        confirmed.load == level if confirmed.load is not None else
        _operating(record_of(trial), objective) == level))
    if is_remeasured and is_there and confirmed is not None and \
            (confirmed.gain is None or not (math.isfinite(confirmed.gain)
                                            and confirmed.gain > 0)):
        # No ratio (a round measured 0; a study stored before that was said gives inf or 0):
        # none is stated, never "infx".
        return f"none stated: {confirmed.sentence}"
    if is_remeasured and is_there and confirmed is not None and \
            (gain := stored_gain(confirmed)) is not None:
        mine, theirs = reference_of(trial), reference_of(baseline_trial(study))
        if max(mine.num_gpus if mine else 1, theirs.num_gpus if theirs else 1) > 1:
            what = f"{what} per GPU"  # the rounds' ratios are per GPU, as every gain is
        if confirmed.is_simulated:  # a model's repeats: nothing measured, nothing confirmed
            return (f"{objective} {gains.format_gain(gain, what)}; not confirmed (re-run "
                    f"interleaved with the {words.short} on the simulated engine: "
                    f"{SIMULATED_VERDICT})")
        verdict = gains.confirmation_verdict(gain, f"the {words.short}")
        state = "confirmed" if gain.is_better else "not confirmed"
        return (f"{objective} {gains.format_gain(gain, what)}; {state} (re-measured "
                f"interleaved with the {words.short}: {verdict})")
    if is_baseline(trial):
        noise = noise_pick(study)
        if noise is not None:
            worse = noise.ci_high is not None and noise.ci_high < 1.0
            return (f"none: this is {what}; the final confirmation found the "
                    f"search's pick, trial {noise.best_trial}, "
                    f"{'worse than' if worse else 'within noise of'} them")
        return f"none: this is {what}"
    capacity = cfg.spec.workload.capacity
    axis = capacity.axis if capacity is not None else None
    here = reference_of(trial, axis, objective)
    base_trial = baseline_trial(study)
    base = reference_of(base_trial, axis, objective)
    if base is None and (reason := no_baseline_reason(study)):
        return f"none stated: {words.the} could not run ({reason})"
    if here is None or base is None:
        return (f"unknown: {words.the} {'was' if words.has_fixed_flags else 'were'} not "
                "measured; not confirmed")
    maximize = OBJECTIVES[objective].direction == "maximize"
    if level is not None:  # both at the level picked, whatever their operating points
        my_record, base_record = record_of(trial), record_of(base_trial) if base_trial else None
        gain = gains.at_level(
            level, at_loads_of_record(objective, my_record).value_at(level)
            if my_record is not None else None,
            at_loads_of_record(objective, base_record) if base_record is not None
            else AtLoads(None, {}), maximize=maximize)
    else:
        gain = gains.gain_over(here.value, base.value, here.capacity, base.capacity,
                               maximize=maximize, num_gpus=here.num_gpus,
                               defaults_num_gpus=base.num_gpus, loads=here.loads,
                               defaults_loads=base.loads)
    raw = ""
    if here.num_gpus > 1 or base.num_gpus > 1:  # the ratio is per GPU: said, as measured too
        what = f"{what} per GPU"
        whole = gains.as_measured(gain, objective, here.value, base.value, here.capacity,
                                  base.capacity, num_gpus=here.num_gpus,
                                  defaults_num_gpus=base.num_gpus)
        if whole is not None and whole.value is not None and gain.basis == "single" and \
                OBJECTIVES[objective].is_per_gpu:
            raw = (f"; {whole.value:.2f}x as measured, on {here.num_gpus} GPU(s) against "
                   f"{base.num_gpus}")
    if confirmed is None:
        why = "no final confirmation re-measured it"
    elif not is_remeasured:
        why = f"the final confirmation re-measured trial {confirmed.best_trial}, not this one"
    else:  # re-measured, compared elsewhere than the level picked
        why = ("the final confirmation compared the two " +
               (f"at {confirmed.load}" if confirmed.load is not None else
                "runs' operating points") + ", not at this level")
    return f"{objective} {gains.format_gain(gain, what)}{raw}; not confirmed ({why})"


def render(trial: optuna.trial.FrozenTrial, cfg: StudyConfig, fmt: str, *,
           note: str = "", path: Path | None = None, study: optuna.Study | None = None,
           minimal: bool = False, level: str | None = None) -> str:
    """The trial as `fmt`; `path` is the file it is written to (the YAML's run line names it).
    With `study` (the study it belongs to), flags equal to vLLM's defaults on the study's host
    are left out and the header states the GPUs, engine, workload, SLO and gain, at `level`
    where the export was picked at a fixed level (`choice.TpotPick.level`), else at the trial's
    operating point; `minimal` also drops the flags the study measured as making no
    difference (`minimal_drops`)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}.")
    record = record_of(trial) or TrialRecord.from_user_attr({})
    fp = stored_fingerprint(study) if study is not None else None
    ran = launched(record)
    flags, notes = deploy_flags(cfg, record, ran, fp.weights if fp is not None else None)
    model, model_note = deploy_model(cfg)
    if study is not None:
        dropped = default_flags(study, trial, flags)
        for name in dropped:
            flags.pop(name, None)
        if dropped:
            notes.append("left out, as vLLM's own value on the study's host: "
                         + ", ".join(_flag_text(k) for k in dropped))
        if minimal:
            drops = minimal_drops(study, trial)
            for name, why in drops:
                for flag in to_flags({name: params_of(trial)[name]}):
                    flags.pop(flag, None)
                notes.append(f"--minimal dropped {name}: {why}")
            if not drops:
                notes.append("--minimal dropped nothing: no measured trial ran this config "
                             "with one of its flags at vLLM's default")
        about_lines = export_header(study, trial, cfg, model, model_note, level)
        if trial.constraints.get(SLO_CONSTRAINT, 0.0) > 0:
            unmet = no_slo_met(study, cfg.spec.slo.model_dump())
            notes.append("slo: MISSED: this trial met the SLO at no load it ran"
                         + (f"; {unmet.split(': nothing to recommend')[0]}" if unmet else ""))
    else:
        values = ", ".join(f"{o}={v:.4g}" for o, v in zip(cfg.objectives, trial.values or [],
                                                          strict=False))
        about_lines = [f"nightshift study {cfg.name!r}, trial {trial.number} ({values})",
                       record.conclusion]
        if model_note:
            notes.append(model_note)
    if note:
        notes.insert(0, note)
    quality_note = header_line(record.quality, cfg.quality_skip_reason)
    if quality_note:
        notes.append(quality_note)
    # A secret is named, never written: an older study may hold one (runners/credentials.py).
    extra_args, extra_note = deploy_extra_args(cfg, ran)
    if extra_note:
        notes.append(extra_note)
    env = trial_env(record.env, startup_saver_env(cfg.spec.startup.savers))
    secrets = sorted(k for k in env if is_secret_name(k))
    env = {k: v for k, v in env.items() if k not in secrets}
    if secrets:
        notes.append(f"secrets not written: set {', '.join(secrets)} in the environment "
                     "before serving")
    about = "\n".join([*about_lines, *notes])
    if fmt == "env":
        header = "".join(f"# {line}\n" for line in about.splitlines())
        if not env:
            return header + ("# environment: none needed (the trial ran with no VLLM_, NCCL_, "
                             "CUDA_, TORCH_ or PYTORCH_ variable set)\n")
        return header + "".join(f"{k}={shlex.quote(v)}\n" for k, v in env.items())
    if fmt == "sh":
        lines = ["#!/usr/bin/env bash", *(f"# {line}" for line in about.splitlines()),
                 "set -euo pipefail"]
        lines += [f'export {k}="${{{k}:?set {k} (a secret, not written here)}}"'
                  for k in secrets]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        lines.append("exec " + shlex.join(serve_argv(model, flags, extra_args)) + ' "$@"')
        return "\n".join(lines) + "\n"
    config_file = shlex.quote(str(path)) if path is not None else "THIS_FILE"
    run = shlex.join(["vllm", "serve", model]) + f" --config {config_file}" + \
        "".join(f" {shlex.quote(a)}" for a in extra_args)
    comments = [*(f"# {line}" for line in about.splitlines()),
                f"# run: {run}" + (" (with the env: variables below set)" if env else "")]
    # A comment is one line: values go JSON-escaped (a newline would end the comment).
    comments += [f"# env: {k}={json.dumps(v)}" for k, v in env.items()]
    body: str = yaml.safe_dump(to_config_dict(flags, flag_table()), sort_keys=False,
                               default_flow_style=False)
    return "\n".join(comments) + "\n" + body
