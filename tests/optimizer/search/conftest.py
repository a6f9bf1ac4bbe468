"""Builders for the search's unit tests: a study file and a small space in tmp_path, an
in-memory Optuna study with the study file's sampler and pruner. No Ray, no processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import StudyConfig, load_study
from optimizer.storage.study import make_pruner, make_sampler
from runners.base import BenchmarkMetrics, StepMetrics
from runners.load_level import LoadLevel
from search_spaces import ResolvedSpace, load_space
from tests.builders import benchmark_metrics
from tests.optimizer.test_daemon import categorical_space, write_study

Setup = tuple[StudyConfig, ResolvedSpace, optuna.Study]


@pytest.fixture
def make_setup(tmp_path: Path) -> Callable[..., Setup]:
    """`make_setup(choices={...}, **study_overrides)`: the study file's config, the resolved
    space over `choices` (vLLM's default first) and a new in-memory study."""

    def build(choices: dict[str, list[Any]] | None = None, **overrides: Any) -> Setup:
        space_path = categorical_space(tmp_path, **(choices or {"max_num_seqs": [256, 64]}))
        cfg = load_study(write_study(tmp_path, search_space=str(space_path), **overrides))
        study = optuna.create_study(directions=cfg.directions, sampler=make_sampler(cfg),
                                    pruner=make_pruner(cfg))
        return cfg, load_space(space_path).resolve({}), study

    return build


def metrics(goodput: float, throughput: float) -> BenchmarkMetrics:
    """A level's figures: `goodput` of `throughput` requests/s met the SLO."""
    return benchmark_metrics(1.0, completed=16, total_input_tokens=1, total_output_tokens=1,
                             request_throughput=throughput, request_goodput=goodput,
                             output_throughput=100 * goodput, total_token_throughput=1.0)


def step(index: int, level: LoadLevel, goodput: float, throughput: float) -> StepMetrics:
    return StepMetrics(step=index, level=level, metrics=metrics(goodput, throughput))
