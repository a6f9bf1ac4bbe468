"""The staircase's profiled window (runners/capacity/profile_window.py) on a scripted stream
and clock: what it covers does not depend on how promptly the host sends."""

from __future__ import annotations

import types
from collections.abc import Callable

import pytest

from runners.capacity import step as step_module
from runners.capacity.plan import StepPlan
from runners.capacity.profile_window import profile_window


class _ScriptedStream:
    """A stand-in for `StaircaseDriver` on a scripted clock: its sends are at `send_times`
    (seconds), known only once the clock has passed them; `time.sleep` advances the clock."""

    axis = "request_rate"

    def __init__(self, load: float, send_times: list[float]) -> None:
        self.load = load
        self.clock_s = 100.0
        self.send_times = send_times
        self.profile_calls: list[tuple[str, float]] = []

    def now(self) -> float:
        return self.clock_s

    def sleep(self, seconds: float) -> None:
        self.clock_s += max(seconds, 1e-3)

    def set_load(self, load: float) -> None:
        self.load = load

    def sent_between(self, start_s: float, end_s: float) -> list[float]:
        return [t for t in self.send_times if start_s <= t < min(end_s, self.clock_s)]

    def num_ended_between(self, start_s: float, end_s: float) -> int:
        return 0

    def mean_in_flight(self, start_s: float, end_s: float) -> float:
        return 4.0

    def num_in_flight(self) -> int:
        return 4

    def mark(self, what: str) -> Callable[[], None]:
        return lambda: self.profile_calls.append((what, self.clock_s))


@pytest.mark.parametrize("late_s", [0.0, 2.0])
def test_a_profiled_window_stays_open_until_its_requests_were_sent(
        monkeypatch: pytest.MonkeyPatch, late_s: float) -> None:
    """At 64 req/s a window of 40 requests is planned at 0.625 s. A sender that runs 2 s late
    (a starved host) sent none of them in it on the CI's host: the window stays open until
    all 40 were sent, and says how long it ran; a prompt sender's window keeps its plan."""
    rate, num = 64.0, 40
    window_start = 100.0  # the scripted clock's start: the stream has run at `rate` since 90
    sends = [window_start + late_s + k / rate for k in range(200)]
    stream = _ScriptedStream(rate, sends)
    monkeypatch.setattr(step_module, "time", types.SimpleNamespace(sleep=stream.sleep))
    plan = StepPlan(load=rate, warmup_s=1.0, window_s=2.0, lifetime_s=0.5,
                    expected_requests=128.0)
    window = profile_window(
        stream, plan, since_s=90.0, num_requests=num, is_operating_point=True,  # type: ignore[arg-type]
        check_engine=lambda: None, start_profile=stream.mark("start"),
        stop_profile=stream.mark("stop"))
    assert window.num_sent >= num, window
    assert [what for what, _ in stream.profile_calls] == ["start", "stop"]
    planned_s = num / rate
    if late_s:
        assert window.window_s >= late_s + (num - 1) / rate, "open until the 40th was sent"
        assert window.window_s < late_s + planned_s + 0.5, "and closed soon after"
    else:
        assert window.window_s == pytest.approx(planned_s, abs=0.25), "its planned length"


def test_a_profiled_window_of_a_stream_that_sends_nothing_ends_at_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that sends nothing (its sender stuck) does not hold the profiler open for
    ever: the window ends at four times its plan or 10 s past it, and says it sent none."""
    stream = _ScriptedStream(64.0, [])
    monkeypatch.setattr(step_module, "time", types.SimpleNamespace(sleep=stream.sleep))
    plan = StepPlan(load=64.0, warmup_s=1.0, window_s=2.0, lifetime_s=0.5,
                    expected_requests=128.0)
    window = profile_window(
        stream, plan, since_s=90.0, num_requests=40, is_operating_point=True,  # type: ignore[arg-type]
        check_engine=lambda: None, start_profile=stream.mark("start"),
        stop_profile=stream.mark("stop"))
    assert window.num_sent == 0
    assert 40 / 64.0 + 10.0 <= window.window_s < 40 / 64.0 + 10.5
