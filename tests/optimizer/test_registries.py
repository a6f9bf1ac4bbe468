"""Plug-ins chosen by name: samplers, pruners, runners and objectives are dict registries; the
study file is checked against the registry's keys (an unknown name is refused in one line that
lists the valid ones), and a new entry is all a study needs to use it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import parse_study
from optimizer.errors import ConfigError
from optimizer.results.objectives import OBJECTIVES, Objective, get_objective, objective_value
from optimizer.results.trial_record import objective_unit
from optimizer.run.engines import RUNNERS, RunnerSpec, build_runner
from optimizer.search.pruners import PRUNERS
from optimizer.search.samplers import SAMPLERS
from optimizer.storage.study import make_pruner, make_sampler, open_study
from runners.base import BenchmarkMetrics, StepMetrics
from runners.load_level import LoadLevel

BASE: dict[str, Any] = {"name": "s", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
                        "slo": {"tpot_p99_ms": 50}}


def _refusal(patch: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_study({**BASE, **patch})
    message = str(info.value)
    assert "\n" not in message, f"one line: {message}"
    return message


@pytest.mark.parametrize(("patch", "field", "given", "registry", "also"), [
    ({"sampler": {"name": "cmaes"}}, "sampler.name", "cmaes", SAMPLERS, ()),
    ({"pruner": {"name": "hyperband"}}, "pruner.name", "hyperband", PRUNERS, ()),
    ({"engine": "tensorrt"}, "engine", "tensorrt", RUNNERS, ("auto",)),
    ({"objective": "latency"}, "objective", "latency", OBJECTIVES, ()),
    ({"objective": ["goodput", "latency"]}, "objective", "latency", OBJECTIVES, ()),
], ids=["sampler", "pruner", "runner", "objective", "objective-in-a-pair"])
def test_an_unknown_plugin_name_is_refused_listing_every_registered_name(
        patch: dict[str, Any], field: str, given: str, registry: dict[str, Any],
        also: tuple[str, ...]) -> None:
    message = _refusal(patch)
    assert message.startswith(f"study.yaml: {field}: expected one of "), message
    for name in [*registry, *also]:
        assert repr(name) in message, f"the error lists the valid name {name!r}: {message}"
    assert message.endswith(f"but got {given!r}."), f"the error shows what was given: {message}"


def test_the_runtime_lookups_name_the_valid_entries_too(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown runner 'tensorrt'; valid: vllm, simulated"):
        build_runner(RunnerSpec(kind="tensorrt", registry_dir=tmp_path))
    with pytest.raises(ValueError, match="unknown objective 'latency'; valid: goodput, "
                                         "throughput, tpot, ttft"):
        get_objective("latency")


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_registered_sampler_is_built_from_the_study_file(name: str) -> None:
    cfg = parse_study({**BASE, "sampler": {"name": name, "seed": 3}})
    assert isinstance(make_sampler(cfg), optuna.samplers.BaseSampler)


@pytest.mark.parametrize("name", list(PRUNERS))
def test_every_registered_pruner_is_built_from_the_study_file(name: str) -> None:
    cfg = parse_study({**BASE, "pruner": {"name": name}})
    assert isinstance(make_pruner(cfg), optuna.pruners.BasePruner)


def _metrics(e2el_p99_ms: float) -> BenchmarkMetrics:
    zero = dict.fromkeys(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
                         for m in ("ttft", "tpot", "itl", "e2el"))
    figures: dict[str, Any] = {k: 0.0 for k in zero} | {"p99_e2el_ms": e2el_p99_ms}
    return BenchmarkMetrics(completed=10, failed=0, duration_s=1.0, total_input_tokens=1,
                            total_output_tokens=1, request_throughput=1.0, request_goodput=1.0,
                            output_throughput=1.0, total_token_throughput=1.0, **figures)


def test_one_objective_entry_is_enough_for_a_study_to_optimize_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    e2el = Objective("e2el", "minimize", "ms E2EL p99", lambda m: m.p99_e2el_ms)
    monkeypatch.setitem(OBJECTIVES, "e2el", e2el)
    cfg = parse_study({**BASE, "objective": ["throughput", "e2el"],
                       "storage": f"sqlite:///{tmp_path / 'optuna.db'}"})
    assert cfg.objectives == ["throughput", "e2el"]
    assert cfg.directions == ["maximize", "minimize"], "the direction comes from the entry"
    steps = [StepMetrics(step=i, level=LoadLevel(max_concurrency=8 * (i + 1)),
                         metrics=_metrics(ms)) for i, ms in enumerate((900.0, 1400.0))]
    assert objective_value("e2el", steps) == 1400.0, "its value function reads each level"
    assert objective_unit("e2el") == "ms E2EL p99", "its unit is printed with its values"
    study = open_study(cfg)
    assert [d.name.lower() for d in study.directions] == ["maximize", "minimize"]


def test_an_objective_that_needs_an_slo_is_refused_without_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OBJECTIVES, "slo_rate", Objective(
        "slo_rate", "maximize", "req/s", lambda m: m.request_throughput, needs_slo=True))
    message = _refusal({"objective": "slo_rate", "slo": {}})
    assert "objective slo_rate needs slo.ttft_p99_ms" in message, message
