"""The runners a study can measure with, by name (`engine:` in the study file): a registry of
factories and the plain-data `RunnerSpec` a worker builds its runner from. Ray-free, so that the
study file's validation can name the valid engines."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a worker needs to build its runner; plain data so it pickles through Ray."""

    kind: str  # a key of RUNNERS
    registry_dir: Path  # engine pid records, for reaping strays after a crash
    hardware: dict[str, Any] | None = None  # simulated engine only: the host it pretends to be
    startup_time_scale: float = 0.01  # simulated engine only
    seed: int = 0
    cache_root: Path | None = None  # VLLM_CACHE_ROOT shared by every trial
    is_cache_per_trial: bool = False  # startup.compile_cache: per_trial (under each trial's dir)
    stall_timeout_s: float = 120.0
    # Who appends to the shared cache root's compile ledger ("study:<name>", "regress:<case>";
    # runners/vllm/compile_ledger.py); None writes nothing, nor does a per-trial cache.
    ledger_writer: str | None = None
    options: dict[str, Any] = field(default_factory=dict)


def _simulated_runner(spec: RunnerSpec, gpu_indices: tuple[int, ...] | None) -> Any:
    from runners.engine import EngineRunner
    from runners.hardware import HardwareProfile
    from runners.simulated.launcher import SimulatedLauncher, VllmVariant

    hardware = HardwareProfile.from_dict(spec.hardware) if spec.hardware else "h200"
    # options["vllm_variant"]: the vLLM release the simulated engine pretends to be
    # (`VllmVariant.to_dict`); absent: 0.26.0.
    variant = spec.options.get("vllm_variant")
    launcher = SimulatedLauncher(hardware=hardware,
                                 startup_time_scale=spec.startup_time_scale, seed=spec.seed,
                                 variant=VllmVariant.from_dict(variant) if variant else None)
    return EngineRunner(launcher, spec.registry_dir, stall_timeout_s=spec.stall_timeout_s,
                        gpu_indices=None, ledger_writer=_ledger_writer(spec))


def _vllm_runner(spec: RunnerSpec, gpu_indices: tuple[int, ...] | None) -> Any:
    from runners.engine import EngineRunner
    from runners.vllm.launcher import VllmLauncher

    # Dev mode for /reset_prefix_cache between load levels (127.0.0.1 only).
    launcher = VllmLauncher(cache_root=spec.cache_root, dev_mode=True,
                            is_cache_per_trial=spec.is_cache_per_trial)
    return EngineRunner(launcher, spec.registry_dir, stall_timeout_s=spec.stall_timeout_s,
                        gpu_indices=gpu_indices, ledger_writer=_ledger_writer(spec))


def _ledger_writer(spec: RunnerSpec) -> str | None:
    # startup.compile_cache: per_trial shares no cache, so it neither reads nor writes the ledger.
    return None if spec.is_cache_per_trial else spec.ledger_writer


# The engines a study can run its trials on, by name (`engine:` in the study file, where "auto"
# also picks between them); each factory builds a Runner in the worker that runs it.
RUNNERS: dict[str, Callable[[RunnerSpec, tuple[int, ...] | None], Any]] = {
    "vllm": _vllm_runner,
    "simulated": _simulated_runner,
}


def build_runner(spec: RunnerSpec, gpu_indices: tuple[int, ...] | None = None) -> Any:
    try:
        factory = RUNNERS[spec.kind]
    except KeyError:  # from None: a miss in our own registry; the message lists its names
        raise ValueError(f"unknown runner {spec.kind!r}; valid: {', '.join(RUNNERS)}") from None
    return factory(spec, gpu_indices)
