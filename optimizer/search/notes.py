"""The notes a trial's conclusion carries beside its figures: what speculative decoding did, what
vLLM changed by itself for the config, why a capacity search found no operating point, and
which fixed levels saturated (with the failure of a run that saturated before serving any)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optuna

from optimizer.results.objectives import described_step, is_capacity_search, operating_step
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
    point, and why the lightest load probed missed where the runner says (its `miss_reason`,
    read with getattr until `StepMetrics` has it); "" otherwise."""
    if not is_capacity_search(steps) or operating_step(objective, steps) is not None:
        return ""
    lightest = described_step(objective, steps)
    if lightest is None:
        return ""
    level = lightest.level
    load = f"{level.request_rate_rps:.3g} req/s" if level.request_rate_rps is not None \
        else f"concurrency {level.max_concurrency}"
    why = getattr(lightest, "miss_reason", None)
    return (f"No operating point: no probed load met the SLO; the lightest, {load}, missed it"
            + (f" ({why})." if why else "."))


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


def saturated_failure(saturated: Sequence[StepMetrics], missing: str, advice: str) -> Failure:
    """The failure of a run none of whose levels completed a request, where the levels
    `saturated` were stopped as saturated: `saturated` (never `too_many_errors`: the cancelled
    requests are the load generator's, not the engine's), saying what has no value for it
    (`missing`) and what to do (`advice`)."""
    return Failure(FailureReason.SATURATED,
                   f"saturated at {saturated_note(saturated)}; no level completed a request, "
                   f"so {missing}: {advice}.")


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

