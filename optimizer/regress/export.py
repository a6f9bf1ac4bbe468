"""A study's trials as a library case (`nightshift export --to-library`): the exported trial and
the vLLM defaults, each with its flags and environment and, as its reference, the figures its
trial and the study's confirmation runs of the same config measured."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.config import StudyConfig
from optimizer.errors import ConfigError
from optimizer.export import trial_env
from optimizer.regress.library import DEFAULT_FIGURES, FIGURES
from optimizer.results.recommendation import is_measured, params_of
from optimizer.results.trial_record import confirm_label, is_baseline, record_of
from runners.simulated.launcher import is_simulated_argv

logger = logging.getLogger(__name__)


def _samples(study: optuna.Study, trial: FrozenTrial) -> list[FrozenTrial]:
    """The trial and every complete confirmation run of the same config."""
    params = params_of(trial)
    runs = [trial]
    for other in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        record = record_of(other)
        if confirm_label(other) is not None and record is not None and \
                record.state == "complete" and params_of(other) == params:
            runs.append(other)
    return runs


def _metrics(trial: FrozenTrial) -> Mapping[str, float]:
    record = record_of(trial)
    return record.metrics if record is not None else {}


def _reference(study: optuna.Study, cfg: StudyConfig, trial: FrozenTrial,
               card: str) -> dict[str, Any]:
    runs = _samples(study, trial)
    figures: dict[str, Any] = {}
    for name in DEFAULT_FIGURES:
        if name == "goodput" and not cfg.spec.slo.is_set:
            continue
        attr = FIGURES[name][1]
        values = [_metrics(t).get(attr) for t in runs]
        samples = [float(v) for v in values if isinstance(v, int | float)]
        if samples:  # a run whose record lacks the figure adds no sample
            figures[name] = {"samples": samples}
    if not figures:
        raise ConfigError(f"trial {trial.number}: its record holds none of the figures "
                          f"{', '.join(DEFAULT_FIGURES)}; export a trial measured by this "
                          "version of nightshift.")
    record = record_of(trial)
    version = str((record.engine if record else {}).get("engine_version") or "unknown")
    when = trial.datetime_complete or trial.datetime_start
    confirm = len(runs) - 1
    return {"vllm_version": version, "card": card,
            "date": when.date().isoformat() if when else "unknown", "figures": figures,
            "source": f"study {cfg.name}, trial {trial.number}" +
                      (f" + {confirm} confirmation run{'s' if confirm != 1 else ''}"
                       if confirm else "")}


def _config(study: optuna.Study, cfg: StudyConfig, trial: FrozenTrial, name: str,
            card: str) -> dict[str, Any]:
    record = record_of(trial)
    flags = dict(record.flags) if record is not None else {}
    env = trial_env(record.env) if record is not None else {}
    return {"name": name, "flags": flags, "env": env,
            "reference": _reference(study, cfg, trial, card)}


def card_of(cfg: StudyConfig, trial: FrozenTrial, gpu_param: str | None) -> str:
    """The card the study measured on: the simulated preset's (said so), else the `gpu` param
    of the study's MLflow run (`gpu_param`), else unknown."""
    record = record_of(trial)
    if record is not None and is_simulated_argv(record.argv):
        from optimizer.run.engine_choice import simulated_hardware

        sim = cfg.spec.simulated
        return f"simulated {simulated_hardware(sim.hardware, sim.num_gpus).gpu_name}"
    return gpu_param or "unknown (not in the study's MLflow run)"


def case_from_study(study: optuna.Study, cfg: StudyConfig, chosen: FrozenTrial,
                    case_name: str, gpu_param: str | None = None) -> dict[str, Any]:
    """The library case for `chosen` (already checked by `export.select_trial`): the study's
    model, workload, SLO and engine sections, the defaults and `chosen` as configs."""
    spec = cfg.spec
    if spec.workload.capacity is not None:
        raise ConfigError(f"--to-library: study {cfg.name!r} searches capacity; regress "
                          "re-measures fixed load levels, so give its case workload.levels "
                          "by hand (docs/regress.md).")
    baseline = next((t for t in study.get_trials(deepcopy=False)
                     if is_baseline(t) and is_measured(t)), None)
    card = card_of(cfg, chosen, gpu_param)
    configs = []
    if baseline is not None:
        configs.append(_config(study, cfg, baseline, "defaults", card))
    if baseline is None or baseline.number != chosen.number:
        configs.append(_config(study, cfg, chosen, f"trial-{chosen.number}", card))
    # A regression check measures; it does not profile (a trace window costs device time).
    workload = spec.workload.model_dump(mode="json", exclude={"repeats", "capacity", "profile"})
    # Files named relative to the study file resolve against the library's folder there:
    # written absolute, they name the same files.
    if cfg.prompts_file is not None:
        workload["prompts_file"] = str(cfg.prompts_file.resolve())
    if cfg.trace_file is not None:
        workload["trace"]["path"] = str(cfg.trace_file.resolve())
    if cfg.dataset_file is not None:
        workload["dataset"]["path"] = str(cfg.dataset_file.resolve())
    model = spec.model.model_dump(mode="json")
    local = cfg.base_dir / model["path"]
    if not Path(model["path"]).is_absolute() and (local / "config.json").is_file():
        model["path"] = str(local.resolve())  # a model directory beside the study file
    objective = cfg.objectives[0]
    return {"name": case_name, "engine": spec.engine, "objective": objective,
            "model": model, "workload": workload,
            "slo": spec.slo.model_dump(mode="json"),
            "simulated": spec.simulated.model_dump(mode="json"),
            "rounds": max(1, spec.confirm_rounds), "repeats": spec.workload.repeats,
            "configs": configs}


def study_gpu_param(tracking_uri: str, study_name: str, key: str | None = None) -> str | None:
    """The `gpu` param of the study's MLflow parent run, where the store has it."""
    from optimizer.tracking.tracker import Tracker

    if tracking_uri.startswith("sqlite:///") and \
            not Path(tracking_uri.removeprefix("sqlite:///")).is_file():
        return None  # no store there: reading must not create one
    try:
        tracker = Tracker(tracking_uri)
        run_id = tracker.find_study_run(study_name, key)
        if run_id is None:
            return None
        params: Mapping[str, str] = tracker.client.get_run(run_id).data.params
        return params.get("gpu")
    except Exception as exc:  # an unreadable store only costs the card name
        logger.info("no card from MLflow (%s); the reference says unknown", exc)
        return None
