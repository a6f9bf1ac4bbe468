"""An asyncio event loop on a virtual clock, for in-process code that times itself by
`loop.time()` and `asyncio.sleep` (the simulated engine): when nothing is ready the clock jumps
to the next timer instead of sleeping, as trio's `MockClock(autojump_threshold=0)` does. What
such code measures is then the same on any host, however busy, and takes no wall time."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls without waiting; a wait for a timer moves the loop's clock to it instead."""

    loop: VirtualTimeLoop

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if events:
            return events
        if timeout is None:  # no timer: waiting on I/O alone is a real wait
            return super().select(None)
        self.loop.now_s += max(0.0, timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self.now_s = 0.0  # virtual seconds since the loop was made

    def time(self) -> float:
        return self.now_s


def run_in_virtual_time(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a `VirtualTimeLoop`."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)
