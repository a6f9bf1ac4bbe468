"""Wiring for `nightshift start`: pick the engine, know the hardware and model, resolve the
search space against them, start Ray, and build the daemon. Kept apart from `optimizer/cli/` so
the composition is testable without a terminal."""

from __future__ import annotations

import importlib.util
import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from optimizer.config import StudyConfig, check_before_start
from optimizer.daemon import Daemon, TrialEvent
from optimizer.engines import RunnerSpec
from optimizer.errors import ConfigError, TrackingError
from optimizer.study_summary import study_summary
from optimizer.tracking import Tracker
from optimizer.workers import RayExecutor, init_ray, largest_node_gpus, probe_on_cluster
from runners.hardware import GpuInfo, HardwareProfile, load_preset, preset_names, probe
from runners.model_info import ModelInfo, bundled_shapes, load_model_info
from runners.workload import Workload
from search_spaces import (
    ResolvedSpace,
    SpaceError,
    load_space,
    recommend_space,
)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "nightshift" / "vllm"


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and shutil.which("nvidia-smi") is not None


def choose_engine(cfg: StudyConfig, dry_run: bool) -> str:
    if dry_run:
        return "simulated"
    if cfg.spec.engine == "auto":
        return "vllm" if vllm_available() else "simulated"
    return cfg.spec.engine


def simulated_hardware(preset: str, num_gpus: int) -> HardwareProfile:
    """A preset's GPU repeated `num_gpus` times, as the simulated engine's host."""
    try:
        base = load_preset(preset)
    except ValueError:
        raise ConfigError(f"simulated.hardware: unknown preset {preset!r}; valid: "
                          f"{', '.join(preset_names())}.") from None
    if base.num_gpus >= num_gpus:
        gpus = base.gpus[:num_gpus]
        interconnect = base.interconnect if num_gpus > 1 else "none"
    else:
        template = base.gpus[0]
        gpus = tuple(GpuInfo(**{**template.__dict__, "index": i,
                                "uuid": f"{template.uuid or 'GPU-sim'}-{i}"})
                     for i in range(num_gpus))
        # Data-centre parts come in NVLink boxes; consumer cards talk over PCIe.
        interconnect = "none" if num_gpus == 1 else (
            "pcie" if base.hardware_class == "24gb" else "nvlink")
    return HardwareProfile(**{**base.__dict__, "gpus": gpus, "interconnect": interconnect})


def space_context(hardware: HardwareProfile, model: ModelInfo | None) -> dict[str, Any]:
    hw = {"num_gpus": hardware.num_gpus, "compute_capability": hardware.compute_capability,
          "gpu_memory_gib": hardware.gpu_memory_gib, "interconnect": hardware.interconnect,
          "hardware_class": hardware.hardware_class, "gpu_name": hardware.gpu_name}
    mdl: dict[str, Any] = {}
    if model is not None:
        mdl = {"num_attention_heads": model.num_attention_heads,
               "num_key_value_heads": model.num_key_value_heads,
               "quant_method": model.quant_method,
               "max_position_embeddings": model.max_position_embeddings,
               "num_params": model.num_params}
    return {"hardware": hw, "model": mdl}


def build_daemon(cfg: StudyConfig, *, dry_run: bool = False, ray_address: str | None = None,
                 on_event: Callable[[TrialEvent], None] | None = None,
                 ) -> tuple[Daemon, list[str]]:
    """Everything `start` needs, validated before anything is written; returns the daemon and
    notes for the user (engine chosen, rules applied)."""
    check_before_start(cfg)  # stores, prompts, model fit: before anything is written
    notes: list[str] = []
    address = ray_address or cfg.spec.ray.address
    engine = choose_engine(cfg, dry_run and not address) if not address else \
        ("simulated" if dry_run or cfg.spec.engine == "simulated" else "vllm")
    model = load_model_info(cfg.spec.model.path)
    sim = cfg.spec.simulated
    if engine == "simulated":
        if model is None:
            raise ConfigError(f"model.path: the simulated engine needs the model's shape; give a "
                              f"directory with config.json or one of {', '.join(bundled_shapes())}"
                              f" (got {cfg.spec.model.path!r}).")
        hardware = simulated_hardware(sim.hardware, sim.num_gpus)
        notes.append(f"engine: SIMULATED ({sim.num_gpus} x {hardware.gpu_name}); its figures "
                     "come from a model, never a measurement.")
    elif address:  # the driver may have no GPU: the cluster's GPU nodes are what counts
        init_ray(None, address)
        hardware = probe_on_cluster(cfg.spec.ray.accelerator_type, cfg.spec.ray.resources)
        notes.append(f"engine: vLLM on the Ray cluster at {address}; a node has "
                     f"{hardware.num_gpus} x {hardware.gpu_name}")
    else:
        hardware = probe()
        if not hardware.has_gpu:
            raise ConfigError("engine vllm: no NVIDIA GPU found; run with --dry-run (or engine: "
                              "auto) to use the simulated engine.")
        notes.append(f"engine: vLLM on {hardware.num_gpus} x {hardware.gpu_name}")
    space_name = cfg.spec.search_space
    if space_name == "auto":
        space_name = recommend_space(hardware.hardware_class)
    path = cfg.base_dir / space_name
    try:
        space = load_space(path if path.suffix in (".yaml", ".yml") and path.is_file()
                           else space_name)
        resolved = space.resolve(space_context(hardware, model))
    except SpaceError as exc:
        raise ConfigError(f"search_space: {exc}") from None
    for rule in resolved.applied_rules:
        notes.append(f"rule {rule.name}: {rule.effect} ({rule.reason})")
    try:
        resolved, removed = resolved.with_fixed(cfg.spec.fixed_flags)
    except SpaceError as exc:
        raise ConfigError(f"{cfg.source_name}: {exc}") from None
    notes.extend(removed)  # one line per param the study's fixed flags take out of the search
    if cfg.spec.fixed_flags:
        notes.append(f"baseline: {cfg.baseline_name}; every trial runs these fixed flags too")
    seed_trials = seed_trial_params(cfg, resolved)
    workload = cfg.workload(vocab_size=model.vocab_size if model else 32000)
    notes.extend(capacity_notes(workload))
    for name in cfg.spec.fixed_flags:  # the flags themselves were checked with the study file
        if name.startswith("sim_") and engine != "simulated":
            raise ConfigError(f"fixed_flags.{name}: a simulated-engine fault, but this study "
                              f"runs on {engine}; remove it or run with --dry-run.")
    fixed_tp = int(cfg.spec.fixed_flags.get("tensor_parallel_size") or 1)
    if fixed_tp > hardware.num_gpus:
        raise ConfigError(f"fixed_flags.tensor_parallel_size: {fixed_tp} needs {fixed_tp} GPUs "
                          f"but this host has {hardware.num_gpus}; lower it.")
    try:  # an unreachable or read-only store is bad input: refuse before anything is written
        tracker = Tracker(cfg.tracking_uri)
        tracker.check_writable(cfg.name)
    except TrackingError as exc:
        raise ConfigError(f"tracking_uri: {exc}") from None
    total_gpus = init_ray(sim.num_gpus if engine == "simulated" else None, address)
    if total_gpus < 1:
        raise ConfigError("the Ray cluster has no GPU; start Ray with GPUs or use --dry-run.")
    node_gpus = largest_node_gpus()
    if address:
        notes.append(f"Ray cluster: {total_gpus} GPUs, at most {node_gpus} on one node; trials "
                     "run where their GPUs are free")
    results = cfg.results_dir.resolve()
    runner = RunnerSpec(kind=engine, registry_dir=results / "engines",
                        hardware=hardware.to_dict() if engine == "simulated" else None,
                        startup_time_scale=sim.startup_time_scale,
                        seed=sim.seed, cache_root=cfg.spec.vllm.cache_root or DEFAULT_CACHE_ROOT,
                        is_cache_per_trial=cfg.spec.startup.compile_cache == "per_trial",
                        stall_timeout_s=cfg.spec.workload.stall_timeout_s)
    hw_dict = hardware.to_dict()
    study_params = {
        "engine": engine, "model": cfg.spec.model.path, "load_format": cfg.spec.model.load_format,
        "objective": ",".join(cfg.objectives), "search_space": space_name,
        "slo.ttft_p99_ms": cfg.spec.slo.ttft_p99_ms, "slo.tpot_p99_ms": cfg.spec.slo.tpot_p99_ms,
        "gpu": hardware.gpu_name, "num_gpus": total_gpus,
        "hardware_class": hardware.hardware_class,
        "budget.trials": cfg.spec.budget.trials, "budget.wall_hours": cfg.spec.budget.wall_hours,
        "sampler": cfg.spec.sampler.name, "pruner": cfg.spec.pruner.name,
    }
    artifacts = {
        "study.json": cfg.to_dict(),
        "search_space.json": resolved.to_dict(),
        "hardware.json": hw_dict,
        "applied_rules.json": [rule.__dict__ for rule in resolved.applied_rules],
    }
    executor = RayExecutor(runner, total_gpus, accelerator_type=cfg.spec.ray.accelerator_type,
                           resources=cfg.spec.ray.resources)
    daemon = Daemon(cfg, space=resolved, executor=executor, registry_dir=runner.registry_dir,
                    tracker=tracker, workload=workload, study_params=study_params,
                    study_artifacts=artifacts, summarize=study_summary, on_event=on_event,
                    hardware=hardware, model=model, seed_trials=seed_trials,
                    max_gpus_per_node=node_gpus)
    return daemon, notes


def seed_trial_params(cfg: StudyConfig, space: ResolvedSpace) -> list[dict[str, Any]]:
    """`seed_trials` as full configs (each over the defaults baseline), refused with the first
    problem when one is not a config of the space."""
    defaults = space.defaults()
    out: list[dict[str, Any]] = []
    for index, changes in enumerate(cfg.spec.seed_trials):
        for name, value in changes.items():
            fixed = cfg.spec.fixed_flags.get(name)
            if name in cfg.spec.fixed_flags and value != fixed:
                raise ConfigError(f"seed_trials[{index}].{name}: fixed_flags fixes it to "
                                  f"{fixed!r} for every trial; drop it from the seed or from "
                                  "fixed_flags.")
        params = {**defaults, **changes}
        problems = space.check(params)
        if problems:
            raise ConfigError(f"seed_trials[{index}]: {problems[0]}; change it to a value of "
                              f"search space {space.name!r}.")
        out.append(params)
    return out


def capacity_notes(workload: Workload) -> list[str]:
    """What to know before a capacity search runs: whether max_probes can close the bracket by
    bisection alone, and whether num_requests cuts fast probes short of probe_duration_s."""
    notes: list[str] = []
    search = workload.capacity
    if search is not None and search.worst_case_probes() > search.max_probes:
        notes.append(
            f"capacity: bisecting [{search.low:g}, {search.high:g}] to {search.tolerance:.0%} "
            f"can take {search.worst_case_probes()} probes but max_probes is "
            f"{search.max_probes}: a trial whose probes run out before that (when no probe's "
            "served rate narrows it) is flagged unresolved; raise max_probes or tolerance, or "
            "narrow low/high")
    if search is not None and search.axis == "request_rate" and workload.num_requests and \
            search.probe_duration_s and workload.num_requests < search.high * \
            search.probe_duration_s:
        notes.append(
            f"capacity: at {search.high:g} req/s a probe's {workload.num_requests} requests "
            f"last {workload.num_requests / search.high:.1f} s, less than probe_duration_s "
            f"({search.probe_duration_s:g} s): a short probe above capacity can end before "
            "its growing queue is seen, and what it served cannot steer the search; set "
            f"num_requests to {math.ceil(search.high * search.probe_duration_s)} or more to "
            "let the duration bound every probe")
    return notes
