"""The Ray executor: an actor per trial's GPUs runs a `Runner`, relaying each load level's
figures to the driver and waiting for its verdict (go on / stop); the driver stays the only
writer of the Optuna storage and MLflow. A dead worker becomes a failed result here. With
`ray_cluster` (start, count, probe, reap on other nodes), the only modules of `optimizer` that
import Ray.
"""

from __future__ import annotations

import logging
import os
import re
import socket
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
    RayTaskError,
    WorkerCrashedError,
)

from optimizer.errors import WorkerLost, describe, translate
from optimizer.run.engines import RunnerSpec, build_runner
from optimizer.run.executor import TrialHandle, TrialSession
from optimizer.run.ray_cluster import (
    cluster_nodes,
    live_gpus,
    placement_problem,
    ray_lost,
    reap_on_other_nodes,
)
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
            ref = self.actor.poll.remote()
            if not wait_watching([ref], timeout_s):
                raise WorkerLost(f"worker did not answer a poll ({ray_lost() or 'timed out'})")
            steps: list[StepMetrics] = ray.get(ref, timeout=timeout_s)
        except _POLL_ERRORS as exc:
            raise translate(exc, f"worker did not answer a poll ({type(exc).__name__})",
                            into=WorkerLost) from exc
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
            cancelled = self.actor.cancel.remote()
            if wait_watching([cancelled], timeout_s):
                ray.get(cancelled, timeout=timeout_s)
                wait_watching([self.ref], timeout_s)
        except Exception:  # a dead worker: its engine is reaped from the registry
            logger.debug("cancel failed", exc_info=True)


def wait_watching(refs: Sequence[Any], timeout_s: float, *, slice_s: float = 1.0) -> bool:
    """Whether every one of `refs` is ready within `timeout_s`, waited for in slices of
    `slice_s`: False at once when the Ray under the daemon is gone (`ray_lost`). A call on a
    dead worker waits out its whole timeout when Ray's GCS, which would say the actor died, is
    gone with it: a stop's cancel then held the daemon for its 120 s, past the signal that had
    ended its Ray too."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        ready, _ = ray.wait(list(refs), num_returns=len(refs),
                            timeout=max(0.0, min(slice_s, remaining)))
        if len(ready) == len(refs):
            return True
        if ray_lost() is not None or time.monotonic() >= deadline:
            return False


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
            if not wait_watching([ref], timeout_s):
                if (lost := ray_lost()) is not None:  # nothing left to cancel or ask
                    logger.error("%s: this daemon can place no trial", lost)
                    return "raylet_died"
                raise GetTimeoutError(f"not placed within {timeout_s:g} s")
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

    def lost(self) -> str | None:
        return ray_lost()

    def abandon(self) -> None:
        self._slots.clear()  # Ray is gone: its actors with it

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
        if ray_lost() is not None:
            return  # Ray is gone: its actors with it, and nothing there to ask
        try:
            ray.kill(slot.actor)
        except Exception:  # already dead: nothing to release
            logger.debug("actor already gone", exc_info=True)

    def shutdown(self) -> None:
        for slot in list(self._slots):
            if ray_lost() is not None:
                self._slots.clear()  # Ray is gone: its actors with it
                return
            try:
                done = slot.actor.shutdown.remote()
                if wait_watching([done], 60.0):
                    ray.get(done, timeout=60)
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
