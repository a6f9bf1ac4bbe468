"""bench/replay.py on the H200 table it ships (bench/data/h200_grid.json): a table still being
filled replays as its complete sub-grid, and a study's final re-measurements are not grid
points."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from bench import replay as replay_mod

ROOT = Path(__file__).resolve().parents[1]
H200_TABLE = json.loads((ROOT / "bench" / "data" / "h200_grid.json").read_text())


def test_an_incomplete_table_says_how_to_replay_it() -> None:
    with pytest.raises(SystemExit, match="--only KEY=VALUE"):
        replay_mod.Table(H200_TABLE)


def test_only_keeps_the_complete_sub_grid_in_grid_order() -> None:
    sub = replay_mod.restrict(H200_TABLE, {"kv_cache_dtype": "auto"})
    table = replay_mod.Table(sub)  # complete: no SystemExit
    assert len(table.rows) == 4
    assert sub["space"]["quantization"] == ["none", "fp8"]
    assert table.grid_order()[0]["quantization"] == "none", "the defaults come first"
    with pytest.raises(SystemExit, match="not a parameter"):
        replay_mod.restrict(H200_TABLE, {"kv_dtype": "auto"})


def test_replay_of_the_h200_sub_grid_finds_fp8_weights_cheaper_than_the_grid() -> None:
    result = replay_mod.replay(replay_mod.restrict(H200_TABLE, {"kv_cache_dtype": "auto"}),
                               range(3))
    grid = result["summary"]["grid"]["median_gpu_s"]
    assert result["best"] == pytest.approx(38.8, abs=0.1)
    assert result["summary"]["random"]["median_gpu_s"] <= grid


def test_confirmation_runs_are_not_grid_points(tmp_path: Path) -> None:
    db = tmp_path / "optuna.db"
    study = optuna.create_study(study_name="g", storage=f"sqlite:///{db}", direction="maximize")
    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}

    def record(q: str, value: float) -> dict[str, object]:
        return {"state": "complete", "params": {"quantization": q},
                "metrics": {"engine.startup_s": 90.0},
                "steps": [{"level": {"max_concurrency": 64},
                           "metrics": {"request_goodput": value, "duration_s": 10.0}}]}

    for q, value, attrs in (("none", 29.0, {}), ("fp8", 39.0, {}),
                            ("fp8", 35.0, {"confirm": "best"})):
        study.add_trial(optuna.trial.create_trial(
            params={"quantization": q}, distributions=dist, value=value,
            user_attrs={"record": record(q, value), **attrs}))
    table = replay_mod.table_from_study(db, "g")
    values = {r["params"]["quantization"]: r["value"] for r in table["rows"]}
    assert values == {"none": 29.0, "fp8": 39.0}, "the grid's own measurement stands"


class _StuckSampler(optuna.samplers.RandomSampler):
    """Proposes the defaults forever, as a GP sampler stalled on its incumbent does."""

    def sample_independent(self, study, trial, name, distribution):  # type: ignore[no-untyped-def]
        return distribution.choices[0]


def test_a_search_stalled_on_measured_configs_ends_unfinished_as_the_daemon_ends_it() -> None:
    table = replay_mod.Table(replay_mod.restrict(H200_TABLE, {"kv_cache_dtype": "auto"}))
    cost = replay_mod._replay_optuna(table, _StuckSampler(seed=0), 0, pruner="none")
    assert cost == float("inf"), "200 repeats in a row: the space counts as exhausted"


def test_gp_replays_where_torch_is_installed() -> None:
    pytest.importorskip("torch", reason="GPSampler needs torch (bench/README.md: GP)")
    result = replay_mod.replay(replay_mod.restrict(H200_TABLE, {"kv_cache_dtype": "auto"}),
                               range(2))
    assert result["summary"]["gp"]["reached"] == 2
