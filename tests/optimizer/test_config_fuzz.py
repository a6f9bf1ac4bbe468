"""Fuzz the study loader: whatever the YAML holds, the answer is a StudyConfig or a one-line
ConfigError, never a traceback."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from optimizer.config import load_study, parse_study
from optimizer.errors import ConfigError

KEYS = ["name", "model", "workload", "slo", "objective", "search_space", "budget", "engine",
        "simulated", "sampler", "pruner", "vllm", "results_dir", "storage", "tracking_uri",
        "env", "fixed_flags", "max_parallel_trials", "retries", "path", "load_format",
        "levels", "concurrency", "request_rate", "input_len", "output_len", "kind", "mean",
        "low", "high", "num_requests", "duration_s", "trials", "wall_hours", "ttft_p99_ms",
        "tpot_p99_ms", "hardware", "num_gpus", "typo"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
                    st.sampled_from(["goodput", "tpot", "dummy", "auto", "qwen2.5-7b", "h200",
                                     "fixed", "uniform", "simulated", "vllm", "x/../y"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=20)
VALID = {"name": "s", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
         "slo": {"tpot_p99_ms": 50}}


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(values, st.dictionaries(st.sampled_from(KEYS), values, max_size=8),
                 st.builds(lambda patch: {**VALID, **patch},
                           st.dictionaries(st.sampled_from(KEYS), values, max_size=3))))
def test_any_study_data_gives_a_config_or_a_one_line_error(data: object) -> None:
    try:
        cfg = parse_study(data)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message, "errors are one line"
        return
    assert cfg.name and cfg.workload.levels, "an accepted study is usable"


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_file_bytes_give_a_config_or_a_one_line_error(tmp_path_factory: object,
                                                          raw: bytes) -> None:
    path = Path(str(tmp_path_factory.mktemp("fuzz"))) / "study.yaml"  # type: ignore[attr-defined]
    path.write_bytes(raw)
    try:
        load_study(path)
    except ConfigError as exc:
        assert "\n" not in str(exc)


def test_yaml_roundtrip_of_the_valid_base_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(VALID))
    assert load_study(path).name == "s"
