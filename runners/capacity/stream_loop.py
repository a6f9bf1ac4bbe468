"""The end of the event loop a staircase's stream runs on (runners/capacity/driver.py runs it on
a thread of its own): `close_loop` cleans whatever a cancel left before the loop closes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


def close_loop(loop: asyncio.AbstractEventLoop,
               aclose: Callable[[], Awaitable[None]] | None = None) -> None:
    """Close `loop` once its run has ended, however it ended. Whatever a cancel left: tasks
    still pending, then `aclose` (the stream's clients, for a run that ended before it closed
    them; a second close of an httpx client is a no-op, which is why `ClientPool.aclose` itself
    runs to its end under a cancel), then the async generators."""
    with contextlib.suppress(Exception):
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    if aclose is not None:
        with contextlib.suppress(Exception):
            loop.run_until_complete(aclose())
    with contextlib.suppress(Exception):  # the streams' generators, closed in order
        loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
