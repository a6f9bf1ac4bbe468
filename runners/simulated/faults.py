"""Fault injection for the simulated engine: which misbehaviour a test asked for.

Faults come from `sim_`-prefixed flags of the EngineConfig (so a study can inject them per trial)
or from the `--faults` JSON argument; the argument wins where both name the same fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

FAULT_PREFIX = "sim_"


@dataclass(frozen=True)
class Faults:
    """Every field off by default: a plain config gives a well-behaved engine."""

    crash_after_requests: int | None = None  # os._exit(1) when request N+1 arrives
    hang_after_requests: int | None = None  # from request N+1: no tokens, /health never answers
    hang_at_start: bool = False  # never becomes healthy
    slow_start_s: float = 0.0  # real seconds added before healthy (not time-scaled)
    # Real seconds of busy CPU before the first completion is served, as an engine that
    # JIT-compiles kernels on its first request (not time-scaled).
    slow_first_request_s: float = 0.0
    oom_at_start: bool = False  # vLLM's KV-cache OOM message, exit 1
    graph_capture_fail: bool = False  # CUDA OOM while "Capturing CUDA graphs", exit 1
    error_rate: float = 0.0  # fraction of requests answered HTTP 500
    # A noisy neighbour: from each prefix-cache reset (the start of a level) the engine runs at
    # a random 1/(1+u) of its modelled speed, u uniform in [0, unstable].
    unstable: float = 0.0
    # A regression injected on purpose (`nightshift regress` tests): every modelled step takes
    # (1 + step_slowdown) times as long, as a debug setting left on would make it.
    step_slowdown: float = 0.0

    @property
    def is_any(self) -> bool:
        return self != Faults()

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Faults:
        """From `sim_`-prefixed flags or a plain dict; unknown `sim_` names are an error so a
        typo does not silently run a healthy engine."""
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            name = key.removeprefix(FAULT_PREFIX)
            if name not in known:
                raise ValueError(
                    f"unknown simulated-engine fault {key!r}; valid: "
                    f"{', '.join(FAULT_PREFIX + k for k in sorted(known))}.")
            if value is None:
                continue
            kwargs[name] = value
        faults = cls(**kwargs)
        faults._validate()
        return faults

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], faults_json: str | None = None) -> Faults:
        merged: dict[str, Any] = {k: v for k, v in flags.items() if k.startswith(FAULT_PREFIX)}
        if faults_json:
            extra = json.loads(faults_json)
            if not isinstance(extra, dict):
                raise ValueError(f"--faults must be a JSON object but got {faults_json!r}.")
            merged.update({FAULT_PREFIX + k.removeprefix(FAULT_PREFIX): v
                           for k, v in extra.items()})
        return cls.from_mapping(merged)

    def _validate(self) -> None:
        if not 0.0 <= float(self.error_rate) <= 1.0:
            raise ValueError(f"sim_error_rate must be in [0, 1] but got {self.error_rate}.")
        if float(self.unstable) < 0:
            raise ValueError(f"sim_unstable must be >= 0 but got {self.unstable}.")
        if not 0.0 <= float(self.step_slowdown) <= 100.0:
            raise ValueError(f"sim_step_slowdown must be in [0, 100] but got "
                             f"{self.step_slowdown}.")
        if float(self.slow_start_s) < 0:
            raise ValueError(f"sim_slow_start_s must be >= 0 but got {self.slow_start_s}.")
        if not 0.0 <= float(self.slow_first_request_s) <= 3600.0:
            raise ValueError(f"sim_slow_first_request_s must be in [0, 3600] but got "
                             f"{self.slow_first_request_s}.")


def strip_fault_flags(flags: Mapping[str, Any]) -> dict[str, Any]:
    """The flags without the simulator's own `sim_` ones (they are not vLLM flags)."""
    return {k: v for k, v in flags.items() if not k.startswith(FAULT_PREFIX)}
