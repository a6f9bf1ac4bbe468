"""Wiring for `nightshift start`: pick the engine (`engine_choice`), know the hardware and model,
resolve the search space against them (`space_context`), plan the seeds (`seeds`), start Ray,
and build the daemon. Kept apart from `optimizer/cli/` so the composition is testable without a
terminal."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

from optimizer.config import StudyConfig, check_before_start
from optimizer.config.space_fit import space_fit_problem
from optimizer.errors import ConfigError, TrackingError, headline, translate
from optimizer.results.trial_record import (
    STUDY_ATTR_FINGERPRINT,
    STUDY_ATTR_VLLM_DEFAULTS,
    STUDY_ATTR_WARM_START,
)
from optimizer.run.daemon import Daemon
from optimizer.run.engine_choice import (
    DEFAULT_CACHE_ROOT,
    choose_engine,
    compiled_elsewhere,
    engine_version,
    installed_release_problem,
    release_table,
    simulated_hardware,
)
from optimizer.run.engines import RunnerSpec
from optimizer.run.events import TrialEvent
from optimizer.run.ray_cluster import (
    cluster_placement_problem,
    init_ray,
    largest_node_gpus,
    probe_on_cluster,
)
from optimizer.run.ray_executor import RayExecutor
from optimizer.run.seeds import seed_trial_params, template_trial_params, warm_start
from optimizer.run.space_context import space_context
from optimizer.storage.study import make_storage
from optimizer.tracking.study_summary import study_summary
from optimizer.tracking.tracker import Tracker
from optimizer.tuning_memory.earlier_studies import TAG_WARM_START
from optimizer.tuning_memory.fingerprint import Fingerprint, resume_changes
from optimizer.tuning_memory.fingerprint_of import fingerprint_of
from optimizer.tuning_memory.learned_facts import learn_facts
from runners.hardware import HardwareProfile
from runners.hardware_probe import probe
from runners.model_info import bundled_shapes, load_model_info
from runners.simulated.sizing import UNMODELLED_FLAGS
from runners.tokenizer import load_tokenizer
from runners.vllm.flags import installed_version
from runners.workload import Workload
from search_spaces import SpaceError, load_space, recommend_space
from search_spaces.known_facts import FactError, facts_file, load_facts

logger = logging.getLogger(__name__)


def build_daemon(cfg: StudyConfig, *, dry_run: bool = False, ray_address: str | None = None,
                 on_event: Callable[[TrialEvent], None] | None = None,
                 resume: str | None = None) -> tuple[Daemon, list[str]]:
    """Everything `start` needs, validated before anything is written; returns the daemon and
    notes for the user (engine chosen, rules applied). A problem is a ConfigError naming the
    study file, then the field. `resume` is the command that resumes the study
    (`optimizer.config.resume_command` of the options given), for the daemon's own lines."""
    try:
        return _build_daemon(cfg, dry_run=dry_run, ray_address=ray_address, on_event=on_event,
                             resume=resume)
    except ConfigError as exc:
        message = str(exc)
        if message.startswith(f"{cfg.source_name}:"):
            raise
        raise translate(exc, f"{cfg.source_name}: {message}") from exc


def _build_daemon(cfg: StudyConfig, *, dry_run: bool, ray_address: str | None,
                  on_event: Callable[[TrialEvent], None] | None,
                  resume: str | None) -> tuple[Daemon, list[str]]:
    check_before_start(cfg)  # stores, prompts, model fit: before anything is written
    notes: list[str] = []
    address = ray_address or cfg.spec.ray.address
    engine = choose_engine(cfg, dry_run and not address) if not address else \
        ("simulated" if dry_run or cfg.spec.engine == "simulated" else "vllm")
    model = load_model_info(cfg.spec.model.path)
    sim = cfg.spec.simulated
    placement = cfg.spec.ray
    if not address and (placement.accelerator_type or placement.resources):
        name = "ray.accelerator_type" if placement.accelerator_type else "ray.resources"
        raise ConfigError(f"{name} picks nodes of a shared Ray cluster, but this study runs on "
                          "a Ray of its own on this machine (no ray.address or --ray-address); "
                          "leave it out or give the cluster's address.")
    if address:  # joined before anything is written: a cluster that is not there is bad input
        _join_ray(address)
        # A label or resource no live node has would leave every trial queued for ever.
        problem = cluster_placement_problem(placement.accelerator_type, placement.resources)
        if problem is not None:
            raise ConfigError(problem + ".")
    if engine == "simulated":
        if model is None:
            raise ConfigError(f"model.path: the simulated engine needs the model's shape; give a "
                              f"directory with config.json or one of {', '.join(bundled_shapes())}"
                              f" (got {cfg.spec.model.path!r}).")
        hardware = simulated_hardware(sim.hardware, sim.num_gpus)
        notes.append(f"engine: SIMULATED ({sim.num_gpus} x {hardware.gpu_name}); its figures "
                     "come from a model, never a measurement.")
    elif address:  # the driver may have no GPU: the cluster's GPU nodes are what counts
        hardware = probe_on_cluster(cfg.spec.ray.accelerator_type, cfg.spec.ray.resources)
        notes.append(f"engine: vLLM on the Ray cluster at {address}; a node has "
                     f"{hardware.num_gpus} x {hardware.gpu_name}")
    else:
        hardware = probe()
        if not hardware.has_gpu:
            raise ConfigError("engine vllm: no NVIDIA GPU found; run with --dry-run (or engine: "
                              "auto) to use the simulated engine.")
        notes.append(f"engine: vLLM on {hardware.num_gpus} x {hardware.gpu_name}")
    workload = cfg.workload
    space_name = cfg.spec.search_space
    if space_name == "auto":
        space_name = recommend_space(hardware.hardware_class)
    path = cfg.base_dir / space_name
    asked = cfg.spec.vllm.version
    if engine == "vllm":
        problem = installed_release_problem(asked, installed_version())
        if problem is not None:
            raise ConfigError(problem)
    elif asked is not None:
        notes.append(f"engine: SIMULATED as vLLM {asked} (vllm.version): that release's flags "
                     "and parser; its figures are the 0.26-calibrated model's, a release's "
                     "performance changes are not modelled.")
    table, table_note = release_table(engine, asked)
    version = engine_version(engine, asked)
    if table_note is not None:
        notes.append(table_note)
    try:
        space = load_space(path if path.suffix in (".yaml", ".yml") and path.is_file()
                           else space_name)
        resolved = space.resolve(space_context(
            hardware, model, workload, cfg.spec.model.load_format, table,
            vllm_version=version, known_facts=load_facts(),
            ignore_facts=cfg.spec.known_facts.ignore))
    except SpaceError as exc:
        raise translate(exc, f"search_space: {exc}") from exc
    except FactError as exc:
        raise translate(exc, f"known_facts: {exc}") from exc
    for rule in resolved.applied_rules:
        notes.append(f"rule {rule.name}: {rule.effect} ({rule.reason})")
    if engine == "simulated":
        unmodelled = [p.name for p in resolved.params
                      if p.name in UNMODELLED_FLAGS and not p.is_fixed]
        if unmodelled:
            notes.append(f"engine: SIMULATED does not model {', '.join(unmodelled)}: their "
                         "trials run with the figures of the same config without them "
                         "(docs/simulated-engine.md).")
    try:
        resolved, removed = resolved.with_fixed(cfg.spec.fixed_flags)
    except SpaceError as exc:
        raise translate(exc, f"{cfg.source_name}: {exc}") from exc
    notes.extend(removed)  # one line per param the study's fixed flags take out of the search
    problem = space_fit_problem(cfg, resolved, hardware, model, engine=engine)
    if problem is not None:  # every trial would be rejected before launch
        raise ConfigError(f"{problem}.")
    if cfg.spec.fixed_flags:
        notes.append(f"baseline: {cfg.baseline_name}; every trial runs these fixed flags too")
    seed_trials = seed_trial_params(cfg, resolved)
    template_trials, template_notes = template_trial_params(cfg, resolved,
                                                            hardware.hardware_class)
    notes.extend(template_notes)
    notes.extend(capacity_notes(workload))
    prompt_lengths = _prompt_lengths(cfg, workload)
    notes.append(cfg.tokenizer_note)
    tokenizer = load_tokenizer(workload.tokenizer_dir)  # read (and checked) before start
    if tokenizer is not None and tokenizer.note is not None:
        notes.append(tokenizer.note)
    if prompt_lengths == "estimated":
        notes.append("workload: text prompts' lengths are ESTIMATES (UTF-8 bytes / 4): the "
                     "model has no tokenizer.json here; the server's usage.prompt_tokens is "
                     "logged beside them (server.prompt_tokens_server_minus_client_*)")
    for name in cfg.spec.fixed_flags:  # the flags themselves were checked with the study file
        if name.startswith("sim_") and engine != "simulated":
            raise ConfigError(f"fixed_flags.{name}: a simulated-engine fault, but this study "
                              f"runs on {engine}; remove it or run with --dry-run.")
    fixed_tp = int(cfg.spec.fixed_flags.get("tensor_parallel_size") or 1)
    if fixed_tp > hardware.num_gpus:
        raise ConfigError(f"fixed_flags.tensor_parallel_size: {fixed_tp} needs {fixed_tp} GPUs "
                          f"but this host has {hardware.num_gpus}; lower it.")
    fixed_dp = int(cfg.spec.fixed_flags.get("data_parallel_size") or 1)
    if fixed_tp * fixed_dp > hardware.num_gpus:
        raise ConfigError(f"fixed_flags.data_parallel_size: {fixed_dp} replicas of "
                          f"{fixed_tp} GPU(s) need {fixed_tp * fixed_dp} GPUs but this host has "
                          f"{hardware.num_gpus}; lower it.")
    named = cfg.spec.warm_start
    if isinstance(named, list) and cfg.tracking_uri.startswith("sqlite:///") and \
            not Path(cfg.tracking_uri.removeprefix("sqlite:///")).expanduser().is_file():
        # Opening the store would create it, and it could hold no study to name.
        raise ConfigError(f"warm_start: no study named {named[0]!r} in the tracking store "
                          f"{cfg.tracking_uri}: it does not exist yet; fix tracking_uri or set "
                          "warm_start: auto.")
    fingerprint = fingerprint_of(cfg, engine=engine, engine_version=version,
                                 hardware=hardware, model=model)
    refuse_a_changed_study(cfg, fingerprint)  # before either store takes a write
    try:  # an unreachable store is bad input: refuse before anything is written
        tracker = Tracker(cfg.tracking_uri)
    except TrackingError as exc:
        raise translate(exc, f"tracking_uri: {exc}", into=ConfigError) from exc
    # Study names are looked up before the store takes a write (the study's experiment), so
    # that a name it does not hold is refused with nothing written.
    warm = warm_start(cfg, tracker, fingerprint, resolved, seed_trials) \
        if isinstance(named, list) else None
    try:  # a read-only store is bad input too
        tracker.check_writable(cfg.name)
    except TrackingError as exc:
        raise translate(exc, f"tracking_uri: {exc}", into=ConfigError) from exc
    if warm is None:
        warm = warm_start(cfg, tracker, fingerprint, resolved, seed_trials)
    notes.append(f"fingerprint {fingerprint.hash}: {fingerprint.card}, "
                 f"{fingerprint.architecture or cfg.spec.model.path}, {fingerprint.arrival}")
    notes.extend(f"warm start: {line}" for line in warm.lines)
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
                        stall_timeout_s=cfg.spec.workload.stall_timeout_s,
                        ledger_writer=f"study:{cfg.name}",
                        options={"vllm_variant": {"version": asked}}
                        if engine == "simulated" and asked is not None else {})
    hw_dict = hardware.to_dict()
    study_params = {
        "engine": engine, "model": cfg.spec.model.path, "load_format": cfg.spec.model.load_format,
        "objective": ",".join(cfg.objectives), "search_space": space_name,
        "slo.ttft_p99_ms": cfg.spec.slo.ttft_p99_ms, "slo.tpot_p99_ms": cfg.spec.slo.tpot_p99_ms,
        "slo.e2el_ms": cfg.spec.slo.e2el_ms,
        "gpu": hardware.gpu_name, "num_gpus": total_gpus,
        "hardware_class": hardware.hardware_class,
        "budget.trials": cfg.spec.budget.trials, "budget.wall_hours": cfg.spec.budget.wall_hours,
        "sampler": cfg.spec.sampler.name, "pruner": cfg.spec.pruner.name,
        "workload": workload.describe(),
        "workload.prompt_lengths": prompt_lengths,
    }
    artifacts = {
        "study.json": cfg.to_dict(),
        "search_space.json": resolved.to_dict(),
        "hardware.json": hw_dict,
        "applied_rules.json": [rule.__dict__ for rule in resolved.applied_rules],
        "fingerprint.json": fingerprint.to_dict(),
    }
    executor = RayExecutor(runner, total_gpus, accelerator_type=cfg.spec.ray.accelerator_type,
                           resources=cfg.spec.ray.resources)
    daemon = Daemon(cfg, space=resolved, executor=executor, registry_dir=runner.registry_dir,
                    tracker=tracker, workload=workload, study_params=study_params,
                    study_artifacts=artifacts, summarize=study_summary, on_event=on_event,
                    hardware=hardware, model=model, seed_trials=seed_trials,
                    template_trials=template_trials,
                    max_gpus_per_node=node_gpus,
                    warm_seeds=[(s.params, s.source) for s in warm.seeds],
                    study_tags={**fingerprint.tags(), TAG_WARM_START: warm.summary()},
                    resume=resume,
                    study_attrs={STUDY_ATTR_FINGERPRINT: fingerprint.to_dict(),
                                 STUDY_ATTR_WARM_START: list(warm.lines),
                                 STUDY_ATTR_VLLM_DEFAULTS: {**resolved.vllm_defaults,
                                                            **resolved.study_fixed}},
                    compiled_elsewhere=compiled_elsewhere(cfg, engine),
                    learn_facts=None if engine == "simulated" else partial(
                        learn_facts, study_name=cfg.name, hardware_class=hardware.hardware_class,
                        vllm_version=version, path=facts_file()))
    return daemon, notes


def refuse_a_changed_study(cfg: StudyConfig, fingerprint: Fingerprint) -> None:
    """ConfigError (one line, exit 2) where the study file names a stored study but no longer
    describes it: another workload, SLO, model, weights, engine, vLLM release, hardware or
    fixed flags (fingerprint.resume_changes). Resuming would compare new trials with the
    stored defaults trial, measured under the old file; a new model also changes the search
    space Optuna keeps. Reads the storage only: a SQLite file that does not exist is a new
    study."""
    url = cfg.storage_url
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).is_file():
        return
    storage = make_storage(url)
    try:
        study_id = storage.get_study_id_from_name(cfg.name)
    except KeyError:
        return
    stored = storage.get_study_user_attrs(study_id).get(STUDY_ATTR_FINGERPRINT)
    if not isinstance(stored, Mapping):
        return  # a study from before fingerprints: nothing to compare
    changes = resume_changes(stored, fingerprint)
    if changes:
        raise ConfigError(
            f"{cfg.source_name}: study {cfg.name!r} in {url} ran under another study file "
            f"({'; '.join(changes)}); its trials are not comparable with new ones: give the "
            f"study a new `name:` to start a new study, or restore the file (and the vLLM "
            f"it ran) to resume it.")


def _join_ray(address: str) -> None:
    """Join the Ray cluster at `address`; ConfigError (one line) where Ray cannot."""
    try:
        init_ray(None, address)
    except (ConnectionError, TimeoutError, ValueError, RuntimeError) as exc:
        raise translate(exc, f"ray.address: cannot join the Ray cluster at {address} "
                        f"({headline(exc)}); start it (`ray start --head`) or "
                        "fix the address.", into=ConfigError) from exc


def study_fingerprint(cfg: StudyConfig, *, dry_run: bool = False) -> Fingerprint:
    """The fingerprint `nightshift start` would give the study on this machine (no Ray, no
    store): its hardware unknown where it would run vLLM and this machine has no GPU."""
    engine = choose_engine(cfg, dry_run)
    model = load_model_info(cfg.spec.model.path)
    if engine == "simulated":
        hardware: HardwareProfile | None = simulated_hardware(cfg.spec.simulated.hardware,
                                                              cfg.spec.simulated.num_gpus)
    else:
        hardware = probe()
    return fingerprint_of(cfg, engine=engine,
                          engine_version=engine_version(engine, cfg.spec.vllm.version),
                          hardware=hardware, model=model)


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
    is_per_level = workload.trace is not None or workload.multi_turn is not None
    if search is not None and is_per_level and search.axis == "request_rate" and \
            workload.num_requests and search.probe_duration_s and \
            workload.num_requests < search.high * search.probe_duration_s:
        notes.append(
            f"capacity: at {search.high:g} req/s a probe's {workload.num_requests} requests "
            f"last {workload.num_requests / search.high:.1f} s, less than probe_duration_s "
            f"({search.probe_duration_s:g} s): a short probe above capacity can end before "
            "its growing queue is seen, and what it served cannot steer the search; set "
            f"num_requests to {math.ceil(search.high * search.probe_duration_s)} or more to "
            "let the duration bound every probe")
    return notes


def _prompt_lengths(cfg: StudyConfig, workload: Workload) -> str:
    """How the load generator knows its prompts' lengths: `counted` (the model's tokenizer),
    `token_ids` (synthesised ids, exact by construction), `estimated` (text, UTF-8 bytes / 4) or
    `estimated_where_text` (a prompts file: its token-id lines exact, its text lines not) or
    `recorded_where_text` (a trace: its text prompts' lengths are its recorded input_length,
    unchecked; its other requests token ids)."""
    if workload.tokenizer_dir is not None:
        return "counted"
    if workload.dataset is not None or workload.multi_turn is not None:
        return "estimated"
    if cfg.prompts_file is not None:
        return "estimated_where_text"  # a line of token ids is exact, a text line estimated
    if workload.trace is not None:
        from runners.arrivals import read_trace

        entries = read_trace(workload.trace.path, workload.trace.timestamp_unit_s,
                             workload.trace.max_gap_s)
        if any(isinstance(e.prompt, str) for e in entries):
            return "recorded_where_text"
    return "token_ids"
