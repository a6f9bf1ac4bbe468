"""Where trials run: the `Executor` protocol the daemon dispatches to, `TrialSession` (a runner
relaying each load level and waiting for the verdict), and `InlineExecutor`, which runs trials
on threads of this process (tests, the replay). The Ray pool
(`optimizer.run.ray_executor.RayExecutor`) is the other implementation; it and
`optimizer.run.ray_cluster` alone import Ray.

A trial's life on an executor: `submit` starts it (the caller checked `can_start`), the caller
`poll`s its handle for each load level's figures and answers each with `decide` (stop or go
on), `wait_any` says which handles have ended, `result` gives the `RunResult` (a lost worker is
a failed result, never an exception), and `release` returns its GPUs.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from optimizer.errors import describe
from runners.base import (
    EngineConfig,
    Failure,
    FailureReason,
    Runner,
    RunResult,
    StepMetrics,
)
from runners.workload import Workload

DECISION_TIMEOUT_S = 3600.0  # a driver that never answers is dead (Ray then kills its workers)

# The OSErrors that are the host's doing: its permissions, its paths, a full or read-only disk,
# its limit on open files. Others (a socket's TimeoutError, ConnectionError, BrokenPipeError,
# ENOENT...) come from our code as often as not and stay `internal`, not retried.
_HOST_OSERRORS: tuple[type[OSError], ...] = (PermissionError, FileExistsError, IsADirectoryError,
                                             NotADirectoryError)
_HOST_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EMFILE, errno.ENFILE})


def is_host_refusal(exc: OSError) -> bool:
    """Whether an OSError escaping a runner is the host refusing the trial's files or
    processes (`host_error`, retried once) rather than a bug of ours (`internal`)."""
    return isinstance(exc, _HOST_OSERRORS) or exc.errno in _HOST_ERRNOS


class TrialSession:
    """Runs one trial at a time on a `Runner`, relaying each load level to the driver and
    waiting for its decision. `run` blocks in one thread while the driver calls `poll`,
    `decide` and `cancel` from others (a Ray actor with max_concurrency > 1, or a thread)."""

    def __init__(self, runner: Runner) -> None:
        self._runner = runner
        self._cond = threading.Condition()
        self._pending: list[StepMetrics] = []
        self._decisions: dict[int, bool] = {}
        self._cancelled = False

    def run(self, config: EngineConfig, workload: Workload, workdir: str) -> RunResult:
        with self._cond:
            self._pending.clear()
            self._decisions.clear()
            self._cancelled = False
        try:
            result: RunResult = self._runner.run(config, workload, Path(workdir), self._on_step)
        except Exception as exc:  # the runner tore its engine down before raising
            if self._cancelled:  # stopped in flight: whatever the run raised after that
                return RunResult(status="failed", failure=Failure(
                    FailureReason.INTERRUPTED,
                    f"the daemon was stopped with this trial in flight (the run then raised "
                    f"{describe(exc)})."))
            if not isinstance(exc, OSError) or not is_host_refusal(exc):
                raise  # a bug of ours: the handle records it as internal
            return RunResult(status="failed", failure=Failure(
                FailureReason.HOST_ERROR,
                f"the host refused the trial's files or processes ({describe(exc)})."))
        if self._cancelled:
            return RunResult(status="failed", steps=result.steps, engine=result.engine,
                             argv=result.argv, env=result.env, server_log=result.server_log,
                             workdir=result.workdir, wall_s=result.wall_s, host=result.host,
                             engine_started_unix_s=result.engine_started_unix_s,
                             engine_ended_unix_s=result.engine_ended_unix_s,
                             failure=Failure(FailureReason.INTERRUPTED,
                                             "the daemon was stopped with this trial in flight."))
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

    def shutdown(self) -> None:
        self._runner.close()


class TrialHandle(Protocol):
    """The driver's view of one submitted trial."""

    def poll(self) -> list[StepMetrics]:
        """The load levels measured since the last poll (raises `WorkerLost` if the worker
        does not answer; its result then says what happened)."""
        ...

    def decide(self, step: int, stop: bool) -> None:
        """Answer a polled level: `stop=True` ends the trial there (pruned)."""
        ...

    def result(self) -> RunResult:
        """The finished run (call once `wait_any` returned the handle)."""
        ...

    def cancel(self) -> None:
        """Stop the trial now; its engine is killed."""
        ...

    def is_placed(self) -> bool:
        """Whether the trial's worker exists (Ray may hold one back while no node offers what
        it asks for); a stop ends an unplaced trial at once, as it launched nothing."""
        ...


class Executor(Protocol):
    """GPUs and the workers that own them. Called by the daemon's loop only (one thread)."""

    total_gpus: int  # shrinks when a cluster node dies

    def can_start(self, num_gpus: int) -> bool: ...

    def submit(self, config: EngineConfig, workload: Workload, workdir: Path) -> TrialHandle: ...

    def wait_any(self, handles: Sequence[TrialHandle], timeout_s: float) -> list[TrialHandle]:
        """The handles whose run has ended, after at most `timeout_s`."""
        ...

    def release(self, handle: TrialHandle, *, healthy: bool) -> None:
        """Free the trial's GPUs; `healthy=False` discards its worker."""
        ...

    def shrink_to_live(self, timeout_s: float = 30.0, *, placing_gpus: int = 0) -> int:
        """After a worker or node died: plan with the GPUs that can still be had; returns them
        (0: nothing can run, stop). With `placing_gpus` (a lost worker), first prove a task
        needing that many is placed within `timeout_s`; else wait up to `timeout_s` for a dead
        node to be counted out."""
        ...

    def reap_elsewhere(self, registry_dir: Path) -> dict[str, list[int]]:
        """Kill engines a dead daemon left on other machines (node id -> pids)."""
        ...

    def placement_problem(self) -> str | None:
        """Why no live node can hold a trial's worker now (the study's `ray.accelerator_type`
        or `ray.resources`: the node that offered it is gone), one line naming the field and
        the fix; None when one can, or where it cannot be said."""
        ...

    def lost(self) -> str | None:
        """Why no trial can run or be reached any more (the local Ray's GCS or raylet ended
        under the daemon, or a joined cluster's GCS stopped answering), or None. Cheap: the
        daemon asks on every turn of its loop."""
        ...

    def abandon(self) -> None:
        """Forget every worker without asking the infrastructure `lost` named (it would not
        answer); their engines are reaped from the registry."""
        ...

    def shutdown(self) -> None: ...


class _InlineHandle:
    def __init__(self, session: TrialSession, num_gpus: int) -> None:
        self.session = session
        self.num_gpus = num_gpus
        self.done = threading.Event()
        self._result: RunResult | None = None
        self._error: BaseException | None = None

    def _run(self, config: EngineConfig, workload: Workload, workdir: Path) -> None:
        try:
            self._result = self.session.run(config, workload, str(workdir))
        except BaseException as exc:  # surfaced as a failed result, as a lost worker is
            self._error = exc
        finally:
            self.done.set()

    def poll(self) -> list[StepMetrics]:
        return self.session.poll()

    def decide(self, step: int, stop: bool) -> None:
        self.session.decide(step, stop)

    def result(self) -> RunResult:
        self.done.wait()
        if self._result is not None:
            return self._result
        return RunResult(status="failed", failure=Failure(
            FailureReason.INTERNAL, f"the trial raised: {type(self._error).__name__}: "
                                    f"{str(self._error)[:300]}"))

    def cancel(self) -> None:
        self.session.cancel()
        self.done.wait(timeout=120)

    def is_placed(self) -> bool:
        return True  # a thread of this process, started at submit


class InlineExecutor:
    """Trials on threads of this process, each on a runner from `make_runner`: no Ray, no
    processes of its own; for tests and replays of the shipped policy."""

    def __init__(self, make_runner: Callable[[], Runner], total_gpus: int) -> None:
        self.make_runner = make_runner
        self.total_gpus = total_gpus
        self._running: list[_InlineHandle] = []

    def can_start(self, num_gpus: int) -> bool:
        return sum(h.num_gpus for h in self._running) + num_gpus <= self.total_gpus

    def submit(self, config: EngineConfig, workload: Workload, workdir: Path) -> TrialHandle:
        handle = _InlineHandle(TrialSession(self.make_runner()), config.num_gpus)
        self._running.append(handle)
        threading.Thread(target=handle._run, args=(config, workload, workdir), daemon=True,
                         name="nightshift-inline-trial").start()
        return handle

    def wait_any(self, handles: Sequence[TrialHandle], timeout_s: float) -> list[TrialHandle]:
        inline = [h for h in handles if isinstance(h, _InlineHandle)]
        if inline and not any(h.done.is_set() for h in inline):
            inline[0].done.wait(timeout_s)  # ends early only for the first; polled again soon
        return [h for h in inline if h.done.is_set()]

    def release(self, handle: TrialHandle, *, healthy: bool) -> None:
        if isinstance(handle, _InlineHandle) and handle in self._running:
            self._running.remove(handle)
            handle.session.shutdown()

    def shrink_to_live(self, timeout_s: float = 30.0, *, placing_gpus: int = 0) -> int:
        return self.total_gpus

    def reap_elsewhere(self, registry_dir: Path) -> dict[str, list[int]]:
        return {}  # one machine: the daemon reaps its own registry

    def placement_problem(self) -> str | None:
        return None  # threads of this process: nothing to place

    def lost(self) -> str | None:
        return None  # threads of this process: they end with it

    def abandon(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        for handle in list(self._running):
            handle.cancel()
            self.release(handle, healthy=False)
