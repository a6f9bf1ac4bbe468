"""Export a trial as what a user deploys: a `vllm serve --config` YAML (data only), a shell
launcher, or env vars — each built from the trial's recorded flags and environment."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
import yaml
from optuna.trial import TrialState

from optimizer import gains
from optimizer.conclusions import baseline_trial, reference_of
from optimizer.config import StudyConfig
from optimizer.confirm import STUDY_ATTR_CONFIRM
from optimizer.errors import ConfigError, NightshiftError
from optimizer.fingerprint import Fingerprint
from optimizer.memory import STUDY_ATTR_FINGERPRINT
from optimizer.objectives import OBJECTIVES
from optimizer.quality import header_line, is_quality_violation
from optimizer.recommendation import (
    NOISE_FRACTION,
    audit_errors,
    is_measured,
    params_of,
    recommendation_note,
    recommended_trial,
    vllm_defaults_of,
)
from optimizer.records import ATTR_RECORD, gpus_of, objective_unit
from optimizer.study import ATTR_BASELINE, startup_saver_env
from runners.credentials import is_secret_name, redact_argv
from runners.model_info import BUNDLED_CHECKPOINTS, bundled_shape_of
from runners.vllm.flags import flag_table
from search_spaces import SpaceError, changed_params, to_flags
from search_spaces.engine.facts import ENV_PREFIXES
from search_spaces.engine.render import to_argv, to_config_dict

FORMATS = ("yaml", "sh", "env")
# Variables that describe where a trial ran, not how the engine is configured.
# VLLM_FORCE_AOT_LOAD (startup.verify_warm) would make a deployment's first start fail.
_PLACEMENT_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "VLLM_CACHE_ROOT", "VLLM_SERVER_DEV_MODE",
                            "VLLM_FORCE_AOT_LOAD"})


def select_trial(study: optuna.Study, cfg: StudyConfig, *, number: int | None = None,
                 max_tpot_ms: float | None = None,
                 force_quality: bool = False) -> optuna.trial.FrozenTrial:
    # Measured configs: not a config failure (complete to Optuna, failed to us), not a final
    # confirmation run (a copy of the best or of the defaults), not refused by the quality gate.
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if is_measured(t) and not is_quality_violation(t.constraints)]
    if number is not None:
        found = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not found:
            raise ConfigError(f"--trial {number}: no such trial in study {cfg.name!r}; "
                              f"see `nightshift status` for the numbers.")
        state = (found[0].user_attrs.get(ATTR_RECORD) or {}).get("state") or \
            found[0].state.name.lower()
        if found[0].state != TrialState.COMPLETE or state != "complete":
            raise ConfigError(f"--trial {number}: the trial is {state}, not complete; export a "
                              "complete trial.")
        if is_quality_violation(found[0].constraints) and not force_quality:
            failed = ((found[0].user_attrs.get(ATTR_RECORD) or {}).get("quality") or {}).get(
                "failed") or ["outside the limits"]
            raise ConfigError(f"--trial {number}: the quality gate refused it "
                              f"({'; '.join(failed)}); export another trial, or pass "
                              "--force-quality to export it anyway.")
        errors = audit_errors(found[0])
        if errors:
            raise ConfigError(f"--trial {number}: its launch has what `nightshift audit` calls "
                              f"an error ({errors[0].rstrip('.')}); export another trial.")
        return found[0]
    if max_tpot_ms is not None:
        within = [t for t in complete if not audit_errors(t)
                  and _metric(t, "p99_tpot_ms") is not None
                  and _metric(t, "p99_tpot_ms") <= max_tpot_ms]  # type: ignore[operator]
        if not within:
            raise ConfigError(f"--max-tpot-ms {max_tpot_ms:g}: no complete trial has a TPOT p99 "
                              "that low; raise the limit or run more trials.")
        sign = 1 if OBJECTIVES[cfg.objectives[0]].direction == "maximize" else -1
        return max(within, key=lambda t: sign * t.values[0])
    chosen = recommended_trial(study)
    if chosen is None:
        raise NightshiftError(f"study {cfg.name!r} has no complete trial yet; wait for one or "
                              "check `nightshift status`.")
    return chosen


def choice_note(study: optuna.Study, chosen: optuna.trial.FrozenTrial) -> str:
    """Why the recommendation is not the nominal best (empty when it is)."""
    return recommendation_note(study, chosen)


def _flag_text(name: str) -> str:
    return "--" + name.replace("_", "-")


def _metric(trial: optuna.trial.FrozenTrial, key: str) -> float | None:
    value = (trial.user_attrs.get(ATTR_RECORD) or {}).get("metrics", {}).get(key)
    return float(value) if isinstance(value, int | float) else None


def trial_env(record: Mapping[str, Any], benchmark_only: Mapping[str, str] = {}
              ) -> dict[str, str]:
    """The engine-relevant variables the trial ran with (VLLM_*, NCCL_*, ...), in one place,
    less those that only placed the trial and `benchmark_only` (the study's start-up savers,
    which hold for nightshift's greedy load but not for a deployment's: docs/startup-cost.md)."""
    env = record.get("env") or {}
    return {k: str(v) for k, v in sorted(env.items())
            if k.startswith(ENV_PREFIXES) and k not in _PLACEMENT_ENV
            and benchmark_only.get(k) != str(v)}


def serve_argv(model: str, flags: Mapping[str, Any], extra_args: Sequence[str] = ()) -> list[str]:
    """`vllm serve MODEL` with snake_case `flags` rendered by the one flag renderer, then the
    study's `vllm.extra_args` verbatim (as the runner passed them)."""
    return ["vllm", "serve", model, *to_argv(flags, flag_table()), *extra_args]


def deploy_model(cfg: StudyConfig) -> tuple[str, str]:
    """The model a deployment serves and, where it is not what the study measured, why: the
    hub id or path the user gave, as given; for a bundled shape (config.json only, measured
    with dummy weights), the real checkpoint it stands for."""
    given = cfg.spec.model.path
    shape = bundled_shape_of(given)
    if shape is None:
        return given, ""
    checkpoint = BUNDLED_CHECKPOINTS.get(shape)
    if checkpoint is None:
        return given, (f"model: {given!r} is a bundled shape (config.json only): replace it "
                       "with the checkpoint of that shape you serve")
    return checkpoint, (f"model: the study measured the bundled shape {shape!r} (config.json "
                        f"only, dummy weights), which stands for {checkpoint}; any checkpoint "
                        "of that shape runs the same")


def deploy_flags(cfg: StudyConfig, record: Mapping[str, Any],
                 weights: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """What a deployment passes besides the model (snake_case): the flags the trial ran with,
    as its record holds them (the study's `fixed_flags` of that day included: not today's
    study file), without the benchmark's artefacts (dummy weights, no tokenizer) and with a
    served name only where the study file sets one (nightshift's own is `model`). `weights`:
    "real" or "dummy" as the study ran (its stored fingerprint); None: the study file's."""
    flags = {k: v for k, v in (record.get("flags") or {}).items() if k not in _RESERVED}
    model = cfg.spec.model
    if "served_model_name" in model.model_fields_set:
        flags = {"served_model_name": model.served_model_name, **flags}
    is_dummy = weights == "dummy" if weights is not None else model.load_format == "dummy"
    notes = []
    if is_dummy or model.skip_tokenizer_init:
        # Benchmark artefacts: speed does not depend on weight values or the tokenizer.
        notes.append("measured with dummy weights and token-id prompts; serves real weights as is")
    elif model.load_format not in ("auto", "dummy"):
        flags = {"load_format": model.load_format, **flags}
    return flags, notes


# Flags the runner owns or adds for its own measurement: never part of a deployment.
_RESERVED = frozenset({"host", "port", "served_model_name", "load_format", "skip_tokenizer_init",
                       "model"})


def default_flags(study: optuna.Study, trial: optuna.trial.FrozenTrial,
                  flags: Mapping[str, Any]) -> list[str]:
    """The flags among `flags` that set vLLM's own value on the study's host (or one another
    flag makes moot, a capture size with CUDA graphs off): `changed_params` counts them as no
    change, and a deployment leaves them out."""
    params = params_of(trial)
    changed = set(changed_params(params, {}, vllm_defaults_of(study)))
    out = []
    for name, value in params.items():
        if name in changed or value is None:
            continue
        try:
            rendered = to_flags({name: value})
        except SpaceError:  # a param outside the known flags: kept as it ran
            continue
        out += [k for k, v in rendered.items() if k in flags and flags[k] == v]
    return out


def minimal_drops(study: optuna.Study, trial: optuna.trial.FrozenTrial
                  ) -> list[tuple[str, str]]:
    """(param, why) for each param whose removal did not change the measured result, by the
    study's own records: a measured trial that ran the same config with that param at vLLM's
    default, within NOISE_FRACTION of this trial's value (or better). Cumulative: two params
    each harmless alone are not known to be harmless together, so a second is dropped only
    where a trial without both was measured."""
    if not trial.values or len(study.directions) > 1:
        return []
    host = vllm_defaults_of(study)
    sign = 1.0 if study.direction.name == "MAXIMIZE" else -1.0
    top = float(trial.values[0])
    mine = params_of(trial)
    kept = dict(mine)
    drops: list[tuple[str, str]] = []
    others = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if is_measured(t) and t.values and t.number != trial.number]
    for name in changed_params(mine, {}, host):
        without = {**kept, name: None}
        for other in others:
            theirs = params_of(other)
            if changed_params(without, theirs, host):
                continue
            value = float(other.values[0])
            if sign * (value - top) >= -NOISE_FRACTION * abs(top):
                kept = without
                drops.append((name, f"trial {other.number} ran without it (vLLM's default) "
                                    f"and measured {value:.4g} vs {top:.4g}: within "
                                    f"{NOISE_FRACTION:.0%}"))
                break
    return drops


def export_header(study: optuna.Study, trial: optuna.trial.FrozenTrial, cfg: StudyConfig,
           model: str, model_note: str) -> list[str]:
    """The export's header, one fact a line: the trial and its figure, the model, the GPUs,
    the vLLM version, the engine (real or SIMULATED), the workload, the SLO, the gain as its
    interval with what the final confirmation found, and the quality verdict."""
    stored = study.user_attrs.get(STUDY_ATTR_FINGERPRINT)
    fp = Fingerprint.from_dict(stored)[0] if isinstance(stored, Mapping) else None
    record = trial.user_attrs.get(ATTR_RECORD) or {}
    # A rate's value is per GPU (objectives.per_gpu): said so, with the GPUs it ran on.
    num_gpus = gpus_of(record.get("flags") or trial.params)
    values = ", ".join(
        f"{o} {v:.3g} {objective_unit(o)}".rstrip()
        + (f" per GPU on {num_gpus} GPU{'s' if num_gpus > 1 else ''}"
           if o in OBJECTIVES and OBJECTIVES[o].is_per_gpu else "")
        for o, v in zip(cfg.objectives, trial.values or [], strict=False))
    lines = [f"nightshift study {cfg.name!r}, trial {trial.number}: {values}"]
    lines.append(f"model: {model}" + (f" ({model_note.removeprefix('model: ')})"
                                       if model_note else ""))
    flags = record.get("flags") or {}
    tp = int(flags.get("tensor_parallel_size") or 1)
    dp = int(flags.get("data_parallel_size") or 1)
    card = fp.gpu_model if fp is not None and fp.gpu_model else "unknown GPU"
    layout = f"tensor parallel {tp} x {dp} replica{'s' if dp > 1 else ''}"
    lines.append(f"gpus: {tp * dp} x {card} ({layout}; the study's host: "
                 f"{fp.card if fp is not None else 'unknown'})")
    engine = fp.engine if fp is not None else None
    version = str((record.get("engine") or {}).get("engine_version") or
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
        peak = f" up to {fp.peak_load:g}" if fp.peak_load is not None else ""
        lines.append(f"workload: input {fp.input_len} tokens, output {fp.output_len} tokens, "
                     f"{fp.arrival}{peak}" + (f", prompts {fp.prompts_file}"
                                               if fp.prompts_file else ""))
        slo = [f"{name} <= {v:g} ms" for name, v in (
            ("TTFT p99", fp.slo_ttft_p99_ms), ("TPOT p99", fp.slo_tpot_p99_ms),
            ("E2E latency", fp.slo_e2el_ms)) if v is not None]
        lines.append("slo: " + (", ".join(slo) if slo else "none"))
    lines.append("gain: " + gain_line(study, trial, cfg))
    return lines


def gain_line(study: optuna.Study, trial: optuna.trial.FrozenTrial, cfg: StudyConfig) -> str:
    """The trial's gain over the defaults with what bounds it. The final confirmation's
    interval wins where it re-measured this trial (a search measurement's bounds never stand
    beside an interval that contradicts them); else the search's own, not confirmed."""
    objective = cfg.objectives[0]
    confirmed = study.user_attrs.get(STUDY_ATTR_CONFIRM)
    if isinstance(confirmed, Mapping) and confirmed.get("best_trial") == trial.number:
        gain = gains.interval_gain(float(confirmed["gain"]), confirmed.get("ci_low"),
                                   confirmed.get("ci_high"), len(confirmed.get("ratios") or []))
        verdict = gains.confirmation_verdict(gain)
        state = "confirmed" if gain.is_better else "not confirmed"
        return (f"{objective} {gains.format_gain(gain)}; {state} (re-measured interleaved "
                f"with the defaults: {verdict})")
    if trial.user_attrs.get(ATTR_BASELINE):
        return "none: this is the vLLM defaults"
    capacity = cfg.spec.workload.capacity
    axis = capacity.axis if capacity is not None else None
    here, base = reference_of(trial, axis), reference_of(baseline_trial(study), axis)
    if here is None or base is None:
        return "unknown: the defaults were not measured; not confirmed"
    gain = gains.gain_over(here.value, base.value, here.capacity, base.capacity,
                           maximize=OBJECTIVES[objective].direction == "maximize")
    why = (f"the final confirmation re-measured trial {confirmed.get('best_trial')}, not this "
           "one" if isinstance(confirmed, Mapping) else "no final confirmation re-measured it")
    return f"{objective} {gains.format_gain(gain)}; not confirmed ({why})"


def render(trial: optuna.trial.FrozenTrial, cfg: StudyConfig, fmt: str, *,
           note: str = "", path: Path | None = None, study: optuna.Study | None = None,
           minimal: bool = False) -> str:
    """The trial as `fmt`; `path` is the file it is written to (the YAML's run line names it).
    With `study` (the study it belongs to), flags equal to vLLM's defaults on the study's host
    are left out and the header states the GPUs, engine, workload, SLO and gain; `minimal`
    also drops the flags the study measured as making no difference (`minimal_drops`)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}.")
    record = trial.user_attrs.get(ATTR_RECORD) or {}
    stored = study.user_attrs.get(STUDY_ATTR_FINGERPRINT) if study is not None else None
    weights = stored.get("weights") if isinstance(stored, Mapping) else None
    flags, notes = deploy_flags(cfg, record, weights)
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
        about_lines = export_header(study, trial, cfg, model, model_note)
    else:
        values = ", ".join(f"{o}={v:.4g}" for o, v in zip(cfg.objectives, trial.values or [],
                                                          strict=False))
        about_lines = [f"nightshift study {cfg.name!r}, trial {trial.number} ({values})",
                       str(record.get("conclusion", ""))]
        if model_note:
            notes.append(model_note)
    if note:
        notes.insert(0, note)
    quality_note = header_line(record.get("quality"), cfg.quality_skip_reason)
    if quality_note:
        notes.append(quality_note)
    # A secret is named, never written: an older study may hold one (runners/credentials.py).
    extra_args = tuple(redact_argv(cfg.spec.vllm.extra_args))
    env = trial_env(record, startup_saver_env(cfg.spec.startup.savers))
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
