"""The study file: every bad input is one line naming the field and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from optimizer.config import load_study, parse_study
from optimizer.errors import ConfigError

BASE = {"name": "s", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 3},
        "slo": {"tpot_p99_ms": 50}}


def test_quickstart_example_is_valid() -> None:
    cfg = load_study(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
    assert cfg.name == "quickstart"
    assert cfg.objectives == ["goodput"] and cfg.directions == ["maximize"]
    workload = cfg.workload()
    assert [lv.max_concurrency for lv in workload.levels] == [8, 32]


def test_defaults_fill_a_minimal_study() -> None:
    cfg = parse_study(dict(BASE))
    assert cfg.storage_url == "sqlite:///results/s/optuna.db"
    assert cfg.workload().slo.tpot_p99_ms == 50


@pytest.mark.parametrize(("patch", "expected"), [
    ({"slo": {"tpot_p99_ms": -5}}, "slo.tpot_p99_ms: Input should be greater than 0 but got -5."),
    ({"budgett": {"trials": 1}}, "unknown key 'budgett'; did you mean 'budget'?"),
    ({"model": {"pat": "x"}}, "unknown key 'model.pat'; did you mean 'path'?"),
    ({"workload": {"levels": [{}]}}, "workload.levels[0]: a load level needs request_rate"),
    ({"name": "../etc"}, "name: must be 1-100 letters"),
    ({"slo": {}}, "objective goodput needs slo.ttft_p99_ms"),
    ({"objective": "latency"}, "objective"),
    ({"budget": {}}, "budget: set trials and/or wall_hours"),
    ({"workload": {"input_len": {"kind": "uniform", "low": 9, "high": 3}}},
     "low (9) must be <= high (3)"),
    ({"workload": {"num_requests": None}}, "set num_requests or duration_s"),
    ({"env": {"bad name": "1"}}, "is not an environment variable name"),
    ({"ray": {"resources": {"GPU": 2}}}, "ray.resources: 'GPU' is set by nightshift per trial"),
    ({"ray": {"resources": {"pool": 0}}}, "pool must be > 0 but got 0"),
    ({"ray": {"adress": "auto"}}, "unknown key 'ray.adress'; did you mean 'address'?"),
])
def test_bad_study_fields_give_one_line_errors(patch: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_study({**BASE, **patch})
    message = str(info.value)
    assert expected in message, message
    assert "\n" not in message, "errors are one line"
    assert message.startswith("study.yaml: "), "errors name the file"


def test_missing_required_section_says_what_to_add() -> None:
    data = {k: v for k, v in BASE.items() if k != "budget"}
    with pytest.raises(ConfigError, match="budget is required; add it"):
        parse_study(data)


def test_broken_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "study.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_study(bad)
    with pytest.raises(ConfigError, match="no such study file"):
        load_study(tmp_path / "absent.yaml")
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_study(bad)


def test_paths_resolve_against_the_study_file(tmp_path: Path) -> None:
    data = {**BASE, "results_dir": "out", "workload": {"prompts_file": "p.jsonl"}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_study(path)
    assert cfg.results_dir == tmp_path / "out"
    assert cfg.workload().prompts_file == tmp_path / "p.jsonl"


def test_overrides_from_the_command_line() -> None:
    cfg = parse_study(dict(BASE)).with_overrides(trials=7, tracking_uri="sqlite:///x.db")
    assert cfg.spec.budget.trials == 7 and cfg.tracking_uri == "sqlite:///x.db"
    with pytest.raises(ConfigError, match="--trials must be >= 1"):
        parse_study(dict(BASE)).with_overrides(trials=0)


def test_multi_objective_pair() -> None:
    cfg = parse_study({**BASE, "objective": ["throughput", "tpot"]})
    assert cfg.directions == ["maximize", "minimize"] and cfg.is_multi_objective
