"""The level path (fixed levels, a trace's probes, multi-turn conversations) to the staircase's
standard: its requests spread over the shared client pool, and a level whose client did not
carry its load (a closed loop short of its concurrency, an open loop that sent late) judged
"load not applied"; a multi-turn loop judged while every slot still had conversations, and not
at all (its record says so) where that span was too short. Real HTTP against the echo engine (a
subprocess with known TTFT and TPOT) and the simulated engine; the rule itself on send logs
with their times given."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import pytest

from runners.applied_load import TOO_SHORT_KEY, UNAPPLIED_KEY, judge_level_load
from runners.conversations import run_conversations_sync
from runners.datasets import Conversation, Turn
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput
from runners.loadgen.level import run_level_sync
from runners.loadgen.requests import RequestSpec
from runners.loadgen.send_log import SendLog
from runners.workload import SLO
from tests.builders import echo_engine, simulated_engine


@pytest.fixture(scope="module")
def echo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with echo_engine(tmp_path_factory.mktemp("echo"), ttft_ms=20, tpot_ms=5) as url:
        yield url


def _specs(num: int, output_len: int) -> list[RequestSpec]:
    return [RequestSpec(prompt=list(range(10, 18)), prompt_len=8, output_len=output_len)
            for _ in range(num)]


class _Starved(Sequence[RequestSpec]):
    """Requests whose iteration blocks the level's event loop `block_s` at each send, as a host
    whose other work starves the client does."""

    def __init__(self, specs: list[RequestSpec], block_s: float) -> None:
        self._specs = specs
        self._block_s = block_s

    @overload
    def __getitem__(self, index: int) -> RequestSpec: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[RequestSpec]: ...
    def __getitem__(self, index: int | slice) -> RequestSpec | Sequence[RequestSpec]:
        return self._specs[index]

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[RequestSpec]:
        for spec in self._specs:
            time.sleep(self._block_s)
            yield spec


# -- the client pool -------------------------------------------------------------------------

def test_a_levels_requests_are_spread_over_clients_of_at_most_32_in_flight(
        tmp_path: Path) -> None:
    """As the staircase's stream: one httpx client for 100 requests in flight spends its CPU
    walking its connections (runners/loadgen/clients.py); the level's go out on clients of
    32 each. (The issuer turns its loop between two sends, so on a busy host the echo's first
    replies could end before the hundredth send at 220 ms a request: 60 in flight at most in
    one CI run, and 64 at 2 s a request with a CPU-bound process beside it. At 6 s a request
    of 1200 tokens streamed one a chunk, 120,000 chunks cost both sides so much CPU that on a
    2-core host running four test workers at most 50 overlapped (2026-12-07, three runs). So
    each request's 6 s is its first token's wait, with 4 tokens after: the hundred overlap
    on any host that sends 100 requests in 6 s; the most in flight sets the count.)"""
    with echo_engine(tmp_path, ttft_ms=6000, tpot_ms=5) as slow_url:
        result = run_level_sync(slow_url, "echo", _specs(100, 4),
                                LoadLevel(max_concurrency=100), SLO(), timeout_s=30, seed=0)
    assert result.metrics.completed == 100 and result.sends is not None
    most = result.metrics.max_concurrency_seen
    assert most > 64, "several clients' worth in flight at once"
    assert result.sends.num_clients == math.ceil(most / 32), \
        f"{most} requests in flight on clients of at most 32"


# -- a closed loop that did not hold its concurrency -----------------------------------------

def test_a_starved_closed_loop_level_is_a_load_not_applied(echo_url: str) -> None:
    """The client's loop blocked 20 ms at each send refills at most 50 requests a second, where
    32 requests of about 70 ms each need over 400: it held a few, not 32. Its figures are of
    that lighter load; the level is not a measurement at concurrency 32."""
    level = LoadLevel(max_concurrency=32)
    result = run_level_sync(echo_url, "echo", _Starved(_specs(96, 10), 0.02), level,
                            SLO(tpot_p99_ms=1000.0), timeout_s=30, seed=0)
    assert result.metrics.failed == 0
    applied = judge_level_load(level, result.sends, result.outputs, (), tolerance=0.05)
    assert applied.reason is not None and applied.reason.startswith("load not applied: "), \
        applied
    assert "of 32 requests in flight" in applied.reason
    assert applied.as_server_metrics()[UNAPPLIED_KEY] == 1.0


def test_a_closed_loop_is_judged_between_the_send_that_filled_it_and_the_last() -> None:
    """The first 4 go out at once and after the last send the loop drains: neither is the
    load. Over the span between, the client held 4, but the server's running + waiting read 2
    (its samples outside the span are not read)."""
    sends = SendLog()
    for t in (0.0, 0.0, 0.0, 0.0):
        sends.record_send(t, None)
    sends.record_in_flight(0.0, 4)
    for t in (1.0, 2.0, 3.0, 4.0):
        sends.record_send(t, None)
    sends.record_in_flight(4.5, 3)
    sends.record_in_flight(5.0, 0)
    level = LoadLevel(max_concurrency=4)

    def sample(t: float, running: float) -> tuple[float, dict[str, float]]:
        return t, {"vllm:num_requests_running": running, "vllm:num_requests_waiting": 0.0}

    starved = [sample(-1.0, 4.0), sample(1.0, 2.0), sample(2.5, 2.0), sample(3.5, 2.0),
               sample(4.8, 0.0)]
    applied = judge_level_load(level, sends, [], starved, tolerance=0.05)
    assert applied.reason == ("load not applied: the server held 2 of 4 requests (running + "
                              "waiting, 3 samples) over the 4 s window; the SLO is not shown "
                              "at 4")
    held = [sample(1.0, 4.0), sample(2.5, 4.0), sample(3.5, 4.0), sample(4.8, 0.0)]
    assert judge_level_load(level, sends, [], held, tolerance=0.05).reason is None, \
        "the drain after the last send is not the load"
    at_once = SendLog()
    for _ in range(4):
        at_once.record_send(0.0, None)
    assert judge_level_load(level, at_once, [], starved, tolerance=0.05).reason is None, \
        "a loop sent all at once never refilled: nothing to judge"


# -- an open loop that sent late -------------------------------------------------------------

def test_a_starved_open_loop_level_sent_late_and_is_a_load_not_applied(echo_url: str) -> None:
    """At 200 req/s (a gap of 5 ms) a client blocked 20 ms at each send falls further behind
    with each: its arrivals are not the process it was asked to offer."""
    level = LoadLevel(request_rate_rps=200.0)
    result = run_level_sync(echo_url, "echo", _Starved(_specs(60, 4), 0.02), level,
                            SLO(), timeout_s=30, seed=0)
    applied = judge_level_load(level, result.sends, result.outputs, (), tolerance=0.05)
    assert applied.reason is not None and applied.reason.startswith(
        "load not applied: the client sent "), applied
    assert "ms late" in applied.reason


def test_an_open_loop_is_late_only_past_a_mean_gap_and_a_capped_wait_is_not_lateness() -> None:
    """Due every 0.1 s (10 req/s): a send 50 ms late is within a gap, one 150 ms late is not.
    A capped rate that waited for a slot is late only from when the slot freed."""
    level = LoadLevel(request_rate_rps=10.0)
    on_time = SendLog()
    for k in range(20):
        on_time.record_send(k * 0.1 + 0.05, k * 0.1)
    assert judge_level_load(level, on_time, [], (), tolerance=0.05).reason is None
    late = SendLog()
    for k in range(20):
        late.record_send(k * 0.1 + (0.15 if k % 4 == 0 else 0.0), k * 0.1)
    reason = judge_level_load(level, late, [], (), tolerance=0.05).reason
    assert reason == ("load not applied: the client sent 25% of its requests more than 100 ms "
                      "late (5 of 20); the SLO is not shown at this load")
    capped = SendLog()
    for k in range(20):  # each waited for a slot freed at 1.0 + k x 0.1, then went at once
        capped.record_send(1.0 + k * 0.1 + 0.001, k * 0.1, free_from_s=1.0 + k * 0.1)
    assert judge_level_load(LoadLevel(request_rate_rps=10.0, max_concurrency=2), capped, [],
                            (), tolerance=0.05).reason is None


def test_on_a_modelled_clock_a_closed_loop_is_judged_by_the_servers_own_spans() -> None:
    """The simulated engine's latencies are on its modelled clock, so its applied load is too:
    the client's own log held 2 throughout, but the server's spans leave it idle from 1 s to
    3 s of the span between the loop's filling arrival and its last (a third of 2 on average)."""
    sends = SendLog()
    for t in (0.0, 0.0, 1.0, 1.0):
        sends.record_send(t, None)
    sends.record_in_flight(0.0, 2)
    spans = [(0.0, 1.0), (0.0, 1.0), (3.0, 4.0), (3.0, 4.0)]
    outputs = [RequestOutput(success=True, modelled_span_s=s) for s in spans]
    applied = judge_level_load(LoadLevel(max_concurrency=2), sends, outputs, (), 0.05)
    assert applied.reason == ("load not applied: 0.667 of 2 requests in flight on average over "
                              "the 3 s window; the SLO is not shown at 2")
    assert judge_level_load(LoadLevel(max_concurrency=2), sends, outputs[:2] + [
        RequestOutput(success=True, modelled_span_s=(1.0, 2.0))] * 2, (), 0.05).reason is None, \
        "refilled at each end on the modelled clock: the load was held"


# -- multi-turn: a closed loop whose slots run out of conversations at different times ------

def _sample(t: float, running: float) -> tuple[float, dict[str, float]]:
    return t, {"vllm:num_requests_running": running, "vllm:num_requests_waiting": 0.0}


def _multi_turn_sends(first_slot_end_s: float) -> SendLog:
    """Four slots fill at 0 and refill at 1, 2, 3 and 4 s; the first runs out of conversations
    at `first_slot_end_s`, the others one a second after it, the last sending at 7 s: from the
    first slot's end the loop drains, whatever its later sends."""
    sends = SendLog()
    for _ in range(4):
        sends.record_send(0.0, None)
    sends.record_in_flight(0.0, 4)
    for t in (1.0, 2.0, 3.0, 4.0, 6.0, 7.0):
        sends.record_send(t, None)
    for k in range(4):
        sends.record_slot_end(first_slot_end_s + k)
        sends.record_in_flight(first_slot_end_s + k, 3 - k)
    return sends


def test_a_multi_turn_loop_is_judged_until_its_first_slot_ran_out_of_conversations() -> None:
    """The client held 4 until the first slot ran dry at 4.5 s, then 3, 2, 1: judged to its
    last send (7 s) the loop would read 3.4 of 4 in flight and the server's count 2.5, a load
    "not applied" that is only its slots running out. Judged to 4.5 s, it held 4; a server that
    ran 2 in that span did not."""
    level = LoadLevel(max_concurrency=4)
    sends = _multi_turn_sends(4.5)
    held = [_sample(1.0, 4.0), _sample(2.5, 4.0), _sample(4.0, 4.0), _sample(5.0, 3.0),
            _sample(6.0, 2.0), _sample(6.8, 1.0)]
    applied = judge_level_load(level, sends, [], held, tolerance=0.05)
    assert applied.reason is None and applied.note is None, applied
    assert applied.figures["applied.window_s"] == 4.5
    assert applied.figures["applied.mean_in_flight"] == 4.0
    starved = [_sample(1.0, 2.0), _sample(2.5, 2.0), _sample(4.0, 2.0), _sample(6.0, 2.0)]
    applied = judge_level_load(level, sends, [], starved, tolerance=0.05)
    assert applied.reason == ("load not applied: the server held 2 of 4 requests (running + "
                              "waiting, 3 samples) over the 4.5 s window; the SLO is not "
                              "shown at 4")
    assert applied.as_server_metrics()[UNAPPLIED_KEY] == 1.0, \
        "recorded as a fixed level's and a staircase step's unapplied load are"


def test_a_multi_turn_loop_too_short_to_judge_is_not_judged_and_its_record_says_so() -> None:
    """A slot ran dry at 2.5 s, after 2 refills of a loop of 4 slots: most slots never turned
    around while it was full, so their time in flight says nothing of the client; a loop that
    had fewer conversations than slots never filled. Neither is read as applied or not: the
    record says it was too short to judge."""
    level = LoadLevel(max_concurrency=4)
    starved = [_sample(1.0, 1.0), _sample(2.0, 1.0)]
    applied = judge_level_load(level, _multi_turn_sends(2.5), [], starved, tolerance=0.05)
    assert applied.reason is None
    assert applied.note is not None and applied.note.startswith(
        "applied load not judged: the loop held its 4 slots for 2.5 s with 2 refill(s)"), \
        applied.note
    metrics = applied.as_server_metrics()
    assert metrics[TOO_SHORT_KEY] == 1.0 and UNAPPLIED_KEY not in metrics
    assert metrics["applied.num_refills"] == 2.0
    never_full = SendLog()  # 3 conversations of 3 turns for 4 slots: one slot had none
    never_full.record_slot_end(0.0)
    for t in (0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0):
        never_full.record_send(t, None)
    for t in (3.0, 3.0, 3.0):
        never_full.record_slot_end(t)
    applied = judge_level_load(level, never_full, [], starved, tolerance=0.05)
    assert applied.reason is None and applied.as_server_metrics()[TOO_SHORT_KEY] == 1.0


def test_on_a_modelled_clock_a_multi_turn_loop_ends_with_its_first_slots_last_request() -> None:
    """On the simulated engine's clock the span ends where the first slot's last request
    ended (3 s), not at the last arrival (4 s): over [0, 3] both slots were in flight, where
    to 4 s the one slot left would read as 1.75 of 2."""
    sends = SendLog()
    for t in (0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0):
        sends.record_send(t, None)
    sends.record_slot_end(3.0, 3.0)
    sends.record_slot_end(5.0, 5.0)
    spans = [(0.0, 1.0), (0.0, 1.0), (1.0, 2.0), (1.0, 2.0), (2.0, 3.0), (2.0, 3.0),
             (3.0, 4.0), (4.0, 5.0)]
    outputs = [RequestOutput(success=True, modelled_span_s=s) for s in spans]
    applied = judge_level_load(LoadLevel(max_concurrency=2), sends, outputs, (), 0.05)
    assert applied.reason is None, applied
    assert (applied.figures["applied.window_s"], applied.figures["applied.mean_in_flight"]) == \
        (3.0, 2.0)


class _StarvedTurns(tuple[Turn, ...]):
    """A conversation's turns whose iteration blocks the level's event loop 20 ms before each
    turn, as a host whose other work starves the client does."""

    def __iter__(self) -> Iterator[Turn]:
        for turn in super().__iter__():
            time.sleep(0.02)
            yield turn


def test_a_starved_multi_turn_level_on_the_simulated_engine_is_a_load_not_applied(
        tmp_path: Path) -> None:
    """16 slots of conversations whose client blocks 20 ms before each turn: it sends at most
    50 turns a second where 16 slots of turns of about 0.1 s need over 150. Every slot had
    conversations left for most of the level, so the span is long enough to judge, and the
    server's own spans show it held a few of 16."""
    user = Turn("Name a river that crosses more than one country, please.", 14, 8)
    dialogues = [Conversation(f"c{k}", _StarvedTurns((user, user, user)), is_estimated=True)
                 for k in range(48)]
    level = LoadLevel(max_concurrency=16)
    with simulated_engine(tmp_path) as url:
        result, turns, _ = run_conversations_sync(url, "model", dialogues, level,
                                                  SLO(tpot_p99_ms=1000.0), timeout_s=30)
    assert result.metrics.failed == 0 and len(turns) == 48 * 3
    assert result.sends is not None and len(result.sends.slot_ends_s) == 16, \
        "each slot says when it ran out of conversations"
    applied = judge_level_load(level, result.sends, result.outputs, (), tolerance=0.05)
    assert applied.note is None, applied.note
    assert applied.reason is not None and applied.reason.startswith("load not applied: "), \
        applied
    assert "of 16 requests in flight" in applied.reason
    assert applied.as_server_metrics()[UNAPPLIED_KEY] == 1.0


# -- a trace's capacity probe, end to end on the simulated engine ----------------------------

def test_a_trace_probe_whose_client_sent_late_has_not_met_and_ends_no_bracket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole level path: a probe at 40 req/s whose client blocks 50 ms at each send (a
    starved host) sends late, so it has not met the SLO at 40, whatever its percentiles, and
    the bracket names 40 as a load not measured. The starving is patched in by string path
    (`runners.levels.run_level_sync`): the level builds its own requests, and a starved host
    cannot be made on purpose otherwise."""
    from runners.base import EngineConfig
    from runners.capacity.search import CapacitySearch
    from runners.engine import EngineRunner
    from runners.simulated.launcher import SimulatedLauncher
    from runners.workload import LengthDistribution, TraceReplay, Workload

    real = run_level_sync  # the function runners.levels imported

    def starved(base_url: str, model: str, requests: Sequence[RequestSpec],
                *args: object, **kwargs: object) -> object:
        return real(base_url, model, _Starved(list(requests), 0.05), *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("runners.levels.run_level_sync", starved)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(f'{{"timestamp": {0.1 * k}, "input_length": 16, '
                             f'"output_length": 2}}\n' for k in range(40)))
    search = CapacitySearch("request_rate", low=1.0, high=40.0, max_probes=1,
                            probe_duration_s=1.0)
    workload = Workload(output_len=LengthDistribution(mean=2), num_requests=None,
                        num_warmup_requests=0, slo=SLO(tpot_p99_ms=1000.0),
                        trace=TraceReplay(trace), capacity=search)
    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", stall_timeout_s=30.0)
    try:
        result = runner.run(EngineConfig("qwen2.5-0.5b", {"max_model_len": 4096},
                                         load_format="dummy", skip_tokenizer_init=True),
                            workload, tmp_path / "trial")
    finally:
        runner.close()
    assert result.status == "complete", result.failure
    (probe,) = result.steps
    assert probe.is_load_unapplied and not probe.meets_slo
    assert probe.miss_reason is not None and probe.miss_reason.startswith(
        "load not applied: the client sent "), probe.miss_reason
    assert result.capacity is not None and result.capacity.unapplied_load == 40.0 and \
        result.capacity.met_load is None, result.capacity
