"""`EngineRunner`: the life cycle every HTTP engine shares — launch in its own process group,
readiness, warm-up, load levels or a capacity search, optional profile window, quality
evaluation, teardown — around an `EngineLauncher` that knows one engine's argv and log (vLLM or
the simulated engine). Each part works on the launch's `EngineSession` (runners/session.py):
readiness (runners/readiness.py), levels (runners/levels.py), the capacity search
(runners/capacity/), the profile (runners/profiling.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

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
from runners.capacity.bracket import Bracket
from runners.capacity.probes import run_probes
from runners.capacity.search import CapacitySearch, Probe
from runners.capacity.staircase import holds_of, run_staircase, unapplied_of
from runners.credentials import (
    API_KEY_ENV,
    launch_secrets,
    new_api_key,
    redact_argv,
    redact_env,
    scrub,
)
from runners.levels import run_levels
from runners.process import EngineProcess, free_port, tail
from runners.profiling import Profiled, profile_after_levels
from runners.quality_eval import QualityRun, run_eval
from runners.readiness import await_ready, warm_up
from runners.session import LOG_TAIL_BYTES, Abort, EngineSession
from runners.telemetry import TelemetrySampler
from runners.vllm.compile_cache import FORCE_AOT_LOAD
from runners.vllm.compile_ledger import append_entry, entry_of
from runners.workload import QualityEval, Workload

logger = logging.getLogger(__name__)

_RUNTIME_LOG_BYTES = 8_000_000  # the log's end read after the load (per-request access lines)


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
        api_key = new_api_key()
        launch_env = {**env, API_KEY_ENV: api_key}
        # What the engine may print of its secrets (an echoed token, its key) is scrubbed from
        # its output before it reaches its log (runners/log_pump.py), and from its failure.
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
        profiled: Profiled | None = None
        proc = EngineProcess.start(argv, launch_env, log_path, self.registry_dir,
                                   secrets=secrets_)
        engine_started_unix_s = time.time()
        self._proc = proc
        logger.info("engine %s started (pid %d, port %d)", self.launcher.name, proc.pid, port)
        session = EngineSession(proc=proc, base_url=base_url, config=config, workload=workload,
                                log_path=log_path, started=started, launcher=self.launcher,
                                stall_timeout_s=self.stall_timeout_s, api_key=api_key)
        try:
            engine = await_ready(session)
            self._record_compile(config, env, engine)
            warm_up(session)
            sampler = TelemetrySampler(self.gpu_indices)
            sampler.start()
            session.sampler = sampler
            try:
                status, profiled = self._drive(session, steps, on_step, profile_dir)
            finally:
                session.sampler = None
                telemetry = sampler.stop()
            if workload.quality is not None and status == "complete":
                quality = self._quality(session, workload.quality, workdir)
            # What the log says of the load itself (kernels compiled while serving), read once
            # the measured levels are over.
            served = self.launcher.parse_log(tail(log_path, _RUNTIME_LOG_BYTES))
            engine = replace(engine, num_runtime_jit_compiles=served.num_runtime_jit_compiles)
            if profiled is not None:  # a window of the staircase's stream
                trace_path, trace_summary = profiled
            elif workload.profile and status == "complete" and profile_dir is not None:
                trace_path, trace_summary = profile_after_levels(session, steps, profile_dir)
        except Abort as abort:
            status, failure = "failed", replace(
                abort.failure, message=scrub(abort.failure.message, secrets_),
                log_excerpt=scrub(abort.failure.log_excerpt, secrets_))
            logger.info("engine run failed: %s: %s", failure.reason, failure.message)
        finally:
            proc.terminate()
            engine_ended_unix_s = time.time()
            self._proc = None
        search = workload.capacity
        probes = [(search.load_of(s.level), bool(s.meets_slo)) for s in steps
                  if s.meets_slo is not None] if search is not None else []
        return RunResult(
            status=status,
            steps=tuple(steps),
            capacity=held_bracket(search, probes, steps) if search is not None and probes
            else None,
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

    @staticmethod
    def _drive(session: EngineSession, steps: list[StepMetrics], on_step: OnStep | None,
               profile_dir: Path | None) -> tuple[RunStatus, Profiled | None]:
        """The measured levels: fixed levels, else a capacity search (the steady staircase; a
        trace's or conversations' probes). And, where the staircase took it inside its stream,
        the profile (else None: `profile_after_levels` takes one after the levels, where
        asked)."""
        workload = session.workload
        if workload.capacity is None:
            return run_levels(session, steps, on_step), None
        if workload.multi_turn is None and workload.trace is None:
            return run_staircase(session, steps, on_step, profile_dir)
        return run_probes(session, steps, on_step), None

    def _quality(self, session: EngineSession, spec: QualityEval, workdir: Path) -> QualityRun:
        """The output-quality evaluation on the running server, after the measured levels (so
        it never disturbs them). Its failures are data on the result, never the run's."""
        if session.config.skip_tokenizer_init:
            return QualityRun(error="skipped: the engine runs without a tokenizer "
                                    "(skip_tokenizer_init); the evaluation sends text.")
        session.reset_prefix_cache()
        run = run_eval(session.base_url, session.config.served_model_name, spec, workdir,
                       api_key=session.api_key)
        logger.info("quality evaluation: %s in %.1f s", run.error or "sampled", run.wall_s)
        return run


def held_bracket(search: CapacitySearch, probes: Sequence[Probe],
                 steps: Sequence[StepMetrics]) -> Bracket:
    """The search's bracket, and whether its lower end held: True where a hold met at it,
    False where holds ran and none met there (the claim rests on a short window), None where
    no hold ran (none asked for, a trace's probes, or the trial stopped first). A step whose
    load was not applied ends no bracket (`unapplied_of`): it is named beside it instead."""
    bracket = search.bracket(probes, unapplied_of(search, steps))
    holds = holds_of(search, steps)
    if not holds or bracket.met_load is None:
        return bracket
    return replace(bracket, held=any(ok and load == bracket.met_load for load, ok in holds))
