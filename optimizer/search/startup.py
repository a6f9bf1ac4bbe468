"""What a trial's start-up will cost, as the search policy plans it: the compile-cache state of
each estimated key (`CompileCaches`: predicted warm or cold, compiling now), the launch order
that starts warm keys first and never compiles one key twice at once (`launch_order`), the
warm-cache check's environment (`trial_env`), and what a trial's record says of its start-up
(`startup_record`). Pure: no processes, no I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from runners.base import EngineConfig, RunResult
from runners.vllm.compile_cache import FORCE_AOT_LOAD, CompileKey, compile_key

if TYPE_CHECKING:
    from optimizer.config.sections import StartupSpec

logger = logging.getLogger(__name__)

# "warm": a trial of this key started here before (its cache is on disk); "cold": it compiles;
# "none": it runs no torch.compile (eager); "uncached": vLLM's cache is off for it.
Prediction = Literal["warm", "cold", "none", "uncached"]
T = TypeVar("T")


@dataclass
class CompileCaches:
    """The keys this study has compiled (warm) and is compiling (a running trial that predicted
    cold and has not measured a level yet), and the keys other processes compiled on the same
    cache root under the same vLLM version (`elsewhere`: the compile ledger's, handed in by the
    caller, runners/vllm/compile_ledger.py). One cache domain: on a multi-node cluster a trial
    on another node than the one that compiled its key finds it cold (recorded as a wrong
    prediction: Ray, not the policy, picks the node)."""

    warm: set[str] = field(default_factory=set)
    compiling: dict[str, int] = field(default_factory=dict)  # key -> the trial compiling it
    elsewhere: frozenset[str] = frozenset()

    def predict(self, key: CompileKey | None) -> Prediction:
        if key is None:
            return "none"
        if not key.is_cached:
            return "uncached"
        return "warm" if key.digest in self.warm or key.digest in self.elsewhere else "cold"

    def is_compiling(self, key: CompileKey | None) -> bool:
        return key is not None and key.is_cached and key.digest in self.compiling

    def launched(self, number: int, key: CompileKey | None, prediction: Prediction) -> None:
        if key is not None and prediction == "cold":
            self.compiling.setdefault(key.digest, number)

    def started(self, number: int, key: CompileKey | None) -> None:
        """The trial's engine served a level: whatever it compiled is on disk now."""
        if key is None or not key.is_cached:
            return
        if self.compiling.get(key.digest) == number:
            del self.compiling[key.digest]
        self.warm.add(key.digest)

    def ended(self, number: int, key: CompileKey | None, observed: str | None) -> None:
        """The trial ended: its key is warm if its start-up compiled or loaded it."""
        if key is None or not key.is_cached:
            return
        if self.compiling.get(key.digest) == number:
            del self.compiling[key.digest]
        if observed in ("warm", "cold"):
            self.warm.add(key.digest)

    def learn(self, record_startup: Mapping[str, Any]) -> None:
        """A finished trial of an earlier daemon run (the cache root outlives the daemon)."""
        key = record_startup.get("compile_key")
        if key and record_startup.get("compile_cache") in ("warm", "cold"):
            self.warm.add(str(key))


def launch_order(items: Sequence[T], key_of: Callable[[T], CompileKey | None],
                 caches: CompileCaches, *, is_reserved: Callable[[T], bool]) -> list[int]:
    """The indices of `items` (trials waiting for GPUs, in the order asked) in the order to try
    them: one holding the next free GPUs first (`is_reserved`), then those whose key is warm or
    that compile nothing, then the rest; each group in the order asked. A trial whose key a
    running trial is compiling is left out: it waits for that compile (or other work starts)."""
    def rank(index: int) -> tuple[int, int, int]:
        item = items[index]
        prediction = caches.predict(key_of(item))
        return (0 if is_reserved(item) else 1,
                0 if prediction in ("warm", "none") else 1, index)

    return sorted((i for i, item in enumerate(items) if not caches.is_compiling(key_of(item))),
                  key=rank)


def trial_env(config: EngineConfig, spec: StartupSpec, prediction: Prediction) -> EngineConfig:
    """The config as launched: the warm-cache check where it is asked for and the trial is
    predicted warm (VLLM_FORCE_AOT_LOAD is outside vLLM's key, envs.py:2123, so the key holds)."""
    if spec.verify_warm and prediction == "warm":
        return replace(config, env={**config.env, FORCE_AOT_LOAD: "1"})
    return config


def startup_record(key: CompileKey | None, prediction: str,
                   result: RunResult) -> dict[str, Any]:
    """What a trial's record keeps of its start-up: the estimated key, the prediction, what the
    log says happened (and vLLM's own key), whether they agree, and the seconds by part."""
    engine = result.engine
    observed = engine.compile_cache
    out: dict[str, Any] = {
        "compile_key": key.digest if key is not None else None,
        "predicted": prediction,
        "compile_cache": observed,
        "vllm_key": engine.compile_cache_dir,
        "is_warm_check_refused": engine.is_warm_check_refused,
    }
    expected = {"warm": "warm", "cold": "cold", "uncached": "cold", "none": "none"}.get(prediction)
    out["is_prediction_right"] = None if observed is None else observed == expected
    seconds = {"total_s": engine.startup_s, "load_s": engine.model_load_s,
               "compile_s": engine.compile_s, "graph_capture_s": engine.graph_capture_s,
               "init_engine_s": engine.init_engine_s}
    out.update({k: v for k, v in seconds.items() if v is not None})
    return out


def startup_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """MLflow metrics of a record's start-up (`startup.*`): seconds by part, 1/0 flags."""
    out = {f"startup.{k}": float(v) for k, v in record.items()
           if k.endswith("_s") and isinstance(v, int | float)}
    if record.get("compile_cache") in ("warm", "cold"):
        out["startup.is_cold_compile"] = 1.0 if record["compile_cache"] == "cold" else 0.0
    if record.get("is_prediction_right") is not None:
        out["startup.is_prediction_right"] = 1.0 if record["is_prediction_right"] else 0.0
    return out


def startup_tags(record: Mapping[str, Any]) -> dict[str, str]:
    """MLflow tags of a record's start-up: the cache state seen and predicted, the keys."""
    tags = {"startup.compile_cache": str(record.get("compile_cache") or "unknown"),
            "startup.compile_cache_predicted": str(record.get("predicted") or "unknown")}
    for name in ("compile_key", "vllm_key"):
        if record.get(name):
            tags[f"startup.{name}"] = str(record[name])
    if record.get("is_warm_check_refused"):
        tags["startup.warm_check"] = "refused: relaunched without VLLM_FORCE_AOT_LOAD"
    return tags


__all__ = ["CompileCaches", "Prediction", "compile_key", "launch_order",
           "startup_metrics", "startup_record", "startup_tags", "trial_env"]
