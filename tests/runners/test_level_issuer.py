"""A load level's issuer (runners/loadgen/level_driver.py) lets its event loop turn between two
sends, however late it runs: the level's requests (their connects, their chunks) and its
watchdog run on that loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from runners.load_level import LoadLevel
from runners.loadgen.clients import client_pool
from runners.loadgen.level_driver import SERVER_GONE_ERROR, LevelDriver
from runners.loadgen.requests import RequestSpec

_SPEC = RequestSpec(prompt=[1, 2, 3], prompt_len=3, output_len=4)


class _TurnCountingRequests(list[RequestSpec]):
    """A level's requests; handing one out also schedules a callback on the loop, so that the
    next one can tell how many of the earlier ones' callbacks have run: one per turn of the
    loop between two sends."""

    def __init__(self, num: int) -> None:
        super().__init__([_SPEC] * num)
        self.num_run = 0
        self.runs_before_send: list[int] = []

    def __iter__(self) -> Iterator[RequestSpec]:
        for spec in super().__iter__():
            self.runs_before_send.append(self.num_run)
            asyncio.get_running_loop().call_soon(self._ran)
            yield spec

    def _ran(self) -> None:
        self.num_run += 1


def test_an_issuer_behind_its_schedule_lets_its_loop_turn_between_two_sends() -> None:
    """An issuer behind its schedule sent every late arrival in one turn of its loop, and their
    work then filled the next: 600 requests at 200 req/s under tracemalloc (sends costing more
    than their gaps) made turns of 10-21 s, and 5 connects to an accepting simulated engine
    timed out. Sent all at once (no rate), every arrival is due at the start: the issuer is
    behind from its first send."""
    requests = _TurnCountingRequests(20)

    async def level() -> None:
        driver = LevelDriver("http://127.0.0.1:9", "m", requests, LoadLevel(), timeout_s=5,
                             seed=0, duration_s=None, stop_event=None, stall_timeout_s=None)
        async with client_pool(None) as clients:  # port 9 refuses: the requests end at once
            outputs, _ = await driver.run(clients)
        assert len(outputs) == 20

    asyncio.run(level())
    assert requests.runs_before_send == list(range(20)), \
        ("a turn of the loop between every two sends (callbacks run before each: "
         f"{requests.runs_before_send})")


def test_a_sparse_rate_level_ends_once_its_server_stops_listening() -> None:
    """A "stop now" kills the engine, but a level at 0.0001 req/s (8 requests: ~22 h of
    arrivals) slept to its next arrival: nothing in flight to fail, nothing to stall, and the
    trial's worker answered the cancel only after its 120 s timeout. The issuer's long wait is
    watched: while the server listens the level goes on; once it refuses, the level ends."""

    async def level() -> tuple[LevelDriver, int]:
        accepted = 0

        def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        driver = LevelDriver(f"http://127.0.0.1:{port}", "m", [_SPEC] * 8,
                             LoadLevel(max_concurrency=8, request_rate_rps=0.0001),
                             timeout_s=5, seed=0, duration_s=None, stop_event=None,
                             stall_timeout_s=None)
        async with client_pool(None) as clients:
            run = asyncio.create_task(driver.run(clients))
            while driver.num_listen_checks < 2:  # the server listens: the level goes on
                await asyncio.sleep(0.05)
            assert not run.done()
            server.close()
            await server.wait_closed()
            # A guard against the hang (hours), not a bound the test measures.
            outputs, _ = await asyncio.wait_for(run, 60)
        assert outputs == []  # the first arrival was hours away: nothing was sent
        return driver, accepted

    driver, accepted = asyncio.run(level())
    assert driver.abort_reason == SERVER_GONE_ERROR
    assert accepted >= 1  # the checks while it listened connected, and were not taken as gone
