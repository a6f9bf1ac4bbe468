"""A load's clients close every connection they opened, however a cancel interleaves with the
close (runners/loadgen/clients.py, runners/capacity/driver.py): a connection left open is a
socket to the GC ("unclosed <socket.socket>"), which the suite's warnings-as-errors fail."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import runners.capacity.driver as driver_module
from runners.capacity.driver import StaircaseDriver
from runners.capacity.stream_source import endless_requests
from runners.loadgen.clients import ClientPool, client_pool
from runners.loadgen.requests import build_requests
from runners.workload import LengthDistribution, Workload

_SERVER_DELAY_S = 0.05  # each reply: requests stay in flight a moment, on their connections


class _CountingServer(http.server.ThreadingHTTPServer):
    """A keep-alive HTTP/1.1 server on 127.0.0.1 that counts the connections open to it (a
    connection ends when the client closes its socket)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.num_open = 0
        self.changed = threading.Condition()

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a request the client cancelled ends in a reset: no traceback on stderr

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def wait_open(self, num: int, timeout_s: float = 10.0) -> int:
        """The count once it is `num`, or as it is after `timeout_s` (a failed test's bound)."""
        with self.changed:
            self.changed.wait_for(lambda: self.num_open == num, timeout=timeout_s)
            return self.num_open


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: _CountingServer

    def setup(self) -> None:
        super().setup()
        with self.server.changed:
            self.server.num_open += 1
            self.server.changed.notify_all()

    def finish(self) -> None:
        with self.server.changed:
            self.server.num_open -= 1
            self.server.changed.notify_all()
        super().finish()

    def _reply(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        time.sleep(_SERVER_DELAY_S)
        self.send_response(404)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"no")

    do_GET = do_POST = _reply

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_CountingServer]:
    srv = _CountingServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


@pytest.mark.parametrize("num_turns", [2, 5])
def test_a_cancel_that_lands_in_a_client_pools_close_still_closes_every_connection(
        server: _CountingServer, num_turns: int) -> None:
    """httpx marks a client closed, then closes its connections one by one: a cancel between
    two of them left the rest open for good (a second close is a no-op). The cancel is injected
    `num_turns` turns of the loop into the close, among the connections of 3 clients."""

    async def main() -> None:
        pool = client_pool(None, per_client=8)

        async def one() -> None:
            index, client = pool.acquire()
            try:
                await client.get(f"{server.url}/")
            finally:
                pool.release(index)

        await asyncio.gather(*(one() for _ in range(24)))
        assert pool.num_clients == 3 and server.wait_open(24) == 24, "24 kept alive"
        closing = asyncio.create_task(pool.aclose())
        for _ in range(num_turns):
            await asyncio.sleep(0)
        assert not closing.done(), "the cancel lands inside the close"
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        assert closing.cancelled(), "the cancel is not swallowed: it is raised once closed"
        await pool.aclose()  # again, as a stream's loop does before it closes: a no-op
        # Asserted while the loop still runs: nothing has been handed to the GC yet.
        assert await asyncio.to_thread(server.wait_open, 0) == 0, "no connection left open"

    asyncio.run(main())


def _call_after_turns(loop: asyncio.AbstractEventLoop, num_turns: int,
                      call: Callable[[], object]) -> None:
    if num_turns == 0:
        call()
    else:
        loop.call_soon(_call_after_turns, loop, num_turns - 1, call)


@pytest.mark.parametrize("num_turns", [0, 1, 2, 3])
def test_a_streams_close_whose_cancel_arrives_during_its_clean_up_is_no_error(
        server: _CountingServer, monkeypatch: pytest.MonkeyPatch, num_turns: int) -> None:
    """`close` stops the sending (`_closing`), then cancels it; on a busy host the cancel may
    arrive only once the sending has stopped on its own and the stream is closing its clients.
    It must not land there (the clients' close cut short, the requests cancelled twice): the
    stream ends with every connection closed and no error."""
    driver: StaircaseDriver | None = None

    class LateCancelPool(ClientPool):
        async def aclose(self) -> None:
            assert driver is not None
            # close's cancel, as it arrives late on a busy host: inside the clients' close,
            # `num_turns` turns of the loop into it
            _call_after_turns(asyncio.get_running_loop(), num_turns, driver._cancel_sending)
            await super().aclose()

    def late_cancel_pool(api_key: str | None, per_client: int) -> ClientPool:
        pool = client_pool(api_key, per_client)
        return LateCancelPool(pool._make, per_client)

    monkeypatch.setattr(driver_module, "client_pool", late_cancel_pool)
    monkeypatch.setattr(driver_module, "_REQUESTS_PER_CLIENT", 4)  # 3 clients to close
    workload = Workload(input_len=LengthDistribution(mean=16),
                        output_len=LengthDistribution(mean=4))
    requests = endless_requests(lambda n, s: build_requests(workload, n, seed=s), 64, 0,
                                False)
    driver = StaircaseDriver(server.url, "m", requests, axis="concurrency", timeout_s=30,
                             seed=0)
    driver.start(12)
    try:
        assert server.wait_open(12) == 12, "the stream's 12 requests on their connections"
    finally:
        driver.close()
    assert driver.error is None, f"the stream ended with {driver.error!r}"
    assert server.wait_open(0) == 0, "no connection left open"


def test_a_cancel_of_requests_waits_a_bounded_time_and_cancels_a_swallowed_one_again() -> None:
    """A missed step's cancel (and a stream's close) waits for its requests a bounded time,
    on the loop's clock: one that swallowed its first cancel (Python 3.11's `wait_for` does,
    as its wait ends) is cancelled again and ends; one that never ends is returned after
    `wait_s`, not waited for without end (an unbounded `gather` held a cancel past its
    caller's 30 s on a starved host and failed the trial). Virtual time: no wall time."""
    from runners.capacity.stream_loop import cancel_and_wait
    from tests.virtual_time import run_in_virtual_time

    async def swallows_one_cancel() -> str:
        with contextlib.suppress(asyncio.CancelledError):  # swallowed, as 3.11's wait_for may
            await asyncio.sleep(3600)
        await asyncio.sleep(3600)
        return "ran on"

    async def never_ends() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue

    async def main() -> tuple[float, set[str], bool]:
        loop = asyncio.get_running_loop()
        tasks = {asyncio.create_task(coro, name=name) for name, coro in (
            ("swallows", swallows_one_cancel()), ("never", never_ends()),
            ("plain", asyncio.sleep(3600)))}
        await asyncio.sleep(0)
        start = loop.time()
        left = await cancel_and_wait(tasks, 10.0, recancel_after_s=2.0)
        swallowed = next(t for t in tasks if t.get_name() == "swallows")
        waited = loop.time() - start
        for task in left:  # the test's own clean-up: this one ignores every cancel
            task.get_coro().close()  # type: ignore[union-attr]
        return waited, {t.get_name() for t in left}, swallowed.cancelled()

    waited, left, swallowed_cancelled = run_in_virtual_time(main())
    assert left == {"never"} and swallowed_cancelled, (left, swallowed_cancelled)
    assert waited == pytest.approx(10.0, abs=0.01)
