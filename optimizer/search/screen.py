"""The informed start's screen: every config of a (finite) space ranked in CPU time by the
simulated engine's analytic model (runners/simulated/performance.py, `PerformanceModel.step_time`:
the roofline of one engine step), never by running anything. A prediction, never a measurement:
it only orders which configs the GPU measures first (optimizer/search/samplers.py `ScreenSampler`).

The estimate a level: a closed loop of `concurrency` requests decoding `output_len` tokens each
after a prompt of `input_len` (`prefix_tokens` of it shared and, with prefix caching, computed
once). The batch is what max_num_seqs and the KV cache admit; a step decodes the batch and
prefills its share of new prompts (within max_num_batched_tokens); TPOT is that step, TTFT the
steps a prompt's prefill takes, E2EL the TTFT and output_len - 1 steps. Goodput is the
throughput, scaled down steeply past each bound the SLO sets (`SLO.is_set` says which count)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna._transform import _SearchSpaceTransform
from optuna.distributions import BaseDistribution, CategoricalDistribution, _get_single_value

from runners.base import EngineConfig
from runners.hardware import HardwareProfile
from runners.model_info import ModelInfo
from runners.simulated.performance import PerformanceModel
from runners.workload import Workload


@dataclass(frozen=True)
class ScreenLoad:
    """The workload as the screen reads it."""

    input_len: int
    output_len: int
    concurrencies: tuple[int, ...]
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    prefix_tokens: int = 0  # of input_len, shared by every request
    slo_e2el_ms: float | None = None


def _past(value: float, bound: float | None) -> float:
    """1 within the bound, falling as (bound/value)^4 past it: a ranking, not a verdict."""
    return 1.0 if bound is None or value <= bound else (bound / value) ** 4


def predicted_goodput(model: PerformanceModel, load: ScreenLoad) -> float:
    """Requests/s within the SLO the analytic model expects at the best level; 0 for a config
    the model says cannot start."""
    if model.check() is not None:
        return 0.0
    best = 0.0
    tokens_per_request = load.input_len + load.output_len
    for concurrency in load.concurrencies:
        batch = max(1, min(concurrency, model.max_num_seqs,
                           model.kv_cache_tokens // max(1, tokens_per_request)))
        cached = load.prefix_tokens if model.enable_prefix_caching else 0
        fresh = max(1, load.input_len - cached)
        # New prompts a step: the batch turns over once per output_len steps.
        prefill = min(max(0, model.max_num_batched_tokens - batch),
                      math.ceil(batch * fresh / load.output_len))
        step = model.step_time(batch, batch * (load.input_len + load.output_len // 2),
                               prefill).total_s
        tpot_ms = step * 1e3
        ttft_ms = tpot_ms * max(1.0, fresh / max(1, model.max_num_batched_tokens - batch))
        waves = math.ceil(concurrency / batch)  # requests beyond the batch queue
        ttft_ms += (waves - 1) * tpot_ms * load.output_len
        e2el_ms = ttft_ms + tpot_ms * max(0, load.output_len - 1)
        throughput = batch / (step * load.output_len)
        best = max(best, throughput * _past(tpot_ms, load.slo_tpot_ms)
                   * _past(ttft_ms, load.slo_ttft_ms) * _past(e2el_ms, load.slo_e2el_ms))
    return best


def screen(configs: Sequence[Mapping[str, Any]], *, model: str,
           hardware: HardwareProfile, load: ScreenLoad,
           fixed_flags: Mapping[str, Any] | None = None,
           model_info: ModelInfo | None = None) -> list[float]:
    """Each config's predicted goodput (its params as vLLM flags, "none"/None left out), in
    the order given; 0 where the model cannot take the config."""
    out = []
    for params in configs:
        flags = {**(fixed_flags or {}),
                 **{k: v for k, v in params.items() if v not in ("none", None)}}
        try:
            perf = PerformanceModel.from_config(EngineConfig(model, flags), hardware,
                                                model_info, is_compile_cache_warm=True)
        except ValueError:
            out.append(0.0)
            continue
        out.append(predicted_goodput(perf, load))
    return out


def load_of(workload: Workload) -> ScreenLoad | None:
    """The screen's view of a study's workload; None where it cannot say (a capacity search,
    a rate without a concurrency cap: no concurrency to screen at)."""
    concurrencies = tuple(lv.max_concurrency for lv in workload.levels if lv.max_concurrency)
    if workload.capacity is not None or not concurrencies:
        return None
    prefix = workload.shared_prefix.num_tokens if workload.shared_prefix is not None else 0
    slo = workload.slo
    return ScreenLoad(int(workload.input_len.mean) + prefix, int(workload.output_len.mean),
                      concurrencies, slo.ttft_p99_ms, slo.tpot_p99_ms, prefix, slo.e2el_ms)


class _RandomDraws(optuna.trial.FixedTrial):
    """A trial whose every suggestion is drawn as Optuna's `RandomSampler` draws it, with no
    study behind it: asked config after config, it yields the values a `RandomSampler(seed)`
    study yields ask after ask, without a trial in a storage, a sampler call and a
    distribution check per value. RandomSampler draws one `uniform` of a `RandomState(seed)`
    over the param's transformed bounds and maps it back (`_SearchSpaceTransform`); a
    single-valued distribution takes no draw (`Trial._suggest`). Overrides FixedTrial's
    `_suggest`, for which its public `suggest_*` build the distribution;
    tests/optimizer/search/test_screen.py holds it to a real RandomSampler study."""

    def __init__(self, seed: int) -> None:
        super().__init__({})
        self._rng = np.random.RandomState(seed)
        # A param has the same distribution in every config (Optuna requires it).
        self._draws: dict[str, _Draw] = {}

    def _suggest(self, name: str, distribution: BaseDistribution) -> Any:
        draw = self._draws.get(name)
        if draw is None:
            draw = self._draws[name] = _Draw(name, distribution)
        if draw.single is not None:
            return draw.single[0]
        if draw.choices is not None:
            # Bounds (0, 1) per choice, the one-hot argmax mapped back: `uniform(0, 1)` is
            # 0 + 1 * u, the very doubles `random_sample` draws, at a tenth of the cost.
            return draw.choices[int(self._rng.random_sample(len(draw.choices)).argmax())]
        return draw.transform.untransform(self._rng.uniform(draw.low, draw.high))[name]


class _Draw:
    """How `_RandomDraws` draws one param."""

    def __init__(self, name: str, distribution: BaseDistribution) -> None:
        self.single = (_get_single_value(distribution),) if distribution.single() else None
        self.choices = distribution.choices if isinstance(
            distribution, CategoricalDistribution) else None
        self.transform = _SearchSpaceTransform({name: distribution})
        self.low = self.transform.bounds[:, 0].copy()
        self.high = self.transform.bounds[:, 1].copy()


def sample_candidates(sample: Callable[[optuna.trial.BaseTrial], Mapping[str, Any]],
                      count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Up to `count` distinct configs drawn at random by `sample` (a `ResolvedSpace.sample`:
    its rules hold), the whole space where it is smaller: the first `count` distinct configs of
    up to 3 * count draws, the same ones (in the same order) a `RandomSampler(seed)` study
    asked that often would give, computed from the distributions without one."""
    draws = _RandomDraws(seed)
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(3 * count):
        params = dict(sample(draws))
        seen.setdefault(repr(sorted(params.items(), key=lambda kv: kv[0])), params)
        if len(seen) >= count:
            break
    return list(seen.values())
