"""bench/h100/tph_pair/table.py: issue 32's trials-per-hour pair read from the two arms' Optuna
storages, the before arm's record as the code before the steady staircase stored it (fixed
probes: no `steady.*` figures, no `held`) and the after arm's as today's code stores it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from bench.h100.tph_pair import table

VLLM_ARGV = ["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]


def _probe(step: int, rate: float, met: bool, elapsed: float, completed: float,
           duration: float, tpot: float) -> dict[str, Any]:
    """A fixed probe as the old code recorded it: its requests, sent for probe_duration_s
    then drained (duration_s), and nothing of a steady window."""
    return {"step": step, "level": {"request_rate_rps": rate}, "meets_slo": met,
            "elapsed_s": elapsed, "server": {"is_saturated": 0.0},
            "metrics": {"completed": completed, "duration_s": duration, "p99_tpot_ms": tpot}}


def _step(step: int, rate: float, met: bool, elapsed: float, window: float, sent: float,
          tpot: float, *, hold: bool = False, reason: str | None = None) -> dict[str, Any]:
    return {"step": step, "level": {"request_rate_rps": rate}, "meets_slo": met,
            "elapsed_s": elapsed, "miss_reason": reason,
            "server": {"steady.is_hold": 1.0 if hold else 0.0, "steady.window_s": window,
                       "steady.num_measured": sent, "steady.warmup_s": 45.0},
            "metrics": {"p99_tpot_ms": tpot, "window.completed_rate_rps": sent / window}}


BEFORE = {
    "state": "complete", "argv": VLLM_ARGV, "wall_s": 440.0,
    "engine_started_unix_s": 1_796_560_000.0, "engine_ended_unix_s": 1_796_560_440.0,
    "startup": {"total_s": 150.0, "compile_cache": "cold"},
    "capacity": {"axis": "request_rate", "met_load": 9.79, "missed_load": 10.8,
                 "status": "resolved", "num_probes": 4},
    "steps": [_probe(0, 12.0, False, 212.0, 360, 47.0, 19.1),
              _probe(1, 8.0, True, 262.0, 241, 46.5, 11.8),
              _probe(2, 9.79, True, 311.0, 323, 42.7, 13.9),
              _probe(3, 10.8, False, 360.0, 330, 44.0, 15.4)],
}
AFTER = {
    "state": "complete", "argv": VLLM_ARGV, "wall_s": 1040.0,
    "engine_started_unix_s": 1_796_560_500.0, "engine_ended_unix_s": 1_796_561_540.0,
    "startup": {"total_s": 110.0, "compile_cache": "cold"},
    "capacity": {"axis": "request_rate", "met_load": 8.84, "missed_load": 9.79,
                 "status": "unresolved", "num_probes": 6, "held": True},
    "steps": [_step(0, 12.0, False, 200.0, 12.5, 157, 18.9),
              _step(1, 8.0, True, 290.0, 18.8, 148, 11.7),
              _step(2, 9.79, False, 375.0, 15.3, 151, 13.3, reason="met in its 15 s window, "
                    "but the hold at rate=9.79 missed"),
              _step(3, 10.8, False, 460.0, 13.9, 152, 15.0),
              _step(4, 9.79, False, 750.0, 223.9, 2303, 15.9, hold=True),
              _step(5, 8.84, True, 1037.0, 223.9, 1997, 13.5, hold=True)],
}


def _arm(folder: Path, name: str, record: dict[str, Any] | None) -> None:
    """An arm's storage: one trial holding `record` as stored, or one still running."""
    folder.mkdir(parents=True)
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{folder / 'optuna.db'}")
    if record is None:
        study.ask()  # a trial the device time cut off: no record
        return
    dist: dict[str, optuna.distributions.BaseDistribution] = {
        "x": optuna.distributions.CategoricalDistribution([0])}
    study.add_trial(optuna.trial.create_trial(params={"x": 0}, distributions=dist, value=1.0,
                                              user_attrs={"record": record}))


def test_the_pair_reads_each_arms_wall_claim_and_judgement_and_states_the_ratio(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _arm(tmp_path / "tph-before", "tph-before", BEFORE)
    _arm(tmp_path / "tph-after", "tph-after", AFTER)
    (tmp_path / "tph-before" / "COMMIT").write_text("8f4c42c2ad2464b44b3a66aa4dd9c313a1f7d2dc\n")
    assert table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "SIMULATED" not in out
    # 3600 / 440 = 8.2 an hour; 3600 / 1040 = 3.5; 3.46 / 8.18 = 0.42
    assert ("| before (tph-before) | fixed probes, 8f4c42c2ad24 | 12:26:40 | 440 | 150 (cold) "
            "| 290 | 4 | [9.79, 10.8) req/s, resolved | fixed probe at 9.79: TPOT p99 13.90 ms "
            "over its 323 requests, sent for a fixed time then drained (42.7 s in all: 7.56 "
            "req/s completed of 9.79 offered) | 8.2 |") in out
    assert ("| after (tph-after) | staircase + hold | 12:35:00 | 1040 | 110 (cold) | 930 | "
            "4 + 2 hold(s) | [8.84, 9.79) req/s, unresolved | held: the hold at 8.84 met the "
            "SLO (224 s window, 1997 requests, TPOT p99 13.50 ms) | 3.5 |") in out
    # each step's cost: since the previous ended, the first since the engine was ready
    assert "| 0 | probe | 12 | missed | 62 | 47.0 | 360 | 19.10 | 7.66 |" in out
    assert "| 5 | hold | 8.84 | met | 287 | 223.9 | 1997 | 13.50 | 8.92 |" in out
    assert "| 2 | step | 9.79 | missed: met in its 15 s window, but the hold" in out
    assert "after / before: 0.42x trials per hour (3.5 against 8.2; one trial each, the " \
        "before arm's engine started first" in out


def test_an_arm_whose_trial_did_not_end_bounds_the_ratio_by_how_long_its_logs_ran(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _arm(tmp_path / "tph-before", "tph-before", BEFORE)
    after = tmp_path / "tph-after"
    _arm(after, "tph-after", None)
    (after / "daemon.log").write_text(
        "2026-12-06 12:35:00,120 INFO optimizer.cli: warm start: off\n"
        "2026-12-06 12:35:01,954 INFO optimizer.run.daemon: trial 0 started: params={}\n")
    (after / "trials" / "0000").mkdir(parents=True)
    (after / "trials" / "0000" / "server.log").write_text(
        "(APIServer pid=1411) INFO 12-06 12:37:11 [api_server.py:1] Starting vLLM API server\n"
        "(APIServer pid=1411) INFO 12-06 12:55:01 [loggers.py:310] Engine 000: Running: 101\n"
        "a line of a traceback, no time\n")
    assert table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # 12:35:01 to 12:55:01: >= 1200 s, so <= 3.0 trials an hour against 8.2: <= 0.37x
    assert ("| after (tph-after) | staircase + hold | - | no trial ended (state RUNNING); its "
            "logs ran >= 1200 s | - | - | - | - | - | <= 3.0 |") in out
    assert "after / before: <= 0.37x trials per hour (the after arm's trial did not end" in out
    (after / "daemon.log").unlink()  # nothing to bound it by: no ratio
    assert table.main([str(tmp_path)]) == 0
    assert "after / before: not given (an arm has no trial that ended)" in \
        capsys.readouterr().out


def test_a_simulated_record_is_labelled_and_its_slept_start_up_is_what_it_subtracts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    simulated = {**AFTER, "argv": ["python3", "-m", "runners.simulated",
                                   "--startup-time-scale", "0.01"], "wall_s": 100.0}
    _arm(tmp_path / "tph-before", "tph-before", BEFORE)
    _arm(tmp_path / "tph-after", "tph-after", simulated)
    assert table.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("SIMULATED engine: every figure below comes from its model")
    assert "| 100 | 110 modelled, 1.1 slept (cold) | 99 |" in out


def test_results_without_the_pairs_folders_are_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert table.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"table.py: {tmp_path}/tph-before/optuna.db: not found; RESULTS_DIR must "
                   "hold tph-before/ and tph-after/ (the h200-results folder of the packed "
                   "results)")
