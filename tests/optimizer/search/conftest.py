"""Builders for the search's unit tests: a study file and a small space in tmp_path, an
in-memory Optuna study with the study file's sampler and pruner. No Ray, no processes."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import optuna
import pytest

from optimizer.config import StudyConfig
from runners.base import BenchmarkMetrics, StepMetrics
from runners.load_level import LoadLevel
from search_spaces import ResolvedSpace
from tests.builders import benchmark_metrics, search_setup

Setup = tuple[StudyConfig, ResolvedSpace, optuna.Study]


@pytest.fixture
def make_setup(tmp_path: Path) -> Callable[..., Setup]:
    """`make_setup(choices={...}, **study_overrides)`: the study file's config, the resolved
    space over `choices` (vLLM's default first) and a new in-memory study (`search_setup`)."""
    return partial(search_setup, tmp_path)


def metrics(goodput: float, throughput: float) -> BenchmarkMetrics:
    """A level's figures: `goodput` of `throughput` requests/s met the SLO."""
    return benchmark_metrics(1.0, completed=16, total_input_tokens=1, total_output_tokens=1,
                             request_throughput=throughput, request_goodput=goodput,
                             output_throughput=100 * goodput, total_token_throughput=1.0)


def step(index: int, level: LoadLevel, goodput: float, throughput: float) -> StepMetrics:
    return StepMetrics(step=index, level=level, metrics=metrics(goodput, throughput))
