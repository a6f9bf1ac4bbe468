"""Capacity as an interval: the bracket holds only measured loads, a probe that could not keep
up steers the next one to what it served, probes are bounded by time, and a search that runs
out of probes says it is unresolved."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from runners.base import EngineConfig
from runners.capacity.bracket import Bracket, bracket_from_metrics
from runners.capacity.search import CapacitySearch, Probe
from runners.workload import SLO, LengthDistribution, Workload
from tests.builders import simulated_run


def _served(load: float, knee: float, ceiling: float, under_read: float) -> float:
    """A server that meets the SLO up to `knee`, serves at most `ceiling` req/s, and whose
    saturated probes under-read what they served by `under_read` (a probe stopped early)."""
    return ceiling * (1 - under_read) if load > ceiling else load * 0.99


def _search(search: CapacitySearch, knee: float, ceiling: float,
            under_read: float) -> list[Probe]:
    history: list[Probe] = []
    while (load := search.next_load(history)) is not None:
        history.append((load, load <= knee, _served(load, knee, ceiling, under_read)))
    return history


KNEES = [1.4 * (45 / 1.4) ** (i / 24) for i in range(25)]


@pytest.mark.parametrize("ceiling_over_knee", [1.0, 1.15, 1.4, 2.0, 3.0])
@pytest.mark.parametrize("under_read", [0.0, 0.15, 0.3])
def test_the_bracket_holds_only_measured_loads_around_any_knee(
        ceiling_over_knee: float, under_read: float) -> None:
    search = CapacitySearch("request_rate", low=1.0, high=64.0, tolerance=0.1, max_probes=8)
    for knee in KNEES:
        history = _search(search, knee, knee * ceiling_over_knee, under_read)
        bracket = search.bracket(history)
        probed = {load: ok for load, ok, *_ in history}
        assert bracket.met_load is not None and probed[bracket.met_load] is True
        assert bracket.met_load <= knee, "the lower end is a load that met the SLO"
        assert bracket.missed_load is not None and probed[bracket.missed_load] is False
        assert bracket.missed_load > knee, "the upper end is a load that missed it"
        assert bracket.is_resolved, f"knee {knee:.3g}: {history}"


def test_a_saturated_probe_sends_the_next_probe_to_what_it_served() -> None:
    search = CapacitySearch("request_rate", low=1.0, high=64.0, tolerance=0.05)
    load = search.next_load([(64.0, False, 11.3)])
    assert load == pytest.approx(11.3), "not above what it could serve, and not at low"
    # The served rate chooses probes; it never becomes an end of the bracket.
    assert search.bracket([(64.0, False, 11.3)]).missed_load == 64.0


def test_served_rates_close_the_bracket_in_fewer_probes_than_bisection() -> None:
    guided = CapacitySearch("request_rate", low=1.0, high=64.0, tolerance=0.05, max_probes=12)
    counts_guided, counts_blind = [], []
    for knee in KNEES:
        counts_guided.append(len(_search(guided, knee, knee * 1.2, 0.15)))
        blind: list[Probe] = []
        while (load := guided.next_load(blind)) is not None:
            blind.append((load, load <= knee))
        counts_blind.append(len(blind))
    assert sum(counts_guided) / len(KNEES) <= 6.0 < sum(counts_blind) / len(KNEES), \
        (counts_guided, counts_blind)


def test_concurrency_probes_never_exceed_the_requests_the_engine_ran_at_once() -> None:
    search = CapacitySearch("concurrency", low=4, high=256, tolerance=0.05)
    load = search.next_load([(256.0, False, 96.0)])
    assert load == 96.0


def test_met_at_high_is_at_least_and_missed_at_low_is_none() -> None:
    search = CapacitySearch("request_rate", low=2.0, high=64.0)
    top = search.bracket([(64.0, True, 63.0)])
    assert top.status == "at_least" and top.missed_load is None and top.is_resolved
    assert top.describe().startswith(">= 64 req/s")
    assert "capacity.bracket_high" not in top.as_metrics(), "absent when no load missed"
    history: list[Probe] = [(64.0, False, None)]
    while (load := search.next_load(history)) is not None:
        history.append((load, False, None))
    assert history[1][0] == pytest.approx(11.3), "halfway (in log) down, not straight to low"
    assert history[-1][0] == 2.0, "down to the lightest load, where nothing is left"
    bottom = search.bracket(history)
    assert bottom.status == "none" and bottom.met_load is None
    assert bottom.describe() == "below low (2 req/s): no load in [2, 64] req/s met the SLO"
    assert bottom.as_metrics()["capacity.bracket_low"] == 0.0
    assert bracket_from_metrics("request_rate", bottom.as_metrics()).describe() == \
        bottom.describe(), "the range of interest is logged with the bracket"


def test_a_search_where_nothing_met_spends_its_last_probe_on_low() -> None:
    """The held-out study (s10): low 2, high 40, 5 probes, an SLO nothing meets; the served
    rates steered the steps down 40, 8.94, ... and the probes ran out at 3.17 without ever
    probing 2: "the lightest load probed, 3.17 req/s". The last probe goes to low."""
    search = CapacitySearch("request_rate", low=2.0, high=40.0, tolerance=0.05, max_probes=5)
    history: list[Probe] = []
    while (load := search.next_load(history)) is not None:
        history.append((load, False, 8.94 if load == 40.0 else 0.95 * load))
    assert len(history) == 5 and history[-1][0] == 2.0, history
    bracket = search.bracket(history)
    assert bracket.status == "none" and bracket.is_resolved
    assert bracket.describe() == "below low (2 req/s): no load in [2, 40] req/s met the SLO"
    # A search that met somewhere keeps its last probe for the bracket, not for low.
    met = [(40.0, False, 8.94), (8.94, True, None), (18.9, False, None), (13.0, False, None)]
    assert search.next_load(met) not in (None, 2.0)


def test_a_probe_whose_load_was_not_applied_ends_no_bracket() -> None:
    """A step whose client fell behind is not a measurement of the config at its load: it
    steers the search down as a miss does, but the bracket claims nothing from it."""
    search = CapacitySearch("request_rate", low=1.0, high=60.0, tolerance=0.05)
    history: list[Probe] = [(60.0, False, None), (7.74, True, None), (21.5, False, None),
                            (12.0, False, None)]
    plain = search.bracket(history)
    assert (plain.met_load, plain.missed_load) == (7.74, 12.0)
    late = search.bracket(history, unapplied=[60.0, 12.0])
    assert (late.met_load, late.missed_load, late.unapplied_load) == (7.74, 21.5, 12.0)
    assert late.status == "unresolved"
    assert late.describe() == \
        "[7.74, 21.5) req/s (12 req/s not measured: the load was not applied)"
    assert bracket_from_metrics("request_rate", late.as_metrics()) == late
    assert Bracket.from_dict(late.to_dict()) == late
    only = search.bracket([(60.0, False, None), (7.74, True, None)], unapplied=[60.0])
    assert only.missed_load is None and only.status == "unresolved"
    assert only.describe() == ">= 7.74 req/s (60 req/s not measured: the load was not applied)"
    none = search.bracket([(60.0, False, None)], unapplied=[60.0])
    assert none.describe().startswith("not measured: no probe applied its load")


def test_a_bracket_wider_than_the_tolerance_when_probes_run_out_is_unresolved() -> None:
    search = CapacitySearch("request_rate", low=1.0, high=64.0, tolerance=0.05, max_probes=3)
    history = _search(search, knee=20.0, ceiling=60.0, under_read=0.0)
    assert len(history) == 3
    bracket = search.bracket(history)
    assert bracket.status == "unresolved" and not bracket.is_resolved
    assert bracket.as_metrics()["capacity.is_resolved"] == 0.0
    assert bracket_from_metrics("request_rate", bracket.as_metrics()) == bracket, \
        "what is logged reads back as the same bracket"


def test_neighbouring_concurrencies_are_resolved() -> None:
    search = CapacitySearch("concurrency", low=2, high=32, tolerance=0.01)
    history: list[Probe] = [(32.0, False, None), (2.0, True, None), (8.0, True, None),
                            (9.0, False, None)]
    assert search.next_load(history) is None
    assert search.bracket(history) == Bracket("concurrency", 8.0, 9.0, "resolved", 4)


def test_plain_bisection_probe_count_is_known_up_front() -> None:
    assert CapacitySearch("request_rate", 1.0, 64.0, 0.05).worst_case_probes() == 9
    assert CapacitySearch("request_rate", 1.0, 40.0, 0.1).worst_case_probes() == 8
    assert math.isclose(CapacitySearch("request_rate", 1.0, 2.0, 0.05).step_ratio, 1.05 ** 4)


def test_a_light_step_is_bounded_by_its_window_not_by_num_requests(tmp_path: Path) -> None:
    # 2 req/s for 200 requests would take 100 s; a window of at most 3 s sends about 6.
    search = CapacitySearch("request_rate", low=1.0, high=2.0, max_probes=1,
                            min_window_requests=200, min_window_s=1.0, max_window_s=3.0,
                            warmup_s=0.5, hold_s=0)
    workload = Workload(input_len=LengthDistribution(mean=64), output_len=LengthDistribution(
        mean=8), num_requests=128, num_warmup_requests=1, slo=SLO(tpot_p99_ms=200.0),
        capacity=search)
    config = EngineConfig("qwen2.5-7b", {"max_model_len": 4096}, load_format="dummy",
                          skip_tokenizer_init=True)
    result = simulated_run(tmp_path, config, workload)
    (step,) = result.steps
    assert 1 <= step.metrics.completed <= 14, step.metrics.completed
    assert step.server_metrics["steady.num_measured"] == step.metrics.completed
    assert result.capacity is not None and result.capacity.met_load == 2.0
    assert result.capacity.status == "at_least"


def test_a_served_figure_is_trusted_only_when_it_was_measured() -> None:
    from tests.optimizer.test_records import _metrics

    concurrency = CapacitySearch("concurrency", low=2, high=32)
    assert concurrency.served_of(_metrics(5.0, 9.0), {"max_num_requests_running": 24.0,
                                                      "max_num_requests_waiting": 40.0,
                                                      "num_samples": 6.0}) == 24.0
    assert concurrency.served_of(_metrics(5.0, 9.0), {"max_num_requests_running": 24.0,
                                                      "max_num_requests_waiting": 0.0,
                                                      "num_samples": 6.0}) is None, \
        "an engine that queued nothing ran all it was sent: no evidence of a limit"
    assert concurrency.served_of(_metrics(5.0, 9.0), {"max_num_requests_running": 0.0,
                                                      "num_samples": 2.0}) is None, \
        "two samples of a short probe can miss its peak"
    rate = CapacitySearch("request_rate", low=1.0, high=64.0)
    assert rate.served_of(_metrics(7.5, 9.0), {"is_saturated": 1.0}) == 7.5
    assert rate.served_of(_metrics(7.5, 9.0), {"is_saturated": 0.0}) is None, \
        "a probe that kept up is no evidence of a limit"
    assert rate.served_of(_metrics(0.0, 0.0, completed=0), {"is_saturated": 1.0}) is None
    # A pass far above a served figure shows that figure was wrong: bisect, do not creep.
    assert rate.next_load([(64.0, False, 0.5), (1.0, True, None), (8.0, True, None)]) == \
        pytest.approx(22.6)


@pytest.mark.slow
def test_a_saturated_rate_probe_steers_the_search_on_the_simulated_engine(
        tmp_path: Path) -> None:
    # Eager decode of 8 sequences serves about 7 requests a second: 30/s saturates. Not 32
    # sequences at 400/s: in a CI run on a busy host the simulated server could not accept 400
    # connections a second and every measured request failed on its connect timeout (a miss,
    # rightly, but no saturation read: its /metrics went unanswered too); and under two
    # spinners a client reading ~2000 tokens a second sends late, near the engine's pace.
    # Three probes: the saturated one, the one it steers, and one asserted on by none (with two,
    # the second would go to low: while nothing has met, the last probe does). Steps sized
    # for the simulated engine: a 2 s warm-up (two lives of a request at the steered rate) and
    # a window of 40 requests, not 10 s and 10 s sized from the SLO.
    search = CapacitySearch("request_rate", low=1.0, high=30.0, tolerance=0.1, max_probes=3,
                            probe_duration_s=8.0, hold_s=0, warmup_s=2.0, min_window_s=2.0,
                            min_window_requests=40)
    workload = Workload(input_len=LengthDistribution(mean=128), output_len=LengthDistribution(
        mean=64), num_requests=600, num_warmup_requests=2, slo=SLO(tpot_p99_ms=50.0),
        capacity=search)
    config = EngineConfig("qwen2.5-7b", {"enforce_eager": True, "max_num_seqs": 8},
                          load_format="dummy", skip_tokenizer_init=True)
    result = simulated_run(tmp_path, config, workload)
    first, second = result.steps[:2]
    assert first.server_metrics["is_saturated"] == 1.0 and first.meets_slo is False
    served = search.served_of(first.metrics, first.server_metrics, mean_input_tokens=128,
                              mean_output_tokens=64)
    assert served is not None and second.level.request_rate_rps is not None
    # Not the log midpoint of [1, 30] (5.5, below the ~7 served): the served rate, within
    # the search's rounding.
    assert served / 1.1 <= second.level.request_rate_rps <= served * 1.001, \
        "the next probe goes to what the saturated one served, not to low"
    assert result.capacity is not None and result.capacity.missed_load is not None
    assert result.capacity.met_load is None or result.capacity.met_load < \
        result.capacity.missed_load


def test_a_flood_that_completed_nothing_is_read_from_the_servers_token_counters() -> None:
    from tests.optimizer.test_records import _metrics

    # 120 req/s of 2000-token prompts stopped after 4 s with nothing complete: the engine had
    # prefilled 160k tokens (20 req/s of prompts) and generated 12k tokens (94 req/s of 32).
    flood = replace(_metrics(0.0, 0.0, completed=0), duration_s=4.0)
    server = {"is_saturated": 1.0, "vllm:prompt_tokens_total": 160_000.0,
              "vllm:generation_tokens_total": 12_000.0}
    rate = CapacitySearch("request_rate", low=2.0, high=120.0)
    assert rate.served_of(flood, server, mean_input_tokens=2000,
                          mean_output_tokens=32) == pytest.approx(20.0)
    assert rate.served_of(flood, server) is None, "no lengths, nothing completed: unknown"
