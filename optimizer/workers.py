"""The Ray executor and the cluster around it: an actor per trial's GPUs runs a `Runner`,
relaying each load level's figures to the driver and waiting for its verdict (go on / stop);
the driver stays the only writer of the Optuna storage and MLflow. The only module of
`optimizer` that imports Ray (start, probe, reap on other nodes).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

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

from optimizer.engines import RunnerSpec, build_runner
from optimizer.errors import ConfigError, NightshiftError, WorkerLost, describe
from optimizer.executor import TrialHandle, TrialSession
from runners.base import EngineConfig, Failure, FailureReason, RunResult, StepMetrics
from runners.workload import Workload

logger = logging.getLogger(__name__)

_RAY_LOST: tuple[type[BaseException], ...] = (RayActorError, WorkerCrashedError, RayTaskError)
_POLL_ERRORS: tuple[type[BaseException], ...] = (*_RAY_LOST, GetTimeoutError)


class TrialWorker(TrialSession):
    """The Ray actor of one trial's GPUs: a `TrialSession` on the GPUs Ray gave it, whose
    results say where they ran and carry the trimmed trace back (the driver may be elsewhere)."""

    def __init__(self, spec: RunnerSpec) -> None:
        gpu_ids = tuple(int(g) for g in ray.get_gpu_ids()) if ray.is_initialized() else ()
        self._gpu_ids = gpu_ids
        super().__init__(build_runner(spec, gpu_ids or None))

    def run(self, config: EngineConfig, workload: Workload, workdir: str) -> RunResult:
        result = super().run(config, workload, workdir)
        return replace(result, host=_where_label(), trace_data=_small_file(result.trace_path))

    def where(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "gpu_ids": list(self._gpu_ids),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


_RemoteWorker = ray.remote(max_concurrency=4)(TrialWorker)  # type: ignore[call-overload]


class RayTrialHandle:
    """The driver's view of one trial running on a worker: every Ray call the daemon makes
    goes through here, so Ray's exceptions become `WorkerLost` at this boundary."""

    def __init__(self, actor: Any, ref: Any, placed: Any = None) -> None:
        self.actor = actor
        self.ref = ref
        self.placed = placed  # resolves once Ray has made the actor (None: made already)

    def is_placed(self) -> bool:
        """Whether Ray made the trial's worker: one no node can hold waits unplaced for ever."""
        if self.placed is None:
            return True
        ready, _ = ray.wait([self.placed], timeout=0)
        return bool(ready)

    def poll(self, timeout_s: float = 30.0) -> list[StepMetrics]:
        if not self.is_placed():
            return []  # nothing measured; asking a worker not made yet would wait timeout_s
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
        if not self.is_placed():
            return  # nothing runs: the executor's release kills the actor Ray never made
        try:
            ray.get(self.actor.cancel.remote(), timeout=timeout_s)
            ray.wait([self.ref], timeout=timeout_s)
        except Exception:  # a dead worker: its engine is reaped from the registry
            logger.debug("cancel failed", exc_info=True)


def wait_any(handles: Sequence[TrialHandle], timeout_s: float) -> list[TrialHandle]:
    """The handles whose run has ended, after at most `timeout_s`."""
    refs = {h.ref.hex(): h for h in handles if isinstance(h, RayTrialHandle)}
    if not refs:
        return []
    ready, _ = ray.wait([h.ref for h in refs.values()], num_returns=len(refs),
                        timeout=timeout_s)
    ready_ids = {r.hex() for r in ready}
    return [h for key, h in refs.items() if key in ready_ids]


@dataclass
class _Slot:
    actor: Any
    num_gpus: int
    busy: bool = False


class RayExecutor:
    """The `Executor` on Ray: actors keyed by how many GPUs they own; idle ones are reused by
    trials of the same size and killed when a trial of another size needs their GPUs."""

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
        return RayTrialHandle(actor, actor.run.remote(config, workload, str(workdir)),
                              placed=actor.where.remote())

    def wait_any(self, handles: Sequence[TrialHandle], timeout_s: float) -> list[TrialHandle]:
        return wait_any(handles, timeout_s)

    def reap_elsewhere(self, registry_dir: Path) -> dict[str, list[int]]:
        return reap_on_other_nodes(registry_dir)

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

    def shrink_to_live(self, timeout_s: float = 30.0, *, placing_gpus: int = 0) -> int:
        """After a worker or node died: plan with the GPUs Ray can still give, so no trial
        waits forever for one it cannot have; returns them (0: stop the study).

        With `placing_gpus` (a lost worker), a task needing that many GPUs is placed first,
        `timeout_s` at most: a lost worker may be the local raylet gone, which Ray's GCS counts
        alive until its health checks time out (about 15 s by default) and under which nothing
        is ever placed again; Ray says so (`LocalRayletDiedError`, in seconds), and that reads
        0. A task merely not placed in time (another job's demand first, a dead actor's GPUs
        slow to come back) proves nothing: the GPUs Ray lists count then. Without (a dead
        node), waits up to `timeout_s` for Ray to count the node out. A GCS that does not
        answer (gone: `ray.nodes()` then blocks or raises) reads 0."""
        deadline = time.monotonic() + timeout_s
        try:
            if placing_gpus and self._probe_placement(placing_gpus, timeout_s) == "raylet_died":
                live = 0
            elif placing_gpus:
                live = live_gpus(max(1.0, deadline - time.monotonic()))
            else:
                live = live_gpus(timeout_s)
                while live >= self.total_gpus and time.monotonic() < deadline:
                    time.sleep(0.5)
                    live = live_gpus(max(1.0, deadline - time.monotonic()))
        except Exception as exc:  # Ray's GCS gone: nothing can be counted or placed
            logger.error("Ray's GCS does not answer (%s): no trial can be placed", describe(exc))
            live = 0
        self.total_gpus = min(self.total_gpus, live)
        return self.total_gpus

    def _probe_placement(self, num_gpus: int, timeout_s: float
                         ) -> Literal["placed", "raylet_died", "not_placed"]:
        """Whether Ray runs a task needing `num_gpus` GPUs (on this executor's nodes) within
        `timeout_s`, or says its local raylet died; says why not in the log."""
        ref = _placement_probe.options(num_gpus=num_gpus, num_cpus=0,
                                       **self._placement).remote()
        try:
            ray.get(ref, timeout=timeout_s)
        except LocalRayletDiedError:
            logger.error("the local Ray raylet died: this daemon can place no trial")
            outcome: Literal["raylet_died", "not_placed"] = "raylet_died"
        except GetTimeoutError:
            logger.warning("Ray placed no task needing %d GPUs within %.0f s; planning with "
                           "the GPUs it lists alive", num_gpus, timeout_s)
            outcome = "not_placed"
        except Exception as exc:  # another refusal of Ray's: the GPUs it lists decide
            logger.warning("Ray could not place a task needing %d GPUs (%s); planning with "
                           "the GPUs it lists alive", num_gpus, describe(exc))
            outcome = "not_placed"
        else:
            return "placed"
        try:
            ray.cancel(ref, force=True)
        except Exception:  # Ray is gone: nothing of the probe is left to cancel
            logger.debug("cancelling the placement probe failed", exc_info=True)
        return outcome

    def placement_problem(self) -> str | None:
        resources = self._placement["resources"]
        accelerator_type = self._placement.get("accelerator_type")
        if not resources and not accelerator_type:
            return None
        try:
            return placement_problem(cluster_nodes(10.0), accelerator_type, resources)
        except Exception as exc:  # Ray's GCS not answering: a lost node's path says so
            logger.debug("the placement check failed (%s)", describe(exc))
            return None

    def release(self, handle: TrialHandle, *, healthy: bool = True) -> None:
        actor = handle.actor if isinstance(handle, RayTrialHandle) else None
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
                       f"the cluster node running this trial died ({type(exc).__name__}).")
    return Failure(FailureReason.WORKER_LOST,
                   f"the Ray worker running this trial died ({type(exc).__name__}).")




@ray.remote
def _placement_probe() -> None:
    """Nothing: that Ray ran it on the GPUs asked for is the answer."""


def live_gpus(timeout_s: float = 30.0) -> int:
    """The GPUs of the cluster's live nodes; raises TimeoutError when Ray's GCS does not answer
    within `timeout_s` (`ray.nodes()` blocks while it tries to reconnect to a GCS gone)."""
    nodes = [n for n in cluster_nodes(timeout_s) if n.get("Alive")]
    return int(sum(n.get("Resources", {}).get("GPU", 0) for n in nodes))


def cluster_nodes(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """`ray.nodes()`, or TimeoutError when Ray's GCS does not answer within `timeout_s`."""
    answer: list[list[dict[str, Any]]] = []
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            answer.append(ray.nodes())  # type: ignore[no-untyped-call]
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=ask, daemon=True, name="nightshift-ray-nodes")
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise failure[0]
    if not answer:
        raise TimeoutError(f"ray.nodes() did not answer within {timeout_s:.0f} s")
    return answer[0]


def largest_node_gpus() -> int:
    """The most GPUs one live node of the cluster has: a trial's GPUs must share a node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    return int(max((n.get("Resources", {}).get("GPU", 0) for n in nodes), default=0))


def placement_problem(nodes: Sequence[Mapping[str, Any]], accelerator_type: str | None,
                      resources: Mapping[str, float]) -> str | None:
    """Why no live node of the cluster (`ray.nodes()`) can take a trial placed by
    `ray.accelerator_type` and `ray.resources`, or None. Ray would queue such a task for ever,
    silently: the study would sit "running" with nothing launched."""
    if not accelerator_type and not resources:
        return None
    alive = [dict(n.get("Resources") or {}) for n in nodes if n.get("Alive")]
    wanted = dict(resources)
    if accelerator_type:
        wanted[f"accelerator_type:{accelerator_type}"] = 0.001  # as Ray asks for it
    if any(all(node.get(k, 0.0) >= v for k, v in wanted.items()) for node in alive):
        return None
    have = sorted({k for node in alive for k in node if k.startswith("accelerator_type:")})
    if accelerator_type and f"accelerator_type:{accelerator_type}" not in \
            {k for node in alive for k in node}:
        kinds = ", ".join(k.partition(":")[2] for k in have) or "none declared"
        return (f"ray.accelerator_type: no node of the Ray cluster is a {accelerator_type!r} "
                f"(its nodes: {kinds}); name one of those or leave it out")
    custom = sorted({k for node in alive for k in node
                     if k not in ("CPU", "GPU", "memory", "object_store_memory")
                     and not k.startswith(("node:", "accelerator_type:"))})
    return (f"ray.resources: no node of the Ray cluster has {dict(wanted)} (custom resources "
            f"there: {', '.join(custom) or 'none'}); start the nodes with `ray start "
            "--resources` or leave ray.resources out")


def cluster_placement_problem(accelerator_type: str | None,
                              resources: Mapping[str, float]) -> str | None:
    """`placement_problem` on the joined cluster's live nodes."""
    return placement_problem(ray.nodes(), accelerator_type, resources)  # type: ignore[no-untyped-call]


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
