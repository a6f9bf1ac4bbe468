"""The one-line conclusion a user reads in the morning: what a trial's config changes from the
vLLM defaults and what that did, against the defaults and the best so far, with the bracket or
interval that bounds it and the bottleneck's label."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from optimizer import bottleneck
from optimizer.results import gains
from optimizer.results.at_load import AtLoads, compared_loads
from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.objectives import OBJECTIVES, on_all_gpus
from optimizer.results.recommendation import NOISE_FRACTION, is_measured, params_of
from optimizer.results.trial_record import gpus_of, is_baseline, objective_unit, record_of
from runners.capacity.bracket import Bracket, bracket_from_metrics

if TYPE_CHECKING:
    import optuna
    from optuna.trial import FrozenTrial

    from optimizer.bottleneck import Verdict


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


SHORT_CHARS = 70  # a table cell


@dataclass(frozen=True)
class Reference:
    """A finished trial another one is compared with (the vLLM defaults, the best so far)."""

    number: int
    params: Mapping[str, Any]
    value: float | None  # the first objective, per GPU (as Optuna holds it)
    capacity: Bracket | None = None  # after a capacity search, as measured (all its GPUs)
    num_gpus: int = 1  # the GPUs its config used
    # Its value at each applied fixed level, so a trial is compared with it at one load
    # (`gains.same_load`); None: unknown (a reference built by hand, an older record).
    loads: AtLoads | None = None


@dataclass(frozen=True)
class Conclusion:
    """What a trial taught, in one line (`text`: MLflow's `conclusion` tag and run description,
    logs) and as a table cell (`short`, at most SHORT_CHARS characters)."""

    text: str
    short: str


def baseline_trial(study: optuna.Study) -> FrozenTrial | None:
    """The study's measured vLLM-defaults trial (not a confirmation re-run of it), or None."""
    return next((t for t in study.get_trials(deepcopy=False)
                 if is_baseline(t) and is_measured(t)), None)


def reference_of(trial: FrozenTrial | None, axis: str | None = None,
                 objective: str | None = None) -> Reference | None:
    """A finished trial as a comparison point: its record's params (what it ran), value and
    capacity bracket (read back from its metrics, for a capacity search on `axis`), and with
    the study's first `objective` its value at each applied fixed level (`Reference.loads`)."""
    if trial is None or not trial.values:
        return None
    record = record_of(trial)
    capacity = None
    if axis in ("concurrency", "request_rate"):
        capacity = bracket_from_metrics(axis, record.metrics if record else {})  # type: ignore[arg-type]
    num_gpus = record.num_gpus if record is not None else gpus_of(params_of(trial))
    return Reference(trial.number, params_of(trial), float(trial.values[0]), capacity,
                     num_gpus, compared_loads(objective, record))


def _is_default(value: Any, default: Any) -> bool:
    """None is "no flag": vLLM's default. A value equal to vLLM's default changes nothing."""
    if value is None:
        return True
    return default is not None and value == default and \
        isinstance(value, bool) == isinstance(default, bool)


def changes_from_defaults(params: Mapping[str, Any],
                          vllm_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The params a config sets away from vLLM's own defaults (for this host and model)."""
    return {k: v for k, v in params.items() if not _is_default(v, vllm_defaults.get(k))}


def param_changes(params: Mapping[str, Any], reference: Mapping[str, Any]) -> list[str]:
    """`name=value` for each param that differs from `reference`, None counting as the
    default: never `None→x`."""
    return [f"{k}={v}" for k, v in params.items() if not _is_default(v, reference.get(k))]


def _listing(changes: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(changes[:limit])
    return shown + (f" (+{len(changes) - limit} more)" if len(changes) > limit else "")


def shorten(text: str, limit: int = SHORT_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 1].rstrip(" ,;:") + "…"


def capacity_text(bracket: Bracket, tolerance: float | None, *,
                  is_stopped: bool = False) -> str:
    text = f"capacity {bracket.describe()}"
    if bracket.met_load is None and bracket.status != "none":
        text += ", no probed load met the SLO"  # "none" says it itself, with the range
    elif bracket.missed_load is None and bracket.is_resolved:
        text += ", the SLO held at the heaviest load of interest"
    if bracket.held is True:
        text += ", held over a long window at that load"
    elif bracket.held is False:
        text += (", not held: every hold missed, so its lower end rests on a short window "
                 "(whose p99 can read low)")
    if not bracket.is_resolved and is_stopped:
        text += ", unresolved: the search was stopped"
    elif not bracket.is_resolved:
        limit = f"the {tolerance:.0%} tolerance" if tolerance is not None else "the tolerance"
        text += (f", unresolved: the bracket is wider than {limit} after "
                 f"{bracket.num_probes} probes")
    return text


def _gpus(num_gpus: int) -> str:
    return f"{num_gpus} GPU" + ("s" if num_gpus != 1 else "")


def _vs_defaults(value: float | None, capacity: Bracket | None,
                 baseline: Reference | None, objective: str,
                 num_gpus: int = 1, words: BaselineWords = DEFAULTS,
                 loads: AtLoads | None = None) -> tuple[str, str]:
    """The effect against the defaults, per GPU (`gains.gain_over`), as a phrase and a table
    cell; where either side ran on more than one GPU the phrase says "per GPU" and gives the
    ratio as measured beside it ("0.72x the vLLM defaults per GPU ...; 1.45x on 2 GPUs against
    the defaults on 1 GPU"); `words` names the baseline (the vLLM defaults, or them + the
    study's fixed flags)."""
    if baseline is None:
        return f"no {words.short} measurement to compare with", f"vs {words.short}: n/a"
    maximize = OBJECTIVES[objective].direction == "maximize"
    gain = gains.gain_over(value, baseline.value, capacity, baseline.capacity,
                           maximize=maximize, num_gpus=num_gpus,
                           defaults_num_gpus=baseline.num_gpus, loads=loads,
                           defaults_loads=baseline.loads)
    is_multi = num_gpus > 1 or baseline.num_gpus > 1
    what = f"{words.the} per GPU" if is_multi else words.the
    cell_what = f"vs {words.short} per GPU" if is_multi else f"vs {words.short}"
    raw = ""
    if is_multi and (OBJECTIVES[objective].is_per_gpu or capacity is not None):
        whole = gains.as_measured(gain, objective, value, baseline.value, capacity,
                                  baseline.capacity, num_gpus=num_gpus,
                                  defaults_num_gpus=baseline.num_gpus)
        if whole is not None and whole.value is not None:
            raw = (f"; {whole.value:.2f}x as measured, on {_gpus(num_gpus)} against the "
                   f"{words.short} on {_gpus(baseline.num_gpus)}")
    if gain.basis == "single" and gain.value is not None and \
            abs(gain.value - 1.0) < NOISE_FRACTION:
        return (f"within noise of {what} ({gains.format_gain(gain, what)}){raw}",
                f"= {words.short} per GPU (noise)" if is_multi else f"= {words.short} (noise)")
    return gains.format_gain(gain, what) + raw, f"{gains.short_gain(gain)} {cell_what}"


def _vs_best(value: float | None, capacity: Bracket | None, best: Reference,
             objective: str, num_gpus: int = 1, loads: AtLoads | None = None) -> str:
    is_multi = num_gpus > 1 or best.num_gpus > 1
    unit = objective_unit(objective) + \
        (" per GPU" if is_multi and OBJECTIVES[objective].is_per_gpu else "")
    best_value, at = best.value, ""
    maximize = OBJECTIVES[objective].direction == "maximize"
    # The study's best is Optuna's ranking of the operating points' values, whatever load a
    # comparison below is taken at.
    is_new_best = value is not None and best.value is not None and (
        value > best.value if maximize else value < best.value)
    if capacity is None and loads is not None and best.loads is not None and \
            gains.needs_one_load(loads, best.loads):
        # Two operating points at two loads: compared at one both applied, or not at all.
        same = gains.same_load(loads, best.loads, maximize=maximize)
        if same.load is None:
            return (f"vs best trial {best.number}: not comparable at one load "
                    f"({same.not_comparable})")
        value, best_value = loads.value_at(same.load), best.loads.value_at(same.load)
        at = f" at {same.load}"
    if value is None or best_value is None:
        return f"vs best trial {best.number}: no value to compare"
    if not best_value:
        return (f"vs best trial {best.number}: no ratio (the best measured 0"
                f"{' there' if at else ''})")
    delta = (value - best_value) / best_value * 100
    better = value > best_value if maximize else value < best_value
    head = f"vs best trial {best.number} ({_fmt(best_value)} {unit}{at}): {delta:+.0f}%"
    if at:  # compared at a load other than an operating point: the verdict is of that load
        there = "within noise of the best there" if abs(delta) < NOISE_FRACTION * 100 else \
            ("better there" if better else "worse there")
        return f"{head}, {there}" + (", and the new best by its operating point"
                                     if is_new_best else "")
    if capacity is not None and best.capacity is not None:
        gain = gains.capacity_gain(gains.per_gpu_bracket(capacity, num_gpus),
                                   gains.per_gpu_bracket(best.capacity, best.num_gpus))
        if gain.is_better:
            return f"{head}, new best (its bracket lies above the best's)"
        if gain.is_worse:
            return f"{head}, worse (its bracket lies below the best's)"
        nominal = ", nominally the new best" if better else ""
        return f"{head}: the brackets overlap, not distinguishable{nominal}"
    if abs(delta) < NOISE_FRACTION * 100:
        nominal = ", nominally the new best" if better else ""
        return f"{head}, within noise of the best{nominal}"
    return f"{head}, new best" if better else f"{head}, worse"


def conclude(*, params: Mapping[str, Any], state: str, objective: str,
             value: float | None, failure_reason: str | None = None,
             failure_message: str | None = None, is_baseline: bool = False,
             best: Reference | None = None, baseline: Reference | None = None,
             vllm_defaults: Mapping[str, Any] | None = None,
             capacity: Bracket | None = None, tolerance: float | None = None,
             pruned_at: int | None = None, prune_reason: str | None = None,
             verdict: Verdict | None = None, confirm_label: str | None = None,
             note: str = "", number: int | None = None,
             quality_failed: Sequence[str] = (), template: str = "",
             num_gpus: int = 1, baseline_words: BaselineWords = DEFAULTS,
             loads: AtLoads | None = None) -> Conclusion:
    """One line: what this config changes from the vLLM defaults and what that did to the
    objective (with the bracket or interval that bounds it), then against the best so far,
    then the bottleneck's label and its one piece of advice.

    `vllm_defaults`: vLLM's own value of each param on this host (None, or a value equal to
    it, is no change); `capacity`: this trial's bracket after a capacity search, `tolerance`
    the search's; `note`: a sentence to append (e.g. an unstable measurement);
    `quality_failed`: the quality figures outside the study's limits (the gate refuses it);
    `template`: the hardware template the trial measures ("the Hopper template (fp8 weights +
    ...)"), named first so the report shows where the folklore held; `num_gpus`: the GPUs the
    config used. `value` and the references' values are per GPU (`objectives.per_gpu`), as
    Optuna holds them: every comparison is per GPU, and says so where a side used more than
    one GPU. `baseline_words`: how the baseline is named (`baseline_words.baseline_words` of
    the study's fixed flags): "the vLLM defaults" only where the study fixes no flag.
    `loads`: the trial's value at each applied fixed level (`at_load.at_loads`): where its
    operating point and a reference's are two loads (a level whose load was not applied),
    they are compared at a load both applied, named, or said not comparable."""
    words = baseline_words
    unit = objective_unit(objective)
    defaults = vllm_defaults if vllm_defaults is not None else \
        (baseline.params if baseline is not None else {})
    changed = [f"{k}={v}" for k, v in changes_from_defaults(params, defaults).items()]
    change = _listing(changed) if changed else words.name
    short_change = (changed[0] + (f" +{len(changed) - 1}" if len(changed) > 1 else "")) \
        if changed else words.short
    label = verdict.label if verdict is not None else ""
    tail = f" {bottleneck.sentence('', '', verdict, config=params)}" \
        if verdict is not None else ""
    note = f" {note.strip()}" if note.strip() else ""
    shown = f"{objective} {_fmt(value)} {unit}" if value is not None else "no measurement"
    if value is not None and num_gpus > 1 and OBJECTIVES[objective].is_per_gpu:
        shown = (f"{objective} {_fmt(on_all_gpus(objective, value, num_gpus))} {unit} on "
                 f"{_gpus(num_gpus)} = {_fmt(value)} {unit} per GPU")
    if loads is not None and loads.operating and baseline is not None and \
            baseline.loads is not None and baseline.loads.operating not in (None,
                                                                            loads.operating):
        shown += f" at {loads.operating}"  # not the defaults' operating point: named
    cap = f" ({capacity_text(capacity, tolerance, is_stopped=state == 'pruned')})" \
        if capacity is not None else ""
    unresolved = " unresolved" if capacity is not None and not capacity.is_resolved else ""
    named = f"{template}: " if template else ""
    if state == "failed":
        text = f"{named}{change}: failed ({failure_reason}): {failure_message or 'no detail'}"
        return Conclusion(text, shorten(f"{short_change}: failed ({failure_reason})"))
    if confirm_label:
        # The label is stored ("defaults" / "best"); the baseline is named as it ran.
        which = words.short if confirm_label == "defaults" else confirm_label
        text = f"confirmation run of the {which} config: {shown}{cap}.{note}"
        return Conclusion(text, shorten(f"confirmation ({which}): {shown}"))
    if is_baseline:
        text = (f"{words.name}: {shown}{cap}; the baseline every other trial is compared "
                f"with.{tail}{note}")
        per = "/GPU" if num_gpus > 1 and OBJECTIVES[objective].is_per_gpu else ""
        cell = f"{words.short}: {_fmt(value)} {unit}{per}" if value is not None else \
            words.short
        return Conclusion(text, shorten(f"{cell}{unresolved}; {label}" if label else
                                        f"{cell}{unresolved}"))
    # A trial pruned at a fixed level has a value over the levels it ran only: no ratio to a
    # trial that ran them all is true. A bracket's ends were measured, pruned or not.
    is_comparable = state != "pruned" or capacity is not None
    if is_comparable:
        effect, effect_cell = _vs_defaults(value, capacity, baseline, objective, num_gpus,
                                           words, loads)
    else:
        effect, effect_cell = "not compared: its load levels were cut short", ""
    head = f"{change} vs {words.the}" if changed else f"same flags as {words.the}"
    parts = [f"{head}: {shown}{cap}, {effect}"]
    if is_comparable and best is not None and best.number != number and \
            (baseline is None or best.number != baseline.number):
        parts.append(_vs_best(value, capacity, best, objective, num_gpus, loads))
    if state == "pruned":
        why = (prune_reason or "below the median of earlier trials there").rstrip(".")
        parts.append(f"pruned at level {pruned_at}: {why}")
        effect_cell = f"pruned at {pruned_at}"
    text = "; ".join(parts) + "." + tail + note
    cell = f"{short_change}: {effect_cell}{unresolved}" + (f"; {label}" if label else "")
    if quality_failed:  # outside the quality limits: never the best, whatever its speed
        text = (f"refused by the quality gate ({'; '.join(quality_failed)}), never the "
                f"recommendation: {text}")
        cell = f"{short_change}: quality refused ({quality_failed[0]})"
    return Conclusion(named + text, shorten(cell))
