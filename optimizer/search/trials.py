"""The types a trial passes through on its way through the search: asked and `Waiting` for its
GPUs, `Running` (what the scheduler judges and the record is written from), `Told` (what Optuna
was told, for the `TrialLog` that hears it), and `config_key` (one config, one key)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import optuna

from optimizer.results.trial_record import TrialRecord
from runners.base import EngineConfig, RunResult, StepMetrics
from runners.vllm.compile_cache import CompileKey


@dataclass
class Running:
    """A trial handed out to run: what the policy needs to judge its steps and record it."""

    trial: optuna.Trial
    params: dict[str, Any]  # as sampled (fixed params included)
    config: EngineConfig
    is_baseline: bool
    retries: int
    started: float = field(default_factory=time.monotonic)
    run_id: str | None = None  # the tracker's run, set by whoever launches it
    steps: list[StepMetrics] = field(default_factory=list)
    pruned_at: int | None = None
    prune_reason: str | None = None
    compile_key: CompileKey | None = None  # the estimated compile-cache key (search/startup.py)
    prediction: str = "none"  # what the policy expected of its compile cache at launch


@dataclass
class Waiting:
    """A trial asked of Optuna whose GPUs are not free yet."""

    trial: optuna.Trial
    params: dict[str, Any]
    config: EngineConfig
    overtaken: int = 0  # later trials launched while this one waited


@dataclass(frozen=True)
class Told:
    """A trial the policy has told Optuna about, for the log: `kind` "measured" (it ran),
    "rejected" (refused before launch: it has a run of its own) or "duplicate" (no run)."""

    kind: str
    number: int
    record: TrialRecord
    run_id: str | None = None
    result: RunResult | None = None
    running: Running | None = None


class TrialLog(Protocol):
    """Hears what the policy tells Optuna (the daemon: MLflow and the progress display)."""

    def open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        """Give a trial that never launched its run, before it is told (the run id can then
        still be stored on the trial); None when the tracker refuses."""
        ...

    def told(self, told: Told) -> None: ...


class NoLog:
    """A `TrialLog` that keeps nothing (the replay)."""

    def open_run(self, trial: optuna.Trial, params: Mapping[str, Any]) -> str | None:
        return None

    def told(self, told: Told) -> None:
        return None



def config_key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)

