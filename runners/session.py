"""`EngineSession`: one launched engine as the code that measures it sees it (its process,
address, key, log and the run's workload), and `Abort`, which ends a run early with a
classified failure. `EngineRunner` (runners/engine.py) makes one per launch; readiness, the
load levels, the capacity search and the profile window work through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from runners.base import EngineConfig, EngineLauncher, Failure, Phase
from runners.credentials import auth_headers
from runners.process import EngineProcess, tail
from runners.telemetry import TelemetrySampler
from runners.workload import Workload

logger = logging.getLogger(__name__)

LOG_TAIL_BYTES = 64_000  # the server log's tail a result and a failure keep


class Abort(Exception):
    """Ends a run early with a classified failure (control flow inside a run only: `run`
    returns it as a failed `RunResult`, never raises it)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass
class EngineSession:
    """One running engine, from launch to teardown. Mutable only in `sampler` (NVML over the
    measured levels, set while they run)."""

    proc: EngineProcess
    base_url: str  # http://127.0.0.1:<port>
    config: EngineConfig
    workload: Workload
    log_path: Path  # the engine's log
    started: float  # time.monotonic() at launch
    launcher: EngineLauncher
    stall_timeout_s: float  # s without a token from any request in flight: a hang
    # The engine's API key (a new one per launch, given in its environment): only this process
    # holds it, so no other local user can drive or disturb the engine.
    api_key: str | None
    sampler: TelemetrySampler | None = None

    @property
    def name(self) -> str:
        return self.launcher.name

    def failure(self, phase: Phase) -> Failure:
        """Why the engine died, from its exit code and its log's tail."""
        self.proc.wait(timeout_s=5.0)
        return self.launcher.classify_failure(tail(self.log_path, LOG_TAIL_BYTES),
                                              self.proc.returncode, phase)

    def log_excerpt(self) -> str:
        return tail(self.log_path, 2000)

    def reset_prefix_cache(self) -> None:
        """POST /reset_prefix_cache where the engine has it (vLLM with VLLM_SERVER_DEV_MODE=1,
        the simulated engine); a server without it keeps its cache, and the level says so in
        its prefix-cache hit counters."""
        try:
            httpx.post(f"{self.base_url}/reset_prefix_cache", timeout=10.0, trust_env=False,
                       headers=auth_headers(self.api_key))
        except httpx.HTTPError as exc:
            logger.debug("prefix cache not reset: %s", exc)
