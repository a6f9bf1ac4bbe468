"""Which trial an export writes (`select_trial`: the recommendation, a trial named, the best
within a TPOT limit) and which of its flags a deployment leaves out (`default_flags`,
`minimal_drops`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer.config import StudyConfig
from optimizer.errors import ConfigError, NightshiftError
from optimizer.results.at_load import at_loads_of_record
from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.objectives import OBJECTIVES, value_unit
from optimizer.results.quality_gate import is_quality_violation
from optimizer.results.recommendation import (
    NOISE_FRACTION,
    audit_errors,
    is_measured,
    no_slo_met,
    params_of,
    recommendation_note,
    recommended_trial,
    vllm_defaults_of,
)
from optimizer.results.trial_record import (
    confirm_label,
    is_baseline,
    record_of,
)
from search_spaces import SpaceError, changed_params, to_flags


def select_trial(study: optuna.Study, cfg: StudyConfig, *, number: int | None = None,
                 max_tpot_ms: float | None = None,
                 force_quality: bool = False) -> optuna.trial.FrozenTrial:
    """The trial an export writes: `number` (--trial N; never a final confirmation run, which
    re-measured a trial of the search: that one is named), else the best within
    `max_tpot_ms`, else the recommendation. Where no trial met the SLO only `number` exports
    (NightshiftError, exit 1, otherwise: there is nothing to recommend)."""
    if number is not None and max_tpot_ms is not None:
        raise ConfigError("export --trial and --max-tpot-ms pick the trial two ways; give "
                          "one.")
    if number is not None:
        found = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not found:
            raise ConfigError(f"--trial {number}: no such trial in study {cfg.name!r}; "
                              f"see `nightshift status` for the numbers.")
        label = confirm_label(found[0])
        if label is not None:
            raise ConfigError(f"--trial {number}: a final confirmation run (a re-measurement "
                              f"of {_remeasured(study, found[0], cfg.baseline_words)}), "
                              "not a trial of the "
                              "search; export that trial instead.")
        record = record_of(found[0])
        state = record.state if record is not None else found[0].state.name.lower()
        if found[0].state != TrialState.COMPLETE or state != "complete":
            raise ConfigError(f"--trial {number}: the trial is {state}, not complete; export a "
                              "complete trial.")
        if is_quality_violation(found[0].constraints) and not force_quality:
            failed = ((record.quality if record is not None else None) or {}).get(
                "failed") or ["outside the limits"]
            raise ConfigError(f"--trial {number}: the quality gate refused it "
                              f"({'; '.join(failed)}); export another trial, or pass "
                              "--force-quality to export it anyway.")
        errors = audit_errors(found[0])
        if errors:
            raise ConfigError(f"--trial {number}: its launch has what `nightshift audit` calls "
                              f"an error ({errors[0].rstrip('.')}); export another trial.")
        return found[0]
    unmet = no_slo_met(study, cfg.spec.slo.model_dump())
    if unmet is not None:
        raise NightshiftError(f"study {cfg.name!r}: {unmet}; `--trial N` exports a trial that "
                              "missed it anyway.")
    if max_tpot_ms is not None:
        return study_tpot_pick(study, cfg, max_tpot_ms).trial
    chosen = recommended_trial(study)
    if chosen is None:
        raise NightshiftError(f"study {cfg.name!r} has no complete trial yet; wait for one or "
                              "check `nightshift status`.")
    return chosen


@dataclass(frozen=True)
class TpotPick:
    """A trial within a TPOT limit, with the one load both its figures are from."""

    trial: optuna.trial.FrozenTrial
    load: str  # a fixed level's label ("concurrency=8"), or OPERATING_POINT
    value: float  # the study's first objective there, per GPU
    tpot_p99_ms: float  # TPOT p99 there

    @property
    def level(self) -> str | None:
        """The fixed level it was picked at, which the export header describes (`render`'s
        `level`); None: at its operating point (a capacity search, an older record)."""
        return None if self.load == OPERATING_POINT else self.load


OPERATING_POINT = "its operating point"


def _within(trial: optuna.trial.FrozenTrial, objective: str,
            max_tpot_ms: float) -> list[TpotPick]:
    """Each load of `trial` whose TPOT p99 is within the limit, with the objective there: every
    applied fixed level (so two trials are judged at one load, never one's light level against
    another's heavy one), else (a capacity search, an older record) its operating point."""
    record = record_of(trial)
    loads = at_loads_of_record(objective, record) if record is not None else None
    if loads is not None and loads.levels:
        return [TpotPick(trial, f.label, f.value, f.tpot_p99_ms) for f in loads.levels.values()
                if f.tpot_p99_ms is not None and f.tpot_p99_ms <= max_tpot_ms]
    tpot = _metric(trial, "p99_tpot_ms")
    if tpot is None or tpot > max_tpot_ms or not trial.values:
        return []
    return [TpotPick(trial, OPERATING_POINT, float(trial.values[0]), tpot)]


def tpot_pick(complete: Sequence[optuna.trial.FrozenTrial], cfg: StudyConfig,
              max_tpot_ms: float) -> TpotPick:
    """The trial with the best objective (per GPU) at a load where its TPOT p99 was within
    `max_tpot_ms`: each figure of a pick is of one load (`_within`). ConfigError where none."""
    objective = cfg.objectives[0]
    picks = [p for t in complete if not audit_errors(t)
             for p in _within(t, objective, max_tpot_ms)]
    if not picks:
        raise ConfigError(f"--max-tpot-ms {max_tpot_ms:g}: no complete trial has a TPOT p99 "
                          "that low; raise the limit or run more trials.")
    sign = 1 if OBJECTIVES[objective].direction == "maximize" else -1
    return max(picks, key=lambda p: sign * p.value)


def study_tpot_pick(study: optuna.Study, cfg: StudyConfig, max_tpot_ms: float) -> TpotPick:
    """`tpot_pick` among the study's measured trials the quality gate passed (`select_trial`'s
    with `max_tpot_ms`, with the load it was picked at)."""
    # Measured configs: not a config failure (complete to Optuna, failed to us), not a final
    # confirmation run (a copy of the best or of the defaults), not refused by the quality gate.
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if is_measured(t) and not is_quality_violation(t.constraints)]
    return tpot_pick(complete, cfg, max_tpot_ms)


def tpot_note(study: optuna.Study, cfg: StudyConfig, max_tpot_ms: float,
              pick: TpotPick | None = None) -> str:
    """The export header's line on a `--max-tpot-ms` pick (`study_tpot_pick`'s, unless given):
    the load its figures are from."""
    pick = pick or study_tpot_pick(study, cfg, max_tpot_ms)
    objective = cfg.objectives[0]
    return (f"picked by --max-tpot-ms {max_tpot_ms:g}: the most {objective} "
            f"({value_unit(objective)}) at a load whose TPOT p99 was within it, each trial at "
            f"each fixed level it applied: trial {pick.trial.number} at {pick.load}, "
            f"{objective} {pick.value:.3g} {value_unit(objective)}, TPOT p99 "
            f"{pick.tpot_p99_ms:.3g} ms there")


def _remeasured(study: optuna.Study, run: optuna.trial.FrozenTrial,
                words: BaselineWords = DEFAULTS) -> str:
    """Which trial of the search a confirmation run re-measured: `trial 5` (the one of its
    config, the first measured), `the vLLM defaults, trial 0` (`words.the`); its label where
    none is found."""
    mine = params_of(run)
    same = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if is_measured(t) and params_of(t) == mine
            and (is_baseline(t) or not is_baseline(run))]
    if not same:
        label = confirm_label(run)
        return f"the {words.short if label == 'defaults' else label} config"
    first = min(same, key=lambda t: t.number)
    return f"{words.the}, trial {first.number}" if is_baseline(first) else \
        f"trial {first.number}"


def choice_note(study: optuna.Study, chosen: optuna.trial.FrozenTrial) -> str:
    """Why the recommendation is not the nominal best (empty when it is)."""
    return recommendation_note(study, chosen)


def _metric(trial: optuna.trial.FrozenTrial, key: str) -> float | None:
    record = record_of(trial)
    value = record.metrics.get(key) if record is not None else None
    return float(value) if isinstance(value, int | float) else None


def default_flags(study: optuna.Study, trial: optuna.trial.FrozenTrial,
                  flags: Mapping[str, Any]) -> list[str]:
    """The flags among `flags` that set vLLM's own value on the study's host (or one another
    flag makes moot, a capture size with CUDA graphs off): `changed_params` counts them as no
    change, and a deployment leaves them out."""
    params = params_of(trial)
    changed = set(changed_params(params, {}, vllm_defaults_of(study)))
    out = []
    for name, value in params.items():
        if name in changed or value is None:
            continue
        try:
            rendered = to_flags({name: value})
        except SpaceError:  # a param outside the known flags: kept as it ran
            continue
        out += [k for k, v in rendered.items() if k in flags and flags[k] == v]
    return out


def minimal_drops(study: optuna.Study, trial: optuna.trial.FrozenTrial
                  ) -> list[tuple[str, str]]:
    """(param, why) for each param whose removal did not change the measured result, by the
    study's own records: a measured trial that ran the same config with that param at vLLM's
    default, within NOISE_FRACTION of this trial's value (or better). Cumulative: two params
    each harmless alone are not known to be harmless together, so a second is dropped only
    where a trial without both was measured."""
    if not trial.values or len(study.directions) > 1:
        return []
    host = vllm_defaults_of(study)
    sign = 1.0 if study.direction.name == "MAXIMIZE" else -1.0
    top = float(trial.values[0])
    mine = params_of(trial)
    kept = dict(mine)
    drops: list[tuple[str, str]] = []
    others = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if is_measured(t) and t.values and t.number != trial.number]
    for name in changed_params(mine, {}, host):
        without = {**kept, name: None}
        for other in others:
            theirs = params_of(other)
            if changed_params(without, theirs, host):
                continue
            value = float(other.values[0])
            if sign * (value - top) >= -NOISE_FRACTION * abs(top):
                kept = without
                drops.append((name, f"trial {other.number} ran without it (vLLM's default) "
                                    f"and measured {value:.4g} vs {top:.4g}: within "
                                    f"{NOISE_FRACTION:.0%}"))
                break
    return drops
