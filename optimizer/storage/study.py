"""The Optuna side of a study: storage, sampler, pruner, objective values, and the one mapping
from a runner's result to an Optuna trial state."""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import optuna
from optuna.trial import TrialState

from optimizer.config import StudyConfig
from optimizer.config.store_checks import sqlite_file_problem
from optimizer.errors import ConfigError, NightshiftError, cause_of, translate
from optimizer.results.objectives import get_objective
from optimizer.results.trial_record import (
    ATTR_DAEMON_LOSSES,
    ATTR_RETRIES,
    ATTR_RETRY_OF,
    HasUserAttrs,
    confirm_label,
    is_cut_short,
    is_repeat,
    is_stopped_before_launch,
    ran_nothing,
    record_of,
    requeue_marks,
    retry_of,
)
from optimizer.search.pruners import PRUNERS
from optimizer.search.samplers import SAMPLERS
from optimizer.storage.creation_lock import creating_store
from optimizer.storage.lock import read_lock, study_lock_path
from optimizer.storage.sqlite_wait import (
    ATTEMPT_TIMEOUT_S,
    LockWait,
    LockWaitingStorage,
    StoreLocked,
)
from runners.base import EngineConfig, FailureReason, RunResult
from runners.model_info import resolve_model_dir

MAX_DAEMON_LOSSES = 5  # re-queues of a config a dying daemon lost (ATTR_DAEMON_LOSSES)
# The Optuna constraint a trial outside the quality limits violates (results/quality_gate.py).
QUALITY_CONSTRAINT = "quality"
# A config that failed for one of these reasons fails again: it is never launched twice, and
# the sampler is told it as the worst value with a violated constraint (`tell_config_failure`).
CONFIG_FAILURES = frozenset({
    FailureReason.OOM_AT_START, FailureReason.KV_CACHE_TOO_SMALL,
    FailureReason.CUDA_GRAPH_CAPTURE, FailureReason.UNSUPPORTED_CONFIG,
    FailureReason.INVALID_ARGUMENT, FailureReason.INFEASIBLE})
# A config that ran but whose latency objective has no value at the study's load (`saturated`:
# read at a level that saturated; `slo_unmet`: a capacity search in which no load met the SLO)
# misses there again: it is never launched twice either, and the sampler is told the worst
# value with the SLO violated, as a goodput objective is told 0 there
# (`tell_config_failure(has_run=True)`). Not a config fact beyond this load (learned_facts
# keeps CONFIG_FAILURES only).
REPEATED_FAILURES = CONFIG_FAILURES | {FailureReason.SATURATED, FailureReason.SLO_UNMET}
# What a config that cannot run scores, by direction (finite: samplers sort values).
_WORST = {"maximize": 0.0, "minimize": 1e9}
_STORAGE_ATTEMPTS = 4
_RACE_ERRORS = frozenset({"IntegrityError", "OperationalError"})


def make_storage(url: str, *, lock_wait: LockWait | None = None,
                 attempt_timeout_s: float = ATTEMPT_TIMEOUT_S) -> optuna.storages.RDBStorage:
    """The storage at `url`. A SQLite file is opened under its creation lock
    (`creating_store`): a process creating it (its file, tables and schema version) finishes
    before another opens it, which then finds the schema made. Its every read and write waits
    through a lock another process holds (`lock_wait`, by default LOCK_WAIT_S;
    sqlite_wait.py), SQLite's own busy wait lasting `attempt_timeout_s` per attempt."""
    sqlite_file = url.startswith("sqlite:///")
    if sqlite_file:
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(_STORAGE_ATTEMPTS):
        try:
            if sqlite_file:
                with creating_store(url):
                    return LockWaitingStorage(
                        url, {"connect_args": {"timeout": attempt_timeout_s}},
                        wait=lock_wait or LockWait(
                            f"the Optuna storage {url.removeprefix('sqlite:///')}"))
            return optuna.storages.RDBStorage(url)
        except StoreLocked:
            raise
        except Exception as exc:  # SQLAlchemy raises per driver; all mean "unusable URL"
            # Two processes creating the schema at once collide once (on a table or the
            # schema-version row); the second try finds it made. A server RDB has no file to
            # lock (a daemon starting while `status` reads on another host), and an opener that
            # is not ours (optuna-dashboard, a script's `optuna.load_study`) does not take the
            # creation lock of a SQLite file.
            if attempt + 1 < _STORAGE_ATTEMPTS and type(exc).__name__ in _RACE_ERRORS:
                time.sleep(0.5 * (attempt + 1))
                continue
            raise translate(exc, f"storage {url!r} cannot be opened ({type(exc).__name__}); "
                            "give a reachable RDB URL such as sqlite:///results/optuna.db.",
                            into=ConfigError) from exc
    raise AssertionError("unreachable")


def _being_created(cfg: StudyConfig) -> NightshiftError | None:
    """The one line for a study its store does not hold yet while its daemon, which takes the
    study's lock before it opens the store, is creating it; None where no daemon holds it."""
    holder = read_lock(study_lock_path(cfg))
    if holder is None:
        return None
    return NightshiftError(f"study {cfg.name!r} is being created: its daemon (pid "
                           f"{holder.get('pid', '?')}) has started but not yet written it to "
                           f"{cfg.storage_url}; run the command again in a moment.")


def existing_storage(cfg: StudyConfig) -> optuna.storages.RDBStorage:
    """The study's storage for a command that only reads it (`status`, `export`, `report`): a
    SQLite file that does not exist is refused (ConfigError) rather than created with its
    directory. Its file is looked at once no process is creating it (`creating_store`), so a
    store being created is not taken for an empty or a missing one."""
    url = cfg.storage_url
    with creating_store(url) as has_folder:
        problem = sqlite_file_problem("storage", url) if has_folder else None
        is_missing = not has_folder or (url.startswith("sqlite:///") and
                                        not Path(url.removeprefix("sqlite:///")).is_file())
    if problem is not None:
        raise ConfigError(f"{problem}.") from cause_of(problem)
    if is_missing:
        being_created = _being_created(cfg)
        if being_created is not None:
            raise being_created
        raise ConfigError(f"no study named {cfg.name!r}: there is no storage file at {url}; "
                          f"start it with `nightshift start {cfg.source or 'STUDY.yaml'}` or "
                          "pass the --storage it ran with.")
    return make_storage(url)


def sampler_seed(seed: int | None, num_trials: int) -> int | None:
    """The sampler's seed for a start of the daemon that finds `num_trials` trials in the
    storage: the study's seed on the first start, another on each resume. A sampler seeded
    alike on every start proposes, after a restart, the configs it proposed before it."""
    if seed is None or num_trials == 0:
        return seed
    return (seed * 1_000_003 + num_trials) % 2**32


def make_sampler(cfg: StudyConfig, num_trials: int = 0) -> optuna.samplers.BaseSampler:
    """The study's sampler, seeded for a start that finds `num_trials` trials stored."""
    spec = cfg.spec.sampler
    return SAMPLERS[spec.name](sampler_seed(spec.seed, num_trials), spec.n_startup_trials)


def make_pruner(cfg: StudyConfig) -> optuna.pruners.BasePruner:
    spec = cfg.spec.pruner
    if cfg.is_multi_objective:
        return optuna.pruners.NopPruner()
    return PRUNERS[spec.name](spec.n_startup_trials, spec.min_relative_gap)


def open_study(cfg: StudyConfig, *, create: bool = True,
               storage: optuna.storages.BaseStorage | None = None) -> optuna.Study:
    """The study of `cfg` (created unless `create=False`), over `storage` when the caller keeps
    it (for the storage's own API: a lease, recovery's writes to dead trials)."""
    if storage is None and not create:
        storage = existing_storage(cfg)
    storage = storage if storage is not None else make_storage(cfg.storage_url)
    if not create:
        try:
            return optuna.load_study(study_name=cfg.name, storage=storage,
                                     sampler=make_sampler(cfg), pruner=make_pruner(cfg))
        except KeyError as exc:  # Optuna's answer for a name its storage does not hold
            being_created = _being_created(cfg)
            if being_created is not None:
                raise being_created from exc
            raise translate(exc, f"no study named {cfg.name!r} in {cfg.storage_url}; start it "
                            f"with `nightshift start {cfg.source or 'STUDY.yaml'}`.",
                            into=ConfigError) from exc
    study = optuna.create_study(study_name=cfg.name, storage=storage,
                                sampler=make_sampler(cfg), pruner=make_pruner(cfg),
                                directions=cast(list[Literal["minimize", "maximize"]],
                                                cfg.directions),
                                load_if_exists=True)
    if [d.name.lower() for d in study.directions] != cfg.directions:
        raise ConfigError(f"study {cfg.name!r} in {cfg.storage_url} optimizes "
                          f"{[d.name.lower() for d in study.directions]}, not {cfg.directions}; "
                          "keep the objective or give the study a new name.")
    stored = len(study.get_trials(deepcopy=False))
    if stored:  # a resume: seeded afresh, so it does not replay the proposals made before
        study.sampler = make_sampler(cfg, stored)
    return study


def startup_saver_env(savers: Sequence[str]) -> dict[str, str]:
    """The environment the study's start-up savers set (`sections.STARTUP_SAVERS`)."""
    from optimizer.config.sections import STARTUP_SAVERS

    return {k: v for name in savers for k, v in STARTUP_SAVERS[name].items()}


def engine_config(cfg: StudyConfig, flags: Mapping[str, Any]) -> EngineConfig:
    model = cfg.spec.model
    # A bundled shape name becomes its directory: vLLM would take a bare name for a hub id.
    directory = resolve_model_dir(model.path)
    return EngineConfig(
        model=str(directory.resolve()) if directory is not None else model.path,
        # The study's fixed flags win: the space no longer searches them (`with_fixed`), and a
        # flag rendered from a config must never override one the study fixed.
        flags={**flags, **cfg.engine_fixed_flags},
        # The start-up savers' variables (docs/startup-cost.md), then the study's own: every
        # trial carries the same, so the compile cache keys stay consistent across trials.
        env={**startup_saver_env(cfg.spec.startup.savers), **cfg.spec.env},
        load_format=model.load_format,
        served_model_name=model.served_model_name,
        skip_tokenizer_init=model.skip_tokenizer_init,
        extra_args=tuple(cfg.spec.vllm.extra_args),
    )


def state_of(result: RunResult) -> TrialState:
    """The one place a runner's status becomes an Optuna trial state."""
    if result.status == "complete":
        return TrialState.COMPLETE
    if result.status == "stopped":
        return TrialState.PRUNED
    return TrialState.FAIL


def tell_config_failure(study: optuna.Study, trial: optuna.Trial, objectives: Sequence[str],
                        has_slo: bool, *, has_run: bool = False) -> None:
    """A config that cannot run (OOM, graph capture, unsupported, infeasible) teaches the
    sampler: Optuna's TPE ignores FAIL trials, so it is told as a complete trial with the
    worst value and a violated constraint (never the best, and avoided). `has_run`: it ran,
    and its latency has no value at the study's load (`saturated`, `slo_unmet`): the worst
    value and the SLO violated, but not `runs`. Its record keeps `state: failed` for every
    reader of ours."""
    if not has_run:
        trial.set_constraint("runs", 1.0)
    if has_slo:
        trial.set_constraint("slo", 1.0)
    study.tell(trial, [_WORST[get_objective(o).direction] for o in objectives])


def requeueable(trial: HasUserAttrs) -> bool:
    """Whether a trial lost to infrastructure goes back in the queue: all but a confirmation
    run, whose round (its pair of runs) is measured again when the study resumes."""
    return confirm_label(trial) is None


def requeue(study: optuna.Study, trial: optuna.Trial | optuna.trial.FrozenTrial,
            params: Mapping[str, Any], retries: int, *,
            daemon_losses: int | None = None) -> bool:
    """Queue again a trial lost to infrastructure, as what it was (the defaults, a seed),
    unless it is a confirmation run (`requeueable`); says whether it did. `daemon_losses`
    replaces the count the trial carries."""
    if not requeueable(trial):
        return False
    kept = requeue_marks(trial)
    if daemon_losses is not None:
        kept[ATTR_DAEMON_LOSSES] = daemon_losses
    study.enqueue_trial(dict(params), user_attrs={
        **kept, ATTR_RETRY_OF: trial.number, ATTR_RETRIES: retries})
    return True


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]


def is_search_trial(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial of the search itself: not a repeat of a config already measured (it launched
    nothing; the original stands for it), nor one whose sampling a dying daemon cut short (it
    has no config), nor one a stop failed while it waited for GPUs (its config is queued
    again), nor a final confirmation run."""
    return not ran_nothing(trial) and confirm_label(trial) is None


# The one naming of Optuna's trial states for records, the CLI and MLflow ("failed", "queued").
STATE_NAMES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned",
                TrialState.FAIL: "failed", TrialState.RUNNING: "running",
                TrialState.WAITING: "queued"}


@dataclass(frozen=True)
class TrialCounts:
    """A study's trials counted apart, as `status`, the CLI, the report and MLflow say them:
    the search's trials by state (a config failure, which Optuna holds complete, is failed),
    the final confirmation runs, the repeats of a config already measured (they launched
    nothing) and the configs queued that no worker has started."""

    by_state: Mapping[str, int]  # search trials started: complete, pruned, failed, running
    queued: int  # search trials enqueued, not started (a grid's tail, seeds)
    confirmation_runs: int  # re-measurements of the recommended config and the defaults
    repeats: int  # the sampler asked again for a config already held: nothing launched
    cut_short: int = 0  # a dying daemon cut their sampling short: no config, nothing launched
    not_launched: int = 0  # a stop came while they waited for GPUs: re-queued, not failed
    # of the failed: lost to infrastructure (a worker, an interruption) and run again (or
    # running again) under another trial number
    rerun: int = 0

    @property
    def trials(self) -> int:
        """The search's trials that started: what "N trials" means everywhere."""
        return sum(self.by_state.values())

    def describe(self) -> str:
        """`12 trials (9 complete, 2 pruned, 1 failed); 4 confirmation runs; 3 repeats of a
        measured config (not launched); 5 queued`: the parts that are not zero."""
        states = ", ".join(
            f"{n} {state}" + (f", {self.rerun} of them re-run" if state == "failed"
                              and self.rerun else "")
            for state, n in self.by_state.items() if n)
        parts = [f"{self.trials} trial{'s' if self.trials != 1 else ''}"
                 + (f" ({states})" if states else "")]
        if self.confirmation_runs:
            parts.append(f"{self.confirmation_runs} confirmation "
                         f"run{'s' if self.confirmation_runs != 1 else ''}")
        if self.repeats:
            parts.append(f"{self.repeats} repeat{'s' if self.repeats != 1 else ''} of a "
                         "measured config (not launched)")
        if self.cut_short:
            parts.append(f"{self.cut_short} cut short before sampling (not launched)")
        if self.not_launched:
            parts.append(f"{self.not_launched} stopped before launch (re-queued)")
        if self.queued:
            parts.append(f"{self.queued} queued")
        return "; ".join(parts)


def count_trials(trials: Sequence[optuna.trial.FrozenTrial]) -> TrialCounts:
    """The trials counted apart (`TrialCounts`)."""
    by_state = {"complete": 0, "pruned": 0, "failed": 0, "running": 0}
    queued = confirmation_runs = repeats = cut_short = not_launched = rerun = 0
    # A copy still queued has not run yet, and one failed as a repeat never ran.
    retried = {retry_of(t) for t in trials
               if t.state != TrialState.WAITING and not is_repeat(t)}
    for t in trials:
        if confirm_label(t) is not None:
            confirmation_runs += 1
        elif is_repeat(t):
            repeats += 1
        elif is_cut_short(t):
            cut_short += 1
        elif is_stopped_before_launch(t):
            not_launched += 1
        elif t.state == TrialState.WAITING:
            queued += 1
        else:
            record = record_of(t)
            state = (record.state if record is not None else STATE_NAMES[t.state]) \
                if t.state.is_finished() else "running"
            by_state[state] = by_state.get(state, 0) + 1
            rerun += state == "failed" and t.number in retried
    return TrialCounts(by_state, queued, confirmation_runs, repeats, cut_short=cut_short,
                       not_launched=not_launched, rerun=rerun)


def running_trial(study: optuna.Study, storage: optuna.storages.BaseStorage,
                  params: Mapping[str, Any], user_attrs: Mapping[str, Any]) -> optuna.Trial:
    """A new trial of `study`, RUNNING at once with `params` fixed (as `enqueue_trial` fixes
    them) and `user_attrs`: unlike `enqueue_trial` + `ask`, which hands out the oldest WAITING
    trial first, it never takes a trial queued for later (a seed beyond the budget, a retry)."""
    template = optuna.trial.FrozenTrial(
        number=-1, state=TrialState.RUNNING, value=None, values=None,
        datetime_start=datetime.datetime.now(), datetime_complete=None, params={},
        distributions={}, user_attrs=dict(user_attrs),
        system_attrs={"fixed_params": dict(params)}, intermediate_values={}, trial_id=-1)
    trial_id = storage.create_new_trial(storage.get_study_id_from_name(study.study_name),
                                        template_trial=template)
    study.get_trials(deepcopy=False)  # the study's own view of the storage learns the new trial
    return optuna.Trial(study, trial_id)
