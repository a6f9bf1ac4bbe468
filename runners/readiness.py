"""Readiness and warm-up of a launched engine: /health *and* one real completion (an engine
may JIT-compile kernels on its first requests; a stopped leader is a hang, an idle CPU is not),
then the warm-up requests before anything is measured.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from runners.base import EngineInfo, Failure, FailureReason
from runners.load_level import LoadLevel
from runners.loadgen.level import run_level_sync
from runners.loadgen.requests import build_requests
from runners.process import EngineProcess, tail, wait_healthy
from runners.session import Abort, EngineSession

logger = logging.getLogger(__name__)

_READINESS_ATTEMPTS = 3


class _StopWatch:
    """Watches an engine's leader from a thread while its readiness completion waits, and sets
    `stop` once it was stopped (SIGSTOP, a debugger) over all of `window_s`; `reason` then says
    so. Using no CPU is no sign: an engine waiting on another's JIT build (FlashInfer guards a
    shared cache with a file lock) or on workers outside its process tree idles while it
    makes progress. A use: `with _StopWatch(...) as w:`."""

    def __init__(self, proc: EngineProcess, window_s: float, stop: threading.Event) -> None:
        self.proc = proc
        self.window_s = window_s
        self.stop = stop
        self.reason: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="nightshift-stop-watch")

    def __enter__(self) -> _StopWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        interval_s = min(1.0, self.window_s / 5)
        stopped_since: float | None = None  # monotonic s of the first stopped sample in a row
        while not self._done.wait(interval_s):
            now = time.monotonic()
            if not self.proc.is_stopped():
                stopped_since = None
                continue
            stopped_since = now if stopped_since is None else stopped_since
            if now - stopped_since >= self.window_s:
                self.reason = "its process was stopped"
                self.stop.set()
                return


def await_ready(session: EngineSession) -> EngineInfo:
    """Wait for /health and one completion; what the engine's log says of its start. Raises
    `Abort` for an engine that exited, timed out or hung on its first completion."""
    s, proc, workload = session, session.proc, session.workload
    state = wait_healthy(s.base_url, proc, workload.startup_timeout_s, api_key=s.api_key)
    if state == "exited":
        raise Abort(s.failure("startup"))
    if state == "timeout":
        raise Abort(Failure(
            FailureReason.STARTUP_TIMEOUT,
            f"{s.name} did not become ready within {workload.startup_timeout_s:g} s (pid "
            f"{proc.pid}); see {s.log_path} or raise workload.startup_timeout_s.",
            s.log_excerpt()))
    # Readiness is /health *and* one real completion: /health can answer before the
    # engine serves (and a dead engine core answers 503 only later). A live engine that
    # only answers errors is not a start-up crash: the load levels judge it.
    probe = build_requests(
        replace(workload, prompts_file=None, trace=None, shared_prefix=None,
                dataset=None, multi_turn=None), 1,
        seed=workload.seed)
    for attempt in range(_READINESS_ATTEMPTS):
        # The first completion may take minutes: an engine may JIT-compile kernels on its
        # first requests (online fp8_per_block on the H200: 306 s from launch to its first
        # completion against 153 s plain, docs/simulated-engine.md). So it is cut as a
        # stall only after the rest of startup_timeout_s (stall_timeout_s at least), and
        # early only when, for stall_timeout_s, the engine's leader was stopped (an idle
        # CPU is no sign: it may wait on another engine's JIT build).
        rest_s = workload.startup_timeout_s - (time.monotonic() - s.started)
        stall_s = max(s.stall_timeout_s, rest_s)
        bound = "the rest of startup_timeout_s" if rest_s >= s.stall_timeout_s else \
            "stall_timeout_s"
        stop = threading.Event()
        with _StopWatch(proc, s.stall_timeout_s, stop) as watch:
            level = run_level_sync(
                s.base_url, s.config.served_model_name, probe, LoadLevel(max_concurrency=1),
                workload.slo, timeout_s=workload.request_timeout_s,
                seed=workload.seed + attempt, stall_timeout_s=stall_s, stop_event=stop,
                api_key=s.api_key)
        if level.metrics.completed >= 1:
            break
        if not proc.is_alive() or proc.wait(timeout_s=0.5) is not None:
            raise Abort(s.failure("startup"))
        if watch.reason is not None:
            raise Abort(Failure(
                FailureReason.HANG,
                f"{s.name} (pid {proc.pid}) answered /health but produced no token on its "
                f"readiness completion, and {watch.reason} for {s.stall_timeout_s:g} s; see "
                f"{s.log_path}.", s.log_excerpt()))
        if level.stalled:
            raise Abort(Failure(
                FailureReason.HANG,
                f"{s.name} (pid {proc.pid}) answered /health but produced no token for "
                f"{stall_s:.0f} s ({bound}) on its readiness completion; see {s.log_path} or "
                "raise workload.startup_timeout_s.",
                s.log_excerpt()))
        error = level.outputs[0].error if level.outputs else "no answer"
        logger.warning("readiness completion %d failed (%s)", attempt + 1, error[:200])
        time.sleep(1.0)
    info = s.launcher.parse_log(tail(s.log_path, 4_000_000))
    if info.startup_s is not None:
        return info  # the simulated engine reports its modelled start-up (time-scaled here)
    return replace(info, startup_s=time.monotonic() - s.started)


def warm_up(session: EngineSession) -> None:
    """`workload.num_warmup_requests` sent closed-loop (at most the first level's concurrency,
    8 for a rate) before anything is measured."""
    workload = session.workload
    if workload.num_warmup_requests <= 0:
        return
    requests = build_requests(workload, workload.num_warmup_requests,
                                      seed=workload.seed + 7919)
    first = workload.capacity.level(workload.capacity.low) if workload.capacity else \
        workload.levels[0]
    level = LoadLevel(max_concurrency=min(first.max_concurrency or 8,
                                          workload.num_warmup_requests))
    run_level_sync(session.base_url, session.config.served_model_name, requests, level,
                           workload.slo, timeout_s=workload.request_timeout_s,
                           seed=workload.seed, stall_timeout_s=session.stall_timeout_s,
                           api_key=session.api_key)
    if not session.proc.is_alive():
        raise Abort(session.failure("run"))
