"""Pruners for serving trials.

A plain median rule prunes on noise: at a light load level every config serves the offered load,
so half of them sit a hair under the median. `MarginPruner` prunes only a trial that is worse
than a percentile of earlier trials at the same load level by a clear relative margin.
`BottleneckPruner` adds rules on the trial's bottleneck verdict (optimizer/bottleneck/).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from optimizer.results.trial_record import verdict_of


class MarginPruner(optuna.pruners.BasePruner):
    """Prune when the trial's value at a step is worse than the `percentile`-th best of earlier
    trials at that step by more than `min_relative_gap` (0.1 = 10%).

    Reads only intermediate values (`trial.report`: per GPU for a rate, as the search policy
    reports them), so it is safe for any sampler and fair across GPU counts. Needs
    `n_startup_trials` finished trials with a value at the step before it prunes anything.
    """

    def __init__(self, *, percentile: float = 50.0, min_relative_gap: float = 0.10,
                 n_startup_trials: int = 4, n_warmup_steps: int = 0) -> None:
        if not 0.0 <= percentile <= 100.0:
            raise ValueError(f"percentile must be in [0, 100] but got {percentile}.")
        if min_relative_gap < 0.0:
            raise ValueError(f"min_relative_gap must be >= 0 but got {min_relative_gap}.")
        self.percentile = percentile
        self.min_relative_gap = min_relative_gap
        self.n_startup_trials = n_startup_trials
        self.n_warmup_steps = n_warmup_steps

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        if step is None or step < self.n_warmup_steps:
            return False
        value = trial.intermediate_values[step]
        if not math.isfinite(value):
            return True
        others = [t.intermediate_values[step] for t in study.get_trials(
            deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if step in t.intermediate_values and math.isfinite(t.intermediate_values[step])
            # a trial the quality gate refused is no yardstick for others' speed
            and t.constraints.get("quality", 0.0) <= 0]
        if len(others) < self.n_startup_trials:
            return False
        maximize = study.direction == StudyDirection.MAXIMIZE
        # "percentile-th best": for maximize the upper percentile is the better side.
        q = 100.0 - self.percentile if maximize else self.percentile
        reference = float(np.percentile(others, q))
        gap = self.min_relative_gap * abs(reference)
        return value < reference - gap if maximize else value > reference + gap


class BottleneckPruner(optuna.pruners.BasePruner):
    """Wraps a base pruner (default `MarginPruner()`) and also prunes on the verdict a trial
    stored (`trial_record.verdict_of`: `bottleneck.Verdict.as_user_attr`, set by the
    caller before `should_prune`):

    - communication-bound at TP>1, with a value at this step worse than the best TP=1 trial's
      at the same step (the values are per GPU, `objectives.per_gpu`: each GPU of the split
      serves less than a GPU alone, so the split costs more than it gives);
    - launch-bound, with a value at this step worse than the best trial's there by more than
      `launch_margin` (0.25 = 25%): a config idling between kernels rarely catches up.

    Reads only the study's trials and their attributes, never writes (Optuna pruners must not):
    `explain` gives the reason text for the caller's log line. Single-objective only.
    """

    def __init__(self, base: optuna.pruners.BasePruner | None = None, *,
                 launch_margin: float = 0.25, n_warmup_steps: int = 0) -> None:
        if launch_margin < 0.0:
            raise ValueError(f"launch_margin must be >= 0 but got {launch_margin}.")
        self.base = base if base is not None else MarginPruner()
        self.launch_margin = launch_margin
        self.n_warmup_steps = n_warmup_steps

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        return self.explain(study, trial) is not None

    def explain(self, study: optuna.Study, trial: FrozenTrial) -> str | None:
        """Why `prune` would prune this trial now (one sentence), or None when it would not."""
        step = trial.last_step
        if self.base.prune(study, trial):
            name = type(self.base).__name__
            value = trial.intermediate_values.get(step) if step is not None else None
            shown = f" ({value:.4g})" if value is not None else ""
            return (f"{name}: the value at step {step}{shown} is worse than earlier trials "
                    "there by more than the margin.")
        if step is None or step < self.n_warmup_steps or len(study.directions) != 1:
            return None
        verdict = verdict_of(trial)
        if verdict is None:
            return None
        value = trial.intermediate_values[step]
        if not math.isfinite(value):
            return None  # the base pruner's business
        maximize = study.direction == StudyDirection.MAXIMIZE
        label = verdict.get("label")
        if label == "communication-bound":
            tp = _tensor_parallel_size(trial)
            if tp <= 1:
                return None
            best = _best_at(study, step, maximize, exclude=trial.number, tp=1)
            if best is None:
                return None
            number, best_value = best
            worse = value < best_value if maximize else value > best_value
            if worse:
                return (f"communication-bound at TP={tp}: {value:.4g} per GPU at step {step} "
                        f"is worse than TP=1 trial {number} ({best_value:.4g}); the split "
                        "costs more than it gives.")
        elif label == "launch-bound":
            best = _best_at(study, step, maximize, exclude=trial.number)
            if best is None:
                return None
            number, best_value = best
            gap = self.launch_margin * abs(best_value)
            worse = value < best_value - gap if maximize else value > best_value + gap
            if worse:
                delta = (value - best_value) / best_value * 100 if best_value else 0.0
                return (f"launch-bound: {value:.4g} at step {step} is {delta:+.0f}% vs the best "
                        f"trial {number} ({best_value:.4g}), beyond the "
                        f"{self.launch_margin:.0%} margin.")
        return None


def _margin(n_startup_trials: int, min_relative_gap: float) -> MarginPruner:
    return MarginPruner(percentile=50.0, min_relative_gap=min_relative_gap,
                        n_startup_trials=n_startup_trials)


PrunerFactory = Callable[[int, float], optuna.pruners.BasePruner]
# The pruners a study can use, by name (`pruner.name` in the study file); each factory takes
# the number of startup trials and the relative gap a trial must be worse by.
PRUNERS: dict[str, PrunerFactory] = {
    # MarginPruner + the classifier's verdicts
    "bottleneck": lambda n, gap: BottleneckPruner(_margin(n, gap)),
    "median": _margin,  # MarginPruner alone
    "none": lambda n, gap: optuna.pruners.NopPruner(),  # every trial runs all its levels
}

def _tensor_parallel_size(trial: FrozenTrial) -> int:
    """TP of a trial: its sampled param, else what its verdict recorded, else vLLM's default."""
    value = trial.params.get("tensor_parallel_size")
    if value is None:
        verdict = verdict_of(trial)
        if verdict is not None:
            value = verdict.get("tensor_parallel_size")
    try:
        return int(value) if value is not None else 1
    except (TypeError, ValueError):
        return 1


def _best_at(study: optuna.Study, step: int, maximize: bool, *, exclude: int,
             tp: int | None = None) -> tuple[int, float] | None:
    """(number, value) of the finished trial with the best value at `step`, optionally only
    among trials of tensor-parallel size `tp`."""
    best: tuple[int, float] | None = None
    for other in study.get_trials(deepcopy=False,
                                  states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if other.number == exclude or step not in other.intermediate_values:
            continue
        if tp is not None and _tensor_parallel_size(other) != tp:
            continue
        value = other.intermediate_values[step]
        if not math.isfinite(value):
            continue
        if best is None or (value > best[1] if maximize else value < best[1]):
            best = (other.number, value)
    return best
