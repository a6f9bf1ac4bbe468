"""What one simulated engine process is started with (`ServerSettings`): its config, hardware,
port, time scale, faults and key, as `python -m runners.simulated` reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from runners.base import EngineConfig
from runners.hardware import HardwareProfile
from runners.simulated.faults import Faults

HOST = "127.0.0.1"
DEFAULT_NOISE_SIGMA = 0.025  # lognormal sigma on step times: run-to-run jitter of a real GPU


@dataclass(frozen=True)
class ServerSettings:
    """One simulated engine process."""

    config: EngineConfig
    hardware: HardwareProfile
    port: int
    host: str = HOST  # loopback only (the command line allows nothing else)
    profile_dir: Path | None = None
    startup_time_scale: float = 0.01  # slept seconds per modelled start-up second
    seed: int = 0
    faults: Faults = field(default_factory=Faults)
    noise_sigma: float = DEFAULT_NOISE_SIGMA
    # Every route but /health asks for `Authorization: Bearer <api_key>` when set (vLLM, given
    # --api-key or VLLM_API_KEY, asks it of its /v1 routes only).
    api_key: str | None = None
    # The release it logs as its own (a `VllmVariant`'s; the figures stay 0.26-calibrated).
    vllm_version: str | None = None
