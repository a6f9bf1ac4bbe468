"""The samplers a study can search with, by name (`sampler.name` in the study file). A new
sampler is one entry of `SAMPLERS`: a factory from the seed and the number of startup trials."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState

SamplerFactory = Callable[[int | None, int], optuna.samplers.BaseSampler]


def _tpe(seed: int | None, n_startup_trials: int) -> optuna.samplers.BaseSampler:
    # multivariate + group: the space is conditional (rules fix some params for some configs);
    # constant_liar spreads out trials that run in parallel. Both are marked experimental.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials,
                                          multivariate=True, group=True, constant_liar=True)


def _random(seed: int | None, n_startup_trials: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)


def _gp(seed: int | None, n_startup_trials: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.GPSampler(seed=seed, n_startup_trials=n_startup_trials)


def _nsga2(seed: int | None, n_startup_trials: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed)


SAMPLERS: dict[str, SamplerFactory] = {
    "tpe": _tpe,
    # The informed start (`ScreenSampler`): the search policy wraps this TPE with the screen
    # once it knows the space, the hardware and the model (optimizer/search/searcher.py); TPE alone
    # where the screen cannot predict (no model shape, a capacity search).
    "screen": _tpe,
    "random": _random,
    "gp": _gp,
    "nsga2": _nsga2,
}


SCREEN_ATTR = "screen"  # system attr of a trial the screen chose: its rank among the candidates


class ScreenSampler(optuna.samplers.BaseSampler):
    """The informed start: the first `n_screen` trials it is asked for (the queued defaults,
    templates and seeds go before it, untouched) are configs of `candidates` in the order of a
    prediction (`predicted`, e.g. optimizer/search/screen.py), refitted to each measurement; then
    `fallback` (the model-based sampler) takes over, with the screen's trials as its history.

    The refit: a ridge regression of log(measured / predicted), less its mean (a scale the
    same for every candidate), on the configs' (param, value) indicators, added to every
    candidate's log prediction. Every `explore_every`-th pick is the
    most uncertain of the top fifth: the candidate farthest (in changed values) from everything
    measured; the others are the top of the refitted ranking."""

    def __init__(self, candidates: list[dict[str, Any]], predicted: list[float],
                 fallback: optuna.samplers.BaseSampler, *, n_screen: int = 5,
                 explore_every: int = 3, ridge: float = 1.0) -> None:
        import numpy as np

        self.candidates = candidates
        self._index = {json.dumps(c, sort_keys=True, default=str): i
                       for i, c in enumerate(candidates)}
        self.fallback = fallback
        self.n_screen = n_screen
        self.explore_every = explore_every
        self.ridge = ridge
        finite = np.nan_to_num(np.asarray(predicted, dtype=float), nan=0.0, posinf=0.0,
                               neginf=0.0)
        floor = 0.02 * max(float(finite.max(initial=0.0)), 1e-9)
        self.log_pred = np.log(np.maximum(finite, floor))
        self.floor = floor
        columns = sorted({(k, json.dumps(v, default=str)) for c in candidates
                          for k, v in c.items()})
        index = {col: i for i, col in enumerate(columns)}
        self.features = np.zeros((len(candidates), len(columns)))
        for row, c in enumerate(candidates):
            for k, v in c.items():
                self.features[row, index[(k, json.dumps(v, default=str))]] = 1.0
        self._picks: dict[int, dict[str, Any]] = {}

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        if trial.number in self._picks:
            return {}
        return self.fallback.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if trial.number in self._picks:
            return {}
        return self.fallback.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        pick = self._picks.get(trial.number)
        if pick is not None and param_name in pick:
            value = pick[param_name]
            try:
                param_distribution.to_internal_repr(value)
                if not isinstance(param_distribution, CategoricalDistribution) or \
                        value in param_distribution.choices:
                    return value
            except (ValueError, TypeError):
                pass
        return self.fallback.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.fallback.before_trial(study, trial)
        if "fixed_params" in trial.system_attrs:
            return  # queued: the defaults, a template, a seed, a retry
        trials = study.get_trials(deepcopy=False)
        screened = sum(1 for t in trials if SCREEN_ATTR in t.system_attrs)
        if screened >= self.n_screen:
            return
        rank = self._choose(trials, explore=(screened + 1) % self.explore_every == 0)
        if rank is None:
            return
        self._picks[trial.number] = self.candidates[rank]
        study._storage.set_trial_system_attr(trial._trial_id, SCREEN_ATTR, rank)

    def _choose(self, trials: list[FrozenTrial], *, explore: bool) -> int | None:
        import numpy as np

        taken: set[int] = set()
        rows, residuals = [], []
        for t in trials:
            i = self._position(t.params)
            if i is None:
                continue
            taken.add(i)
            if t.state == TrialState.COMPLETE and t.values:
                rows.append(i)
                residuals.append(math.log(max(float(t.values[0]), self.floor))
                                 - float(self.log_pred[i]))
        score = self.log_pred.copy()
        if len(rows) > 1:
            # The mean residual is a scale, the same for every candidate: only what the values
            # add beyond it reorders them (one measurement reorders nothing).
            x = self.features[rows] - self.features[rows].mean(axis=0)
            r = np.asarray(residuals) - float(np.mean(residuals))
            gram = x.T @ x + self.ridge * np.eye(x.shape[1])
            score += (self.features - self.features[rows].mean(axis=0)) @ \
                np.linalg.solve(gram, x.T @ r)
        free = [i for i in range(len(self.candidates)) if i not in taken]
        if not free:
            return None
        if not explore or not rows:
            return max(free, key=lambda i: score[i])
        top = sorted(free, key=lambda i: -score[i])[:max(1, len(free) // 5)]
        measured = self.features[rows]
        return max(top, key=lambda i: (float(np.min(np.sum(
            np.abs(measured - self.features[i]), axis=1))), score[i]))

    def _position(self, params: dict[str, Any]) -> int | None:
        """The candidate a trial's params are (a param a rule fixed is not in them)."""
        if not params:
            return None
        exact = self._index.get(json.dumps(params, sort_keys=True, default=str))
        if exact is not None:
            return exact
        return next((i for i, c in enumerate(self.candidates)
                     if all(c.get(k) == v for k, v in params.items())), None)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._picks.pop(trial.number, None)
        self.fallback.after_trial(study, trial, state, values)
