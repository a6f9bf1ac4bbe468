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

from optimizer.config import StudyConfig
from optimizer.errors import ConfigError, NightshiftError
from optimizer.objectives import OBJECTIVES
from optimizer.quality import header_line, is_quality_violation
from optimizer.records import ATTR_RECORD
from optimizer.study import (
    ATTR_BASELINE,
    NOISE_FRACTION,
    best_trial,
    engine_config,
    is_measured,
    recommended_trial,
    startup_saver_env,
)
from runners.credentials import is_secret_name, redact_argv
from runners.model_info import BUNDLED_CHECKPOINTS, bundled_shape_of
from runners.vllm.facts import ENV_PREFIXES
from runners.vllm.flags import to_argv, to_config_dict
from runners.vllm.launcher import config_flags

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
        return found[0]
    if max_tpot_ms is not None:
        within = [t for t in complete
                  if _metric(t, "p99_tpot_ms") is not None
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
    best = best_trial(study)
    if best is None or best.number == chosen.number or not best.values or not chosen.values:
        return ""
    what = "the vLLM defaults" if chosen.user_attrs.get(ATTR_BASELINE) else \
        f"trial {chosen.number}"
    return (f"{what}: within {NOISE_FRACTION:.0%} of the best measured (trial {best.number}, "
            f"{best.values[0]:.4g} vs {chosen.values[0]:.4g}) with fewer changes from the "
            f"vLLM defaults; `--trial {best.number}` exports that one")


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
    return ["vllm", "serve", model, *to_argv(flags), *extra_args]


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


def deploy_flags(cfg: StudyConfig, record: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What a deployment passes besides the model (snake_case): the trial's flags and the
    study's `fixed_flags`, without the benchmark's artefacts (dummy weights, no tokenizer) and
    with a served name only where the study file set one (nightshift's own is `model`)."""
    config = engine_config(cfg, record.get("flags") or {})
    flags = config_flags(config)
    if "served_model_name" not in cfg.spec.model.model_fields_set:
        flags.pop("served_model_name", None)
    notes = []
    if config.load_format == "dummy" or config.skip_tokenizer_init:
        # Benchmark artefacts: speed does not depend on weight values or the tokenizer.
        flags.pop("load_format", None)
        flags.pop("skip_tokenizer_init", None)
        notes.append("measured with dummy weights and token-id prompts; serves real weights as is")
    return flags, notes


def render(trial: optuna.trial.FrozenTrial, cfg: StudyConfig, fmt: str, *,
           note: str = "", path: Path | None = None) -> str:
    """The trial as `fmt`; `path` is the file it is written to (the YAML's run line names it)."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}.")
    record = trial.user_attrs.get(ATTR_RECORD) or {}
    flags, notes = deploy_flags(cfg, record)
    model, model_note = deploy_model(cfg)
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
    values = ", ".join(f"{o}={v:.4g}" for o, v in zip(cfg.objectives, trial.values or [],
                                                      strict=False))
    about = (f"nightshift study {cfg.name!r}, trial {trial.number} ({values})\n"
             f"{record.get('conclusion', '')}" + "".join(f"\n{n}" for n in notes))
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
    body: str = yaml.safe_dump(to_config_dict(flags), sort_keys=False, default_flow_style=False)
    return "\n".join(comments) + "\n" + body
