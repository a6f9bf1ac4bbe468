"""The samplers a study can search with, by name (`sampler.name` in the study file). A new
sampler is one entry of `SAMPLERS`: a factory from the seed and the number of startup trials."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import optuna

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
    "random": _random,
    "gp": _gp,
    "nsga2": _nsga2,
}
