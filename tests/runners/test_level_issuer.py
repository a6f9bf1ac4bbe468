"""A load level's issuer (runners/loadgen/level_driver.py) lets its event loop turn between two
sends, however late it runs: the level's requests (their connects, their chunks) and its
watchdog run on that loop."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from runners.load_level import LoadLevel
from runners.loadgen.clients import client_pool
from runners.loadgen.level_driver import LevelDriver
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
