"""What the daemon does when the executor loses what runs its trials (`WorkerLoss`, the
daemon's base): its infrastructure gone under it (a local Ray's GCS or raylet ended), a worker or
a node lost with a trial on it (the GPUs left, the engines reaped), or a trial held unplaced while
no live node offers its placement any more."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from optimizer.errors import NightshiftError
from optimizer.run.executor import Executor, TrialHandle
from optimizer.search.controller import SearchController
from optimizer.search.trials import Running
from runners.base import Failure, FailureReason, RunResult
from runners.process import reap_strays

logger = logging.getLogger(__name__)

# How long a task on a lost worker's GPUs may take to be placed: a worker starts in seconds,
# and Ray fails it within seconds where its local raylet died (the study then stops). Under
# 60 s: a Ray whose GCS is gone ends the driver after 60 s.
_PLACEMENT_TIMEOUT_S = 30.0
# While a trial's worker waits unplaced, the cluster is asked at most this often whether any
# live node still offers the study's ray.accelerator_type / ray.resources.
_PLACEMENT_CHECK_S = 30.0


@dataclass
class InFlight:
    """A trial in flight: the search's record of it, its handle on the executor, its work
    directory."""

    running: Running
    handle: TrialHandle
    workdir: Path


class WorkerLoss:
    """The lost-worker side of `optimizer.run.daemon.Daemon`, its base: a trial whose worker,
    node or infrastructure is gone is failed and re-queued, never waited on for ever. Reads and
    writes the daemon's state declared here."""

    executor: Executor
    registry_dir: Path
    resume: str
    _inflight: list[InFlight]
    _placement_checked_at: float | None  # monotonic s (_watch_placement)

    @property
    def stopping(self) -> bool:
        raise NotImplementedError  # the daemon's

    def request_stop(self, now: bool = False) -> None:
        raise NotImplementedError  # the daemon's

    def _watch_placement(self) -> None:
        """A trial Ray holds unplaced while no live node offers the study's placement any
        more (its node gone) would wait for ever: the study fails in one line naming the field
        and the fix (its trials are stopped and re-queued on the way out)."""
        now = time.monotonic()
        if self.stopping or (self._placement_checked_at is not None and
                             now - self._placement_checked_at < _PLACEMENT_CHECK_S) or \
                all(item.handle.is_placed() for item in self._inflight):
            return
        self._placement_checked_at = now
        problem = self.executor.placement_problem()
        if problem is not None:
            raise NightshiftError(f"{problem}; the trials in flight were stopped and are "
                                  "re-queued for the resume.")

    def _watch_infrastructure(self, policy: SearchController) -> None:
        """The executor's infrastructure gone under the daemon (its local Ray's GCS or raylet
        ended: systemd's KillMode=control-group signals every process of the unit, Ray's
        too): no trial in flight can finish or be asked anything. Each is failed and
        re-queued without a word to Ray (interrupted where a stop was asked, else lost with
        its node), the executor forgets its workers and the study stops now; the wind-down
        then reaps their engines from the registry and the study ends "stopped" with its
        resume line, rather than in Ray's abort once its GCS reconnect window passes."""
        lost = self.executor.lost()
        if lost is None:
            return
        if self._inflight or not self.stopping:
            logger.error("%s; stopping now (the trials in flight are re-queued); resume with "
                         "`%s`", lost, self.resume)
        for item in list(self._inflight):
            self._inflight.remove(item)
            reason = FailureReason.INTERRUPTED if self.stopping else FailureReason.NODE_LOST
            policy.on_result(item.running, RunResult(
                status="failed", steps=tuple(item.running.steps),
                failure=Failure(reason, f"{lost}, with this trial in flight.")))
        self.executor.abandon()
        self.request_stop(now=True)

    def _release(self, policy: SearchController, item: InFlight, result: RunResult) -> RunResult:
        """Give the ended trial's worker back to the executor, and where the worker or its node
        was lost, what is left: the GPUs Ray can still give, its engines reaped, the steps it
        measured. The result to record."""
        number = item.running.trial.number
        is_lost = result.failure is not None and result.failure.reason in (
            FailureReason.WORKER_LOST, FailureReason.NODE_LOST, FailureReason.INTERNAL)
        self.executor.release(item.handle, healthy=not is_lost)
        reason = result.failure.reason if result.failure is not None else None
        if reason in (FailureReason.NODE_LOST, FailureReason.WORKER_LOST):
            # A lost worker may be a lost node too: the local raylet gone takes every worker
            # with it, Ray's GCS counts it alive for seconds more, and a trial launched on it
            # would wait forever. So a task on a lost worker's GPUs is placed first (30 s at
            # most; Ray says within seconds that its raylet died); a dead node is waited for
            # until Ray counts it out. Ray not answering (its GCS gone) leaves no GPU.
            before = policy.total_gpus
            lost = self.executor.lost()
            if lost is not None:  # the local Ray itself is gone: nothing to ask it
                logger.error("trial %d: %s", number, lost)
                self.executor.abandon()
                policy.total_gpus = 0
            elif reason == FailureReason.WORKER_LOST:
                policy.total_gpus = self.executor.shrink_to_live(
                    timeout_s=_PLACEMENT_TIMEOUT_S,
                    placing_gpus=item.running.config.num_gpus)
                if policy.total_gpus < before:
                    logger.warning("trial %d: its worker died and Ray can give %d GPUs now "
                                   "(%d before)", number, policy.total_gpus, before)
            else:
                policy.total_gpus = self.executor.shrink_to_live(timeout_s=30.0)
                logger.warning("trial %d: a Ray node died; %d GPUs left", number,
                               policy.total_gpus)
            if policy.total_gpus < 1:
                logger.error("Ray can give no GPU to a trial now; stopping now (the trials in "
                             "flight are re-queued); resume with `%s` once Ray is back",
                             self.resume)
                self.request_stop(now=True)
        if is_lost:  # the worker died; its engine, in a session of its own, did not
            reaped = reap_strays(self.registry_dir, under=item.workdir)
            if reaped:
                logger.warning("trial %d: reaped engines %s of its dead worker", number, reaped)
        if is_lost and not result.steps:
            result = RunResult(status="failed", steps=tuple(item.running.steps),
                               failure=result.failure)
        return result
