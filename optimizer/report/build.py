"""The report's data: one `TrialRow` per trial and the study's `Report` (best, defaults, gain
with its bounds, Pareto front, importances, failures), built by `build_report` from the trial
records in Optuna's storage."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer import gains
from optimizer.config import StudyConfig
from optimizer.objectives import OBJECTIVES, on_all_gpus
from optimizer.quality import table_cell
from optimizer.recommendation import (
    NOISE_FRACTION,
    best_trial,
    host_independent_defaults,
    no_baseline_reason,
    params_of,
    recommendation_note,
    recommended_trial,
    vllm_defaults_of,
)
from optimizer.records import ATTR_RECORD, gpus_of
from optimizer.study import ATTR_CONFIRM, count_trials, is_search_trial
from runners.capacity import bracket_from_metrics
from runners.capacity_search import Bracket
from runners.simulated.launcher import is_simulated_argv
from search_spaces import PARAM_PARENTS, changed_params

logger = logging.getLogger(__name__)

TOO_FEW_FOR_IMPORTANCES = ("too few complete trials to rank parameters (a ranking needs two more "
                           "than the parameters that varied, and at least 4)")


@dataclass(frozen=True)
class TrialRow:
    """One trial as the report shows it."""

    number: int
    state: str  # complete, pruned, failed, running, waiting
    changes: Mapping[str, Any]  # flags that differ from the defaults baseline's
    value: float | None  # the first objective, per GPU for a rate, as Optuna holds it
    output_throughput: float | None  # tok/s at the headline level
    p99_tpot_ms: float | None
    p99_ttft_ms: float | None
    startup_s: float | None
    wall_s: float | None
    label: str  # bottleneck label, "" when unclassified
    conclusion: str
    failure_reason: str
    is_baseline: bool
    capacity: Bracket | None = None  # after a capacity search: where its capacity lies
    conclusion_short: str = ""  # the conclusion for a table cell (<= ~70 characters)
    quality: str = ""  # the quality gate's cell (optimizer/quality.py `table_cell`)
    num_gpus: int = 1  # the GPUs its config used; `value` is per GPU (`objectives.per_gpu`)

    @property
    def output_throughput_per_gpu(self) -> float | None:
        """Output tok/s at the operating point per GPU: what the Pareto front compares."""
        return self.output_throughput / max(self.num_gpus, 1) \
            if self.output_throughput is not None else None


@dataclass(frozen=True)
class KnobEffect:
    """A trial that changed one searched parameter alone from the defaults, measured in the
    same study: that knob's main effect at the defaults (what it does combined with other
    changes is not seen). `spread` is the larger of the two trials' repeat spreads of the
    objective, (max - min) / median over the repeats on one server (`records.spread`; of two
    repeats the median is the larger): not a start-to-start interval, which only a
    confirmation round measures."""

    param: str
    value: Any
    number: int
    gain: gains.Gain  # vs the defaults, > 1 = better
    spread: float | None  # None where either trial measured its level once
    with_params: Mapping[str, Any] = field(default_factory=dict)  # children set with it
    measured: float | None = None  # this trial's objective
    defaults_measured: float | None = None  # the defaults'

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


@dataclass(frozen=True)
class Report:
    study: str
    objective: str
    is_maximize: bool
    is_simulated: bool  # figures from the simulated engine: never measurements
    rows: tuple[TrialRow, ...]
    baseline: TrialRow | None
    best: TrialRow | None
    pareto: tuple[int, ...]  # trial numbers on the throughput / TPOT p99 front
    importances: Mapping[str, float]
    failures: Mapping[str, int]  # failure reason -> trials
    slo: Mapping[str, float]
    confirm: str = ""  # the interleaved re-measurement of best vs defaults, when it ran
    queued: int = 0  # configs enqueued (seeds, a grid) that no worker has started yet
    confirmation_runs: int = 0  # the final re-measurements: counted apart, never as trials
    repeats: int = 0  # the sampler asked again for a config already held: nothing launched
    recommended: TrialRow | None = None  # what `export` writes, when it is not the best
    recommended_why: str = ""  # why it is not the best (study.recommendation_note)
    no_baseline: str = ""  # why the defaults could not be measured (no gain is stated then)
    knob_effects: tuple[KnobEffect, ...] = ()  # one-change trials, largest effect first
    generated: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    @property
    def gain(self) -> float | None:
        """How many times better the best is than the defaults (>1 = better), or None: the
        point only; `gain_bounds` says what bounds it."""
        bounds = self.gain_bounds
        return bounds.value if bounds is not None else None

    @property
    def gain_bounds(self) -> gains.Gain | None:
        """The best's gain over the defaults per GPU with its bounds: the ratio their capacity
        brackets allow after a capacity search, else one measurement each (no bounds)."""
        if self.best is None or self.baseline is None:
            return None
        return gains.gain_over(self.best.value, self.baseline.value, self.best.capacity,
                               self.baseline.capacity, maximize=self.is_maximize,
                               num_gpus=self.best.num_gpus,
                               defaults_num_gpus=self.baseline.num_gpus)

    @property
    def gain_as_measured(self) -> gains.Gain | None:
        """The same on all of each side's GPUs (not per GPU); None where both used one GPU
        (the two agree) or there is no comparison."""
        if self.best is None or self.baseline is None or \
                max(self.best.num_gpus, self.baseline.num_gpus) <= 1:
            return None
        whole = [on_all_gpus(self.objective, r.value, r.num_gpus) if r.value is not None
                 else None for r in (self.best, self.baseline)]
        return gains.gain_over(whole[0], whole[1], self.best.capacity, self.baseline.capacity,
                               maximize=self.is_maximize)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _row(trial: FrozenTrial, baseline_flags: Mapping[str, Any],
         axis: str | None = None) -> TrialRow:
    record: Mapping[str, Any] = trial.user_attrs.get(ATTR_RECORD) or {}
    metrics: Mapping[str, Any] = record.get("metrics") or {}
    flags: Mapping[str, Any] = record.get("flags") or {}
    changes = {k: v for k, v in flags.items() if baseline_flags.get(k) != v}
    values = record.get("values") or (trial.values if trial.state == TrialState.COMPLETE
                                      else None)
    value = _number(values[0]) if values else None
    if value is None and trial.state == TrialState.PRUNED:
        value = _number(trial.intermediate_values.get(max(trial.intermediate_values, default=0)))
    verdict = record.get("verdict") or {}
    return TrialRow(
        number=trial.number,
        state=str(record.get("state") or trial.state.name.lower()),
        changes=changes, value=value,
        output_throughput=_number(metrics.get("output_throughput")),
        p99_tpot_ms=_number(metrics.get("p99_tpot_ms")),
        p99_ttft_ms=_number(metrics.get("p99_ttft_ms")),
        startup_s=_number(metrics.get("engine.startup_s")),
        wall_s=_number(record.get("wall_s")),
        label=str(verdict.get("label") or ""),
        conclusion=str(record.get("conclusion") or ""),
        failure_reason=str(record.get("failure_reason") or ""),
        is_baseline=bool(record.get("is_baseline") or trial.user_attrs.get("baseline")),
        capacity=bracket_from_metrics(axis, metrics)  # type: ignore[arg-type]
        if axis in ("concurrency", "request_rate") else None,
        conclusion_short=str(record.get("conclusion_short") or ""),
        quality=table_cell(record.get("quality")),
        num_gpus=gpus_of(flags or params_of(trial)),
    )


def pareto_front(rows: Sequence[TrialRow]) -> tuple[int, ...]:
    """Complete trials no other beats on both output throughput per GPU (higher) and TPOT p99
    (lower)."""
    points: list[tuple[int, float, float]] = [
        (r.number, r.output_throughput_per_gpu, r.p99_tpot_ms) for r in rows
        if r.state == "complete" and r.output_throughput_per_gpu is not None
        and r.p99_tpot_ms is not None]
    front = []
    for number, tput, tpot in points:
        dominated = any(t2 >= tput and p2 <= tpot and (t2 > tput or p2 < tpot)
                        for n2, t2, p2 in points if n2 != number)
        if not dominated:
            front.append(number)
    return tuple(sorted(front))


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


def knob_effects(trials: Sequence[FrozenTrial], baseline: FrozenTrial | None, objective: str,
                 axis: str | None = None,
                 vllm_defaults: Mapping[str, Any] | None = None) -> tuple[KnobEffect, ...]:
    """Each complete trial whose config differs from the defaults' in exactly one searched
    parameter, as that parameter's effect, largest first. A design of one change per seed
    (the way to learn which knobs matter in a few trials) ranks its knobs here even where too
    few trials were measured for fANOVA's importances, and with what bounds each effect.
    `vllm_defaults`: vLLM's value of each param on the study's host (the study's
    `vllm_defaults` attribute); without it (a study written before it was kept), the
    host-independent ones only: a host-dependent param (the token budget, max_num_seqs,
    max_model_len) set explicitly to the host's default then counts as a change."""
    if baseline is None or baseline.state != TrialState.COMPLETE:
        return ()
    maximize = OBJECTIVES[objective].direction == "maximize"
    reference = params_of(baseline)
    defaults = dict(vllm_defaults) if vllm_defaults is not None else \
        host_independent_defaults(trials)
    base_record = baseline.user_attrs.get(ATTR_RECORD) or {}
    base_metrics = base_record.get("metrics") or {}
    base_values = base_record.get("values") or baseline.values
    defaults_measured = _number(base_values[0]) if base_values else None
    defaults_capacity = bracket_from_metrics(axis, base_metrics) if axis else None  # type: ignore[arg-type]
    out = []
    for trial in trials:
        record = trial.user_attrs.get(ATTR_RECORD) or {}
        if trial.number == baseline.number or trial.state != TrialState.COMPLETE or \
                record.get("state") not in (None, "complete"):
            continue
        params = params_of(trial)
        found = _one_change(params, reference, defaults)
        if found is None:
            continue
        knob, children = found
        metrics = record.get("metrics") or {}
        values = record.get("values") or trial.values
        measured = _number(values[0]) if values else None
        gain = gains.gain_over(
            measured, defaults_measured,
            bracket_from_metrics(axis, metrics) if axis else None,  # type: ignore[arg-type]
            defaults_capacity, maximize=maximize,
            num_gpus=gpus_of(record.get("flags") or params),
            defaults_num_gpus=gpus_of(base_record.get("flags") or reference))
        spreads = [_number(m.get(f"spread.{objective}")) for m in (metrics, base_metrics)]
        spread = max(s for s in spreads if s is not None) \
            if all(s is not None for s in spreads) else None
        out.append(KnobEffect(knob, params.get(knob), trial.number, gain, spread,
                              with_params=children, measured=measured,
                              defaults_measured=defaults_measured))
    return tuple(sorted(out, key=lambda e: (-e.size, e.number)))


def _importances(study: optuna.Study) -> dict[str, float]:
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if is_search_trial(t)]
    if len(complete) < importances_floor(complete):
        logger.info("no parameter importances: %d complete trials, fewer than the %d a ranking "
                    "needs", len(complete), importances_floor(complete))
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


def build_report(study: optuna.Study, cfg: StudyConfig, *,
                 with_importances: bool = True) -> Report:
    # A repeat of a measured config launched nothing: its original stands for it. The final
    # interleaved re-measurements are reported as the confirmation, not as trials.
    # Enqueued configs no worker has started (a grid's or the seeds' tail) are counted, not rows.
    counts = count_trials(study.get_trials(deepcopy=False))
    trials = [t for t in study.get_trials(deepcopy=False) if is_search_trial(t)]
    queued = sum(t.state == TrialState.WAITING for t in trials)
    trials = [t for t in trials if t.state != TrialState.WAITING]
    baseline_trial = next((t for t in trials if t.user_attrs.get("baseline")
                           and t.state == TrialState.COMPLETE), None)
    baseline_flags = ((baseline_trial.user_attrs.get(ATTR_RECORD) or {}).get("flags") or {}
                      if baseline_trial is not None else {})
    capacity = cfg.spec.workload.capacity
    axis = capacity.axis if capacity is not None else None
    rows = tuple(_row(t, baseline_flags, axis) for t in trials)
    objective = cfg.objectives[0]
    is_max = OBJECTIVES[objective].direction == "maximize"
    # The study's own best: one that met the SLO somewhere, when any did (constraint "slo").
    chosen = best_trial(study)
    best = next((r for r in rows if chosen is not None and r.number == chosen.number
                 and r.state == "complete"), None)
    baseline = next((r for r in rows if r.is_baseline and r.state == "complete"), None)
    pick = recommended_trial(study)
    recommended = next((r for r in rows if pick is not None and r.number == pick.number
                        and best is not None and r.number != best.number), None)
    slo = {k: float(v) for k, v in cfg.spec.slo.model_dump().items() if v is not None}
    return Report(
        study=cfg.name, objective=objective, is_maximize=is_max,
        is_simulated=any(is_simulated_argv((t.user_attrs.get(ATTR_RECORD) or {}).get("argv")
                                           or ()) for t in trials),
        rows=rows, baseline=baseline, best=best,
        # a config the quality gate refused is no point to deploy
        pareto=pareto_front([r for r in rows if not r.quality.startswith("REFUSED")]),
        importances=_importances(study) if with_importances else {},
        failures=dict(Counter(r.failure_reason for r in rows
                              if r.state == "failed" and r.failure_reason)),
        slo=slo, confirm=_confirmation(study, axis),
        queued=queued, confirmation_runs=counts.confirmation_runs, repeats=counts.repeats,
        recommended=recommended,
        recommended_why=recommendation_note(study, pick) if recommended is not None and
        pick is not None else "",
        no_baseline=no_baseline_reason(study) or "",
        knob_effects=knob_effects(trials, baseline_trial, objective, axis,
                                  vllm_defaults_of(study)))


def _confirmation(study: optuna.Study, axis: str | None) -> str:
    """The re-measurement's sentence; after a capacity search, also the capacity ratio every
    round's two brackets allow (each round's runs re-bracket both configs, so the ratio lies
    in each round's range, hence in their overlap)."""
    sentence = str((study.user_attrs.get("confirm") or {}).get("sentence") or "")
    if not sentence or axis not in ("concurrency", "request_rate"):
        return sentence
    runs = sorted((t for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get(ATTR_CONFIRM) and t.state == TrialState.COMPLETE),
                  key=lambda t: t.number)
    brackets: dict[str, list[Bracket]] = {"defaults": [], "best": []}
    for t in runs:
        record = t.user_attrs.get(ATTR_RECORD) or {}
        bracket = bracket_from_metrics(axis, record.get("metrics") or {})  # type: ignore[arg-type]
        label = str(t.user_attrs[ATTR_CONFIRM])
        if bracket is not None and label in brackets:  # compared per GPU, as every gain is
            brackets[label].append(gains.per_gpu_bracket(
                bracket, gpus_of(record.get("flags") or params_of(t))))
    rounds = [gains.capacity_gain(b, d) for d, b in zip(brackets["defaults"], brackets["best"],
                                                         strict=False)]
    if not rounds:
        return sentence
    lows = [g.low for g in rounds if g.low is not None]
    highs = [g.high for g in rounds if g.high is not None]
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    if low is not None and high is not None and low > high:
        return (f"{sentence}; the re-measured capacity brackets disagree between rounds "
                "(no common ratio): noise beyond the brackets")
    overlap = gains.format_gain(gains.Gain(None, low, high, "capacity"))
    return f"{sentence}; re-measured capacity brackets, in every one of {len(rounds)} " \
        f"rounds: {overlap}"
