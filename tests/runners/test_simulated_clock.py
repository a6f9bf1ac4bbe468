"""The simulated engine's modelled clock keeps the wall's pace where the host keeps up: a step's
late wake-up is caught up by the next steps' shorter sleeps, never summed into the lag, so an
open loop's arrivals span on the modelled clock what their sends span on the client's. Run in
virtual time (tests/virtual_time.py) with every timer firing late, as a host's wake-ups do, so
the figures are the same on any host. A host that delivers the requests ever later spreads their
arrivals wider than their sends, and the staircase's window reads it as a load not applied
(runners/capacity/judge.py `modelled_load_off`). Properties of the simulated engine, never
measurements."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextvars import Context
from typing import TypeVarTuple, Unpack

import pytest

from runners.base import EngineConfig
from runners.capacity.driver import StaircaseDriver
from runners.capacity.judge import WindowCounts, judge_window, modelled_load_off
from runners.capacity.step import _counts
from runners.hardware import load_preset
from runners.loadgen.client import RequestOutput
from runners.simulated.engine import CATCH_UP_S, SimulatedEngine
from runners.simulated.settings import ServerSettings
from runners.workload import SLO
from tests.builders import benchmark_metrics
from tests.virtual_time import VirtualTimeLoop

# Every timer fires this late (seconds): the 0.85 ms a step measured on a quiet 2-core host
# (2026-12-06), against decode steps of 5-10 ms; before the catch-up it was summed into the
# lag at every step and 20 s of sends at 3 req/s read as 16.6 s of modelled arrivals.
LATE_S = 0.001
_Ts = TypeVarTuple("_Ts")


class _LateTimerLoop(VirtualTimeLoop):
    """A virtual clock on which every timer fires LATE_S after it was due."""

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object],
                *args: *_Ts, context: Context | None = None) -> asyncio.TimerHandle:
        return super().call_at(when + LATE_S, callback, *args, context=context)


def _engine() -> SimulatedEngine:
    """A simulated H200 with the Qwen2.5-7B shape (bench/repeat_stability.py's)."""
    return SimulatedEngine(ServerSettings(
        EngineConfig("qwen2.5-7b", load_format="dummy", skip_tokenizer_init=True),
        load_preset("h200"), port=0, startup_time_scale=1e-5))


async def _open_loop(engine: SimulatedEngine, rate_rps: float, num_requests: int,
                     stall: tuple[float, float] | None = None,
                     delivery_s: Callable[[int], float] | None = None,
                     ) -> tuple[list[float], list[float]]:
    """Send `num_requests` of 512 tokens in / 128 out at `rate_rps`, each on its schedule, to
    their last token; the sends on the loop's clock and the modelled arrivals. `stall`
    (after_s, for_s): the host stops the whole process for that long, once. `delivery_s(i)`:
    how long request i takes to reach the engine after its send (None: at once)."""
    loop = asyncio.get_running_loop()
    sends: list[float] = []
    arrivals: list[float] = []

    async def one(i: int) -> None:
        sends.append(loop.time())
        if delivery_s is not None:
            await asyncio.sleep(delivery_s(i))
        ids = [10 + (7 * i + k) % 30_000 for k in range(512)]
        async for event in engine.generate(ids, 128):
            if event.is_first:
                arrivals.append(event.request.arrival_s)

    async def stop_the_host(after_s: float, for_s: float) -> None:
        await asyncio.sleep(after_s)
        assert isinstance(loop, VirtualTimeLoop)
        loop.now_s += for_s  # every timer now fires that much late

    start = loop.time()
    tasks = [asyncio.create_task(stop_the_host(*stall))] if stall else []
    for i in range(num_requests):
        await asyncio.sleep(max(0.0, start + i / rate_rps - loop.time()))
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return sends, arrivals


def _serve(rate_rps: float, num_requests: int, stall: tuple[float, float] | None = None,
           delivery_s: Callable[[int], float] | None = None,
           ) -> tuple[list[float], list[float], float]:
    async def main() -> tuple[list[float], list[float], float]:
        engine = _engine()
        assert await engine.start() is None
        try:
            sends, arrivals = await _open_loop(engine, rate_rps, num_requests, stall,
                                               delivery_s)
            return sends, arrivals, engine.replicas[0].lag_s
        finally:
            for replica in engine.replicas:
                if replica.task is not None:
                    replica.task.cancel()

    with asyncio.Runner(loop_factory=_LateTimerLoop) as runner:
        return runner.run(main())


@pytest.mark.parametrize("rate_rps", [3.0, 12.0])
def test_a_light_open_loop_arrives_over_its_send_span_on_the_modelled_clock(
        rate_rps: float) -> None:
    sends, arrivals, lag_s = _serve(rate_rps, int(10 * rate_rps))
    sent_span_s = max(sends) - min(sends)
    modelled_span_s = max(arrivals) - min(arrivals)
    assert modelled_span_s == pytest.approx(sent_span_s, rel=0.01), (
        f"{sent_span_s:.3f} s of sends arrived over {modelled_span_s:.3f} s of modelled time "
        f"(lag {lag_s:.3f} s): the steps' late wake-ups slowed the modelled clock")


def test_a_host_stall_longer_than_the_catch_up_bound_is_lag_beyond_it() -> None:
    """The host stops the process for 2 s mid-level: the loop catches up CATCH_UP_S of it by
    stepping without sleeping, and the rest is the host's (lag), not raced through."""
    stall_s = 2.0
    *_, lag_s = _serve(3.0, 30, stall=(4.0, stall_s))
    assert lag_s == pytest.approx(stall_s - CATCH_UP_S, abs=0.02), (
        f"a {stall_s} s stall left {lag_s:.3f} s of lag")


def _window(sends: list[float], arrivals: list[float]) -> WindowCounts:
    """The staircase's counts of a window of these requests (runners/capacity/step.py), read
    as the client reads them: each send on its clock, each modelled arrival from the server.
    Sends and arrivals pair in order: requests reach the engine in the order they were sent."""
    outputs = [RequestOutput(success=True, start_time=s, modelled_span_s=(a, a + 1.0))
               for s, a in zip(sorted(sends), sorted(arrivals), strict=True)]
    with StaircaseDriver("http://127.0.0.1:9", "model", iter(()), axis="request_rate",
                         timeout_s=1.0, seed=0) as driver:
        return _counts(driver, [], min(sends), max(sends), outputs, outputs)


def test_requests_delivered_ever_later_are_a_load_not_applied_and_on_time_they_are_not(
) -> None:
    """A host starved further delivers the requests ever later (one core shared with three
    spinning processes, 2026-12-06: the send-to-stamp delay grew from 7 ms to 860 ms over 8 s):
    the engine stamps them as they reach it, so 10 s of sends at 12 req/s whose delay grows to
    1.2 s arrive over 11.2 s on its modelled clock, a lighter load than sent by more than the
    tolerance (10%). Delivered at once, with every timer late, they arrive as sent."""
    on_time = _window(*_serve(12.0, 120)[:2])
    assert modelled_load_off(on_time, tolerance=0.1) is None
    assert on_time.sent_span_s is not None and \
        on_time.window_s == pytest.approx(on_time.sent_span_s, rel=0.01)
    starved = _window(*_serve(12.0, 120, delivery_s=lambda i: 0.007 + 0.01 * i)[:2])
    reason = modelled_load_off(starved, tolerance=0.1)
    assert reason is not None and reason.startswith(
        "load not applied: the simulated engine received 10.7 req/s on its modelled clock "
        "where the client sent 12 "), reason
    # Through the step's judge: percentiles that meet the SLO at that lighter load are no met.
    verdict = judge_window(benchmark_metrics(p99_tpot_ms=6.3, completed=starved.num_sent),
                           starved, SLO(tpot_p99_ms=15), max_failed_fraction=0.05,
                           tolerance=0.1, min_requests=40, min_window_s=5.0)
    assert not verdict.meets_slo and verdict.is_load_unapplied and verdict.reason == reason
