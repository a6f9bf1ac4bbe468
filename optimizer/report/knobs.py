"""Which knobs mattered: each one-change trial's effect against the defaults (`KnobEffect`,
`knob_effects`) and fANOVA's parameter importances over the complete configs (`importances`,
with the floor of trials a ranking needs)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer.results import gains
from optimizer.results.at_load import compared_loads
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.recommendation import (
    NOISE_FRACTION,
    has_measurement,
    host_independent_defaults,
    params_of,
)
from optimizer.results.trial_record import gpus_of, record_of
from optimizer.storage.study import is_search_trial
from runners.capacity.bracket import bracket_from_metrics
from search_spaces import PARAM_PARENTS, changed_params

logger = logging.getLogger(__name__)

TOO_FEW_FOR_IMPORTANCES = ("too few complete trials to rank parameters (a ranking needs two more "
                           "than the parameters that varied, and at least 4)")



@dataclass(frozen=True)
class KnobEffect:
    """A trial that changed one searched parameter alone from the defaults, measured in the
    same study: that knob's main effect at the defaults (what it does combined with other
    changes is not seen). `spread` is the larger of the two trials' repeat spreads of the
    objective, (max - min) / median over the repeats on one server (`trial_record.spread`; of two
    repeats the median is the larger): not a start-to-start interval, which only a
    confirmation round measures."""

    param: str
    value: Any
    number: int
    gain: gains.Gain  # vs the defaults, > 1 = better
    spread: float | None  # None where either trial measured its level once
    with_params: Mapping[str, Any] = field(default_factory=dict)  # children set with it
    # This trial's objective and the defaults': at the load compared where `gain.load` names
    # one (a level of either not applied), else at each operating point.
    measured: float | None = None
    defaults_measured: float | None = None

    @property
    def shown_value(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.with_params.items())
        return f"{self.value} (with {extra})" if extra else str(self.value)

    @property
    def size(self) -> float:
        """How far from no change, either way (a ratio of 0.5 is as far as 2.0)."""
        value = self.gain.value
        return abs(math.log(value)) if value else math.inf

    @property
    def verdict(self) -> str:
        if self.gain.basis == "capacity":
            return ("beyond the capacity brackets" if self.gain.excludes_one
                    else "the capacity brackets overlap")
        if self.gain.value is None:
            if self.measured is None or self.defaults_measured is None:
                missing = [side for side, v in (("this trial", self.measured),
                                                ("the defaults", self.defaults_measured))
                           if v is None]
                return f"no ratio: no value for {' and '.join(missing)}"
            zero = [side for side, v in (("this trial", self.measured),
                                         ("the defaults", self.defaults_measured)) if v == 0]
            return f"no ratio: {' and '.join(zero) or 'a side'} measured 0"
        change = abs(self.gain.value - 1.0)
        if change < NOISE_FRACTION:
            return f"within noise (under {NOISE_FRACTION:.0%})"
        if self.spread is None:
            return "one measurement each: no spread to compare with"
        if change <= self.spread:
            return f"within the repeats' spread ({self.spread:.0%})"
        return f"beyond the repeats' spread ({self.spread:.0%})"



def finite_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None



def importances_floor(trials: Sequence[optuna.trial.FrozenTrial]) -> int:
    """How many complete trials a ranking of parameters needs: one observation per varied
    parameter's main effect, one for the mean and one for noise, and never fewer than 4. With
    fewer, fANOVA still returns numbers (a 2-trial study ranked two parameters 0.59 and 0.41),
    but they describe which value the two trials happened to differ in, not an effect."""
    configs = [params_of(t) for t in trials]
    varied = {name for name in {k for c in configs for k in c}
              if len({repr(c.get(name)) for c in configs}) > 1}
    return max(4, len(varied) + 2)


def _holds(dist: optuna.distributions.BaseDistribution, value: Any) -> bool:
    if isinstance(dist, optuna.distributions.CategoricalDistribution):
        return value in dist.choices
    low, high = getattr(dist, "low", None), getattr(dist, "high", None)
    return isinstance(value, int | float) and low is not None and high is not None and \
        low <= value <= high


def _merged(dists: Sequence[optuna.distributions.BaseDistribution], values: Sequence[Any]
            ) -> optuna.distributions.BaseDistribution:
    """One distribution for a parameter across trials: Optuna's where every trial that sampled
    it had the same, else categorical over the choices and values seen."""
    if dists and all(d == dists[0] for d in dists) and all(_holds(dists[0], v) for v in values):
        return dists[0]
    choices: list[Any] = []
    for d in dists:
        for c in getattr(d, "choices", ()):
            if c not in choices:
                choices.append(c)
    for v in values:
        if v not in choices:
            choices.append(v)
    return optuna.distributions.CategoricalDistribution(choices)


def _complete_configs(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The trials with every parameter each ran with: a conditional parameter Optuna did not
    sample (a rule fixed it: `data_parallel_size` is 1 at TP 2 on two GPUs) is in the record's
    params, and Optuna's importance evaluators rank only parameters that every trial holds."""
    configs = [params_of(t) for t in trials]
    names = sorted({k for c in configs for k in c})
    varied = [n for n in names
              if n in {k for t in trials for k in t.distributions}
              and all(n in c for c in configs) and len({repr(c[n]) for c in configs}) > 1]
    dists = {n: _merged([t.distributions[n] for t in trials if n in t.distributions],
                        [c[n] for c in configs]) for n in varied}
    return [optuna.trial.create_trial(params={n: c[n] for n in varied}, distributions=dists,
                                      values=t.values) for t, c in zip(trials, configs,
                                                                       strict=True)]


def _one_change(params: Mapping[str, Any], reference: Mapping[str, Any],
                defaults: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The one searched knob `params` changes from `reference` (and the children set with
    it, `PARAM_PARENTS`), or None for no change or several; what counts as a change is
    `changed_params`'s."""
    changed = changed_params(params, reference, defaults)
    children = {k: params.get(k) for k in changed
                if k in PARAM_PARENTS and PARAM_PARENTS[k] in changed}
    knobs = [k for k in changed if k not in children]
    return (knobs[0], children) if len(knobs) == 1 else None


@dataclass(frozen=True)
class OneKnob:
    """The one-change trials against the defaults: each knob's effect, largest first, and the
    trials left out because the two were measured at no common load (trial number, why)."""

    effects: tuple[KnobEffect, ...] = ()
    not_comparable: tuple[tuple[int, str], ...] = ()


def knob_effects(trials: Sequence[FrozenTrial], baseline: FrozenTrial | None, objective: str,
                 axis: str | None = None,
                 vllm_defaults: Mapping[str, Any] | None = None) -> tuple[KnobEffect, ...]:
    """`one_knob`'s effects: those compared at one load."""
    return one_knob(trials, baseline, objective, axis, vllm_defaults).effects


def one_knob(trials: Sequence[FrozenTrial], baseline: FrozenTrial | None, objective: str,
             axis: str | None = None,
             vllm_defaults: Mapping[str, Any] | None = None) -> OneKnob:
    """Each complete trial whose config differs from the defaults' in exactly one searched
    parameter, as that parameter's effect, largest first. A design of one change per seed
    (the way to learn which knobs matter in a few trials) ranks its knobs here even where too
    few trials were measured for fANOVA's importances, and with what bounds each effect.
    Each pair is compared as every gain is (`gains.gain_over`): where a fixed level of either
    was not applied, at one load both applied (named, with the spreads there), or the pair is
    left out as not comparable (`OneKnob.not_comparable`): no effect mixes two loads.
    `vllm_defaults`: vLLM's value of each param on the study's host (the study's
    `vllm_defaults` attribute); without it (a study written before it was kept), the
    host-independent ones only: a host-dependent param (the token budget, max_num_seqs,
    max_model_len) set explicitly to the host's default then counts as a change."""
    if baseline is None or not has_measurement(baseline):
        return OneKnob()  # no measured defaults (a failure held complete in Optuna measured none)
    maximize = OBJECTIVES[objective].direction == "maximize"
    reference = params_of(baseline)
    defaults = dict(vllm_defaults) if vllm_defaults is not None else \
        host_independent_defaults(trials)
    base_record = record_of(baseline)
    base_metrics = base_record.metrics if base_record is not None else {}
    base_flags = base_record.flags if base_record is not None else {}
    base_values = (base_record.values if base_record is not None else None) or baseline.values
    defaults_measured = finite_or_none(base_values[0]) if base_values else None
    defaults_capacity = bracket_from_metrics(axis, base_metrics) if axis else None  # type: ignore[arg-type]
    base_loads = compared_loads(objective, base_record)
    out, left_out = [], []
    for trial in trials:
        record = record_of(trial)
        if trial.number == baseline.number or not has_measurement(trial):
            continue
        params = params_of(trial)
        found = _one_change(params, reference, defaults)
        if found is None:
            continue
        knob, children = found
        metrics = record.metrics if record is not None else {}
        values = (record.values if record is not None else None) or trial.values
        measured = finite_or_none(values[0]) if values else None
        loads = compared_loads(objective, record)
        gain = gains.gain_over(
            measured, defaults_measured,
            bracket_from_metrics(axis, metrics) if axis else None,  # type: ignore[arg-type]
            defaults_capacity, maximize=maximize,
            num_gpus=gpus_of((record.flags if record is not None else None) or params),
            defaults_num_gpus=gpus_of(base_flags or reference),
            loads=loads, defaults_loads=base_loads)
        if gain.not_comparable:
            left_out.append((trial.number, gain.not_comparable))
            continue
        spreads = [finite_or_none(m.get(f"spread.{objective}")) for m in (metrics, base_metrics)]
        mine, theirs = measured, defaults_measured
        if gain.load is not None and loads is not None and base_loads is not None:
            # Taken at one load, not both operating points: the figures and spreads there.
            at = (loads.levels[gain.load], base_loads.levels[gain.load])
            mine, theirs = at[0].value, at[1].value
            spreads = [f.spread for f in at]
        spread = max(s for s in spreads if s is not None) \
            if all(s is not None for s in spreads) else None
        out.append(KnobEffect(knob, params.get(knob), trial.number, gain, spread,
                              with_params=children, measured=mine, defaults_measured=theirs))
    return OneKnob(tuple(sorted(out, key=lambda e: (-e.size, e.number))), tuple(left_out))


def left_out_text(not_comparable: Sequence[tuple[int, str]], short: str) -> str:
    """The one-change trials the knob table leaves out (`OneKnob.not_comparable`), each with
    why, against the baseline named `short` ("defaults", "baseline"); "" where none is."""
    if not not_comparable:
        return ""
    count = len(not_comparable)
    return (f"Left out, {count} one-change trial{'s' if count != 1 else ''} not comparable "
            f"with the {short} at one load: "
            + "; ".join(f"trial {n} ({why})" for n, why in not_comparable) + ".")


def importances(study: optuna.Study) -> dict[str, float]:
    """fANOVA's ranking of the search trials' parameters by the variance of the first
    objective they explain. A rate's failures are in, at the 0 they serve (an infeasible
    config's goodput is 0); a latency's are out: the worst value they were told to steer the
    sampler (`tell_config_failure`, 1e9 ms) is no latency, and its variance would rank the
    parameters by which ones failed."""
    is_rate = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if is_search_trial(t) and (is_rate or has_measurement(t))]
    if len(complete) < importances_floor(complete):
        logger.info("no parameter importances: %d search trial(s) with a value (%s), fewer "
                    "than the %d a ranking needs", len(complete),
                    "an infeasible config's 0 included" if is_rate else
                    "a failed config's told worst value left out", importances_floor(complete))
        return {}
    ranked = optuna.create_study(directions=study.directions)
    try:
        ranked.add_trials(_complete_configs(complete))
        # fANOVA explains the variance of the objective, whichever way it is optimised.
        return {k: float(v) for k, v in optuna.importance.get_param_importances(
            ranked, target=lambda t: t.values[0],
            evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0)).items()}
    except (RuntimeError, ValueError) as exc:  # e.g. one param value only: nothing to rank
        logger.info("no parameter importances: %s", exc)
        return {}
