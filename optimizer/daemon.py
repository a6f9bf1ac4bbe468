"""The daemon loop: ask Optuna for configs, run them on Ray workers as GPUs allow, prune from
each load level's figures, tell Optuna and log MLflow, until the budget ends or a stop.

One daemon per Optuna study, wherever it is started (a file lock keyed by the storage and the
study name, and for a server RDB a lease in the storage); a restarted daemon fails and
re-queues what the dead one had in flight, reaps its engines, and brings MLflow into agreement
with Optuna.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shlex
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import optuna
from optuna.trial import TrialState

from optimizer import bottleneck, gains, records, recovery_tracking
from optimizer.config import StudyConfig
from optimizer.engines import RunnerSpec
from optimizer.errors import StudyLockedError, WorkerLost
from optimizer.objectives import OBJECTIVES
from optimizer.report import build_report, headline
from optimizer.study import (
    ATTR_BASELINE,
    ATTR_CONFIRM,
    ATTR_CUT_SHORT,
    ATTR_DUPLICATE_OF,
    ATTR_MLFLOW_RUN,
    ATTR_RECORD,
    ATTR_RETRY_OF,
    best_trial,
    engine_config,
    is_search_trial,
    no_baseline_reason,
    objective_values,
    open_study,
    params_of,
    recommended_trial,
    state_of,
)
from optimizer.tracking import Tracker
from optimizer.workers import (
    TrialHandle,
    WorkerPool,
    reap_on_other_nodes,
    wait_any,
)
from runners.base import EngineConfig, Failure, FailureReason, RunResult, StepMetrics
from runners.capacity import meets_slo
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.process import reap_strays
from runners.workload import Workload
from search_spaces import ResolvedSpace

logger = logging.getLogger(__name__)

ATTR_RETRIES = "retries"
ATTR_SEEDED = "seeded"  # enqueued from the study file's seed_trials
STUDY_ATTR_CONFIRM = "confirm"  # the study's user attribute holding the confirmed gain
# A config that failed for one of these reasons fails again: it is never launched twice.
_CONFIG_FAILURES = frozenset({
    FailureReason.OOM_AT_START, FailureReason.KV_CACHE_TOO_SMALL,
    FailureReason.CUDA_GRAPH_CAPTURE, FailureReason.UNSUPPORTED_CONFIG,
    FailureReason.INVALID_ARGUMENT, FailureReason.INFEASIBLE})
# A lost baseline is worth another try when it failed for one of these: they can be one-off
# (a crash, a hang, a slow start on a busy host), and every gain is measured against the
# defaults. Config failures (above) repeat; other trials are not retried for these, as a
# crash there is as likely the config's own doing and a retry costs a whole trial.
_ONE_OFF_FAILURES = frozenset({
    FailureReason.CRASH_MID_RUN, FailureReason.HANG, FailureReason.STARTUP_TIMEOUT,
    FailureReason.STARTUP_CRASH})
# A trial waiting for GPUs that later, smaller trials have overtaken this many times holds the
# next free GPUs: nothing behind it starts until it has (no starving a 2-GPU trial by 1-GPU ones).
MAX_OVERTAKEN = 2
# What a config that cannot run scores, by direction (finite: samplers sort values).
_WORST = {"maximize": 0.0, "minimize": 1e9}
# This many proposals in a row of configs already measured: the sampler has nothing new to offer.
MAX_CONSECUTIVE_DUPLICATES = 200
_STATE_NAMES = {TrialState.COMPLETE: "complete", TrialState.PRUNED: "pruned",
                TrialState.FAIL: "failed"}


@dataclass(frozen=True)
class TrialEvent:
    """What the CLI's progress display is told; the core never draws."""

    kind: Literal["started", "step", "finished", "study"]
    number: int = -1
    params: Mapping[str, Any] = field(default_factory=dict)
    state: str = "running"
    value: float | None = None
    tpot_p99_ms: float | None = None
    message: str = ""
    elapsed_s: float = 0.0
    label: str = ""  # the bottleneck classifier's verdict, once there is one


@dataclass
class _InFlight:
    trial: optuna.Trial
    params: dict[str, Any]
    config: EngineConfig
    handle: TrialHandle
    run_id: str | None  # None while the tracking store refuses writes
    workdir: Path
    started: float
    is_baseline: bool
    retries: int
    steps: list[StepMetrics] = field(default_factory=list)
    pruned_at: int | None = None
    prune_reason: str | None = None


@dataclass
class _Waiting:
    """A trial asked of Optuna whose GPUs are not free yet."""

    trial: optuna.Trial
    params: dict[str, Any]
    config: EngineConfig
    overtaken: int = 0  # later trials launched while this one waited


@dataclass(frozen=True)
class DaemonSummary:
    finished: int  # trials finished by this daemon run
    total_finished: int  # in the whole study
    stopped_early: bool  # by a signal or `nightshift stop`
    best_number: int | None
    best_values: list[float] | None
    no_baseline: str = ""  # why the defaults could not be measured, when they could not


LOCK_DIR = Path.home() / ".cache" / "nightshift" / "locks"  # for storages not in a local file


def is_local_file_storage(url: str) -> bool:
    """Whether the storage is a SQLite file on this machine (its lock file sits beside it)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # SQLAlchemy's parse errors vary by version; the storage check reports
        return False
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    return bool(database) and database != ":memory:" and not str(database).startswith("file:")


def study_lock_path(cfg: StudyConfig) -> Path:
    """The lock file of one Optuna study: keyed by the storage and the study name, not by the
    directory the daemon is started from (two daemons on one study fail each other's trials).
    A SQLite storage keeps it next to its database file; a server RDB (postgresql, mysql)
    under LOCK_DIR, named by a hash of the URL and the name: that covers daemons on this host,
    and a `StorageLease` those on others."""
    from sqlalchemy.engine import make_url

    name = cfg.name
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    if slug != name:  # two names that sanitise alike must not share a lock
        slug += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    if is_local_file_storage(cfg.storage_url):
        db = Path(str(make_url(cfg.storage_url).database)).expanduser().resolve()
        return db.parent / f"{db.name}.{slug}.lock"
    digest = hashlib.sha256(f"{cfg.storage_url}\0{name}".encode()).hexdigest()[:16]
    return LOCK_DIR / f"{slug}-{digest}.lock"


class StudyLock:
    """An exclusive `flock` on the study's lock file (`study_lock_path`), holding the daemon's
    pid and host for `status` and `stop`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, study: str, storage: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = read_lock(self.path) or {}
            raise StudyLockedError(
                f"study {study!r} is already run by pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (started in {holder.get('cwd', '?')}, lock "
                f"{self.path}); `nightshift stop` it first or give this study another "
                "name or storage.") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.time(), "study": study,
                                 "storage": _without_password(storage),
                                 "cwd": os.getcwd()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


LEASE_ATTR = "nightshift.daemon"  # the study's system attribute naming the daemon that runs it
LEASE_TTL_S = 60.0  # a lease not renewed for this long is a dead daemon's
LEASE_SETTLE_S = 1.0  # after writing a lease, re-read it this much later: two starts race


class StorageLease:
    """The lock of a study in a server RDB (postgresql, mysql), shared by daemons on several
    hosts: a study system attribute naming the holder (host, pid, a random token) with a
    heartbeat a thread renews every LEASE_TTL_S / 4. A lease not renewed for LEASE_TTL_S is a
    dead daemon's and is taken over (hosts' clocks must agree within that). Two starts racing
    for a free lease both write and re-read it LEASE_SETTLE_S later: the last writer holds it,
    the other refuses."""

    def __init__(self, study: optuna.Study, name: str) -> None:
        self.study = study
        self.name = name
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.is_lost = False  # another daemon took the lease (this one stalled past the TTL)

    def _read(self) -> dict[str, Any]:
        attrs = self.study._storage.get_study_system_attrs(self.study._study_id)
        lease = attrs.get(LEASE_ATTR)
        return lease if isinstance(lease, dict) else {}

    def _write(self, lease: Mapping[str, Any]) -> None:
        self.study._storage.set_study_system_attr(self.study._study_id, LEASE_ATTR, dict(lease))

    def _refuse(self, holder: Mapping[str, Any]) -> StudyLockedError:
        return StudyLockedError(
            f"study {self.name!r} is already run by pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')} (its lease in the storage was renewed "
            f"{max(0.0, time.time() - float(holder.get('heartbeat', 0))):.0f} s ago); "
            "`nightshift stop` it first or give this study another name or storage.")

    def acquire(self) -> None:
        holder = self._read()
        if holder.get("token") and time.time() - float(holder.get("heartbeat", 0)) < LEASE_TTL_S:
            raise self._refuse(holder)
        mine = {"token": self.token, "pid": os.getpid(), "host": socket.gethostname(),
                "started": time.time(), "heartbeat": time.time()}
        self._write(mine)
        time.sleep(LEASE_SETTLE_S)
        holder = self._read()
        if holder.get("token") != self.token:
            raise self._refuse(holder)
        self._thread = threading.Thread(target=self._renew, args=(mine,), daemon=True,
                                        name="nightshift-lease")
        self._thread.start()

    def _renew(self, mine: dict[str, Any]) -> None:
        while not self._stop.wait(LEASE_TTL_S / 4):
            try:
                if self._read().get("token") != self.token:
                    self.is_lost = True
                    logger.error("another daemon took study %r's lease (this one was not "
                                 "heard from for %g s); stopping", self.name, LEASE_TTL_S)
                    return
                self._write({**mine, "heartbeat": time.time()})
            except Exception as exc:  # a storage hiccup: the next beat tries again
                logger.warning("could not renew the study's lease (%s: %s)",
                               type(exc).__name__, str(exc)[:200])

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            if self._read().get("token") == self.token:
                self._write({})
        except Exception as exc:  # the lease then runs out after LEASE_TTL_S
            logger.warning("could not release the study's lease (%s: %s)",
                           type(exc).__name__, str(exc)[:200])


def read_lease(study: optuna.Study) -> dict[str, Any] | None:
    """The daemon holding a study's lease in the storage, or None when no live one does."""
    attrs = study._storage.get_study_system_attrs(study._study_id)
    lease = attrs.get(LEASE_ATTR)
    if not isinstance(lease, dict) or not lease.get("token") or \
            time.time() - float(lease.get("heartbeat", 0)) >= LEASE_TTL_S:
        return None
    return lease


def _without_password(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: keep nothing of it
        return ""


def read_lock(path: Path) -> dict[str, Any] | None:
    """The running daemon's record, or None when no daemon holds the lock."""
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text()
            try:
                data = json.loads(text) if text else {}
            except json.JSONDecodeError:
                data = {}
            return data if isinstance(data, dict) else {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class Daemon:
    """Runs one study to its budget. Not thread-safe: `request_stop` is the only method another
    thread (or a signal handler) may call."""

    def __init__(self, cfg: StudyConfig, *, space: ResolvedSpace, runner: RunnerSpec,
                 total_gpus: int, tracker: Tracker, workload: Workload,
                 study_params: Mapping[str, Any], study_artifacts: Mapping[str, Any],
                 on_event: Callable[[TrialEvent], None] | None = None,
                 hardware: HardwareProfile | None = None, model: ModelInfo | None = None,
                 poll_s: float = 0.25,
                 seed_trials: Sequence[Mapping[str, Any]] = (),
                 max_gpus_per_node: int | None = None) -> None:
        self.cfg = cfg
        self.space = space
        self.runner = runner
        self.total_gpus = total_gpus
        self.tracker = tracker
        self.workload = workload
        self.study_params = study_params
        self.study_artifacts = study_artifacts
        self.on_event = on_event or (lambda event: None)
        self.hardware = hardware  # for the roofline of the bottleneck classifier
        self.model = model
        self.poll_s = poll_s
        self.seed_trials = list(seed_trials)  # full configs, enqueued after the baseline
        self.max_gpus_per_node = max_gpus_per_node or total_gpus  # a trial's GPUs share a node
        self._stop: Literal["no", "finish", "now"] = "no"
        self._inflight: list[_InFlight] = []
        self._finished_here = 0
        self._started = time.monotonic()
        self._parent_run = ""
        self._waiting: list[_Waiting] = []  # asked, in order, waiting for their GPUs
        # Measured before the defaults were: recorded once the defaults are, so that every
        # conclusion compares its trial with them (`_collect`).
        self._deferred: list[tuple[_InFlight, RunResult]] = []
        self._measured: dict[str, int] = {}  # config key -> the finished trial that holds it
        self._duplicates_in_a_row = 0
        self._is_exhausted = False
        self._lease: StorageLease | None = None  # the study's lock in a server RDB

    # -- control ----------------------------------------------------------------------------

    def request_stop(self, now: bool = False) -> None:
        """First call: finish the trials in flight, start none. `now=True` (or a second call):
        fail the trials in flight at once (they are re-queued on resume)."""
        self._stop = "now" if now or self._stop != "no" else "finish"

    @property
    def stopping(self) -> bool:
        return self._stop != "no"

    # -- main loop --------------------------------------------------------------------------

    def run(self) -> DaemonSummary:
        lock = StudyLock(study_lock_path(self.cfg))
        lock.acquire(self.cfg.name, self.cfg.storage_url)
        try:
            study = open_study(self.cfg)
            if not is_local_file_storage(self.cfg.storage_url):  # daemons on other hosts
                lease = StorageLease(study, self.cfg.name)
                lease.acquire()
                self._lease = lease
            killed = reap_strays(self.registry_dir)
            if killed:
                logger.warning("reaped %d engine processes left by a dead daemon: %s",
                               len(killed), killed)
            for node_id, pids in reap_on_other_nodes(self.registry_dir).items():
                logger.warning("reaped %d engine processes left by a dead daemon on node %s: "
                               "%s", len(pids), node_id[:12], pids)
            self._parent_run = self.tracker.start_study(
                self.cfg.name, params=self.study_params, artifacts=self.study_artifacts)
            self._recover(study)
            for frozen in study.get_trials(deepcopy=False):
                self._remember(frozen.number, frozen.user_attrs.get(ATTR_RECORD))
            # On every start, not just the first: a daemon killed between these writes left
            # some seeds out, and a seed added to the study file since runs on resume.
            if not any(ATTR_BASELINE in t.user_attrs for t in study.get_trials(deepcopy=False)):
                study.enqueue_trial(self.space.defaults(), user_attrs={ATTR_BASELINE: True})
            for params in self.seed_trials:
                study.enqueue_trial(dict(params), user_attrs={ATTR_SEEDED: True},
                                    skip_if_exists=True)
            pool = WorkerPool(self.runner, self.total_gpus,
                              accelerator_type=self.cfg.spec.ray.accelerator_type,
                              resources=self.cfg.spec.ray.resources)
            try:
                self._loop(study, pool)
                if not self.stopping:
                    self._confirm(study, pool)
            finally:
                for item in list(self._inflight):  # an exception escaped: fail, never orphan
                    self._cancel_and_collect(study, item, pool)
                self._record_deferred(study, force=True)
                self._release_waiting(study)
                pool.shutdown()
                # Every trial was collected, so an engine still recorded has no worker left (Ray
                # went down under it, as a killed driver takes its local cluster): end it now
                # rather than at the next start.
                orphans = reap_strays(self.registry_dir)
                if orphans:
                    logger.warning("reaped %d engine processes whose workers were gone: %s",
                                   len(orphans), orphans)
            return self._finish(study)
        finally:
            if self._lease is not None:
                self._lease.release()
                self._lease = None
            lock.release()

    @property
    def registry_dir(self) -> Path:
        return self.runner.registry_dir

    def _loop(self, study: optuna.Study, pool: WorkerPool) -> None:
        while True:
            if self._lease is not None and self._lease.is_lost:
                self.request_stop(now=True)  # another daemon runs the study now
            if self._stop == "now":
                for item in list(self._inflight):
                    self._cancel_and_collect(study, item, pool)
            if not self.stopping:
                self._dispatch(study, pool)
            if not self._inflight and (self.stopping or not self._budget_left(study)):
                self._record_deferred(study, force=True)
                return
            self._poll_steps(study)
            if not self._inflight:
                time.sleep(self.poll_s)
                continue
            ended = wait_any([item.handle for item in self._inflight], self.poll_s)
            for item in [i for i in self._inflight if i.handle in ended]:
                self._poll_steps(study)  # steps that arrived just before the result
                self._collect(study, item, pool)

    # -- the final comparison ---------------------------------------------------------------

    def _confirm(self, study: optuna.Study, pool: WorkerPool) -> None:
        """Measure the recommended config (what `export` writes: the best, or the simplest
        within noise of it) and the defaults again, one at a time and interleaved (defaults,
        best, defaults, best, ...), so drift in the machine hits both alike; state the gain as
        the mean of the per-round ratios with a 95% confidence interval."""
        rounds = self.cfg.spec.confirm_rounds
        best = recommended_trial(study)
        trials = study.get_trials(deepcopy=False)
        baseline = next((t for t in trials if t.user_attrs.get(ATTR_BASELINE)
                         and t.state == TrialState.COMPLETE), None)
        if not rounds or self.cfg.is_multi_objective or best is None or baseline is None or \
                best.number == baseline.number or ATTR_CONFIRM in best.user_attrs:
            return
        if study.user_attrs.get(STUDY_ATTR_CONFIRM):
            return  # a resumed study that was confirmed already
        logger.info("confirming: trial %d (best) vs trial %d (defaults), %d interleaved rounds",
                    best.number, baseline.number, rounds)
        pairs: list[dict[str, float]] = []
        for _ in range(rounds):
            values: dict[str, float] = {}
            for label, source in (("defaults", baseline), ("best", best)):
                if self.stopping:
                    return
                study.enqueue_trial(params_of(source), user_attrs={ATTR_CONFIRM: label})
                trial = study.ask()
                sampled = self.space.sample(trial)
                self._launch(study, pool, trial, sampled,
                             engine_config(self.cfg, self.space.to_flags(sampled)))
                while self._inflight:  # one at a time: the interleaving is the point
                    self._poll_steps(study)
                    for item in [i for i in self._inflight
                                 if i.handle in wait_any([i.handle], self.poll_s)]:
                        self._poll_steps(study)
                        self._collect(study, item, pool)
                    if self._stop == "now":
                        for item in list(self._inflight):
                            self._cancel_and_collect(study, item, pool)
                measured = study.get_trials(deepcopy=False)[trial.number]
                if measured.state != TrialState.COMPLETE or not measured.values:
                    logger.warning("confirmation run %d failed; the comparison stops",
                                   trial.number)
                    return
                values[label] = float(measured.values[0])
            pairs.append(values)
        summary = confirm_summary(self.cfg.objectives[0], best.number, baseline.number, pairs)
        study.set_user_attr(STUDY_ATTR_CONFIRM, summary)
        logger.info("re-measured against the defaults: %s", summary["sentence"])

    def _budget_left(self, study: optuna.Study) -> bool:
        if self._is_exhausted:
            return False
        budget = self.cfg.spec.budget
        if budget.wall_hours is not None and \
                time.monotonic() - self._started >= budget.wall_hours * 3600:
            return False
        if budget.trials is not None:
            trials = study.get_trials(deepcopy=False)
            # A failure lost to infrastructure and re-queued does not count: its re-run does;
            # nor does a repeat of a measured config, which cost nothing.
            requeued = {t.user_attrs.get(ATTR_RETRY_OF) for t in trials}
            done = sum(1 for t in trials if t.state.is_finished() and t.number not in requeued
                       and is_search_trial(t))
            return done + len(self._inflight) + len(self._waiting) + len(self._deferred) < \
                budget.trials
        return True

    def _max_parallel(self) -> int:
        return self.cfg.spec.max_parallel_trials or self.total_gpus

    def _max_waiting(self) -> int:
        """How many asked trials may wait for GPUs at once: enough to find one that fits the
        GPUs left free (on 2 GPUs most configs of a space need both), few enough that the
        sampler is not asked far ahead of what it has learnt."""
        return 2 * self._max_parallel()

    def _dispatch(self, study: optuna.Study, pool: WorkerPool) -> None:
        """Start every waiting trial whose GPUs are free, in the order asked, and ask for more
        while GPUs stay free: a trial that needs more GPUs than are free does not hold back one
        that fits (a trial that can never fit was refused in `_ask`). One overtaken
        MAX_OVERTAKEN times reserves the GPUs: nothing behind it starts, nothing more is asked,
        until it has started."""
        while len(self._inflight) < self._max_parallel():
            if self._start_waiting(study, pool):
                continue
            if not pool.can_start(1) or len(self._waiting) >= self._max_waiting() or \
                    any(w.overtaken >= MAX_OVERTAKEN for w in self._waiting) or \
                    not self._budget_left(study):
                return
            asked = self._ask(study)  # None: rejected before launch or a repeat; ask again
            if asked is not None:
                self._waiting.append(asked)

    def _start_waiting(self, study: optuna.Study, pool: WorkerPool) -> bool:
        """Launch the first waiting trial whose GPUs are free; whether one was."""
        for index, waiting in enumerate(self._waiting):
            if waiting.config.num_gpus > pool.total_gpus:  # a node died while it waited
                del self._waiting[index]
                self._tell_without_run(study, waiting.trial, waiting.params, Failure(
                    FailureReason.NODE_LOST,
                    f"it needs {waiting.config.num_gpus} GPUs but the cluster has "
                    f"{pool.total_gpus} left after a node died; not re-queued."))
                return True
            if pool.can_start(waiting.config.num_gpus):
                del self._waiting[index]
                for earlier in self._waiting[:index]:
                    earlier.overtaken += 1
                self._launch(study, pool, waiting.trial, waiting.params, waiting.config)
                return True
            if waiting.overtaken >= MAX_OVERTAKEN:
                return False  # it holds the next free GPUs
        return False

    def _ask(self, study: optuna.Study) -> _Waiting | None:
        trial = study.ask()
        params = self.space.sample(trial)
        key = _config_key(params)
        earlier = self._measured.get(key)
        if earlier is None:
            earlier = self._unfinished_with(study, key, trial.number)
        if earlier is not None and ATTR_CONFIRM not in trial.user_attrs:
            self._tell_duplicate(study, trial, params, earlier)
            return None
        self._duplicates_in_a_row = 0
        config = engine_config(self.cfg, self.space.to_flags(params))
        problems = list(self.space.check(params))
        if config.num_gpus > self.total_gpus:
            problems.append(f"needs {config.num_gpus} GPUs but the cluster has "
                            f"{self.total_gpus}")
        elif config.num_gpus > self.max_gpus_per_node:
            problems.append(f"needs {config.num_gpus} GPUs on one node but the largest node of "
                            f"the cluster has {self.max_gpus_per_node}")
        memory = bottleneck.memory_problem(config, self.hardware, self.model)
        if memory is not None:
            problems.append(memory)
        if problems:
            failure = Failure(FailureReason.INFEASIBLE, "; ".join(problems))
            self._tell_without_run(study, trial, params, failure)
            return None
        return _Waiting(trial, params, config)

    def _unfinished_with(self, study: optuna.Study, key: str, asking: int) -> int | None:
        """The trial that already holds this config and has not finished: in flight, asked and
        waiting for GPUs, or queued in the storage (a retry, a seed, the defaults). A config is
        launched at most once per study, whatever stage its first trial is at."""
        for item in [*self._inflight, *(held for held, _ in self._deferred)]:
            if _config_key(item.params) == key:
                return item.trial.number
        for waiting in self._waiting:
            if _config_key(waiting.params) == key:
                return waiting.trial.number
        for queued in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            fixed = queued.system_attrs.get("fixed_params")
            if queued.number != asking and fixed and _config_key(fixed) == key and \
                    ATTR_CONFIRM not in queued.user_attrs:
                return queued.number
        return None

    def _remember(self, number: int, record: Mapping[str, Any] | None) -> None:
        """Keep a finished trial's config (as sampled, fixed params included) if its outcome
        would repeat: a measurement, a prune, or a failure the config causes (not one lost to
        infrastructure)."""
        params = (record or {}).get("params")
        if not record or not params:
            return
        state, reason = record.get("state"), record.get("failure_reason")
        if state in ("complete", "pruned") or (state == "failed" and reason in _CONFIG_FAILURES):
            self._measured.setdefault(_config_key(params), number)

    def _tell_duplicate(self, study: optuna.Study, trial: optuna.Trial,
                        params: dict[str, Any], earlier: int) -> None:
        """The sampler proposed (or the queue held) a config another trial holds: launch
        nothing. A measured original's outcome is reused: the trial tells the sampler the same
        value (so TPE keeps learning). One still queued or running has no outcome yet: the
        repeat fails (the sampler already sees the original as running). Either way it counts
        for no budget; a long run of them ends the study, the space being exhausted."""
        frozen = study.get_trials(deepcopy=False)[earlier]
        if frozen.state.is_finished():
            record = dict(frozen.user_attrs.get(ATTR_RECORD) or {})
            record["conclusion"] = (f"same config as trial {earlier}: not launched again; its "
                                    f"outcome stands ({record.get('state')}).")
            for key in ("engine_started_unix_s", "engine_ended_unix_s"):
                record.pop(key, None)  # no engine of its own ran
        else:
            stage = "queued" if frozen.state == TrialState.WAITING else "in flight"
            record = records.failed_record(
                params, "duplicate", f"trial {earlier} holds this config ({stage}).",
                f"same config as trial {earlier}, {stage}: not launched; trial {earlier} "
                "measures it.")
        record["is_baseline"] = False
        trial.set_user_attr(ATTR_RECORD, record)
        trial.set_user_attr(ATTR_DUPLICATE_OF, earlier)
        for key, value in frozen.constraints.items():
            trial.set_constraint(key, value)
        if not frozen.state.is_finished():
            study.tell(trial, state=TrialState.FAIL)
        elif frozen.state == TrialState.COMPLETE and frozen.values is not None:
            study.tell(trial, frozen.values)
        else:
            study.tell(trial, state=frozen.state)
        self._duplicates_in_a_row += 1
        if self._duplicates_in_a_row >= MAX_CONSECUTIVE_DUPLICATES:
            self._is_exhausted = True
            logger.warning("the sampler proposed %d measured configs in a row: the space is "
                           "exhausted; the study ends", self._duplicates_in_a_row)
        logger.debug("trial %d repeats trial %d: not launched", trial.number, earlier)

    def _launch(self, study: optuna.Study, pool: WorkerPool, trial: optuna.Trial,
                params: dict[str, Any], config: EngineConfig) -> None:
        attrs = trial.user_attrs
        run_id = self._open_run(trial, {**params, "launch.model": config.model})
        workdir = (self.cfg.results_dir / "trials" / f"{trial.number:04d}").resolve()
        handle = pool.submit(config, self.workload, workdir)
        item = _InFlight(trial, params, config, handle, run_id, workdir, time.monotonic(),
                         bool(attrs.get(ATTR_BASELINE)), int(attrs.get(ATTR_RETRIES, 0)))
        self._inflight.append(item)
        logger.info("trial %d started: params=%s", trial.number, params)
        self.on_event(TrialEvent("started", trial.number, self._changed(config)))

    # -- steps and pruning ------------------------------------------------------------------

    def _poll_steps(self, study: optuna.Study) -> None:
        for item in list(self._inflight):
            try:
                steps = item.handle.poll()
            except WorkerLost:
                continue  # the result will tell what happened
            for step in steps:
                item.steps.append(step)
                stop = self._should_prune(study, item, step)
                if stop:
                    item.pruned_at = step.step
                item.handle.decide(step.step, stop)
                values = objective_values(self.cfg.objectives, item.steps)
                self.on_event(TrialEvent(
                    "step", item.trial.number, self._changed(item.config),
                    "pruning" if stop else "running", values[0] if values else None,
                    step.metrics.p99_tpot_ms, f"level {step.step} ({step.level.label})",
                    time.monotonic() - item.started))

    def _should_prune(self, study: optuna.Study, item: _InFlight, step: StepMetrics) -> bool:
        if self.cfg.is_multi_objective or item.is_baseline or \
                ATTR_CONFIRM in item.trial.user_attrs:
            return False  # Optuna prunes single-objective only; these always complete
        values = objective_values(self.cfg.objectives, item.steps)
        if values is None:
            return False
        item.trial.report(values[0], step.step)
        if step.step >= len(self.workload.levels) - 1 or self.workload.capacity is not None:
            # The last level: stopping now saves nothing. A capacity search's probes are at
            # loads of its own, not comparable between trials.
            return False
        m = step.metrics
        if m.request_goodput is not None and m.request_throughput > 0 and \
                m.request_goodput >= 0.95 * m.request_throughput:
            # Every request met the SLO: this load is below the trial's capacity, where configs
            # differ by latency, not by what they can serve (two replicas look like one at a
            # light load). Judge it where it saturates.
            return False
        # The pruner reads the verdict the trial stores (BottleneckPruner): classify first.
        verdict = self._verdict(study, item.steps, item.config)
        item.trial.set_user_attr(bottleneck.ATTR_VERDICT, verdict.as_user_attr(
            tensor_parallel_size=item.config.tensor_parallel_size,
            objective_value=values[0], step=step.step))
        if not item.trial.should_prune():
            return False
        frozen = next(t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                      if t.number == item.trial.number)
        explain = getattr(study.pruner, "explain", None)
        item.prune_reason = (explain(study, frozen) if explain else None) or \
            f"{self.cfg.objectives[0]} {values[0]:.3g} below the median of earlier trials"
        logger.info("trial %d pruned at step %d: %s params=%s", item.trial.number, step.step,
                    item.prune_reason, item.params)
        return True

    def _verdict(self, study: optuna.Study, steps: Any, config: EngineConfig,
                 result: RunResult | None = None) -> bottleneck.Verdict:
        """Classify a trial from what it has measured so far (or its whole result)."""
        measured = [s for s in (result.steps if result else steps) if s.metrics.completed > 0]
        tp1 = self._tp1_tpot_ms(study, measured[-1].step) if measured and \
            config.tensor_parallel_size > 1 else None
        evidence = bottleneck.evidence_from(result if result is not None else steps, config,
                                            self.hardware, self.model, tp1_tpot_ms=tp1)
        return bottleneck.classify(evidence)

    def _step_records(self, steps: Any, config: EngineConfig) -> list[dict[str, Any]]:
        """Each level's record, with its step-mix roofline (`roofline.*`, `vllm_mfu.*`): the
        per-level figures MLflow logs at step = level."""
        out = records.step_records(steps)
        for record, figures in zip(out, bottleneck.level_metrics(steps, config, self.hardware,
                                                                  self.model), strict=True):
            record["metrics"].update(figures)
        return out

    @staticmethod
    def _tp1_tpot_ms(study: optuna.Study, step_index: int) -> float | None:
        """The best median TPOT at this load level among finished TP=1 trials: what a TP>1
        trial must beat for its split to be worth the communication."""
        best: float | None = None
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            record = t.user_attrs.get(ATTR_RECORD) or {}
            if int((record.get("flags") or {}).get("tensor_parallel_size") or 1) != 1:
                continue
            for s in record.get("steps") or []:
                tpot = (s.get("metrics") or {}).get("median_tpot_ms")
                if s.get("step") == step_index and tpot and (best is None or tpot < best):
                    best = float(tpot)
        return best

    # -- results ----------------------------------------------------------------------------

    def _collect(self, study: optuna.Study, item: _InFlight, pool: WorkerPool) -> None:
        self._inflight.remove(item)
        result = item.handle.result()
        is_lost = result.failure is not None and result.failure.reason in (
            FailureReason.WORKER_LOST, FailureReason.NODE_LOST, FailureReason.INTERNAL)
        pool.release(item.handle.actor, healthy=not is_lost)
        if result.failure is not None and result.failure.reason == FailureReason.NODE_LOST:
            self.total_gpus = pool.shrink_to_live()
            logger.warning("trial %d: a cluster node died; %d GPUs left", item.trial.number,
                           self.total_gpus)
            if self.total_gpus < 1:
                logger.error("no GPU is left in the Ray cluster; stopping (resume with "
                             "`nightshift start` once nodes are back)")
                self.request_stop()
        if is_lost:  # the worker died; its engine, in a session of its own, did not
            reaped = reap_strays(self.registry_dir, under=item.workdir)
            if reaped:
                logger.warning("trial %d: reaped engines %s of its dead worker",
                               item.trial.number, reaped)
        if is_lost and not result.steps:
            result = RunResult(status="failed", steps=tuple(item.steps), failure=result.failure)
        if result.trace_data is not None and result.trace_path is not None and \
                not result.trace_path.is_file():
            # The worker ran on another machine: its trimmed trace came back through Ray.
            local = item.workdir / result.trace_path.name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(result.trace_data)
            result = replace(result, trace_path=local)
        if not item.is_baseline and ATTR_CONFIRM not in item.trial.user_attrs and \
                self._baseline_pending(study):
            # Trials run beside the defaults and may end first: held until the defaults are
            # measured, so its conclusion (Optuna, MLflow, the report) compares it with them.
            logger.info("trial %d measured; recorded once the defaults are", item.trial.number)
            self._deferred.append((item, result))
            return
        self._record(study, item, result)
        self._record_deferred(study)

    def _baseline_pending(self, study: optuna.Study) -> bool:
        """Whether this run is still to measure the defaults: in flight, waiting for GPUs, or
        queued (a retry included)."""
        if records.baseline_trial(study) is not None:
            return False
        return any(i.is_baseline for i in self._inflight) or \
            any(ATTR_BASELINE in w.trial.user_attrs for w in self._waiting) or \
            any(ATTR_BASELINE in t.user_attrs
                for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def _record_deferred(self, study: optuna.Study, *, force: bool = False) -> None:
        """Record the trials held for the defaults once they are measured (or can no longer
        be: then their conclusions say there is no defaults measurement); `force` when the
        run ends with the defaults still queued."""
        if not self._deferred or (self._baseline_pending(study) and not force):
            return
        held, self._deferred = self._deferred, []
        for item, result in held:
            self._record(study, item, result)

    def _cancel_and_collect(self, study: optuna.Study, item: _InFlight, pool: WorkerPool) -> None:
        item.handle.cancel()
        pool.release(item.handle.actor, healthy=False)
        self._inflight.remove(item)
        again = "it is re-queued" if _requeueable(item.trial.user_attrs) \
            else "the confirmation runs whole again"
        result = RunResult(status="failed", steps=tuple(item.steps), failure=Failure(
            FailureReason.INTERRUPTED,
            f"the daemon was stopped with this trial in flight; {again} on resume."))
        self._record(study, item, result)

    def _record(self, study: optuna.Study, item: _InFlight, result: RunResult) -> None:
        state = state_of(result)
        values = objective_values(self.cfg.objectives, result.steps) \
            if state == TrialState.COMPLETE else None
        failure = result.failure
        if state == TrialState.COMPLETE and values is None:
            state, failure = TrialState.FAIL, Failure(
                FailureReason.TOO_MANY_ERRORS, "no load level completed a request.")
        state_name = _STATE_NAMES[state]
        primary = values[0] if values else None
        if state == TrialState.PRUNED and item.steps:
            pruned_values = objective_values(self.cfg.objectives, item.steps)
            primary = pruned_values[0] if pruned_values else None
        metrics = records.summary_metrics(result, self.cfg.objectives)
        objective_spread = metrics.get(f"spread.{self.cfg.objectives[0]}")
        is_unstable = objective_spread is not None and \
            objective_spread > self.cfg.spec.workload.max_spread
        verdict = None
        if result.steps:
            verdict = self._verdict(study, result.steps, item.config, result)
            metrics.update(verdict.as_metrics())
        search = self.cfg.spec.workload.capacity
        axis = search.axis if search is not None else None
        told = records.conclude(
            params=item.params, state=state_name, objective=self.cfg.objectives[0],
            value=primary, failure_reason=failure.reason.value if failure else None,
            failure_message=failure.message if failure else None,
            is_baseline=item.is_baseline, number=item.trial.number,
            best=records.reference_of(best_trial(study), axis),
            baseline=records.reference_of(records.baseline_trial(study), axis),
            vllm_defaults=self.space.vllm_defaults, capacity=result.capacity,
            tolerance=search.tolerance if search is not None else None,
            pruned_at=item.pruned_at, prune_reason=item.prune_reason,
            verdict=verdict if state != TrialState.FAIL else None,
            confirm_label=item.trial.user_attrs.get(ATTR_CONFIRM),
            note=(f"Unstable: its {self.cfg.objectives[0]} varied {objective_spread:.0%} "
                  f"across {self.workload.repeats} repeats (limit "
                  f"{self.cfg.spec.workload.max_spread:.0%}); re-measure before trusting it."
                  if is_unstable and objective_spread is not None else ""))
        conclusion = told.text
        record = {
            "state": state_name,
            "params": item.params,
            "flags": dict(item.config.flags),
            "values": values,
            "metrics": metrics,
            "steps": self._step_records(result.steps, item.config),
            "failure_reason": failure.reason.value if failure else None,
            "failure_message": failure.message if failure else None,
            "conclusion": conclusion,
            "conclusion_short": told.short,
            "capacity": result.capacity.to_dict() if result.capacity is not None else None,
            "argv": list(result.argv),
            "env": dict(result.env),
            "engine": asdict(result.engine),
            "verdict": verdict.as_user_attr() if verdict is not None else None,
            "wall_s": result.wall_s,
            # The engine process's life (Unix s): which trials really ran side by side.
            "engine_started_unix_s": result.engine_started_unix_s,
            "engine_ended_unix_s": result.engine_ended_unix_s,
            "is_baseline": item.is_baseline,
            "host": result.host,
            "is_unstable": is_unstable,
        }
        item.trial.set_user_attr(ATTR_RECORD, record)
        self._remember(item.trial.number, record)
        if state == TrialState.COMPLETE and self._has_slo:
            # The sampler learns where configs miss the SLO at every load: infeasible for
            # Optuna's constrained TPE (and never the study's best while one meets it).
            met = any(s.meets_slo if s.meets_slo is not None else
                      meets_slo(s.metrics, self.workload.slo, self.workload.max_failed_fraction,
                                s.server_metrics.get("is_saturated", 0.0) > 0)
                      for s in result.steps if s.metrics.completed > 0)
            item.trial.set_constraint("slo", 0.0 if met else 1.0)
        if state == TrialState.COMPLETE:
            study.tell(item.trial, values)
        elif failure is not None and failure.reason in _CONFIG_FAILURES:
            self._tell_config_failure(study, item.trial)
        else:
            study.tell(item.trial, state=state)
        self._finished_here += 1
        self._close_run(item.trial.number, item.run_id, tracking_payload(record, result))
        if failure is not None and item.retries < self.cfg.spec.retries and (
                failure.is_retryable or
                (item.is_baseline and failure.reason in _ONE_OFF_FAILURES)) \
                and self._requeue(study, item.trial.number, item.params,
                                  item.trial.user_attrs, item.retries + 1):
            logger.info("trial %d re-queued after %s%s", item.trial.number, failure.reason,
                        " (the defaults: every gain is measured against them)"
                        if item.is_baseline and not failure.is_retryable else "")
        logger.info("trial %d %s: %s params=%s", item.trial.number, state_name, conclusion,
                    item.params)
        self.on_event(TrialEvent("finished", item.trial.number, self._changed(item.config),
                                 state_name, primary,
                                 metrics.get("p99_tpot_ms"), told.short,
                                 time.monotonic() - item.started,
                                 verdict.label if verdict is not None else ""))

    def _release_waiting(self, study: optuna.Study) -> None:
        """Trials asked but never launched (they waited for GPUs) must not stay RUNNING: fail
        them without a run and queue their params again for the resume."""
        waiting, self._waiting = self._waiting, []
        for item in waiting:
            failure = Failure(FailureReason.INTERRUPTED,
                              "the daemon stopped before this trial was launched; re-queued.")
            attrs = dict(item.trial.user_attrs)
            self._tell_without_run(study, item.trial, item.params, failure)
            self._requeue(study, item.trial.number, item.params, attrs,
                          int(attrs.get(ATTR_RETRIES, 0)))

    def _tell_config_failure(self, study: optuna.Study, trial: optuna.Trial) -> None:
        """A config that cannot run (OOM, graph capture, unsupported, infeasible) teaches the
        sampler: Optuna's TPE ignores FAIL trials, so it is told as a complete trial with the
        worst value and a violated constraint (never the best, and avoided). Its record keeps
        `state: failed` for every reader of ours."""
        trial.set_constraint("runs", 1.0)
        if self._has_slo:
            trial.set_constraint("slo", 1.0)
        study.tell(trial, [_WORST[OBJECTIVES[o].direction] for o in self.cfg.objectives])

    @property
    def _has_slo(self) -> bool:
        slo = self.workload.slo
        return any(v is not None for v in (slo.ttft_p99_ms, slo.tpot_p99_ms, slo.e2el_ms))

    def _changed(self, config: EngineConfig) -> dict[str, Any]:
        """The flags a trial sets beyond vLLM's defaults and the study's fixed flags."""
        return {k: v for k, v in config.flags.items() if k not in self.cfg.engine_fixed_flags}

    def _tell_without_run(self, study: optuna.Study, trial: optuna.Trial,
                          params: dict[str, Any], failure: Failure) -> None:
        conclusion = f"rejected before launch ({failure.reason.value}): {failure.message}"
        record = records.failed_record(params, failure.reason.value, failure.message,
                                       conclusion)
        trial.set_user_attr(ATTR_RECORD, record)
        self._remember(trial.number, record)
        run_id = self._open_run(trial, params)
        if failure.reason in _CONFIG_FAILURES:
            self._tell_config_failure(study, trial)
        else:
            study.tell(trial, state=TrialState.FAIL)
        self._close_run(trial.number, run_id, tracking_payload(record, None))
        logger.info("trial %d %s", trial.number, conclusion)
        self.on_event(TrialEvent("finished", trial.number, params, "failed", None, None,
                                 conclusion))

    # -- tracking: MLflow may fail; Optuna keeps the truth and a resume catches MLflow up --

    def _open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        try:
            run_id = self.tracker.start_trial(self._parent_run, self.cfg.name, trial.number,
                                              params)
        except Exception as exc:  # any store error: the study must go on
            self._tracking_failed("start_trial", trial.number, exc)
            return None
        trial.set_user_attr(ATTR_MLFLOW_RUN, run_id)
        return run_id

    def _close_run(self, number: int, run_id: str | None, payload: Mapping[str, Any]) -> None:
        """Log a finished trial. A failure leaves its run RUNNING (or absent), which the next
        resume's `_recover` replays from the record in Optuna."""
        if run_id is None:
            return
        try:
            self.tracker.finish_trial(run_id, **payload)
        except Exception as exc:  # any store error: the study must go on
            self._tracking_failed("finish_trial", number, exc)

    def _tracking_failed(self, action: str, number: int, exc: Exception) -> None:
        logger.warning("trial %d: MLflow %s failed (%s: %s); the trial is kept in Optuna and "
                       "logged to MLflow on the next resume", number, action,
                       type(exc).__name__, str(exc)[:200])

    # -- resume -----------------------------------------------------------------------------

    def _recover(self, study: optuna.Study) -> None:
        """Trials a dead daemon left RUNNING become FAIL (daemon_lost) and are re-queued once
        (a confirmation run is not: the comparison runs whole again); MLflow is then caught up
        with Optuna (`recovery_tracking.catch_up`)."""
        for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if ATTR_DUPLICATE_OF in trial.user_attrs:  # died between marking a repeat and
                study.tell(trial.number, state=TrialState.FAIL)  # telling it: it launched
                continue  # nothing and has no run
            unsampled = self.space.unsampled(trial.params)
            if unsampled and ATTR_MLFLOW_RUN not in trial.user_attrs:
                self._drop_cut_short(study, trial, unsampled)
                continue
            attrs = dict(trial.user_attrs)
            retries = int(attrs.get(ATTR_RETRIES, 0))
            if not _requeueable(attrs):
                fate = "the confirmation runs again whole on this start"
            elif retries < self.cfg.spec.retries:
                fate = "re-queued"
            else:
                fate = f"not re-queued (retried {retries} times already)"
            record = records.failed_record(
                trial.params, FailureReason.DAEMON_LOST.value,
                "the daemon died with this trial in flight.",
                f"the daemon died with this trial in flight; {fate}.",
                is_baseline=bool(attrs.get(ATTR_BASELINE)))
            storage = study._storage
            storage.set_trial_user_attr(trial._trial_id, ATTR_RECORD, record)
            if not trial.user_attrs.get(ATTR_MLFLOW_RUN):
                # Asked but never launched (it waited for GPUs): give it its run now, while the
                # trial can still take the run's id, so every Optuna trial names its one run.
                try:
                    run_id = self.tracker.start_trial(self._parent_run, self.cfg.name,
                                                      trial.number, trial.params)
                    storage.set_trial_user_attr(trial._trial_id, ATTR_MLFLOW_RUN, run_id)
                except Exception as exc:  # any store error: the catch-up finds it by its tag
                    self._tracking_failed("start_trial", trial.number, exc)
            study.tell(trial.number, state=TrialState.FAIL)
            if fate == "re-queued":
                self._requeue(study, trial.number, trial.params, attrs, retries + 1)
            logger.warning("trial %d was in flight when the daemon died: failed, %s",
                           trial.number, fate)
        # MLflow: a run for every finished trial (one asked but never launched included), each
        # finished once from its record; a failing store is a warning, as mid-study.
        recovery_tracking.catch_up(self.tracker, self._parent_run, study, self.cfg.results_dir,
                                   tracking_payload)

    @staticmethod
    def _requeue(study: optuna.Study, number: int, params: Mapping[str, Any],
                 attrs: Mapping[str, Any], retries: int) -> bool:
        """Queue again a trial lost to infrastructure, as what it was (the defaults, a seed),
        unless it is a confirmation run (`_requeueable`); says whether it did."""
        if not _requeueable(attrs):
            return False
        kept = {key: attrs[key] for key in (ATTR_BASELINE, ATTR_SEEDED) if key in attrs}
        study.enqueue_trial(dict(params), user_attrs={
            **kept, ATTR_RETRY_OF: number, ATTR_RETRIES: retries})
        return True

    def _drop_cut_short(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                        unsampled: list[str]) -> None:
        """A dead daemon's trial still being sampled has half a config and never launched: it
        fails without a run and counts for no budget. One the sampler proposed is not
        re-queued (pinning half a config would retry nothing; the sampler asks again); one
        enqueued whole (the defaults, a seed, a retry) goes back in the queue as it was."""
        attrs = dict(trial.user_attrs)
        enqueued = trial.system_attrs.get("fixed_params")
        again = enqueued if enqueued and _requeueable(attrs) else None  # what goes back
        fate = "re-queued as enqueued" if again else "not re-queued"
        record = records.failed_record(
            trial.params, FailureReason.DAEMON_LOST.value,
            "the daemon died while this trial's config was being sampled.",
            f"the daemon died before sampling {', '.join(unsampled)}: nothing launched, "
            f"{fate}.",
            is_baseline=bool(attrs.get(ATTR_BASELINE)))
        study._storage.set_trial_user_attr(trial._trial_id, ATTR_RECORD, record)
        study._storage.set_trial_user_attr(trial._trial_id, ATTR_CUT_SHORT, True)
        study.tell(trial.number, state=TrialState.FAIL)
        if again:
            self._requeue(study, trial.number, again, attrs, int(attrs.get(ATTR_RETRIES, 0)))
        logger.warning("trial %d was being sampled when the daemon died (no %s yet): failed, "
                       "%s", trial.number, ", ".join(unsampled), fate)

    def _finish(self, study: optuna.Study) -> DaemonSummary:
        trials = study.get_trials(deepcopy=False)
        # The search's trials: not a repeat that launched nothing, nor a confirmation run.
        finished = [t for t in trials if t.state.is_finished() and is_search_trial(t)]
        best = best_trial(study)
        done = not self._budget_left(study)
        # By the record's state: a config failure is a COMPLETE trial to Optuna (it teaches
        # the sampler) but a failed one to the user.
        states = [(t.user_attrs.get(ATTR_RECORD) or {}).get("state") or _STATE_NAMES[t.state]
                  for t in finished if t.state in _STATE_NAMES]
        counts = {name: states.count(name) for name in _STATE_NAMES.values()}
        metrics: dict[str, float] = {f"trials_{k}": float(v) for k, v in counts.items()}
        tags = {}
        if best is not None and best.values:
            for name, v in zip(self.cfg.objectives, best.values, strict=True):
                metrics[f"best.{name}"] = v
            tags["best_trial"] = str(best.number)
            report = build_report(study, self.cfg, with_importances=False)
            tags["recommended_trial"] = str((report.recommended or report.best or best).number)
            # The study's conclusion is the best against the defaults (the trial's own one
            # compares it with the best before it).
            tags["conclusion"] = headline(report)
            tags["mlflow.note.content"] = tags["conclusion"]  # the run's description
            if report.gain_bounds is not None:
                metrics.update(report.gain_bounds.as_metrics("gain"))
        no_baseline = no_baseline_reason(study) or ""
        if no_baseline:
            tags["no_baseline"] = no_baseline[:5000]
            logger.warning("no baseline: the defaults could not be measured (%s); no gain over "
                           "the defaults can be stated", no_baseline)
        confirmed = study.user_attrs.get(STUDY_ATTR_CONFIRM)
        if confirmed:
            tags["confirm"] = str(confirmed["sentence"])
            tags["confirmed"] = "true" if confirmed.get("is_confirmed") else "false"
            metrics["confirm.gain"] = float(confirmed["gain"])
            for key in ("ci_low", "ci_high"):
                if confirmed.get(key) is not None:
                    metrics[f"confirm.gain_{key}"] = float(confirmed[key])
        try:
            self.tracker.finish_study(self._parent_run, metrics, tags, is_done=done)
        except Exception as exc:  # any store error: the results are safe in Optuna
            logger.warning("MLflow finish_study failed (%s: %s); rerun `nightshift start` to "
                           "bring MLflow up to date", type(exc).__name__, str(exc)[:200])
        self.on_event(TrialEvent("study", message="done" if done else "stopped"))
        return DaemonSummary(self._finished_here, len(finished), self.stopping and not done,
                             best.number if best else None, list(best.values)
                             if best and best.values else None, no_baseline)


# Two-sided 95% quantiles of Student's t by degrees of freedom (1-30); beyond, the normal's.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _requeueable(attrs: Mapping[str, Any]) -> bool:
    """Whether a trial lost to infrastructure goes back in the queue: all but a confirmation
    run, whose interleaved comparison runs whole again when the study resumes."""
    return ATTR_CONFIRM not in attrs


def confirm_summary(objective: str, best: int, baseline: int,
                    pairs: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """The gain of `best` over `baseline` from interleaved rounds: the mean per-round ratio
    (oriented so > 1 is better) and its 95% t-interval, or None bounds from one round."""
    maximize = OBJECTIVES[objective].direction == "maximize"
    ratios = []
    for pair in pairs:
        a, b = pair["defaults"], pair["best"]
        ratio = (b / a if a > 0 else math.inf) if maximize else (a / b if b > 0 else math.inf)
        ratios.append(ratio)
    n = len(ratios)
    mean = sum(ratios) / n
    low = high = None
    if n > 1 and all(math.isfinite(r) for r in ratios):
        sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (n - 1))
        half = (_T975[n - 2] if n - 1 <= len(_T975) else 1.96) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    gain = gains.interval_gain(mean, low, high, n)
    verdict = gains.confirmation_verdict(gain)
    sentence = (f"trial {best} (the exported config) vs the defaults (trial {baseline}), "
                f"re-measured interleaved: {objective} {gains.format_gain(gain)}: {verdict}")
    return {"objective": objective, "best_trial": best, "baseline_trial": baseline,
            "rounds": [dict(p) for p in pairs], "ratios": ratios, "gain": mean,
            "is_confirmed": gain.is_better, "verdict": verdict,
            "ci_low": low, "ci_high": high, "sentence": sentence}


def _config_key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def tracking_payload(record: Mapping[str, Any], result: RunResult | None) -> dict[str, Any]:
    """Arguments of `Tracker.finish_trial` from a trial record (and its fresh result, whose
    files exist only the first time)."""
    tags = {"conclusion": record.get("conclusion", "")}
    if record.get("argv"):
        tags["launch_command"] = shlex.join(record["argv"])
    if record.get("failure_reason"):
        tags["failure_reason"] = record["failure_reason"]
    if record.get("is_baseline"):
        tags["baseline"] = "true"
    if record.get("host"):
        tags["host"] = str(record["host"])
    if record.get("is_unstable"):
        tags["unstable"] = "true"
    if record.get("conclusion"):
        tags["mlflow.note.content"] = str(record["conclusion"])  # the run's description
    capacity = record.get("capacity") or {}
    if capacity.get("status"):
        tags["capacity.status"] = str(capacity["status"])
        if capacity["status"] == "unresolved":
            tags["unresolved"] = "true"
    verdict = record.get("verdict") or {}
    if verdict.get("label"):
        tags["bottleneck"] = str(verdict["label"])
        tags["bottleneck.reason"] = str(verdict.get("reason", ""))[:5000]
        tags["bottleneck.sources"] = ",".join(verdict.get("sources") or [])
    for key in ("engine_started_unix_s", "engine_ended_unix_s"):
        if record.get(key) is not None:  # "engine.started" / "engine.ended", UTC
            tags[f"engine.{key.split('_')[1]}"] = datetime.fromtimestamp(
                float(record[key]), UTC).isoformat(timespec="milliseconds")
    engine = record.get("engine") or {}
    for key in ("attention_backend", "engine_version"):  # what the engine chose, as tags
        if engine.get(key):
            tags[f"engine.{key}"] = str(engine[key])
    texts: dict[str, str] = {}
    files: list[Path] = []
    if result is not None:
        if result.server_log:
            texts["server.log"] = result.server_log
        if result.trace_path is not None:
            files.append(result.trace_path)
    launch = {"argv": record.get("argv", []), "env": record.get("env", {}),
              "flags": record.get("flags", {})}
    return {
        "state": record["state"],
        "metrics": record.get("metrics", {}),
        "step_metrics": [(s["step"], s["metrics"]) for s in record.get("steps", [])],
        "tags": tags,
        "texts": texts,
        "dicts": {"launch.json": launch, "record.json": dict(record)},
        "files": files,
    }
