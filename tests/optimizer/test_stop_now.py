"""A "stop now" (the daemon's second SIGTERM: `TrialSession.cancel`, which kills the engine)
ends a trial whose open-loop level waits hours for its next arrival: the level ends once its
server stops listening, and the run returns interrupted, on a real simulated engine."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path

from optimizer.run.executor import TrialSession
from runners.base import EngineConfig, FailureReason, RunResult
from runners.engine import EngineRunner
from runners.load_level import LoadLevel
from runners.simulated.launcher import SimulatedLauncher
from tests.runners.contract import small_workload


class _LevelsLogged(logging.Handler):
    """Sets `measuring` once the readiness completion's level has ended: the next level run
    is the workload's own."""

    def __init__(self) -> None:
        super().__init__()
        self.measuring = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("level concurrency=1: 1 completed"):
            self.measuring.set()


def test_stop_now_ends_a_trial_whose_sparse_rate_level_waits_hours_for_its_next_arrival(
        tmp_path: Path) -> None:
    """8 requests at 0.0001 req/s: the first arrival is ~10,000 s after the level's start
    (seed 0). The engine died at once on the cancel, but the level slept to that arrival and
    the Ray worker answered the cancel only at its 120 s timeout."""
    workload = replace(small_workload(), levels=(LoadLevel(request_rate_rps=0.0001,
                                                           max_concurrency=8),),
                       num_requests=8, num_warmup_requests=0)
    session = TrialSession(EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                                        tmp_path / "engines"))
    results: list[RunResult] = []
    run = threading.Thread(target=lambda: results.append(session.run(
        EngineConfig(model="qwen2.5-7b", load_format="dummy"), workload, str(tmp_path / "t"))),
        daemon=True)
    logged = _LevelsLogged()
    logger = logging.getLogger("runners.loadgen.level")
    logger.addHandler(logged)
    logger.setLevel(logging.INFO)
    try:
        run.start()
        assert logged.measuring.wait(120), "the engine answered its readiness completion"
        session.cancel()
        run.join(60)  # a guard against the hang (hours), not a bound the test measures
    finally:
        logger.removeHandler(logged)
    assert not run.is_alive(), "the level waited out its arrivals after the engine died"
    failure = results[0].failure
    assert failure is not None and failure.reason == FailureReason.INTERRUPTED, failure
    assert list((tmp_path / "engines").glob("*.json")) == [], "no engine left"
