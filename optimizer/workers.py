"""Ray workers: an actor per trial's GPUs runs a `Runner`, relaying each load level's figures to
the driver and waiting for its verdict (go on / stop). The driver stays the only writer of the
Optuna storage and MLflow; workers send results back through Ray.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import (
    GetTimeoutError,
    LocalRayletDiedError,
    NodeDiedError,
    RayActorError,
    RayError,
    RayTaskError,
    WorkerCrashedError,
)

from optimizer.errors import ConfigError, NightshiftError, WorkerLost
from runners.base import EngineConfig, Failure, FailureReason, RunResult, StepMetrics, Workload

logger = logging.getLogger(__name__)

_RAY_LOST: tuple[type[BaseException], ...] = (RayActorError, WorkerCrashedError, RayTaskError)
_POLL_ERRORS: tuple[type[BaseException], ...] = (*_RAY_LOST, GetTimeoutError)
DECISION_TIMEOUT_S = 3600.0  # a driver that never answers is dead; Ray then kills us anyway


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a worker needs to build its runner; plain data so it pickles through Ray."""

    kind: str  # a key of RUNNERS
    registry_dir: Path  # engine pid records, for reaping strays after a crash
    hardware: dict[str, Any] | None = None  # simulated engine only: the host it pretends to be
    startup_time_scale: float = 0.01  # simulated engine only
    seed: int = 0
    cache_root: Path | None = None  # VLLM_CACHE_ROOT shared by every trial
    stall_timeout_s: float = 120.0
    options: dict[str, Any] = field(default_factory=dict)


def _simulated_runner(spec: RunnerSpec, gpu_indices: tuple[int, ...] | None) -> Any:
    from runners.engine import EngineRunner
    from runners.hardware import HardwareProfile
    from runners.simulated.launcher import SimulatedLauncher

    hardware = HardwareProfile.from_dict(spec.hardware) if spec.hardware else "h200"
    launcher = SimulatedLauncher(hardware=hardware,
                                 startup_time_scale=spec.startup_time_scale, seed=spec.seed)
    return EngineRunner(launcher, spec.registry_dir, stall_timeout_s=spec.stall_timeout_s,
                        gpu_indices=None)


def _vllm_runner(spec: RunnerSpec, gpu_indices: tuple[int, ...] | None) -> Any:
    from runners.engine import EngineRunner
    from runners.vllm.launcher import VllmLauncher

    # Dev mode for /reset_prefix_cache between load levels (127.0.0.1 only).
    launcher = VllmLauncher(cache_root=spec.cache_root, dev_mode=True)
    return EngineRunner(launcher, spec.registry_dir, stall_timeout_s=spec.stall_timeout_s,
                        gpu_indices=gpu_indices)


RUNNERS: dict[str, Callable[[RunnerSpec, tuple[int, ...] | None], Any]] = {
    "simulated": _simulated_runner,
    "vllm": _vllm_runner,
}


def build_runner(spec: RunnerSpec, gpu_indices: tuple[int, ...] | None = None) -> Any:
    try:
        factory = RUNNERS[spec.kind]
    except KeyError:
        raise ValueError(f"unknown runner {spec.kind!r}; valid: {', '.join(RUNNERS)}") from None
    return factory(spec, gpu_indices)


class TrialWorker:
    """Runs one trial at a time. Threaded (max_concurrency > 1): `run` blocks in one thread
    while the driver calls `poll`, `decide` and `cancel` from others."""

    def __init__(self, spec: RunnerSpec) -> None:
        gpu_ids = tuple(int(g) for g in ray.get_gpu_ids()) if ray.is_initialized() else ()
        self._gpu_ids = gpu_ids
        self._runner = build_runner(spec, gpu_ids or None)
        self._cond = threading.Condition()
        self._pending: list[StepMetrics] = []
        self._decisions: dict[int, bool] = {}
        self._cancelled = False

    def run(self, config: EngineConfig, workload: Workload, workdir: str) -> RunResult:
        with self._cond:
            self._pending.clear()
            self._decisions.clear()
            self._cancelled = False
        result: RunResult = self._runner.run(config, workload, Path(workdir), self._on_step)
        result = replace(result, host=_where_label(), trace_data=_small_file(result.trace_path))
        if self._cancelled:
            return RunResult(status="failed", steps=result.steps, engine=result.engine,
                             argv=result.argv, env=result.env, server_log=result.server_log,
                             workdir=result.workdir, wall_s=result.wall_s, host=result.host,
                             engine_started_unix_s=result.engine_started_unix_s,
                             engine_ended_unix_s=result.engine_ended_unix_s,
                             failure=Failure(FailureReason.INTERRUPTED,
                                             "the daemon was stopped with this trial in flight; "
                                             "it is re-queued on resume."))
        return result

    def _on_step(self, step: StepMetrics) -> bool:
        with self._cond:
            if self._cancelled:
                return True
            self._pending.append(step)
            self._cond.notify_all()
            ok = self._cond.wait_for(lambda: step.step in self._decisions or self._cancelled,
                                     timeout=DECISION_TIMEOUT_S)
            return self._cancelled or not ok or self._decisions.get(step.step, False)

    def poll(self) -> list[StepMetrics]:
        with self._cond:
            steps, self._pending = self._pending, []
            return steps

    def decide(self, step: int, stop: bool) -> None:
        with self._cond:
            self._decisions[step] = stop
            self._cond.notify_all()

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()
        self._runner.close()  # kills the engine in flight; `run` then returns at once

    def where(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "gpu_ids": list(self._gpu_ids),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def shutdown(self) -> None:
        self._runner.close()


_RemoteWorker = ray.remote(max_concurrency=4)(TrialWorker)  # type: ignore[call-overload]


class TrialHandle:
    """The driver's view of one trial running on a worker: every Ray call the daemon makes
    goes through here, so Ray's exceptions become `WorkerLost` at this boundary."""

    def __init__(self, actor: Any, ref: Any) -> None:
        self.actor = actor
        self.ref = ref

    def poll(self, timeout_s: float = 30.0) -> list[StepMetrics]:
        try:
            steps: list[StepMetrics] = ray.get(self.actor.poll.remote(), timeout=timeout_s)
        except _POLL_ERRORS as exc:
            raise WorkerLost(f"worker did not answer a poll ({type(exc).__name__})") from exc
        return steps

    def decide(self, step: int, stop: bool) -> None:
        self.actor.decide.remote(step, stop)

    def result(self, timeout_s: float | None = None) -> RunResult:
        """The run's result; a dead worker becomes a `WORKER_LOST` (or `INTERNAL`) failure."""
        try:
            result: RunResult = ray.get(self.ref, timeout=timeout_s)
        except _RAY_LOST as exc:
            return RunResult(status="failed", failure=lost_worker_failure(exc))
        return result

    def cancel(self, timeout_s: float = 120.0) -> None:
        try:
            ray.get(self.actor.cancel.remote(), timeout=timeout_s)
            ray.wait([self.ref], timeout=timeout_s)
        except Exception:  # a dead worker: its engine is reaped from the registry
            logger.debug("cancel failed", exc_info=True)


def wait_any(handles: list[TrialHandle], timeout_s: float) -> list[TrialHandle]:
    """The handles whose run has ended, after at most `timeout_s`."""
    if not handles:
        return []
    ready, _ = ray.wait([h.ref for h in handles], num_returns=len(handles), timeout=timeout_s)
    ready_ids = {r.hex() for r in ready}
    return [h for h in handles if h.ref.hex() in ready_ids]


@dataclass
class _Slot:
    actor: Any
    num_gpus: int
    busy: bool = False


class WorkerPool:
    """Actors keyed by how many GPUs they own; idle ones are reused by trials of the same size
    and killed when a trial of another size needs their GPUs."""

    def __init__(self, spec: RunnerSpec, total_gpus: int, *,
                 accelerator_type: str | None = None,
                 resources: Mapping[str, float] | None = None) -> None:
        self.spec = spec
        self.total_gpus = total_gpus
        self._slots: list[_Slot] = []
        # Placement on a shared cluster: only nodes of this GPU model / with these resources.
        self._placement: dict[str, Any] = {"resources": dict(resources or {})}
        if accelerator_type:
            self._placement["accelerator_type"] = accelerator_type

    @property
    def gpus_busy(self) -> int:
        return sum(s.num_gpus for s in self._slots if s.busy)

    def can_start(self, num_gpus: int) -> bool:
        return self.gpus_busy + num_gpus <= self.total_gpus

    def submit(self, config: EngineConfig, workload: Workload, workdir: Path) -> TrialHandle:
        """Start a trial on a worker owning `config.num_gpus` GPUs (check `can_start` first)."""
        actor = self.acquire(config.num_gpus)
        return TrialHandle(actor, actor.run.remote(config, workload, str(workdir)))

    def acquire(self, num_gpus: int) -> Any:
        for slot in self._slots:
            if not slot.busy and slot.num_gpus == num_gpus:
                slot.busy = True
                return slot.actor
        held = sum(s.num_gpus for s in self._slots)
        for slot in [s for s in self._slots if not s.busy]:
            if held + num_gpus <= self.total_gpus:
                break
            self._kill(slot)
            held -= slot.num_gpus
        # num_cpus=0: the engine's CPU work is not Ray's to schedule; GPUs are the constraint.
        # One actor owns all of a trial's GPUs, so Ray places them on one node (as a
        # STRICT_PACK placement group would); vLLM's own mp executor spans them.
        actor = _RemoteWorker.options(num_gpus=num_gpus, num_cpus=0,
                                      **self._placement).remote(self.spec)
        self._slots.append(_Slot(actor, num_gpus, busy=True))
        return actor

    def shrink_to_live(self, timeout_s: float = 30.0) -> int:
        """After a node died: wait until Ray counts it out (or `timeout_s`), then plan with the
        GPUs of the nodes left, so no trial waits forever for a GPU that is gone."""
        deadline = time.monotonic() + timeout_s
        live = live_gpus()
        while live >= self.total_gpus and time.monotonic() < deadline:
            time.sleep(0.5)
            live = live_gpus()
        self.total_gpus = min(self.total_gpus, live)
        return self.total_gpus

    def release(self, actor: Any, *, healthy: bool = True) -> None:
        for slot in self._slots:
            if slot.actor is actor:
                if healthy:
                    slot.busy = False
                else:
                    self._kill(slot)
                return

    def _kill(self, slot: _Slot) -> None:
        self._slots.remove(slot)
        try:
            ray.kill(slot.actor)
        except Exception:  # already dead: nothing to release
            logger.debug("actor already gone", exc_info=True)

    def shutdown(self) -> None:
        for slot in list(self._slots):
            try:
                ray.get(slot.actor.shutdown.remote(), timeout=60)
            except Exception:  # a dead actor's engines are reaped from the registry
                logger.debug("actor shutdown failed", exc_info=True)
            self._kill(slot)


_NODE_DEATH = re.compile(r"node (?:has )?died|node .*(?:dead|removed|died)|raylet.*died",
                         re.IGNORECASE)
_TRACE_DATA_MAX_BYTES = 64 << 20  # the trimmed trace: a few MB; anything larger stays behind


def _where_label() -> str:
    """Host, Ray node and the GPUs Ray gave this worker (its engine inherits them)."""
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    label = f"{socket.gethostname()} node {node[:12]}" if node else socket.gethostname()
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"{label} gpus {gpus}" if gpus else label


def _small_file(path: Path | None) -> bytes | None:
    try:
        if path is not None and path.stat().st_size <= _TRACE_DATA_MAX_BYTES:
            return path.read_bytes()
    except OSError:
        pass
    return None


def lost_worker_failure(exc: BaseException) -> Failure:
    """A RunResult-shaped failure for a worker that died under its trial."""
    if isinstance(exc, RayTaskError):
        return Failure(FailureReason.INTERNAL,
                       f"the trial raised inside its worker: {str(exc).splitlines()[-1][:300]}")
    if isinstance(exc, NodeDiedError | LocalRayletDiedError) or _NODE_DEATH.search(str(exc)):
        return Failure(FailureReason.NODE_LOST,
                       f"the cluster node running this trial died ({type(exc).__name__}); "
                       "re-queued on the nodes left.")
    return Failure(FailureReason.WORKER_LOST,
                   f"the Ray worker running this trial died ({type(exc).__name__}); re-queued.")




def live_gpus() -> int:
    """The GPUs of the cluster's live nodes."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    return int(sum(n.get("Resources", {}).get("GPU", 0) for n in nodes))


def largest_node_gpus() -> int:
    """The most GPUs one live node of the cluster has: a trial's GPUs must share a node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    return int(max((n.get("Resources", {}).get("GPU", 0) for n in nodes), default=0))


def _reap(registry_dir: str) -> list[int]:
    from runners.process import reap_strays

    return reap_strays(Path(registry_dir))


def reap_on_other_nodes(registry_dir: Path, timeout_s: float = 60.0) -> dict[str, list[int]]:
    """Kill the engines a dead daemon left on the cluster's other live nodes: a worker there
    launched them and recorded them under `registry_dir` on that node's disk, which the daemon
    cannot read. One task pinned to each node reaps them (`runners.process.reap_strays`, which
    acts only on a pid alive with its recorded create time). Call with the study lock held.
    Returns node id -> pids killed, for the nodes where any were."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        return {}
    here = ray.get_runtime_context().get_node_id()
    pending = {}
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node.get("Alive") or node["NodeID"] == here:
            continue
        strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        pending[node["NodeID"]] = ray.remote(_reap).options(
            num_cpus=0, scheduling_strategy=strategy).remote(str(registry_dir))
    reaped: dict[str, list[int]] = {}
    for node_id, ref in pending.items():
        try:
            pids = ray.get(ref, timeout=timeout_s)
        except (GetTimeoutError, RayError) as exc:
            logger.warning("could not reap stray engines on node %s (%s: %s); they may still "
                           "hold its GPUs", node_id[:12], type(exc).__name__, str(exc)[:200])
            continue
        if pids:
            reaped[node_id] = list(pids)
    return reaped


def _probe_hardware() -> dict[str, Any]:
    from runners.hardware import probe

    return probe().to_dict()


def probe_on_cluster(accelerator_type: str | None = None,
                     resources: Mapping[str, float] | None = None,
                     timeout_s: float = 300.0) -> Any:
    """The hardware profile of a GPU node of the cluster (the driver may have no GPU), read by
    a one-GPU task placed as the study's trials will be."""
    from runners.hardware import HardwareProfile

    options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0, "resources": dict(resources or {})}
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    task = ray.remote(_probe_hardware).options(**options)
    try:
        data = ray.get(task.remote(), timeout=timeout_s)
    except GetTimeoutError:
        raise ConfigError(f"ray: no GPU node of the cluster took a probe within {timeout_s:g} s; "
                          "check ray.accelerator_type and ray.resources against the cluster's "
                          "nodes (`ray status`).") from None
    return HardwareProfile.from_dict(data)


LOOPBACK = "127.0.0.1"
# Ray resolves a loopback `_node_ip_address` to the machine's address unless it believes
# multi-node clusters are off (ray/_private/services.py `resolve_ip_for_localhost` and
# `get_node_ip_address`); this switch, read by `ray._private.ray_constants` at import, says so.
_RAY_CLUSTERS_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(num_gpus: int | None, address: str | None = None) -> int:
    """Join `address` or start a local cluster (declaring `num_gpus` for the simulated engine);
    returns the GPUs the cluster has."""
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "configure_logging": False}
        if address:
            ray.init(address=address, **kwargs)
        else:
            start_local_ray(num_gpus=num_gpus, num_cpus=max(2, (num_gpus or 0) + 2), **kwargs)
    resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    return int(resources.get("GPU", 0))


def start_local_ray(**kwargs: Any) -> None:
    """A Ray of the daemon's own on this machine, bound to 127.0.0.1 only, whatever the
    environment holds.

    `address="local"` starts a new cluster even with `RAY_ADDRESS` set or a `ray start` left
    running (which `ray.init()` without an address would join). Ray 2.60 binds its gRPC servers
    (GCS, raylet and object manager, every core worker and the driver), the runtime-env agent,
    the autoscaler monitor's metrics server and (by its source; in a minimal install it opens
    no port) the dashboard agent to loopback when the node's IP is a loopback one; the
    dashboard process gets `--host=127.0.0.1`, Ray's default. `ray.init` would turn
    `_node_ip_address="127.0.0.1"` into the machine's address unless multi-node clusters are
    switched off, so the switch is off for this call: in the environment, for the processes Ray
    starts (its workers inherit the raylet's), and in the constant already imported, for this
    process. Raises `NightshiftError` (Ray shut down again) if the node came up on another
    address all the same."""
    from ray._private import ray_constants

    saved = {name: os.environ.get(name) for name in ("RAY_ADDRESS", _RAY_CLUSTERS_SWITCH)}
    saved_switch = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.pop("RAY_ADDRESS", None)
    os.environ[_RAY_CLUSTERS_SWITCH] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", _node_ip_address=LOOPBACK, **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_switch
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    nodes = [n.get("NodeManagerAddress") for n in ray.nodes()]  # type: ignore[no-untyped-call]
    if nodes != [LOOPBACK]:
        ray.shutdown()
        raise NightshiftError(f"the local Ray came up on {', '.join(map(str, nodes))}, not "
                              f"{LOOPBACK} only; this Ray version binds differently: pin ray "
                              "2.60 or pass --ray-address to use a cluster you run.")
