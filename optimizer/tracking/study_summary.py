"""The study run's closing figures and tags in MLflow: trial counts by state (confirmation runs
apart), the best and the recommended trial, the headline conclusion against the defaults, why
there is no baseline, and the confirmed gain. Given to the daemon by the composition root
(`runtime.build_daemon`)."""

from __future__ import annotations

import json
import math

import optuna

from optimizer.config import StudyConfig
from optimizer.report import build_report, headline
from optimizer.report.render import best_tags
from optimizer.results import gains
from optimizer.results.conclusion import baseline_trial, reference_of
from optimizer.results.confirmation import is_simulated_run
from optimizer.results.objectives import OBJECTIVES
from optimizer.results.recommendation import best_trial, is_measured, no_baseline_reason, params_of
from optimizer.results.trial_record import confirm_label, confirmation_of
from optimizer.storage.study import count_trials
from optimizer.tracking.tags import (
    ENGINE_SIMULATED,
    SIMULATED_DESCRIPTION,
    TAG_ENGINE,
)


def study_summary(study: optuna.Study,
                  cfg: StudyConfig) -> tuple[dict[str, float], dict[str, str]]:
    """(metrics, tags) for `Tracker.finish_study`."""
    # By the record's state (`study.count_trials`): a config failure is a COMPLETE trial to
    # Optuna (it teaches the sampler) but a failed one to the user.
    by_state = count_trials(study.get_trials(deepcopy=False)).by_state
    metrics: dict[str, float] = {f"trials_{k}": float(by_state.get(k, 0))
                                 for k in ("complete", "pruned", "failed")}
    # The final re-measurements are counted apart: they are not trials of the search.
    metrics["confirmation_runs"] = float(sum(
        t.state.is_finished() and confirm_label(t) is not None
        for t in study.get_trials(deepcopy=False)))
    tags: dict[str, str] = {}
    is_simulated = any(is_simulated_run(t) for t in study.get_trials(deepcopy=False))
    if is_simulated:  # a model's figures, never measurements: said on the study's run too
        tags[TAG_ENGINE] = ENGINE_SIMULATED
    best = best_trial(study)
    if best is not None and best.values:
        for name, v in zip(cfg.objectives, best.values, strict=True):
            # As Optuna holds it: per GPU for a rate (objectives.per_gpu), named so.
            metrics[f"best.{name}.per_gpu" if OBJECTIVES[name].is_per_gpu else
                    f"best.{name}"] = v
        tags["best_trial"] = str(best.number)
        report = build_report(study, cfg, with_importances=False)
        if not report.no_slo_met:  # nothing met the SLO: nothing is recommended
            tags["recommended_trial"] = str((report.recommended or report.best or best).number)
        # The study's conclusion is the best against the defaults (the trial's own one
        # compares it with the best before it).
        tags["conclusion"] = headline(report)
        tags["mlflow.note.content"] = (SIMULATED_DESCRIPTION if is_simulated else "") + \
            tags["conclusion"]  # the run's description
        tags.update(best_tags(report))
        # What the tuning memory seeds a later study with
        # (optimizer/tuning_memory/earlier_studies.py): the best's config, and its params that
        # differ from the measured defaults'. best_trial never picks a config the quality gate
        # refused.
        params = params_of(best)
        tags["best.params"] = json.dumps(params, sort_keys=True, default=str)
        baseline = baseline_trial(study)
        if baseline is not None:
            defaults = params_of(baseline)
            tags["best.changes"] = json.dumps(
                {k: v for k, v in params.items() if defaults.get(k) != v},
                sort_keys=True, default=str)
        if report.gain_bounds is not None:
            metrics.update(report.gain_bounds.as_metrics("gain"))
    no_baseline = no_baseline_reason(study) or ""
    if no_baseline:
        tags["no_baseline"] = no_baseline[:5000]
    confirmed = confirmation_of(study)
    if confirmed is not None:
        tags["confirm"] = confirmed.sentence
        tags["confirmed"] = "true" if confirmed.is_confirmed else "false"
        if confirmed.gain is not None:  # no ratio: no metric, never a 0 in its place
            # With the rounds it averages and the load they compared the two at, where that
            # is not their operating points (`Gain.load`): a ratio is never logged bare.
            metrics["confirm.gain"] = confirmed.gain
            metrics["confirm.num_rounds"] = float(confirmed.num_rounds)
            if confirmed.load is not None:
                tags["confirm.load"] = confirmed.load
        for key, bound in (("ci_low", confirmed.ci_low), ("ci_high", confirmed.ci_high)):
            if bound is not None:
                metrics[f"confirm.gain_{key}"] = bound
    return metrics, tags


def trial_figures(study: optuna.Study, cfg: StudyConfig) -> dict[int, dict[str, float]]:
    """The runs view's review columns of each measured trial (trial number -> metrics): each
    objective in its unit and the first's gain over the measured defaults (one measurement
    each; > 1 is better), 3 significant digits (tracking.runs_view)."""
    from optimizer.tracking.view import VIEW_GAIN, three_digits, view_key

    first = cfg.objectives[0]
    baseline = reference_of(baseline_trial(study), None, first)
    out: dict[int, dict[str, float]] = {}
    for t in study.get_trials(deepcopy=False):
        if not is_measured(t) or not t.values:
            continue
        row = {view_key(o): three_digits(float(v))
               for o, v in zip(cfg.objectives, t.values, strict=False) if math.isfinite(v)}
        # At one load where a level of either was not applied, as every gain (gains.gain_over).
        mine = reference_of(t, None, first)
        gain = gains.gain_over(float(t.values[0]), baseline.value if baseline else None,
                               None, None, maximize=OBJECTIVES[first].direction == "maximize",
                               loads=mine.loads if mine else None,
                               defaults_loads=baseline.loads if baseline else None)
        if gain.value is not None:
            row[VIEW_GAIN] = three_digits(gain.value)
        out[t.number] = row
    return out
