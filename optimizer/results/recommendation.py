"""The study's best and the config to ship: `best_trial` (the best measured trial, feasible
first), `recommended_trial` (the simplest within noise of it whose launch `nightshift audit`
passes; `RECOMMENDATION_RULE`), and what they read: which trials measured their config
(`is_measured`), a trial's config (`params_of`), vLLM's defaults on the study's host, and why
there is no measurement of the defaults (`no_baseline_reason`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer.results import gains
from optimizer.results.baseline_words import baseline_words_of
from optimizer.results.trial_record import (
    StoredConfirmation,
    confirm_label,
    confirmation_of,
    is_baseline,
    record_of,
    stored_fingerprint,
    stored_vllm_defaults,
)
from optimizer.storage.study import QUALITY_CONSTRAINT, is_search_trial
from search_spaces import HOST_DEFAULTS, changed_params, vllm_default


def is_measured(trial: optuna.trial.FrozenTrial) -> bool:
    """A complete trial that measured its config: not a config failure (held complete in
    Optuna to teach the sampler, `failed` in its record) nor a final confirmation run."""
    return trial.state == TrialState.COMPLETE and confirm_label(trial) is None and \
        _record_state(trial) == "complete"


def has_measurement(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a run, a confirmation run included, measured its config: complete with a value
    in Optuna and in its record. A failure held complete in Optuna to teach the sampler (a
    config failure, `saturated`) was told the worst value, which is no measurement."""
    return trial.state == TrialState.COMPLETE and bool(trial.values) and \
        _record_state(trial) == "complete"


# Two measurements of one config differ by about this much: a change whose effect is smaller
# "does not matter here" (conclusion.conclude) and is not worth deploying (recommended_trial).
NOISE_FRACTION = 0.02


def audit_errors(trial: optuna.trial.FrozenTrial) -> list[str]:
    """The errors `nightshift audit` finds in the flags the trial ran with
    (optimizer.export.audit): a config that ships one is never recommended. The simulated engine
    prices CUDA graphs off only where a decode-only batch would have replayed one, so a
    mixed-batch workload can measure it as free; the audit's cost is vLLM's on real GPUs."""
    from optimizer.export.audit import Launch, audit

    record = record_of(trial)
    if record is None:
        return []
    launch = Launch(model="", flags=dict(record.flags), env={})  # its errors are the flags''
    return [f.message for f in audit(launch) if f.severity == "error"]


def _best_of(study: optuna.Study,
             trials: Sequence[optuna.trial.FrozenTrial]) -> optuna.trial.FrozenTrial | None:
    """`best_trial`'s rule over `trials` alone (one objective)."""
    if not trials or len(study.directions) > 1:
        return trials[0] if trials else None
    feasible = [t for t in trials if all(v <= 0 for v in t.constraints.values())]
    sign = 1.0 if study.direction.name == "MAXIMIZE" else -1.0
    return max(feasible or trials, key=lambda t: sign * float(t.values[0]))


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The study's best: among measured trials (not a config failure, which Optuna holds as
    complete to teach the sampler, nor a final confirmation run), one that met the SLO
    somewhere (constraints all <= 0) when any did; else the best measured. For two
    objectives, the first of the feasible Pareto front."""
    measured = _measured_trials(study)
    if not measured:
        return None
    if len(study.directions) == 1:
        feasible = [t for t in measured if all(v <= 0 for v in t.constraints.values())]
        sign = 1.0 if study.direction.name == "MAXIMIZE" else -1.0
        return max(feasible or measured, key=lambda t: sign * float(t.values[0]))
    numbers = {t.number for t in measured}
    front = [t for t in study.best_trials if t.number in numbers]
    if not front:  # the front held only refused trials: the front of the rest
        front = _pareto_front(measured, [d.name == "MAXIMIZE" for d in study.directions])
    return front[0] if front else None


def _pareto_front(trials: list[optuna.trial.FrozenTrial],
                  maximize: list[bool]) -> list[optuna.trial.FrozenTrial]:
    def oriented(t: optuna.trial.FrozenTrial) -> list[float]:
        return [float(v) if up else -float(v) for v, up in zip(t.values, maximize, strict=True)]

    def dominates(a: list[float], b: list[float]) -> bool:
        return all(x >= y for x, y in zip(a, b, strict=True)) and a != b

    points = [(t, oriented(t)) for t in trials]
    return [t for t, p in points if not any(dominates(q, p) for _, q in points)]


def recommended_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The config to ship: among measured trials whose launch `nightshift audit` passes
    (`audit_errors`: CUDA graphs off is an error, however the search measured it), those within
    NOISE_FRACTION of the best's value (and meeting the SLO where the best does), the one that
    changes the fewest flags from the vLLM defaults, then the better value. A flag whose
    measured effect is noise is not deployed: if the defaults themselves are within noise of
    the best, they are the recommendation. A flag counts as changed where it changes what vLLM
    runs with (`changed_params`): an explicit value equal to vLLM's default on the study's host
    is none. Two objectives, or no defaults trial to count changes from: the best. Where the
    final confirmation re-measured that pick against the defaults and its interval contains
    1.0 (or lies below it), the defaults (`is_confirmed_noise`). None where no trial met the
    SLO (`no_slo_met`): a config that meets it nowhere is nothing to ship. The simulated
    engine's repeats are no confirmation and never change the pick."""
    if is_slo_unmet(study):
        return None
    measured = _measured_trials(study)
    shippable = [t for t in measured if not audit_errors(t)]
    best = best_trial(study)
    if best is not None and audit_errors(best) and shippable:
        best = _best_of(study, shippable)
    if best is None or len(study.directions) > 1 or best.values is None:
        return best
    measured = shippable or measured
    baseline = next((t for t in measured if is_baseline(t)), None)
    if baseline is None:
        return best
    defaults = params_of(baseline)
    top = float(best.values[0])
    best_feasible = all(v <= 0 for v in best.constraints.values())
    sign = 1.0 if study.direction.name == "MAXIMIZE" else -1.0
    candidates = [t for t in measured
                  if abs(float(t.values[0]) - top) <= NOISE_FRACTION * abs(top)
                  and (not best_feasible or all(v <= 0 for v in t.constraints.values()))]

    host_defaults = vllm_defaults_of(study)

    def changes(trial: optuna.trial.FrozenTrial) -> int:
        return len(changed_params(params_of(trial), defaults, host_defaults))

    chosen = min(candidates, key=lambda t: (changes(t), -sign * float(t.values[0]), t.number))
    confirmed = confirmation_of(study)
    if confirmed is not None and confirmed.best_trial == chosen.number and \
            chosen.number != baseline.number and is_confirmed_noise(confirmed):
        return baseline  # its changes were measured as noise: the defaults are what ships
    return chosen


def is_confirmed_noise(confirmed: StoredConfirmation) -> bool:
    """Whether the final confirmation's 95% interval contains 1.0 or lies below it: the
    re-measured pick is not shown better than the defaults. One round (no interval) is not
    noise shown, only no interval: the pick stands, its export saying "not confirmed". Nor
    are the simulated engine's repeats: they measured nothing (a model's figures, moved by
    the host's load as much as by the config), so they never change the pick; every place
    calls them "simulated repeats", never the final confirmation."""
    gain = stored_gain(confirmed)
    if confirmed.is_simulated or gain is None:
        return False  # no ratio: nothing shown either way
    return gain.basis == "interval" and not gain.is_better


def stored_gain(confirmed: StoredConfirmation) -> gains.Gain | None:
    """The final confirmation's gain as stored: its rounds, the load they compared at, the
    rounds measured where fewer were compared; None where it states no ratio."""
    if confirmed.gain is None:
        return None
    return gains.interval_gain(confirmed.gain, confirmed.ci_low, confirmed.ci_high,
                               confirmed.num_rounds, load=confirmed.load,
                               rounds_each=confirmed.rounds_each)


def noise_pick(study: optuna.Study) -> StoredConfirmation | None:
    """The final confirmation, where it found the search's pick within noise of the defaults
    (or worse), so that the defaults are the recommendation; None otherwise."""
    confirmed = confirmation_of(study)
    if confirmed is None or confirmed.best_trial is None or not is_confirmed_noise(confirmed):
        return None
    pick = recommended_trial(study)
    return confirmed if pick is not None and is_baseline(pick) and \
        pick.number != confirmed.best_trial else None


def confirmation_sentence(study: optuna.Study) -> str:
    """The final confirmation's sentence as `status` and the report print it; where the
    defaults are recommended because of it (`noise_pick`), the re-measured trial is named the
    search's pick, not "the exported config" (the sentence was written before it was judged)."""
    confirmed = confirmation_of(study)
    if confirmed is None:
        return ""
    if noise_pick(study) is not None:
        words = baseline_words_of(study)
        verb = "is" if words.has_fixed_flags else "are"
        return confirmed.sentence.replace(
            "(the exported config)", f"(the search's pick; within noise, so the {words.short} "
            f"{verb} exported)")
    return confirmed.sentence


# The SLO constraint a complete trial holds (optimizer/search/tell.py): 0 where some level met
# the SLO, 1 where none did; absent where the study has no SLO.
SLO_CONSTRAINT = "slo"

# (words, the SLO's field, the level's p99 metric) of each bound.
_SLO_BOUNDS = (("TTFT p99", "ttft_p99_ms", "p99_ttft_ms"),
               ("TPOT p99", "tpot_p99_ms", "p99_tpot_ms"),
               ("E2E latency p99", "e2el_ms", "p99_e2el_ms"))


def is_slo_unmet(study: optuna.Study) -> bool:
    """Whether the study has an SLO and no measured trial met it at any load (each holds a
    violated SLO constraint); False before any trial was measured."""
    measured = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if is_measured(t) and t.values is not None]
    return bool(measured) and not any(met_slo(t) for t in measured)


def met_slo(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether a measured trial met the SLO at some load: its SLO constraint holds (or the
    study has none), and after a capacity search a load met it (an operating point: a probe
    that met the SLO in its window but whose hold missed leaves none)."""
    if trial.constraints.get(SLO_CONSTRAINT, 0.0) > 0:
        return False
    record = record_of(trial)
    capacity = record.capacity if record is not None else None
    return not (isinstance(capacity, Mapping) and "met_load" in capacity
                and not capacity.get("met_load"))


def no_slo_met(study: optuna.Study,
               slo: Mapping[str, float | None] | None = None) -> str | None:
    """One line where no measured trial met the SLO (`is_slo_unmet`): that, the closest miss
    (the level whose worst p99 was nearest its bound, with each bound it missed), and what to
    do; None otherwise. `slo`: the bounds by field (`tpot_p99_ms`, ...); default: the study's
    stored fingerprint's."""
    if not is_slo_unmet(study):
        return None
    bounds = dict(slo) if slo is not None else _stored_slo(study)
    closest: tuple[float, int, str, list[str]] | None = None
    saturated: list[tuple[float, int, str]] = []  # (load, trial, load's words)
    for trial in _measured_trials(study) or [t for t in study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE,)) if is_measured(t)]:
        record = record_of(trial)
        if record is None:
            continue
        for step in record.steps or ({"metrics": record.metrics},):
            metrics = step.get("metrics") or {}
            if (step.get("server") or {}).get("is_saturated"):
                load = metrics.get("offered_rate_rps") or metrics.get("offered_concurrency")
                saturated.append((float(load) if isinstance(load, int | float) else 0.0,
                                  trial.number, _step_load(metrics)))
            if not metrics.get("completed", 1):
                continue
            worst, misses = 0.0, []
            for words, field_name, key in _SLO_BOUNDS:
                bound, value = bounds.get(field_name), metrics.get(key)
                if bound is None or not isinstance(value, int | float) or \
                        not math.isfinite(value) or bound <= 0:
                    continue
                worst = max(worst, float(value) / bound)
                if value > bound:
                    shown = f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"
                    misses.append(f"{words} {shown} ms against {bound:g} ms")
            if misses and (closest is None or worst < closest[0]):
                closest = (worst, trial.number, _step_load(metrics), misses)
    if not any(v is not None for v in bounds.values()):
        miss = "the study keeps no SLO bounds to name the closest miss"
    elif closest is None and saturated:
        _, number, load = min(saturated)
        miss = (f"no level missed on a p99 bound: the engine saturated (its queue kept "
                f"growing) at {load or 'a load'} (trial {number}), the lightest such load")
    elif closest is None:
        miss = "no level missed on a p99 bound: each failed requests or overloaded the engine"
    else:
        _, number, load, misses = closest
        miss = f"closest: trial {number}{f' at {load}' if load else ''}, {', '.join(misses)}"
    return (f"no trial met the SLO ({miss}): nothing to recommend; relax the SLO or lighten "
            "the load (fewer concurrent requests, a lower rate, shorter requests)")


def _stored_slo(study: optuna.Study) -> dict[str, float | None]:
    fp = stored_fingerprint(study)
    if fp is None:
        return {}
    return {"ttft_p99_ms": fp.slo_ttft_p99_ms, "tpot_p99_ms": fp.slo_tpot_p99_ms,
            "e2el_ms": fp.slo_e2el_ms}


def _step_load(metrics: Mapping[str, Any]) -> str:
    concurrency, rate = metrics.get("offered_concurrency"), metrics.get("offered_rate_rps")
    if isinstance(rate, int | float):
        return f"{rate:.3g} req/s"
    if isinstance(concurrency, int | float):
        return f"concurrency {concurrency:g}"
    return ""


# The one rule that names the config to ship; every place that names it (the end-of-run line,
# `status`, the report, MLflow's tag and run name, the export) names `recommended_trial`'s.
RECOMMENDATION_RULE = (f"the best measured trial whose launch `nightshift audit` passes, unless "
                       f"one within {NOISE_FRACTION:.0%} of it (noise) changes fewer flags "
                       "from the vLLM defaults, or the final confirmation found it within noise "
                       "of the defaults (then the defaults; the simulated engine's repeats are "
                       "no confirmation and never change the pick)")


def recommendation_note(study: optuna.Study, chosen: optuna.trial.FrozenTrial) -> str:
    """Why the recommendation `chosen` is not the nominal best (empty when it is)."""
    noise = noise_pick(study)
    words = baseline_words_of(study)
    gain = stored_gain(noise) if noise is not None else None
    if noise is not None and gain is not None and chosen.number != noise.best_trial:
        them = "it" if words.has_fixed_flags else "them"
        verdict = gains.confirmation_verdict(gain, f"the {words.short}")
        return (f"{words.the}: the final confirmation re-measured the search's pick, "
                f"trial {noise.best_trial}, against {them}: {gains.format_gain(gain, words.the)}"
                f", {verdict}; its changes are not worth deploying; "
                f"`--trial {noise.best_trial}` exports it")
    best = best_trial(study)
    if best is None or best.number == chosen.number or not best.values or not chosen.values:
        return ""
    what = words.the if is_baseline(chosen) else f"trial {chosen.number}"
    refused = audit_errors(best)
    if refused:
        return (f"the best measured, trial {best.number} ({best.values[0]:.4g} vs "
                f"{chosen.values[0]:.4g}), runs a flag `nightshift audit` calls an error "
                f"({refused[0].rstrip('.')}); {what} is the best launch that passes it")
    return (f"{what}: within {NOISE_FRACTION:.0%} of the best measured (trial {best.number}, "
            f"{best.values[0]:.4g} vs {chosen.values[0]:.4g}) with fewer changes from "
            f"{words.the}; `--trial {best.number}` exports that one")


def vllm_defaults_of(study: optuna.Study) -> dict[str, Any]:
    """vLLM's value of each param on the study's host, as the study kept it at start; for a
    study written before it was kept, the host-independent ones only (a host-dependent param
    set to the host's default then counts as a change)."""
    kept = stored_vllm_defaults(study)
    if kept is not None:
        return dict(kept)
    return host_independent_defaults(study.get_trials(deepcopy=False))


def host_independent_defaults(trials: Sequence[optuna.trial.FrozenTrial]) -> dict[str, Any]:
    """vLLM's value of each param the trials set that is the same on every host."""
    names = {k for t in trials for k in params_of(t)}
    return {k: vllm_default(k) for k in sorted(names) if k not in HOST_DEFAULTS}


def _record_state(trial: optuna.trial.FrozenTrial) -> str:
    """The record's state; a trial without a record is taken as Optuna holds it (complete)."""
    record = record_of(trial)
    return record.state if record is not None else "complete"


def params_of(trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """The config a trial ran: its record's params, else Optuna's."""
    record = record_of(trial)
    return dict(record.params if record is not None and record.params else trial.params)


def _measured_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Measured trials that may be the best: a trial the quality gate refused never is, even
    when no trial met the SLO (its speed was bought with the model's outputs)."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if is_measured(t) and t.values is not None
            and t.constraints.get(QUALITY_CONSTRAINT, 0.0) <= 0]


def no_baseline_reason(study: optuna.Study) -> str | None:
    """Why the study has no measurement of the defaults (every gain is stated against it):
    the last defaults trial's failure, once none was measured and none is queued or running
    (a retry may still measure them); None otherwise."""
    baselines = [t for t in study.get_trials(deepcopy=False)
                 if is_baseline(t) and is_search_trial(t)]
    if not baselines or any(is_measured(t) or not t.state.is_finished() for t in baselines):
        return None
    last = max(baselines, key=lambda t: t.number)
    record = record_of(last)
    reason = (record.failure_reason if record else None) or last.state.name.lower()
    message = str((record.failure_message if record else None) or "").strip()
    if len(message) > 600:  # a long one (a traceback's line) cut at a word, and said so
        message = f"{message[:600].rsplit(' ', 1)[0]} ..."
    tries = f"; tried {len(baselines)} times" if len(baselines) > 1 else ""
    if _says_reason(message, reason):  # "saturated at ...": the reason said once
        return f"{message.rstrip('.')}{tries}"
    return f"{reason}{tries}" + (f": {message}" if message else "")


def _says_reason(message: str, reason: str) -> bool:
    """Whether `message` starts with its reason's name as a word ("saturated at rate=12" of
    `saturated`; "too many errors" of `too_many_errors`)."""
    words = reason.replace("_", " ").lower()
    return message.lower().startswith(words) and not message[len(words):][:1].isalnum()
