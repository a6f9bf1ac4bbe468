"""Pruners for serving trials.

A plain median rule prunes on noise: at a light load level every config serves the offered load,
so half of them sit a hair under the median. `MarginPruner` prunes only a trial that is worse
than a percentile of earlier trials at the same load level by a clear relative margin.
"""

from __future__ import annotations

import math

import numpy as np
import optuna
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState


class MarginPruner(optuna.pruners.BasePruner):
    """Prune when the trial's value at a step is worse than the `percentile`-th best of earlier
    trials at that step by more than `min_relative_gap` (0.1 = 10%).

    Reads only intermediate values (`trial.report`), so it is safe for any sampler. Needs
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
            if step in t.intermediate_values and math.isfinite(t.intermediate_values[step])]
        if len(others) < self.n_startup_trials:
            return False
        maximize = study.direction == StudyDirection.MAXIMIZE
        # "percentile-th best": for maximize the upper percentile is the better side.
        q = 100.0 - self.percentile if maximize else self.percentile
        reference = float(np.percentile(others, q))
        gap = self.min_relative_gap * abs(reference)
        return value < reference - gap if maximize else value > reference + gap
