"""Re-measuring a library case on this machine: which vLLM (and card) is installed, each config
started through the study's runner machinery (`engines.build_runner`, `EngineRunner`) in
interleaved rounds (A B A B, as the confirmation does), and the figures each run gave."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from optimizer.regress.compare import (
    CaseVerdict,
    FigureComparison,
    FlagProblem,
    compare_figure,
    flag_problems,
    worst,
)
from optimizer.regress.library import FIGURES, CaseSpec, LibraryConfig
from optimizer.results.objectives import operating_step
from optimizer.run.engines import RunnerSpec, build_runner
from optimizer.search.notes import saturated_failure, saturated_levels
from optimizer.storage.study import engine_config
from runners.base import BenchmarkMetrics, Failure, FailureReason, RunResult
from search_spaces.engine.tables import VllmFlags

logger = logging.getLogger(__name__)

# Failures in which no request was served: the engine never came up.
_START_FAILURES = frozenset({
    FailureReason.OOM_AT_START, FailureReason.KV_CACHE_TOO_SMALL,
    FailureReason.CUDA_GRAPH_CAPTURE, FailureReason.UNSUPPORTED_CONFIG,
    FailureReason.INVALID_ARGUMENT, FailureReason.STARTUP_TIMEOUT, FailureReason.STARTUP_CRASH,
    FailureReason.PORT_IN_USE})


@dataclass(frozen=True)
class Installed:
    """The engine a case runs on here: its kind, vLLM version, card and flag table."""

    engine: str  # "vllm" or "simulated"
    vllm_version: str
    card: str
    flags: VllmFlags
    options: Mapping[str, Any] = field(default_factory=dict)  # RunnerSpec.options


def installed(case: CaseSpec, simulated_variant: Mapping[str, Any] | None = None) -> Installed:
    """What this machine runs the case on: for vLLM the installed package's version, the GPU
    NVML reports and the installed parser; for the simulated engine the release it pretends
    to be (0.26.0 unless `simulated_variant` says otherwise)."""
    from optimizer.run.engine_choice import choose_engine

    engine = choose_engine(case.study_config(), dry_run=False)
    if engine == "simulated":
        from optimizer.run.engine_choice import simulated_hardware
        from runners.simulated.launcher import VllmVariant

        variant = VllmVariant.from_dict(simulated_variant or {})
        hardware = simulated_hardware(case.simulated.hardware, case.simulated.num_gpus)
        return Installed("simulated", variant.version, f"simulated {hardware.gpu_name}",
                         variant.flag_table(),
                         {"vllm_variant": variant.to_dict()} if simulated_variant else {})
    from importlib.metadata import PackageNotFoundError, version

    from runners.hardware_probe import probe
    from runners.vllm.flags import flag_table

    try:
        vllm_version = version("vllm")
    except PackageNotFoundError:
        vllm_version = "not installed"
    profile = probe()
    return Installed("vllm", vllm_version, profile.gpu_name if profile.has_gpu else "no GPU",
                     flag_table())


@dataclass(frozen=True)
class ConfigOutcome:
    """One config of a case after its rounds."""

    name: str
    flags: Mapping[str, Any]
    env: Mapping[str, str]
    samples: Mapping[str, tuple[float, ...]]  # figure -> every round x repeat
    comparisons: tuple[FigureComparison, ...] = ()
    failure: Failure | None = None
    flag_problems: tuple[FlagProblem, ...] = ()
    num_runs: int = 0  # engine starts that measured

    @property
    def verdict(self) -> CaseVerdict:
        if self.failure is not None:
            return "failed to start" if self.failure.reason in _START_FAILURES else "failed"
        return worst([c.verdict for c in self.comparisons])


@dataclass(frozen=True)
class CaseOutcome:
    name: str
    installed: Installed
    configs: tuple[ConfigOutcome, ...]
    date: str  # when it was measured (UTC, ISO)
    rounds: int
    repeats: int
    objective: str  # picks the headline level

    @property
    def verdict(self) -> CaseVerdict:
        return worst([c.verdict for c in self.configs])

    reference_versions: tuple[str, ...] = ()  # the vLLM versions its references were taken on
    reference_cards: tuple[str, ...] = ()


def figures_of(result: RunResult, objective: str) -> dict[str, list[float]]:
    """Each figure at the run's operating point (`objectives.operating_step`),
    one value per repeat of that level."""
    step = operating_step(objective, result.steps)
    if step is None:
        return {}
    runs: tuple[BenchmarkMetrics, ...] = step.repeats or (step.metrics,)
    out: dict[str, list[float]] = {}
    for name, (_, attr) in FIGURES.items():
        values = [getattr(m, attr) for m in runs]
        if all(isinstance(v, int | float) for v in values):
            out[name] = [float(v) for v in values]
    return out


def no_figure_failure(result: RunResult) -> Failure:
    """Why a run that completed gave no figure (no level completed a request): `saturated`
    where a level was stopped as saturated (it cancelled its own requests: no errors of the
    engine's), else `too_many_errors`."""
    saturated = saturated_levels(result.steps)
    if saturated:
        return saturated_failure(saturated, "the config has no figure", "lighten the case's "
                                 "load (a lower request rate in workload.levels, shorter "
                                 "requests)")
    return Failure(FailureReason.TOO_MANY_ERRORS, "no load level completed a request")


def measure_case(case: CaseSpec, here: Installed, workdir: Path, threshold: float,
                 on_run: Callable[[str, int, RunResult], None] | None = None,
                 source: Path | None = None) -> CaseOutcome:
    """Start each config `case.rounds` times, interleaved (config 1, 2, ..., 1, 2, ...), each
    start measuring the workload's levels `case.repeats` times on the same server; compare each
    config's figures with its reference. A config that fails is not started again."""
    from optimizer.run.engine_choice import DEFAULT_CACHE_ROOT, simulated_hardware

    cfg = case.study_config(source)  # paths resolve against the library file's folder
    workload = cfg.workload
    spec = RunnerSpec(
        kind=here.engine, registry_dir=workdir / "engines",
        hardware=simulated_hardware(case.simulated.hardware, case.simulated.num_gpus).to_dict()
        if here.engine == "simulated" else None,
        startup_time_scale=case.simulated.startup_time_scale, seed=case.simulated.seed,
        cache_root=DEFAULT_CACHE_ROOT, stall_timeout_s=case.workload.stall_timeout_s,
        ledger_writer=f"regress:{case.name}", options=dict(here.options))
    samples: dict[str, dict[str, list[float]]] = {c.name: {} for c in case.configs}
    failures: dict[str, Failure] = {}
    runs: dict[str, int] = {c.name: 0 for c in case.configs}
    runner = build_runner(spec)
    try:
        for round_index in range(case.rounds):
            for config in case.configs:
                if config.name in failures:
                    continue
                engine = replace(engine_config(cfg, config.flags), env=dict(config.env))
                logger.info("case %s: config %s, round %d of %d", case.name, config.name,
                            round_index + 1, case.rounds)
                result = runner.run(engine, workload,
                                    workdir / case.name / config.name / f"round-{round_index}")
                if on_run is not None:
                    on_run(config.name, round_index, result)
                if result.status != "complete" or result.failure is not None:
                    failures[config.name] = result.failure or Failure(
                        FailureReason.INTERNAL, f"the run ended {result.status}")
                    continue
                figures = figures_of(result, case.objective)
                if not figures:
                    failures[config.name] = no_figure_failure(result)
                    continue
                runs[config.name] += 1
                for name, values in figures.items():
                    samples[config.name].setdefault(name, []).extend(values)
    finally:
        runner.close()
    outcomes = []
    for config in case.configs:
        comparisons: list[FigureComparison] = []
        measured = samples[config.name]
        if config.name not in failures and config.reference is not None:
            for name, ref in config.reference.figures.items():
                if measured.get(name):
                    comparisons.append(compare_figure(name, ref, measured[name], threshold))
        outcomes.append(ConfigOutcome(
            name=config.name, flags=dict(config.flags), env=dict(config.env),
            samples={k: tuple(v) for k, v in measured.items()},
            comparisons=tuple(comparisons), failure=failures.get(config.name),
            flag_problems=tuple(flag_problems(config.flags, here.flags)),
            num_runs=runs[config.name]))
    return CaseOutcome(name=case.name, installed=here, configs=tuple(outcomes),
                       date=datetime.now(UTC).isoformat(timespec="seconds"),
                       rounds=case.rounds, repeats=case.repeats, objective=case.objective,
                       reference_versions=_refs(case.configs, "vllm_version"),
                       reference_cards=_refs(case.configs, "card"))


def _refs(configs: tuple[LibraryConfig, ...] | list[LibraryConfig], key: str) -> tuple[str, ...]:
    return tuple(sorted({str(getattr(c.reference, key)) for c in configs
                         if c.reference is not None}))
