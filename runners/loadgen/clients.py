"""The httpx clients a load's requests go out on (`ClientPool`): a request goes to the client
with the fewest in flight, and a new one is made once each holds `per_client`. The staircase's
stream (runners/capacity/driver.py) and a bounded level (runners/loadgen/level.py) share it.

Why several: httpcore 1.0's pool (httpx's transport) walks every connection it holds for each
queued request whenever a request starts or ends (`AsyncConnectionPool._assign_requests_to_
connections`), and closes its idle connections whenever it holds more than its keep-alive limit:
a stream of a thousand requests in flight (a saturated step, a closed loop at 256) spent most of
its client's CPU there and reopened a connection per request. Spread over clients of
`REQUESTS_PER_CLIENT` each, the same saturated step cost 0.69x the client CPU per request
(bench/staircase_client_cpu.py, simulated engine).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx

from runners.credentials import auth_headers

REQUESTS_PER_CLIENT = 32  # requests in flight on one httpx client at most
CONNECT_TIMEOUT_S = 10.0


class ClientPool:
    """A load's httpx clients: a request goes to the one with the fewest in flight, and a new
    one is made once each holds `per_client`. One event loop's thread only. `async with`
    closes every client, as `async with httpx.AsyncClient()` closes its one."""

    def __init__(self, make: Callable[[], httpx.AsyncClient], per_client: int) -> None:
        if per_client < 1:
            raise ValueError(f"per_client must be >= 1 but got {per_client}.")
        self._make = make
        self._per_client = per_client
        self._clients: list[httpx.AsyncClient] = []
        self._in_flight: list[int] = []

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def acquire(self) -> tuple[int, httpx.AsyncClient]:
        """A client for one more request, and its index for `release`."""
        index = min(range(len(self._clients)), key=self._in_flight.__getitem__, default=-1)
        if index < 0 or self._in_flight[index] >= self._per_client:
            self._clients.append(self._make())
            self._in_flight.append(0)
            index = len(self._clients) - 1
        self._in_flight[index] += 1
        return index, self._clients[index]

    def release(self, index: int) -> None:
        self._in_flight[index] -= 1

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Every client closed (a cancel that lands in the caller's own clean-up must not
        leave their sockets open: `aclose`)."""
        await self.aclose()

    async def aclose(self) -> None:
        """Close every client (again: a closed one ignores it), to the end even where a cancel
        lands meanwhile; the cancel is raised once they are closed. httpx marks a client closed,
        then closes its connections one by one, a turn of the loop each: a close that a cancel
        cut short cannot be done again, and the connections it had not reached stayed open
        until the GC found them ("unclosed transport", "unclosed <socket.socket>")."""
        closing = asyncio.gather(*(c.aclose() for c in self._clients), return_exceptions=True)
        cancelled: asyncio.CancelledError | None = None
        while not closing.done():
            try:
                await asyncio.shield(closing)
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled


def client_pool(api_key: str | None, per_client: int = REQUESTS_PER_CLIENT) -> ClientPool:
    """A pool of clients for one server's load: reads unbounded (the per-request timeout and
    the stall watchdog bound them; httpx's default 5 s would cut long streams), connects within
    `CONNECT_TIMEOUT_S`, keep-alive for `per_client` connections each, the engine's `api_key` as
    a bearer token, and no proxy from the environment (`trust_env=False`: an http_proxy must
    not capture 127.0.0.1). Call it on the loop that will use it."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=per_client)
    timeout = httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)
    headers = auth_headers(api_key)
    ssl_context = httpx.create_ssl_context()  # once: each client would load the CAs again
    return ClientPool(lambda: httpx.AsyncClient(
        limits=limits, timeout=timeout, trust_env=False, headers=headers,
        verify=ssl_context), per_client)
