"""The capacity search: the bracketing logic on its own, then through the whole runner on the
simulated engine, where the knee it finds in real time is checked against the knee of the same
model computed in virtual time (`simulate_benchmark`, no sleeping)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runners.base import EngineConfig
from runners.capacity.search import CapacitySearch
from runners.engine import EngineRunner
from runners.hardware import load_preset
from runners.simulated.benchmark import simulate_benchmark
from runners.simulated.launcher import SimulatedLauncher
from runners.simulated.performance import PerformanceModel
from runners.workload import SLO, LengthDistribution, Workload


def _search_against(search: CapacitySearch, knee: float) -> list[tuple[float, bool]]:
    history: list[tuple[float, bool]] = []
    while (load := search.next_load(history)) is not None:
        history.append((load, load <= knee))
    return history


@pytest.mark.parametrize("knee", [17.0, 40.0, 70.0, 129.0, 255.0])
def test_bisection_brackets_any_knee_within_the_tolerance(knee: float) -> None:
    search = CapacitySearch("concurrency", low=8, high=256, tolerance=0.05, max_probes=10)
    history = _search_against(search, knee)
    found = CapacitySearch.capacity(history)
    assert found <= knee, "the capacity is a load that met the SLO"
    assert knee - found <= max(1.0, 0.05 * knee), f"found {found} for a knee at {knee}"
    assert history[0][0] == 256, "heaviest load first"
    if not history[0][1]:
        assert history[1][0] == 45, "then halfway (in log) down to the lightest, not to it"


def test_search_stops_at_once_when_the_heaviest_load_meets_the_slo() -> None:
    search = CapacitySearch("request_rate", low=1.0, high=64.0)
    assert _search_against(search, knee=100.0) == [(64.0, True)]


def test_a_config_that_misses_the_slo_even_at_the_lightest_load_has_no_capacity() -> None:
    search = CapacitySearch("concurrency", low=4, high=128)
    history = _search_against(search, knee=1.0)
    assert history[0] == (128.0, False) and history[-1] == (4.0, False), history
    assert len(history) <= 5, "halfway steps down reach the lightest load in a few probes"
    assert CapacitySearch.capacity(history) == 0.0


def test_probes_are_capped() -> None:
    search = CapacitySearch("request_rate", low=0.5, high=512.0, tolerance=0.001, max_probes=4)
    assert len(_search_against(search, knee=33.3)) == 4


WORKLOAD = Workload(input_len=LengthDistribution(mean=256), output_len=LengthDistribution(
    mean=64), num_requests=96, num_warmup_requests=4, slo=SLO(tpot_p99_ms=10.0))
CONFIG = EngineConfig("qwen2.5-7b", {"max_model_len": 4096}, load_format="dummy",
                      skip_tokenizer_init=True)


def _virtual_tpot_p99(concurrency: float) -> float:
    model = PerformanceModel.from_config(CONFIG, load_preset("h200"))
    return simulate_benchmark(model, input_len=256, output_len=64,
                              max_concurrency=int(concurrency), num_requests=96).p99_tpot_ms


def test_search_finds_the_simulated_engines_knee_within_five_percent() -> None:
    # The simulated engine's own answer, in virtual time (deterministic, no sleeping): the
    # highest concurrency whose TPOT p99 meets 10 ms, by brute force...
    knee = max(c for c in range(8, 97) if _virtual_tpot_p99(c) <= 10.0)
    # ...and the search's, probing the same model as the runner probes a server.
    search = CapacitySearch("concurrency", low=8, high=256, tolerance=0.05, max_probes=10)
    history: list[tuple[float, bool]] = []
    while (load := search.next_load(history)) is not None:
        history.append((load, _virtual_tpot_p99(load) <= 10.0))
    found = CapacitySearch.capacity(history)
    assert abs(found - knee) <= 0.05 * knee, f"found {found}, knee {knee}: {history}"
    assert len(history) <= 10


@pytest.mark.slow
def test_capacity_search_probes_one_running_server_and_stops_by_its_rule(
        tmp_path: Path) -> None:
    # Whether a probe near the knee meets the SLO depends on the host as well as the model (a
    # busy client under-loads the server): the knee itself is checked in virtual time above;
    # here, what the search does with whatever each probe measured.
    # Windows sized for the simulated engine (a default 200-request window runs minutes here),
    # and a warm-up of 2 s, two lives of a request near the knee (0.5-0.9 s here), where two
    # lives sized from the SLO's bounds would take 5.3 s a step.
    from runners.capacity.staircase import unapplied_of

    search = CapacitySearch("concurrency", low=8, high=256, tolerance=0.1, max_probes=5,
                            min_window_requests=60, min_window_s=1.0, max_window_s=5.0,
                            warmup_s=2.0, hold_s=0)
    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", stall_timeout_s=10.0)
    try:
        result = runner.run(CONFIG, Workload(**{**WORKLOAD.__dict__, "capacity": search}),
                            tmp_path / "trial")
    finally:
        runner.close()
    assert result.status == "complete", result.failure
    probes = [(float(s.level.max_concurrency or 0), bool(s.meets_slo)) for s in result.steps]
    assert probes[0] == (256.0, False), "heaviest first (the knee is below 96)"
    # A step whose load was not applied (a busy host) ends no bracket: it is named beside it.
    assert result.capacity == search.bracket(probes, unapplied_of(search, result.steps)), \
        "the bracket is what the probes showed"
    assert result.capacity.is_resolved or len(probes) == search.max_probes, \
        f"the search ends within its tolerance or out of probes: {probes}"
    assert result.engine.startup_s is not None and len(probes) >= 3, \
        "one start-up for the whole latency-vs-load curve"


@pytest.mark.slow
def test_an_open_loop_level_above_capacity_is_stopped_once_its_queue_keeps_growing(
        tmp_path: Path) -> None:
    from runners.load_level import LoadLevel

    # Eager decode of 8 sequences serves about 7 requests a second; 30 a second is far above
    # it. Run to the end, the 1200 requests would take minutes of queueing; the level stops in
    # seconds. (Not 32 sequences at 400 or 100 a second: under two CPU spinners the client,
    # reading the replies of ~2000 tokens a second, sent 98-100% of its requests late, near
    # the engine's pace, so no queue grew: load not applied, rightly.)
    workload = Workload(input_len=LengthDistribution(mean=128), output_len=LengthDistribution(
        mean=64), num_requests=1200, num_warmup_requests=2, slo=SLO(tpot_p99_ms=50.0),
        levels=(LoadLevel(request_rate_rps=30.0),))
    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", stall_timeout_s=30.0)
    config = EngineConfig("qwen2.5-7b", {"enforce_eager": True, "max_num_seqs": 8},
                          load_format="dummy", skip_tokenizer_init=True)
    light = Workload(**{**workload.__dict__, "num_requests": 12,
                        "levels": (LoadLevel(request_rate_rps=4.0),)})
    try:
        calm = runner.run(config, light, tmp_path / "calm")
        result = runner.run(config, workload, tmp_path / "flood")
    finally:
        runner.close()
    assert calm.status == "complete" and calm.steps[0].server_metrics["is_saturated"] == 0.0
    assert result.status == "complete", result.failure
    (step,) = result.steps
    assert step.server_metrics["is_saturated"] == 1.0, step.server_metrics
    assert step.metrics.completed < 1200, \
        f"stopped early, not run to the end: {step.metrics.completed} requests done"
