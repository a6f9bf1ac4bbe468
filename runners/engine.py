"""`EngineRunner`: the life cycle every HTTP engine shares — launch in its own process group,
readiness, warm-up, load levels, optional profile window, teardown — around an `EngineLauncher`
that knows one engine's argv and log (vLLM or the simulated engine).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from runners import arrivals, conversations, prometheus, staircase
from runners.base import (
    EngineConfig,
    EngineInfo,
    EngineLauncher,
    Failure,
    FailureReason,
    OnStep,
    RunResult,
    RunStatus,
    StepMetrics,
)
from runners.capacity import meets_slo
from runners.capacity_search import CapacitySearch, Probe
from runners.credentials import (
    API_KEY_ENV,
    auth_headers,
    launch_secrets,
    new_api_key,
    redact_argv,
    redact_env,
    scrub,
    scrub_file,
)
from runners.load_level import LoadLevel
from runners.loadgen.level import run_level_sync
from runners.loadgen.metrics import compute_metrics, prompt_len_gap
from runners.loadgen.requests import build_requests
from runners.process import EngineProcess, free_port, tail, wait_healthy
from runners.quality import QualityRun, run_eval
from runners.telemetry import TelemetrySampler
from runners.vllm.compile_cache import FORCE_AOT_LOAD
from runners.vllm.compile_ledger import append_entry, entry_of
from runners.workload import LengthDistribution, QualityEval, Workload

logger = logging.getLogger(__name__)

LOG_TAIL_BYTES = 64_000
_RUNTIME_LOG_BYTES = 8_000_000  # the log's end read after the load (per-request access lines)
_DURATION_POOL = 4096  # requests synthesised for a duration-bound level (cycled)
_STREAM_POOL = 8192  # a file's or dataset's requests a capacity stream takes before it cycles
_READINESS_ATTEMPTS = 3
_TRACE_ARTIFACT_EVENTS = 20_000
_LONG_TRACE_GAP_S = 60.0  # a replayed trace idle this long is worth a word in the log
_TRACE_SETTLE_TIMEOUT_S = 120.0  # a large eager trace takes seconds to write and gzip


class _Abort(Exception):
    """Ends a run early with a classified failure (internal control flow only)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure




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


class EngineRunner:
    """A `Runner` for engines that speak vLLM's OpenAI-compatible HTTP API.

    One engine at a time; `run` always tears its engine down (process group, then strays), also
    when the caller's `on_step` raises. Engine pids are recorded under `registry_dir` so a
    restarted daemon can reap what a crashed one left behind (`process.reap_strays`).
    With `ledger_writer` ("study:<name>", "regress:<case>"), each start whose log says warm or
    cold is appended to the compile ledger of the cache root it used
    (runners/vllm/compile_ledger.py); None (a per-trial cache) writes nothing.
    """

    def __init__(self, launcher: EngineLauncher, registry_dir: Path, *,
                 stall_timeout_s: float = 120.0, port_retries: int = 2,
                 gpu_indices: tuple[int, ...] | None = None,
                 ledger_writer: str | None = None) -> None:
        self.launcher = launcher
        self.ledger_writer = ledger_writer
        self.registry_dir = registry_dir
        self.stall_timeout_s = stall_timeout_s
        self.port_retries = port_retries
        self.gpu_indices = gpu_indices
        self._proc: EngineProcess | None = None
        # The running engine's API key (a new one per launch, given in its environment): only
        # this process holds it, so no other local user can drive or disturb the engine.
        self._api_key: str | None = None
        self._sampler: TelemetrySampler | None = None  # NVML over the levels of this run

    def run(self, config: EngineConfig, workload: Workload, workdir: Path,
            on_step: OnStep | None = None) -> RunResult:
        workdir.mkdir(parents=True, exist_ok=True)
        result = self._run_once(config, workload, workdir, on_step)
        for _ in range(self.port_retries):
            if result.failure is None or result.failure.reason != FailureReason.PORT_IN_USE:
                break
            logger.info("port taken before the engine bound it; relaunching")
            result = self._run_once(config, workload, workdir, on_step)
        if result.failure is not None and \
                result.failure.reason == FailureReason.COMPILE_CACHE_MISS and \
                config.env.get(FORCE_AOT_LOAD) == "1":
            # The warm-cache check (startup.verify_warm) refused: a wrong prediction, never
            # the trial's outcome. Start again as any trial starts, and say it was refused.
            logger.info("the compile cache predicted warm was not (%s); relaunching without "
                        "%s", result.failure.message, FORCE_AOT_LOAD)
            refused = (workdir / "server.log").read_text(errors="replace") \
                if (workdir / "server.log").is_file() else ""
            (workdir / "server.aot-refused.log").write_text(refused)
            plain = replace(config, env={k: v for k, v in config.env.items()
                                         if k != FORCE_AOT_LOAD})
            result = self.run(plain, workload, workdir, on_step)
            result = replace(result, engine=replace(result.engine, is_warm_check_refused=True))
        return result

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc = None

    # -- one launch -------------------------------------------------------------------------

    def _run_once(self, config: EngineConfig, workload: Workload, workdir: Path,
                  on_step: OnStep | None) -> RunResult:
        started = time.monotonic()
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        profile_dir = workdir / "profile" if workload.profile else None
        if profile_dir is not None:
            profile_dir.mkdir(parents=True, exist_ok=True)
        argv, env = self.launcher.command(config, port, workdir, profile_dir)
        self._api_key = new_api_key()
        launch_env = {**env, API_KEY_ENV: self._api_key}
        # What the engine may print of its secrets (an echoed token, its key) is scrubbed from
        # its log and failure before anything reads them for a record, MLflow or a message.
        secrets_ = launch_secrets(argv, {**os.environ, **launch_env})
        log_path = workdir / "server.log"
        steps: list[StepMetrics] = []
        engine = EngineInfo()
        status: RunStatus = "complete"
        failure: Failure | None = None
        trace_path: Path | None = None
        trace_summary: Mapping[str, Any] | None = None
        telemetry: dict[str, float] = {}
        quality: QualityRun | None = None
        proc = EngineProcess.start(argv, launch_env, log_path, self.registry_dir)
        engine_started_unix_s = time.time()
        self._proc = proc
        logger.info("engine %s started (pid %d, port %d)", self.launcher.name, proc.pid, port)
        try:
            engine = self._await_ready(proc, base_url, config, workload, log_path, started)
            self._record_compile(config, env, engine)
            self._warm_up(base_url, config, workload, proc, log_path)
            sampler = TelemetrySampler(self.gpu_indices)
            sampler.start()
            self._sampler = sampler
            try:
                status = self._drive_levels(proc, base_url, config, workload, log_path,
                                            started, steps, on_step)
            finally:
                self._sampler = None
                telemetry = sampler.stop()
            if workload.quality is not None and status == "complete":
                quality = self._quality(base_url, config, workload.quality, workdir)
            # What the log says of the load itself (kernels compiled while serving), read once
            # the measured levels are over.
            served = self.launcher.parse_log(tail(log_path, _RUNTIME_LOG_BYTES))
            engine = replace(engine, num_runtime_jit_compiles=served.num_runtime_jit_compiles)
            if workload.profile and status == "complete" and profile_dir is not None:
                trace_path, trace_summary = self._profile(base_url, config, workload, steps,
                                                          profile_dir)
        except _Abort as abort:
            status, failure = "failed", replace(
                abort.failure, message=scrub(abort.failure.message, secrets_),
                log_excerpt=scrub(abort.failure.log_excerpt, secrets_))
            logger.info("engine run failed: %s: %s", failure.reason, failure.message)
        finally:
            proc.terminate()
            engine_ended_unix_s = time.time()
            self._proc = None
            self._api_key = None
            scrub_file(log_path, secrets_)
        search = workload.capacity
        probes = [(search.load_of(s.level), bool(s.meets_slo)) for s in steps
                  if s.meets_slo is not None] if search is not None else []
        return RunResult(
            status=status,
            steps=tuple(steps),
            capacity=search.bracket(probes) if search is not None and probes else None,
            failure=failure,
            engine=engine,
            # What is recorded names each secret, never its value (runners/credentials.py).
            argv=tuple(redact_argv(argv)),
            env=redact_env(env),
            server_log=tail(log_path, LOG_TAIL_BYTES),
            workdir=workdir,
            trace_summary=trace_summary,
            trace_path=trace_path,
            telemetry=telemetry,
            wall_s=time.monotonic() - started,
            engine_started_unix_s=engine_started_unix_s,
            engine_ended_unix_s=engine_ended_unix_s,
            quality=quality,
        )

    def _record_compile(self, config: EngineConfig, env: Mapping[str, str],
                        engine: EngineInfo) -> None:
        """Tell the other processes on this cache root that this key is on disk now. Only a
        root named in the launch (the launcher's, or the config's VLLM_CACHE_ROOT): vLLM's own
        default root is never written to."""
        root = env.get("VLLM_CACHE_ROOT") or config.env.get("VLLM_CACHE_ROOT")
        if self.ledger_writer is None or not root:
            return
        entry = entry_of(config, engine, engine_name=self.launcher.name,
                         writer=self.ledger_writer)
        if entry is not None:
            append_entry(root, entry)

    def _failure(self, proc: EngineProcess, log_path: Path, phase: str) -> Failure:
        proc.wait(timeout_s=5.0)
        text = tail(log_path, LOG_TAIL_BYTES)
        return self.launcher.classify_failure(text, proc.returncode,
                                              "startup" if phase == "startup" else "run")

    def _await_ready(self, proc: EngineProcess, base_url: str, config: EngineConfig,
                     workload: Workload, log_path: Path, started: float) -> EngineInfo:
        state = wait_healthy(base_url, proc, workload.startup_timeout_s,
                             api_key=self._api_key)
        if state == "exited":
            raise _Abort(self._failure(proc, log_path, "startup"))
        if state == "timeout":
            raise _Abort(Failure(
                FailureReason.STARTUP_TIMEOUT,
                f"{self.launcher.name} did not become ready within "
                f"{workload.startup_timeout_s:g} s (pid {proc.pid}); see {log_path} or raise "
                "workload.startup_timeout_s.",
                tail(log_path, 2000)))
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
            rest_s = workload.startup_timeout_s - (time.monotonic() - started)
            stall_s = max(self.stall_timeout_s, rest_s)
            bound = "the rest of startup_timeout_s" if rest_s >= self.stall_timeout_s else \
                "stall_timeout_s"
            stop = threading.Event()
            with _StopWatch(proc, self.stall_timeout_s, stop) as watch:
                level = run_level_sync(
                    base_url, config.served_model_name, probe, LoadLevel(max_concurrency=1),
                    workload.slo, timeout_s=workload.request_timeout_s,
                    seed=workload.seed + attempt, stall_timeout_s=stall_s, stop_event=stop,
                    api_key=self._api_key)
            if level.metrics.completed >= 1:
                break
            if not proc.is_alive() or proc.wait(timeout_s=0.5) is not None:
                raise _Abort(self._failure(proc, log_path, "startup"))
            if watch.reason is not None:
                raise _Abort(Failure(
                    FailureReason.HANG,
                    f"{self.launcher.name} (pid {proc.pid}) answered /health but produced no "
                    f"token on its readiness completion, and {watch.reason} for "
                    f"{self.stall_timeout_s:g} s; see {log_path}.", tail(log_path, 2000)))
            if level.stalled:
                raise _Abort(Failure(
                    FailureReason.HANG,
                    f"{self.launcher.name} (pid {proc.pid}) answered /health but produced no "
                    f"token for {stall_s:.0f} s ({bound}) on its readiness completion; see "
                    f"{log_path} or raise workload.startup_timeout_s.",
                    tail(log_path, 2000)))
            error = level.outputs[0].error if level.outputs else "no answer"
            logger.warning("readiness completion %d failed (%s)", attempt + 1, error[:200])
            time.sleep(1.0)
        info = self.launcher.parse_log(tail(log_path, 4_000_000))
        if info.startup_s is not None:
            return info  # the simulated engine reports its modelled start-up (time-scaled here)
        return replace(info, startup_s=time.monotonic() - started)

    def _warm_up(self, base_url: str, config: EngineConfig, workload: Workload,
                 proc: EngineProcess, log_path: Path) -> None:
        if workload.num_warmup_requests <= 0:
            return
        requests = build_requests(workload, workload.num_warmup_requests,
                                  seed=workload.seed + 7919)
        first = workload.capacity.level(workload.capacity.low) if workload.capacity else \
            workload.levels[0]
        level = LoadLevel(max_concurrency=min(first.max_concurrency or 8,
                                              workload.num_warmup_requests))
        run_level_sync(base_url, config.served_model_name, requests, level,
                       workload.slo, timeout_s=workload.request_timeout_s,
                       seed=workload.seed, stall_timeout_s=self.stall_timeout_s,
                       api_key=self._api_key)
        if not proc.is_alive():
            raise _Abort(self._failure(proc, log_path, "run"))

    def _drive_levels(self, proc: EngineProcess, base_url: str, config: EngineConfig,
                      workload: Workload, log_path: Path, started: float,
                      steps: list[StepMetrics], on_step: OnStep | None) -> RunStatus:
        search = workload.capacity
        if search is None:
            for index, level in enumerate(workload.levels):
                step = self._measure_repeated(proc, base_url, config, workload, log_path,
                                              started, index, level)
                steps.append(step)
                if on_step is not None and on_step(step):
                    return "stopped"
            return "complete"
        if workload.multi_turn is None and workload.trace is None:
            return self._drive_staircase(proc, base_url, config, workload, log_path, started,
                                         steps, on_step)
        # A trace replays its own arrival pattern and a conversation its own turns: each probe
        # is a level of its own, bounded by probe_duration_s (not a steady-state window).
        history: list[Probe] = []
        while (load := search.next_load(history)) is not None:
            index = len(history)
            step = self._measure_repeated(proc, base_url, config, workload, log_path, started,
                                          index, search.level(load),
                                          max_duration_s=search.probe_duration_s)
            ok = meets_slo(step.metrics, workload.slo, workload.max_failed_fraction,
                           step.server_metrics.get("is_saturated", 0.0) > 0)
            step = replace(step, meets_slo=ok)
            served = search.served_of(
                step.metrics, step.server_metrics,
                mean_input_tokens=None if workload.prompts_file or workload.dataset
                or workload.multi_turn else _mean_prompt_tokens(workload),
                mean_output_tokens=None if workload.trace else
                _mean_tokens(workload.output_len))
            history.append((load, ok, served))
            steps.append(step)
            logger.info("capacity probe %d at %s: SLO %s (served %s); bracket %s", index,
                        step.level.label, "met" if ok else "missed",
                        "?" if served is None else f"{served:.3g}",
                        search.bracket(history).describe())
            if on_step is not None and on_step(step):
                return "stopped"
        return "complete"

    def _drive_staircase(self, proc: EngineProcess, base_url: str, config: EngineConfig,
                         workload: Workload, log_path: Path, started: float,
                         steps: list[StepMetrics], on_step: OnStep | None) -> RunStatus:
        """The capacity search on one continuous stream of requests (runners/staircase.py):
        each probe is a step of the staircase, judged on its steady-state window."""
        search = workload.capacity
        assert search is not None
        self._reset_prefix_cache(base_url)  # once: the stream's hit rate is its steady one
        is_text = workload.prompts_file is not None or workload.dataset is not None
        # A file's or a dataset's requests in one pass of up to _STREAM_POOL (then cycled, with
        # the loader's warning where the source holds fewer); synthesised ones drawn afresh.
        requests = staircase.endless_requests(
            lambda num, seed: build_requests(workload, num, seed=seed),
            _STREAM_POOL if is_text else 512, workload.seed * 1000, is_finite_source=is_text)
        history: list[Probe] = []
        lifetime_s = staircase.lifetime_estimate_s(workload)
        met_loads: list[float] = []

        def check_engine() -> None:
            if not proc.is_alive():
                raise _Abort(self._failure(proc, log_path, "run"))
            if driver.stalled:
                raise _Abort(Failure(
                    FailureReason.HANG,
                    f"{self.launcher.name} (pid {proc.pid}) stopped producing tokens for "
                    f"{self.stall_timeout_s:g} s; see {log_path}.", tail(log_path, 2000)))
            if driver.error is not None:  # a bug of ours: no load flows; say so at once
                raise _Abort(Failure(
                    FailureReason.INTERNAL,
                    f"the load generator's stream failed: {driver.error!r}.", ""))

        first = search.next_load(history)
        if first is None:
            return "complete"
        driver = staircase.StaircaseDriver(
            base_url, config.served_model_name, requests, axis=search.axis,
            timeout_s=workload.request_timeout_s, seed=workload.seed,
            burstiness=workload.burstiness, stall_timeout_s=self.stall_timeout_s,
            api_key=self._api_key)
        driver.start(first)
        try:
            load: float | None = first
            while load is not None:
                index = len(history)
                plan = staircase.plan_step(search, load, lifetime_s)
                run = staircase.measure_step(
                    driver, base_url, plan, repeats=workload.repeats,
                    request_timeout_s=workload.request_timeout_s, check_engine=check_engine,
                    is_first=index == 0)
                check_engine()
                step, verdict = self._judge_step(run, index, search, workload, started)
                if verdict.is_overload_errors and (load <= search.low or any(
                        load <= met for met in met_loads)):
                    # Errors at a load the config serves within the SLO (or at the lightest
                    # load of interest) are the config's, not overload's.
                    first_error = next((o.error for outs, _ in run.windows for o in outs
                                        if not o.success), "")
                    raise _Abort(Failure(
                        FailureReason.TOO_MANY_ERRORS,
                        f"{verdict.reason} at load {step.level.label}, a load it should serve; "
                        f"first error: {first_error[:200]}.", tail(log_path, 2000)))
                served = search.served_of(
                    step.metrics, step.server_metrics,
                    mean_input_tokens=None if is_text else _mean_prompt_tokens(workload),
                    mean_output_tokens=None if is_text else _mean_tokens(workload.output_len))
                if served is None and not step.meets_slo and step.completed_rate_rps and \
                        step.offered_rate_rps and search.axis == "request_rate" and \
                        step.completed_rate_rps < step.offered_rate_rps * (1 - search.tolerance):
                    # Fell behind in its window, no drain bias: what it served steers the next.
                    served = step.completed_rate_rps
                history.append((load, bool(step.meets_slo), served))
                steps.append(step)
                logger.info("capacity step %d at %s: SLO %s%s (served %s); bracket %s", index,
                            step.level.label, "met" if step.meets_slo else "missed",
                            f" ({verdict.reason})" if verdict.reason else "",
                            "?" if served is None else f"{served:.3g}",
                            search.bracket(history).describe())
                if step.meets_slo:
                    met_loads.append(load)
                    if step.metrics.p90_e2el_ms is not None:  # a missed step's lives queued
                        lifetime_s = staircase.lifetime_estimate_s(
                            workload, measured_e2el_s=step.metrics.p90_e2el_ms / 1000.0)
                load = search.next_load(history)
                if not step.meets_slo:
                    # The next load first, then the backlog (ours) cancelled: the stream never
                    # refills at the load that missed, and the next step starts from an empty
                    # server, not from a drain.
                    if load is not None:
                        driver.set_load(load)
                    cancelled = driver.cancel_in_flight()
                    if cancelled:
                        logger.info("step %d missed; %d requests in flight cancelled before "
                                    "the next step", index, cancelled)
                if on_step is not None and on_step(step):
                    return "stopped"
        finally:
            driver.close()
        return "complete"

    def _judge_step(self, run: staircase.StepRun, index: int, search: CapacitySearch,
                    workload: Workload, started: float
                    ) -> tuple[StepMetrics, staircase.Verdict]:
        """A staircase step as a `StepMetrics` (the median window where repeated) and its
        verdict."""
        level = search.level(run.plan.load)
        if level.request_rate_rps is not None and workload.burstiness != 1.0:
            level = replace(level, burstiness=workload.burstiness)
        is_closed = search.axis == "concurrency"
        per_window: list[tuple[Any, staircase.WindowCounts, staircase.Verdict]] = []
        for outputs, counts in run.windows:
            ours = [o for o in outputs if o.error != staircase.STOPPED_ERROR]
            metrics = compute_metrics(ours or outputs, counts.window_s, workload.slo)
            verdict = staircase.judge_window(
                metrics, counts, workload.slo, max_failed_fraction=workload.max_failed_fraction,
                tolerance=search.tolerance, is_saturated=run.is_saturated,
                is_closed_loop=is_closed)
            per_window.append((metrics, counts, verdict))
        server = dict(run.server)
        server["is_saturated"] = 1.0 if run.is_saturated else 0.0
        server["steady.warmup_s"] = run.warmup_s
        if not per_window:  # stopped in its warm-up: what it served until then
            ours = [o for o in run.early_outputs if o.error != staircase.STOPPED_ERROR]
            metrics = compute_metrics(ours, max(run.early_duration_s, 1e-9),
                                      workload.slo)
            verdict = staircase.judge_window(
                metrics, None, workload.slo, max_failed_fraction=workload.max_failed_fraction,
                tolerance=search.tolerance, is_saturated=True, is_closed_loop=is_closed)
            step = StepMetrics(step=index, level=level, metrics=metrics, server_metrics=server,
                               elapsed_s=time.monotonic() - started, meets_slo=False,
                               miss_reason=verdict.reason)
            return step, verdict
        order = sorted(range(len(per_window)),
                       key=lambda k: per_window[k][0].output_throughput)
        metrics, counts, verdict = per_window[order[len(order) // 2]]
        # Repeated windows: the step meets the SLO only if every window did.
        missed = next((v for _, _, v in per_window if not v.meets_slo), None)
        if missed is not None:
            verdict = missed
        if not run.is_settled and verdict.meets_slo:
            verdict = staircase.Verdict(False, f"not steady: the in-flight count still rose "
                                               f"after {run.warmup_s:.0f} s of warm-up")
        if not run.is_finished and verdict.meets_slo:
            verdict = staircase.Verdict(False, "measured requests still running when the wait "
                                               "for them ended")
        server.update({
            "steady.window_s": counts.window_s,
            "steady.lifetime_s": run.plan.lifetime_s,
            "steady.num_measured": float(counts.num_sent),
            "steady.num_ended_in_window": float(counts.num_ended),
            "steady.mean_in_flight": counts.mean_in_flight,
            "steady.is_settled": 1.0 if run.is_settled else 0.0,
            "is_saturated": 1.0 if run.is_saturated else 0.0})
        if counts.waiting_rise is not None:
            server["steady.waiting_rise"] = counts.waiting_rise
        if counts.in_flight_rise is not None:
            server["steady.in_flight_rise"] = counts.in_flight_rise
        if any(o.modelled_span_s is not None for outs, _ in run.windows for o in outs):
            server["is_modelled_clock"] = 1.0
        hit_rate = prometheus.prefix_cache_hit_rate(server)
        if hit_rate is not None:
            server["prefix_cache_hit_rate"] = hit_rate
        server.update(prometheus.spec_decode_acceptance(server))
        util = self._sampler.gpu_util_mean_pct_since(run.window_start_s) \
            if self._sampler else None
        if util is not None:
            server["gpu_util_mean_pct"] = util
        step = StepMetrics(
            step=index, level=level, metrics=metrics, server_metrics=server,
            elapsed_s=time.monotonic() - started, meets_slo=verdict.meets_slo,
            repeats=tuple(m for m, _, _ in per_window) if len(per_window) > 1 else (),
            miss_reason=verdict.reason,
            offered_rate_rps=counts.num_sent / counts.window_s,
            completed_rate_rps=counts.num_ended / counts.window_s)
        return step, verdict

    def _measure_repeated(self, proc: EngineProcess, base_url: str, config: EngineConfig,
                          workload: Workload, log_path: Path, started: float, index: int,
                          level: LoadLevel, max_duration_s: float | None = None) -> StepMetrics:
        """A level measured `workload.repeats` times; its median run stands for it."""
        runs = [self._measure_level(proc, base_url, config, workload, log_path, started, index,
                                    level, max_duration_s)
                for _ in range(max(1, workload.repeats))]
        if len(runs) == 1:
            return runs[0]
        median = sorted(runs, key=lambda s: s.metrics.output_throughput)[len(runs) // 2]
        return replace(median, repeats=tuple(s.metrics for s in runs),
                       elapsed_s=runs[-1].elapsed_s)

    def _measure_level(self, proc: EngineProcess, base_url: str, config: EngineConfig,
                       workload: Workload, log_path: Path, started: float, index: int,
                       level: LoadLevel, max_duration_s: float | None = None) -> StepMetrics:
        """One load level on the running server; raises `_Abort` when the engine failed.

        `max_duration_s` (a capacity probe's bound) stops sending new requests after that long,
        whether the level is bounded by requests or by `workload.duration_s`."""
        if level.request_rate_rps is not None and level.burstiness is None and \
                workload.trace is None and workload.burstiness != 1.0:
            # The level's record and label say the arrivals it was sent: the workload's gamma.
            level = replace(level, burstiness=workload.burstiness)
        num = workload.num_requests or _DURATION_POOL
        send_offsets_s: list[float] | None = None
        if workload.trace is not None:  # the whole trace (or its first num_requests), once
            entries = arrivals.read_trace(workload.trace.path, workload.trace.timestamp_unit_s,
                                          workload.trace.max_gap_s)
            num = min(workload.num_requests or len(entries), len(entries))
            send_offsets_s = arrivals.trace_offsets_s([e.arrival_s for e in entries[:num]],
                                                      level.request_rate_rps)
            longest_gap_s = max((b - a for a, b in itertools.pairwise(send_offsets_s)),
                                default=0.0)
            if longest_gap_s > _LONG_TRACE_GAP_S:
                logger.warning("level %d (%s) replays a gap of %.0f s between two requests of "
                               "the trace (the level lasts %.0f s at least); "
                               "workload.trace.max_gap_s cuts idle gaps", index, level.label,
                               longest_gap_s, send_offsets_s[-1])
        # The same prompts for every trial: the seed depends only on the level's index.
        if workload.multi_turn is not None:
            dialogues = conversations.build_conversations(workload, num,
                                                          seed=workload.seed * 1000 + index)
            num_sent = float(sum(len(c.turns) for c in dialogues))
            is_estimated = any(c.is_estimated for c in dialogues)
        else:
            requests = build_requests(workload, num, seed=workload.seed * 1000 + index)
            num_sent = float(len(requests))
            is_estimated = any(r.is_prompt_len_estimated for r in requests)
        # Each level starts from a cold prefix cache, so levels (and trials) compare: a level
        # must not be served from the blocks its predecessor computed (a shared-prefix
        # workload's hit rate is then the level's own: its first request of each prefix misses).
        self._reset_prefix_cache(base_url)
        before = prometheus.scrape(base_url, api_key=self._api_key)
        level_start_s = time.monotonic()
        # An open-loop level (a request rate) above what the engine serves grows its queue
        # without end: stop it once the queue has clearly grown; it is a saturated level.
        saturated = threading.Event() if level.request_rate_rps is not None else None
        duration_s = None if workload.num_requests else workload.duration_s
        if send_offsets_s is not None and duration_s is not None:  # a trace is never cycled
            max_duration_s = min(duration_s, max_duration_s or duration_s)
            duration_s = None
        if duration_s is not None and max_duration_s is not None:
            duration_s, max_duration_s = min(duration_s, max_duration_s), None
        # The queue's rise that means "saturated" scales with what the level sends: a time
        # bound sends at most rate x duration of a large request pool.
        bound_s = duration_s if duration_s is not None else max_duration_s
        if bound_s is not None and level.request_rate_rps is not None:
            num_sent = min(num_sent, level.request_rate_rps * bound_s)
        poller = prometheus.MetricsPoller(
            base_url, saturated=saturated,
            saturation_rise_requests=max(16.0, 0.1 * num_sent), api_key=self._api_key)
        poller.start()
        turns: dict[str, float] = {}
        try:
            if workload.multi_turn is not None:
                result, turn_outputs, num_cut = conversations.run_conversations_sync(
                    base_url, config.served_model_name, dialogues, level, workload.slo,
                    timeout_s=workload.request_timeout_s, tokenizer_dir=workload.tokenizer_dir,
                    stall_timeout_s=self.stall_timeout_s, stop_event=saturated,
                    duration_s=duration_s if duration_s is not None else max_duration_s,
                    max_context_len=workload.dataset.max_total_len
                    if workload.dataset is not None else None, api_key=self._api_key)
                turns = conversations.turn_metrics(turn_outputs, num_cut)
            else:
                result = run_level_sync(
                    base_url, config.served_model_name, requests, level, workload.slo,
                    timeout_s=workload.request_timeout_s, seed=workload.seed + index,
                    duration_s=duration_s, max_duration_s=max_duration_s,
                    stall_timeout_s=self.stall_timeout_s, stop_event=saturated,
                    burstiness=workload.burstiness_of(level), send_offsets_s=send_offsets_s,
                    api_key=self._api_key)
        finally:
            polled = poller.stop()
        is_saturated = bool(saturated is not None and saturated.is_set() and result.stopped)
        # An engine that died mid-level closes its sockets before it is reaped: wait a
        # moment so a crash is not mistaken for failed requests.
        if (result.metrics.failed and proc.wait(timeout_s=0.5) is not None) or \
                not proc.is_alive():
            raise _Abort(self._failure(proc, log_path, "run"))
        if result.stalled:
            raise _Abort(Failure(
                FailureReason.HANG,
                f"{self.launcher.name} (pid {proc.pid}) stopped producing tokens for "
                f"{self.stall_timeout_s:g} s at load {level.label}; see {log_path}.",
                tail(log_path, 2000)))
        m = result.metrics
        total = m.completed + m.failed
        if is_saturated:  # the cancelled requests are ours, not the engine's failures
            logger.info("level %d (%s) stopped early: the queue kept growing (saturated)",
                        index, level.label)
        elif total and m.failed / total > workload.max_failed_fraction:
            first_error = next((o.error for o in result.outputs if not o.success), "")
            raise _Abort(Failure(
                FailureReason.TOO_MANY_ERRORS,
                f"{m.failed} of {total} requests failed at load {level.label} (allowed "
                f"{workload.max_failed_fraction:.0%}); first error: {first_error[:200]}.",
                tail(log_path, 2000)))
        after = prometheus.scrape(base_url, api_key=self._api_key)
        server = {**prometheus.delta(before, after), **polled,
                  "is_saturated": 1.0 if is_saturated else 0.0}
        # Over the whole level (the scrapes around it), not the poller's first-to-last sample.
        hit_rate = prometheus.prefix_cache_hit_rate(server)
        if hit_rate is not None:
            server["prefix_cache_hit_rate"] = hit_rate
        server.update(prometheus.spec_decode_acceptance(server))
        if result.is_modelled_clock:  # the record says its times are a model's clock
            server["is_modelled_clock"] = 1.0
        # The client's prompt lengths against the server's usage.prompt_tokens; and whether
        # the client's were estimates (text without the model's tokenizer).
        server.update(prompt_len_gap(result.outputs))
        server["prompt_len_is_estimated"] = 1.0 if is_estimated else 0.0
        server.update(turns)
        if send_offsets_s is not None:
            server.update(_trace_replayed(send_offsets_s, len(result.outputs), level))
        # NVML over this level alone: the run's mean mixes light and heavy levels.
        util = self._sampler.gpu_util_mean_pct_since(level_start_s) if self._sampler else None
        if util is not None:
            server["gpu_util_mean_pct"] = util
        logger.info("level %d (%s): %.2f req/s, %.0f tok/s, TPOT p99 %s", index,
                    level.label, m.request_throughput, m.output_throughput,
                    "n/a (no request had a second token)" if m.p99_tpot_ms is None
                    else f"{m.p99_tpot_ms:.1f} ms")
        return StepMetrics(step=index, level=level, metrics=m, server_metrics=server,
                           elapsed_s=time.monotonic() - started)

    def _quality(self, base_url: str, config: EngineConfig, spec: QualityEval,
                 workdir: Path) -> QualityRun:
        """The output-quality evaluation on the running server, after the measured levels (so
        it never disturbs them). Its failures are data on the result, never the run's."""
        if config.skip_tokenizer_init:
            return QualityRun(error="skipped: the engine runs without a tokenizer "
                                    "(skip_tokenizer_init); the evaluation sends text.")
        self._reset_prefix_cache(base_url)
        run = run_eval(base_url, config.served_model_name, spec, workdir, api_key=self._api_key)
        logger.info("quality evaluation: %s in %.1f s", run.error or "sampled", run.wall_s)
        return run

    def _reset_prefix_cache(self, base_url: str) -> None:
        """POST /reset_prefix_cache where the engine has it (vLLM with VLLM_SERVER_DEV_MODE=1,
        the simulated engine); a server without it keeps its cache, and the level says so in
        its prefix-cache hit counters."""
        try:
            httpx.post(f"{base_url}/reset_prefix_cache", timeout=10.0, trust_env=False,
                       headers=auth_headers(self._api_key))
        except httpx.HTTPError as exc:
            logger.debug("prefix cache not reset: %s", exc)

    def _profile(self, base_url: str, config: EngineConfig, workload: Workload,
                 steps: Sequence[StepMetrics], profile_dir: Path
                 ) -> tuple[Path | None, Mapping[str, Any] | None]:
        """A short profiled window after the measured levels: profiling slows the engine, so
        no performance figure is ever taken from it. After a capacity search it runs at the
        operating point's rate (the highest that met the SLO; else the lightest probed), but
        anew, after the stream has closed: `profile_num_requests` into an empty server, a
        lighter batch than the steady operating point holds (not yet profiled inside it)."""
        requests = build_requests(workload, workload.profile_num_requests,
                                  seed=workload.seed + 104729)
        level = profile_level(workload, steps)
        try:
            with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False,
                              headers=auth_headers(self._api_key)) as client:
                client.post(f"{base_url}/start_profile").raise_for_status()
                run_level_sync(base_url, config.served_model_name, requests, level,
                               workload.slo, timeout_s=workload.request_timeout_s,
                               seed=workload.seed, stall_timeout_s=self.stall_timeout_s,
                               api_key=self._api_key)
                client.post(f"{base_url}/stop_profile").raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("profiling failed (%s); the trial keeps its measurements", exc)
            return None, None
        gpu_traces = _settled_traces(profile_dir, _TRACE_SETTLE_TIMEOUT_S)
        if not gpu_traces:
            logger.warning("no trace file under %s within %g s of /stop_profile", profile_dir,
                           _TRACE_SETTLE_TIMEOUT_S)
            return None, None
        from runners.profiler_trace.summary import summarize_many
        from runners.profiler_trace.trim import summarize_and_trim, trim

        # One file per rank of this capture (TP > 1): the newest of each rank.
        newest: dict[str, Path] = {}
        for candidate in gpu_traces:
            newest[candidate.name.split(".")[0]] = candidate
        ranks = sorted(newest.values())
        try:
            # The artifact is a trimmed copy (kernel events only): full traces run to
            # hundreds of MB; the full one stays in the trial's directory.
            trimmed = profile_dir.parent / "trace.trimmed.pt.trace.json.gz"
            note = f"kernel events of {ranks[0].name}, trimmed by nightshift"
            if len(ranks) > 1:
                summary = summarize_many(ranks)
                trim(ranks[0], trimmed, max_events=_TRACE_ARTIFACT_EVENTS, note=note)
            else:
                summary = summarize_and_trim(ranks[0], trimmed,
                                             max_events=_TRACE_ARTIFACT_EVENTS, note=note)
        except (ValueError, OSError) as exc:  # a cut or corrupt trace: keep the measurements
            logger.warning("trace %s could not be read (%s)", ranks[0], exc)
            return ranks[0], None
        return trimmed, summary


def profile_level(workload: Workload, steps: Sequence[StepMetrics]) -> LoadLevel:
    """The load a profile window runs at: a capacity search's operating point (its highest
    load within the SLO, else its lightest probe); else the last level as a closed loop."""
    probed = [s for s in steps if s.meets_slo is not None]
    if workload.capacity is not None and probed:
        within = [s for s in probed if s.meets_slo]
        search = workload.capacity
        pick = max(within, key=lambda s: search.load_of(s.level)) if within else \
            min(probed, key=lambda s: search.load_of(s.level))
        return pick.level
    level = workload.levels[-1]
    return LoadLevel(max_concurrency=level.max_concurrency or 16)


def _mean_prompt_tokens(workload: Workload) -> float | None:
    """The mean prompt a level sends, shared prefix included; None when the prompts come from
    a file, a trace or a dataset, or grow over a conversation's turns (not known without
    reading them)."""
    if workload.prompts_file is not None or workload.trace is not None or \
            workload.dataset is not None or workload.multi_turn is not None:
        return None
    shared = workload.shared_prefix
    extra = shared.fraction * shared.num_tokens if shared is not None else 0.0
    return _mean_tokens(workload.input_len) + extra


def _mean_tokens(dist: LengthDistribution) -> float:
    """The mean length a distribution draws (a uniform one's `mean` may be left unset)."""
    if dist.kind == "uniform" and dist.low is not None and dist.high is not None:
        return (dist.low + dist.high) / 2
    return float(dist.mean)


def _trace_replayed(offsets_s: Sequence[float], num_sent: int,
                    level: LoadLevel) -> dict[str, float]:
    """How much of a trace a level replayed: the requests sent, and, where the level ended
    before the trace did (a time bound, saturation), the mean rate they were sent at: the
    level's rate is the whole trace's, which a cut replay did not offer."""
    out = {"trace_num_replayed": float(num_sent),
           "trace_num_requests": float(len(offsets_s))}
    if 0 < num_sent < len(offsets_s):
        try:
            rate: float | None = arrivals.trace_rate_rps(offsets_s[:num_sent])
        except ValueError:  # one request sent, or all at one instant: no rate
            rate = None
        if rate is not None:
            out["trace_replayed_rate_rps"] = rate
        logger.warning("level %s sent %d of the trace's %d requests before it ended; they "
                       "were sent at %s, where the level's rate is the whole trace's",
                       level.label, num_sent, len(offsets_s),
                       "?" if rate is None else f"{rate:.3g} req/s")
    return out


def _settled_traces(profile_dir: Path, timeout_s: float, poll_s: float = 1.0) -> list[Path]:
    """The GPU trace files under `profile_dir`, oldest first, once they exist and their sizes
    have stopped changing: the workers may still be writing (and gzipping) when /stop_profile
    answers, and a half-written file reads as a corrupt trace. Empty after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    previous: dict[Path, tuple[int, float]] | None = None
    while True:
        sizes: dict[Path, tuple[int, float]] = {}
        for path in profile_dir.rglob("*.pt.trace.json*"):
            if "async_llm" in path.name:  # the front-end's CPU-only trace
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:  # renamed between listing and stat
                continue
            sizes[path] = (stat.st_size, stat.st_mtime)
        if sizes and sizes == previous:
            return sorted(sizes, key=lambda p: sizes[p][1])
        if time.monotonic() >= deadline:
            return []
        previous = sizes
        time.sleep(poll_s)
