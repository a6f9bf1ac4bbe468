"""bench/h200/pair_table.py: the trials-per-hour pair read from two arms' Optuna storages."""

from __future__ import annotations

from pathlib import Path

import optuna

from bench.h200 import pair_table as bench
from optimizer.results.trial_record import ATTR_RECORD, TrialRecord


def _arm(folder: Path, name: str, walls: list[tuple[float, float, str]]) -> Path:
    """An arm's storage: trials back to back from t=1000 s, each (start-up s, wall s, cache)."""
    folder.mkdir()
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{folder / 'optuna.db'}")
    clock = 1000.0
    dist = {"x": optuna.distributions.CategoricalDistribution([0, 1, 2])}
    for i, (startup, wall, cache) in enumerate(walls):
        record = TrialRecord(state="complete", params={"x": i}, conclusion="", values=(1.0,),
                             wall_s=wall, engine_started_unix_s=clock,
                             engine_ended_unix_s=clock + wall,
                             startup={"total_s": startup, "compile_cache": cache})
        study.add_trial(optuna.trial.create_trial(
            params={"x": i}, distributions=dist, value=1.0,
            user_attrs={ATTR_RECORD: record.to_user_attr()}))
        clock += wall + 2.0  # the next trial launches 2 s after this one's engine stops
    return folder


def test_each_arm_is_its_trials_over_the_time_they_ran(tmp_path: Path, capsys) -> None:
    before = _arm(tmp_path / "before", "h200-pair-before",
                  [(203, 220, "cold"), (149, 165, "cold"), (70, 85, "warm")])
    after = _arm(tmp_path / "after", "h200-pair-after",
                 [(108, 125, "cold"), (149, 165, "cold"), (70, 85, "warm")])
    assert bench.main([str(before), str(after)]) == 0
    out = capsys.readouterr().out
    # before: 220 + 2 + 165 + 2 + 85 = 474 s for 3 trials = 22.8/h; after 379 s = 28.5/h
    assert "| before (h200-pair-before) | 3 | 7.9 | 22.8 | 203 (cold), 149 (cold), 70 (warm)" \
        in out
    assert "| after (h200-pair-after) | 3 | 6.3 | 28.5 |" in out
    assert "after / before: 1.25x trials per hour" in out and "no interval" in out
