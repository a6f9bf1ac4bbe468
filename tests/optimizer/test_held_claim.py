"""A held claim in the optimizer's words: the operating point is the hold where one held the
highest met load, and the conclusion says whether the bracket's lower end held."""

from __future__ import annotations

from optimizer.results.conclusion import capacity_text
from optimizer.results.objectives import operating_step
from runners.base import StepMetrics
from runners.capacity.bracket import Bracket, bracket_from_metrics
from runners.load_level import LoadLevel
from tests.builders import benchmark_metrics


def _step(index: int, load: float, met: bool, *, hold: bool = False) -> StepMetrics:
    metrics = benchmark_metrics(completed=150, duration_s=14.0, request_throughput=load,
                                request_goodput=load)
    return StepMetrics(step=index, level=LoadLevel(request_rate_rps=load), metrics=metrics,
                       server_metrics={"steady.is_hold": 1.0 if hold else 0.0}, meets_slo=met)


def test_the_operating_point_is_the_hold_at_the_highest_met_load() -> None:
    steps = [_step(0, 8.87, True), _step(1, 10.7, True), _step(2, 11.7, False),
             _step(3, 10.7, True, hold=True)]
    point = operating_step("goodput", steps)
    assert point is not None and point.step == 3 and point.is_hold


def test_the_conclusion_says_whether_the_claim_held() -> None:
    held = Bracket("request_rate", 10.7, 11.7, "resolved", 5, held=True)
    assert "held over a long window" in capacity_text(held, 0.1)
    unheld = Bracket("request_rate", 8.87, 9.74, "resolved", 7, held=False)
    assert "not held" in capacity_text(unheld, 0.1)
    assert "held" not in capacity_text(Bracket("request_rate", 10.7, 11.7, "resolved", 5), 0.1)


def test_a_logged_bracket_reads_back_whether_it_held() -> None:
    for held in (True, False, None):
        bracket = Bracket("request_rate", 10.7, 11.7, "resolved", 5, held=held)
        assert bracket_from_metrics("request_rate", bracket.as_metrics()) == bracket
