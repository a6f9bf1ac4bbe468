"""The end of the event loop a staircase's stream runs on (runners/capacity/driver.py runs it on
a thread of its own): `close_loop` cleans whatever a cancel left before the loop closes;
`cancel_and_wait`, a cancel of requests that waits for them a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

logger = logging.getLogger(__name__)

# s a stream's close waits for its cancelled tasks before the loop is closed anyway
CLOSE_WAIT_S = 20.0


async def cancel_and_wait(tasks: Collection[asyncio.Future[Any]], wait_s: float, *,
                          recancel_after_s: float = 2.0) -> set[asyncio.Future[Any]]:
    """Cancel `tasks` and wait up to `wait_s` (the loop's clock) for them to end; returns
    those still running then. One still running `recancel_after_s` in is cancelled once more:
    Python 3.11's `asyncio.wait_for` swallows a cancel that lands as its wait ends. A wait
    without a bound (`gather`) held a missed step's cancel past its caller's 30 s on a
    starved host (2026-12-07, CI's 2-core host at load 10), which failed the trial; a request
    that never ends must not hold the stream either."""
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    if not pending:
        return set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    _, pending = await asyncio.wait(pending, timeout=min(recancel_after_s, wait_s))
    for task in pending:
        task.cancel()
    remaining = deadline - loop.time()
    if pending and remaining > 0:
        _, pending = await asyncio.wait(pending, timeout=remaining)
    return pending


def close_loop(loop: asyncio.AbstractEventLoop,
               aclose: Callable[[], Awaitable[None]] | None = None) -> None:
    """Close `loop` once its run has ended, however it ended. Whatever a cancel left: tasks
    still pending (cancelled and waited for, `CLOSE_WAIT_S` at most), then `aclose` (the
    stream's clients, for a run that ended before it closed them; a second close of an httpx
    client is a no-op, which is why `ClientPool.aclose` itself runs to its end under a
    cancel), then the async generators."""
    with contextlib.suppress(Exception):
        left = loop.run_until_complete(cancel_and_wait(asyncio.all_tasks(loop), CLOSE_WAIT_S))
        if left:
            logger.warning("%d of the stream's tasks had not ended %g s after their cancel; "
                           "its loop is closed without them", len(left), CLOSE_WAIT_S)
    if aclose is not None:
        with contextlib.suppress(Exception):
            loop.run_until_complete(aclose())
    with contextlib.suppress(Exception):  # the streams' generators, closed in order
        loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
