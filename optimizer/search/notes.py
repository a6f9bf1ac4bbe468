"""The notes a trial's conclusion carries beside its figures: what speculative decoding did, what
vLLM changed by itself for the config, why a capacity search found no operating point, and
which fixed levels saturated (with the failure of a run whose latency would be read at one)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import optuna

from optimizer.results.objectives import (
    described_step,
    get_objective,
    is_capacity_search,
    metrics_value,
    operating_step,
)
from optimizer.results.trial_record import record_of
from runners.base import EngineInfo, Failure, FailureReason, StepMetrics


def speculation_note(params: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
    """What speculative decoding did at the headline level, from vLLM's counters: the share of
    draft tokens accepted and the tokens a verification step yielded; that the counters show
    no draft proposed (prompt lookup finds nothing the output repeats); or that no counter was
    read, so nothing is said of the drafts."""
    method = params.get("spec_method")
    if method in (None, "none"):
        return ""
    rate = metrics.get("server.spec_decode_acceptance_rate")
    length = metrics.get("server.spec_decode_mean_acceptance_length")
    if rate is not None and length is not None:
        return (f"Speculation ({method}): {rate:.0%} of draft tokens accepted, {length:.1f} "
                "tokens per verification step at the headline level.")
    if metrics.get("server.spec_decode_num_drafts") == 0:
        return f"Speculation ({method}): vLLM proposed no draft at the headline level."
    return (f"Speculation ({method}): vLLM's spec-decode counters were not read at the "
            "headline level, so what the drafts did is unknown.")


def no_operating_point_note(objective: str, steps: Sequence[StepMetrics]) -> str:
    """After a capacity search in which no load met the SLO, that the trial has no operating
    point, and why (`lightest_miss`); "" otherwise."""
    miss = lightest_miss(objective, steps)
    return f"No operating point: {miss}." if miss else ""


def lightest_miss(objective: str, steps: Sequence[StepMetrics]) -> str:
    """After a capacity search in which no load met the SLO: that, and why the lightest load
    probed missed where the runner says (its `miss_reason`); "" otherwise."""
    if not is_capacity_search(steps) or operating_step(objective, steps) is not None:
        return ""
    lightest = described_step(objective, steps)
    if lightest is None:
        return ""
    level = lightest.level
    load = f"{level.request_rate_rps:.3g} req/s" if level.request_rate_rps is not None \
        else f"concurrency {level.max_concurrency}"
    why = lightest.miss_reason
    return (f"no probed load met the SLO; the lightest, {load}, missed it"
            + (f" ({why})" if why else ""))


def unapplied_levels_note(steps: Sequence[StepMetrics]) -> str:
    """The fixed levels whose load the client or the server did not carry (a closed loop that
    held fewer than its concurrency, an open loop that sent late, a simulated engine whose
    modelled clock received the sends at another rate than sent: `is_load_unapplied`), each
    with why: their figures are of another load than their label (lighter, or on the simulated
    engine heavier), so no figure of the trial is stated at that load. "" where there is none,
    or after a capacity search (its probes say it in their own miss reasons)."""
    if is_capacity_search(steps):
        return ""
    unapplied = [s for s in steps if s.metrics.completed > 0 and s.is_load_unapplied]
    if not unapplied:
        return ""
    said = "; ".join(f"{s.level.label}: {s.miss_reason or 'load not applied'}"
                     for s in unapplied)
    return (f"Load not applied at {len(unapplied)} level(s), whose figures are of another "
            f"load than their label ({said}).")


def saturated_levels(steps: Sequence[StepMetrics]) -> list[StepMetrics]:
    """The levels the load generator stopped as saturated (its waiting queue kept growing:
    `is_saturated` in the level's server metrics; runners/levels.py), in order."""
    return [s for s in steps if s.is_saturated]


def saturated_note(steps: Sequence[StepMetrics]) -> str:
    """What the saturated levels `steps` were (after "saturated at "): a miss at their load,
    not failed requests."""
    loads = ", ".join(s.level.label for s in steps)
    return (f"{loads}: the queue kept growing, so the level was stopped and its "
            "unfinished requests cancelled (a miss at that load, not failed requests)")


def unbounded_latency_levels(objectives: Sequence[str],
                             steps: Sequence[StepMetrics]) -> list[StepMetrics]:
    """The saturated fixed levels a latency objective's value would be read at or over, so
    that the trial has none (a latency at a load the engine could not keep up with is
    unbounded; the p99 of the requests that finished before the level was stopped reads it
    low). A latency first: every saturated level, its value being the worst level's (what a
    user at the heaviest load sees), never a lighter level's in place of the one it could not
    serve. A rate first and a latency after it: every saturated level where the rate has no
    operating point (a saturated level never is one: `operating_step`), so no level was
    served; else none (the latency is read at the level the rate was). [] without a latency,
    after a capacity search (a saturated probe misses the SLO, never the operating point) or
    where no level saturated."""
    saturated = saturated_levels(steps)
    if not saturated or is_capacity_search(steps) or \
            not any(get_objective(o).is_latency for o in objectives):
        return []
    if get_objective(objectives[0]).is_latency:
        return saturated
    return saturated if operating_step(objectives[0], steps) is None else []


def served_note(objective: str, steps: Sequence[StepMetrics]) -> str:
    """The fixed levels the engine served (requests completed, not saturated, the load of
    their label applied), each with the latency objective `objective`'s p99 there
    ("rate=2 at 41.2 ms TPOT p99"); "" where none was."""
    entry = get_objective(objective)
    said = []
    for step in steps:
        if step.metrics.completed <= 0 or step.is_saturated or step.is_load_unapplied:
            continue
        value = metrics_value(objective, step.metrics)
        said.append(f"{step.level.label} at {value:.1f} {entry.unit}" if math.isfinite(value)
                    else f"{step.level.label} (no {objective} sample)")
    return ", ".join(said)


def saturated_failure(saturated: Sequence[StepMetrics], missing: str, advice: str, *,
                      served: str = "") -> Failure:
    """The failure of a run with no value at the levels `saturated`, stopped as saturated:
    `saturated` (never `too_many_errors`: the cancelled requests are the load generator's, not
    the engine's), saying what it served (`served`, from `served_note`; else that it served
    no level or completed no request), what has no value for it (`missing`) and what to do
    (`advice`)."""
    if served:
        what = f"it served only {served}"
    elif any(s.metrics.completed > 0 for s in saturated):
        what = "it served no level without its queue growing"
    else:
        what = "no level completed a request"
    return Failure(FailureReason.SATURATED,
                   f"saturated at {saturated_note(saturated)}; {what}, so {missing}: {advice}.")


def no_value_failure(objectives: Sequence[str], steps: Sequence[StepMetrics]) -> Failure:
    """Why a run that completed has no value for `objectives`: a latency read at a level that
    saturated (`saturated`, naming what the engine served and its p99 there), a capacity
    search in which no load met the SLO (`slo_unmet`: a latency has no value there), or no
    level gave a figure (`too_many_errors`)."""
    latency = next((o for o in objectives if get_objective(o).is_latency), objectives[0])
    unbounded = unbounded_latency_levels(objectives, steps)
    if unbounded:
        cut = ": the p99 of the requests that finished before the stop reads it low" \
            if any(s.metrics.completed > 0 for s in unbounded) else ""
        return saturated_failure(
            unbounded, f"the trial has no {latency} value (unbounded at that load{cut})",
            "lighten the load (a lower request rate in workload.levels, shorter requests) or "
            "let workload.capacity find the heaviest load it serves within the SLO",
            served=served_note(latency, steps))
    if is_capacity_search(steps):
        # A probe missed for overload is such a miss too, not an error.
        return Failure(FailureReason.SLO_UNMET,
                       f"{lightest_miss(objectives[0], steps) or 'no probed load met the SLO'}"
                       f", so the trial has no {latency} value (it served no load within the "
                       "SLO): relax the SLO, lower workload.capacity.low or shorten the "
                       "requests.")
    if any(s.metrics.completed > 0 for s in steps):
        return Failure(FailureReason.TOO_MANY_ERRORS, f"no load level gave a {latency} sample.")
    return Failure(FailureReason.TOO_MANY_ERRORS, "no load level completed a request.")


def engine_of(trial: optuna.trial.FrozenTrial | None) -> Mapping[str, Any] | None:
    """A trial's engine as its record keeps it (`EngineInfo`), or None (no trial, no record)."""
    record = record_of(trial) if trial is not None else None
    return dict(record.engine or {}) if record is not None else None


def implied_changes_note(params: Mapping[str, Any], engine: EngineInfo,
                         baseline: Mapping[str, Any] | None) -> str:
    """What vLLM changed by itself for this config, beyond what the trial asked for, so that
    the change a conclusion names is not taken for the whole of it (vLLM 0.26, with CPU ngram
    speculation: async scheduling off, config/vllm.py:1059-1107; the V1 model runner instead
    of V2, config/vllm.py:576-588). Each is said where the defaults' engine is known to have
    run otherwise, or where the defaults were not measured yet (then of this config alone); a
    defaults' record that does not say (written before these were read) says nothing."""
    said = []
    if engine.async_scheduling is False and params.get("async_scheduling") is not False and \
            (baseline is None or baseline.get("async_scheduling") is True):
        said.append("turned async scheduling off (its log: \"Asynchronous scheduling is "
                    "disabled\")")
    if engine.model_runner == "V1" and (baseline is None or baseline.get("model_runner") == "V2"):
        said.append("ran the V1 model runner instead of V2 (its log: \"using the V1 model "
                    "runner instead\")")
    if not said:
        return ""
    return f"vLLM {' and '.join(said)} for this config, so the result includes that."

