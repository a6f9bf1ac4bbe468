"""One load level: `run_level` checks its arguments, has a `LevelDriver`
(runners/loadgen/level_driver.py) send the level's requests at its rate or concurrency (or a
trace's times) and watch for stalls and stop requests, and returns its figures (`LevelResult`);
`run_level_sync` is the same for callers that are threads."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from runners import arrivals
from runners.base import BenchmarkMetrics
from runners.load_level import LoadLevel
from runners.loadgen.client import RequestOutput
from runners.loadgen.clients import client_pool
from runners.loadgen.level_driver import (
    SERVER_GONE_ERROR,
    STALLED_ERROR,
    STOPPED_ERROR,
    LevelDriver,
    StopFlag,
)
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.modelled_clock import modelled_level_duration_s
from runners.loadgen.requests import RequestSpec
from runners.loadgen.send_log import SendLog
from runners.workload import SLO

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass(frozen=True)
class LevelResult:
    """One load level: its figures and every request's output, in issue order."""

    metrics: BenchmarkMetrics
    outputs: list[RequestOutput]
    stalled: bool = False  # no chunk from any in-flight request for stall_timeout_s: a hang
    stopped: bool = False  # stop_event ended the level early; not a measurement
    # The server stopped listening while the level waited for an arrival: not a measurement
    # (the engine is gone, or going), whatever its process says at that instant.
    server_gone: bool = False
    # The server declared a modelled clock (the simulated engine) and the figures, duration
    # included, are on it: a model's times, never a measurement.
    is_modelled_clock: bool = False
    # The client's sends and in-flight count (runners/applied_load.py judges from them whether
    # the level applied its load); None where no level ran (a result built by hand)
    sends: SendLog | None = None


def _check_level_args(requests: Sequence[RequestSpec], level: LoadLevel, timeout_s: float,
                      duration_s: float | None, stall_timeout_s: float | None) -> None:
    if not requests:
        raise ValueError("run_level needs at least one request but got none.")
    rate = level.request_rate_rps
    if rate is not None and not rate > 0:
        raise ValueError(f"request_rate_rps must be > 0 (None = all at once) but got {rate}.")
    if level.max_concurrency is not None and level.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 but got {level.max_concurrency}.")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 but got {timeout_s}.")
    if stall_timeout_s is not None and not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0 but got {stall_timeout_s}.")
    if duration_s is not None:
        if not duration_s > 0:
            raise ValueError(f"duration_s must be > 0 but got {duration_s}.")
        if (rate is None or math.isinf(rate)) and level.max_concurrency is None:
            raise ValueError(
                "a duration-bound level needs a request rate or a max concurrency, "
                "but got neither; set one of them."
            )


async def run_level(
    base_url: str,
    model: str,
    requests: Sequence[RequestSpec],
    level: LoadLevel,
    slo: SLO,
    *,
    timeout_s: float,
    seed: int,
    stop_event: StopFlag | None = None,
    stall_timeout_s: float | None = None,
    duration_s: float | None = None,
    max_duration_s: float | None = None,
    burstiness: float | None = None,
    send_offsets_s: Sequence[float] | None = None,
    api_key: str | None = None,
) -> LevelResult:
    """Drive one load level against an OpenAI-compatible server and measure it.

    Requests arrive at `level.request_rate_rps` (all at once when None), with gamma gaps of
    shape `burstiness` (default: the level's, else 1 = Poisson; runners/arrivals.py), at most
    `level.max_concurrency` in flight. `send_offsets_s` (a trace replay) gives each request's
    send time instead, in seconds from the level's start, one per request, non-decreasing.
    Without `duration_s` each request is sent once; with it, requests cycle and no new one is
    sent after `duration_s` (those in flight finish).
    `max_duration_s` bounds a request-bound level by time too: each request is sent at most
    once, and none after `max_duration_s` (a light capacity probe must not take minutes).
    `stop_event` (checked every 50 ms) or a stall (no chunk from any in-flight request for
    `stall_timeout_s`) cancels the requests in flight; they come back failed, with the error
    "stopped" or "stalled", and the result says which. `api_key` is the engine's (sent as a
    bearer token). Raises only ValueError, for bad arguments.
    """
    _check_level_args(requests, level, timeout_s, duration_s, stall_timeout_s)
    if max_duration_s is not None and not max_duration_s > 0:
        raise ValueError(f"max_duration_s must be > 0 but got {max_duration_s}.")
    if burstiness is None:
        burstiness = level.burstiness if level.burstiness is not None else 1.0
    arrivals.check_burstiness(burstiness)
    if send_offsets_s is not None:
        if duration_s is not None:
            raise ValueError("a trace replay sends each request once; bound it with "
                             "max_duration_s, not duration_s.")
        if len(send_offsets_s) != len(requests) or any(
                not math.isfinite(t) or t < 0 for t in send_offsets_s) or any(
                b < a for a, b in itertools.pairwise(send_offsets_s)):
            raise ValueError(f"send_offsets_s must hold {len(requests)} finite, non-negative, "
                             "non-decreasing times, one per request.")
    driver = LevelDriver(base_url, model, requests, level, timeout_s=timeout_s, seed=seed,
                         duration_s=duration_s, stop_event=stop_event,
                         stall_timeout_s=stall_timeout_s, max_duration_s=max_duration_s,
                         burstiness=burstiness, send_offsets_s=send_offsets_s)
    # The requests spread over clients of a few dozen each, as the staircase's stream
    # (runners/loadgen/clients.py: one client's pool spends its CPU walking its connections).
    async with client_pool(api_key) as clients:
        outputs, duration = await driver.run(clients)
        driver.sends.num_clients = clients.num_clients
    modelled_s = modelled_level_duration_s(outputs, driver.sent_offsets_s)
    is_modelled = modelled_s is not None
    if modelled_s is not None:
        duration = modelled_s
    metrics = compute_metrics(outputs, duration, slo, max_concurrency_seen=driver.max_in_flight)
    logger.info(
        "level %s: %d completed, %d failed in %.1f s%s, %.2f req/s, %.1f output tok/s%s",
        level.label, metrics.completed, metrics.failed, duration,
        " (the server's modelled clock)" if is_modelled else "", metrics.request_throughput,
        metrics.output_throughput,
        f" ({driver.abort_reason})" if driver.abort_reason else "",
    )
    return LevelResult(
        metrics=metrics,
        outputs=outputs,
        stalled=driver.abort_reason == STALLED_ERROR,
        stopped=driver.abort_reason == STOPPED_ERROR,
        server_gone=driver.abort_reason == SERVER_GONE_ERROR,
        is_modelled_clock=is_modelled,
        sends=driver.sends,
    )


def blocking(run: Callable[_P, Coroutine[Any, Any, _R]]) -> Callable[_P, _R]:
    """`run` on a fresh event loop, with `run`'s own signature (`help` and `inspect` show it):
    for callers that are threads (runners, Ray actors)."""

    @functools.wraps(run)
    def run_blocking(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return asyncio.run(run(*args, **kwargs))

    run_blocking.__name__ = run_blocking.__qualname__ = f"{run.__name__}_sync"
    run_blocking.__doc__ = (f"`{run.__name__}` on a fresh event loop, for callers that are "
                            "threads; a `threading.Event` as its `stop_event` stops it from "
                            "another.")
    return run_blocking


run_level_sync = blocking(run_level)
