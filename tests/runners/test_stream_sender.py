"""The staircase's stream sender (runners/capacity/driver.py) lets its event loop turn between
two sends, however late it runs: the stream's requests, their connects and a cancel of them
all run on that loop."""

from __future__ import annotations

import asyncio
import itertools
import threading

from runners.capacity.driver import StaircaseDriver
from runners.loadgen.requests import RequestSpec

_SPEC = RequestSpec(prompt=[1, 2, 3], prompt_len=3, output_len=4)


class _TurnCountingRequests:
    """The stream's requests; each one handed out also schedules a callback on the loop, so
    that the next one can tell how many of the earlier ones' callbacks have run: one per turn
    of the loop between two sends."""

    def __init__(self, num_wanted: int) -> None:
        self.num_run = 0
        self.runs_before_send: list[int] = []
        self.enough = threading.Event()
        self._num_wanted = num_wanted

    def __iter__(self) -> _TurnCountingRequests:
        return self

    def __next__(self) -> RequestSpec:
        self.runs_before_send.append(self.num_run)
        asyncio.get_running_loop().call_soon(self._ran)
        if len(self.runs_before_send) >= self._num_wanted:
            self.enough.set()
        return _SPEC

    def _ran(self) -> None:
        self.num_run += 1


def test_a_stream_behind_its_schedule_lets_its_loop_turn_between_two_sends() -> None:
    """A sender behind its schedule sent up to a second of arrivals in one turn of its loop,
    each send's work then falling into the next: where sends cost more than their gaps (a
    starved host, tracemalloc: 300 req/s asked, 22 sent) the turns grew to 5-16 s, nothing
    ended, and `cancel_in_flight` (six turns) ran past its 30 s. The clock here moves 20 ms a
    read at 100 req/s (gaps of 10 ms): the sender is always behind."""
    requests = _TurnCountingRequests(num_wanted=20)
    ticks = itertools.count()
    driver = StaircaseDriver("http://127.0.0.1:9", "m", requests, axis="request_rate",
                             timeout_s=5, seed=0, clock=lambda: 0.02 * next(ticks))
    driver.start(100.0)  # port 9 refuses: the requests end at once
    try:
        assert requests.enough.wait(timeout=60.0), "20 sends"
    finally:
        driver.close()
    first = requests.runs_before_send[:20]
    assert first == list(range(20)), \
        f"a turn of the loop between every two sends (callbacks run before each: {first})"
