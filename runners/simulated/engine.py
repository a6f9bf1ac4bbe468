"""The simulated engine's core (`SimulatedEngine`): data-parallel replicas, each a scheduler
stepped on its own modelled clock, the requests' token streams, the request faults, and the
profiler's recording; its start-up is `startup.start_up`, its HTTP face `server.build_app`.

Step times are slept in real time so client-side latencies (and SLO checks) hold; every time the
engine reports is on the modelled clock, which a busy host cannot stretch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from runners.simulated.calibration import JIT_STEP_STALL_S
from runners.simulated.chrome_trace import ProfileRecorder
from runners.simulated.metrics import EngineMetrics
from runners.simulated.performance import PerformanceModel
from runners.simulated.scheduler import Scheduler, SimRequest, StepPlan, TokenEvent, block_hashes
from runners.simulated.settings import ServerSettings
from runners.simulated.sizing import flag_bool
from runners.simulated.startup import compile_cache_marker, start_up

logger = logging.getLogger(__name__)

# After a step that ended requests whose client promised the next one at once (a closed loop:
# MODELLED_REFILL_HEADER), the engine holds its modelled clock up to this long (wall seconds)
# for those arrivals, and stamps them at the step's end: the model of a client that reacts at
# once, whatever the host's scheduling delay. A promise not kept costs this much wall time.
REFILL_GRACE_S = 10.0
# Likewise a burst the client sends at once (MODELLED_BURST_HEADER: its size, the first requests
# of a closed-loop level) is admitted together, stamped at its first request's arrival.

# A step's wake-up later than its deadline (the timer's resolution and the loop's own work:
# 0.85 ms a step on a quiet 2-core host, 2026-12-06, where decode steps are 5-10 ms) is caught
# up by the next steps' shorter sleeps, whose deadlines it brought nearer, so the modelled clock
# keeps the wall's pace wherever the host keeps up; only what stays behind by more than this
# (seconds: a host that could not run the model in real time for a while) becomes lag for good.
# An arrival while the loop catches up is stamped at the end of the step in flight
# (`_Replica.modelled_now`): up to this much (and a step) earlier than the wall less the lag.
CATCH_UP_S = 0.25


@dataclass
class _Stream:
    """A request's mailbox: the engine loop puts token events, the handler takes them."""

    request: SimRequest
    events: asyncio.Queue[TokenEvent] = field(default_factory=asyncio.Queue)


@dataclasses.dataclass
class _Replica:
    """One engine core: its scheduler and the loop that steps it. `data_parallel_size` of
    them sit behind the one API server, as vLLM's data-parallel engines do."""

    index: int
    scheduler: Scheduler
    wakeup: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # The modelled clock (seconds, the loop's time base): it advances by modelled step times
    # only, so a busy host CPU that wakes the loop late stretches no latency. `lag_s` is how
    # far the loop's clock has run ahead of it: the lateness the loop could not catch up
    # (CATCH_UP_S), the waits for refills, and the idle time before a wake-up.
    clock_s: float = 0.0  # modelled time at the end of the last step (or of the idle wait)
    lag_s: float = 0.0
    step_start_s: float | None = None  # modelled span of the step in flight, if any
    step_end_s: float = 0.0
    is_idle: bool = False  # waiting for a request with none queued: its clock is free to move

    def modelled_now(self, loop_time_s: float) -> float:
        """The modelled time of an event the loop sees at `loop_time_s` (a request arriving):
        inside the step in flight while one runs, never before the last step's end."""
        now = loop_time_s - self.lag_s
        if self.step_start_s is not None:
            return min(max(now, self.step_start_s), self.step_end_s)
        return max(now, self.clock_s)

    @property
    def load(self) -> int:
        # vLLM's data-parallel coordinator scores engines by waiting x 4 + running.
        return len(self.scheduler.waiting) * 4 + len(self.scheduler.running)


class SimulatedEngine:
    """Owns the schedulers, metrics, fault state and the start-up sequence of one process."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        config = settings.config
        marker = compile_cache_marker(config)
        self._compile_marker = marker
        self.model = PerformanceModel.from_config(
            config, settings.hardware, is_compile_cache_warm=bool(marker and marker.is_file()))
        self.faults = settings.faults
        self.metrics = EngineMetrics(
            config.served_model_name,
            is_mfu_enabled=flag_bool(config.flags, "enable_mfu_metrics", False))
        self.replicas = [_Replica(i, Scheduler(self.model))
                         for i in range(config.data_parallel_size)]
        self.is_ready = False
        self.is_hung = False
        self._rng = random.Random(settings.seed)
        self._error_rng = random.Random(settings.seed + 1)
        self._neighbour_rng = random.Random(settings.seed + 2)  # the `unstable` fault's draws
        self._streams: dict[SimRequest, _Stream] = {}
        self._num_requests_started = 0
        # > 1 under the `unstable` and `step_slowdown` faults
        self._slowdown = 1.0 + float(settings.faults.step_slowdown)
        self._profiler = ProfileRecorder(self.model, settings.profile_dir)
        self._epoch_offset_s = 0.0  # wall epoch of modelled time 0, set when the loops start
        self._refilled: set[SimRequest] = set()  # their client sends another when they end
        self._num_remaining = 0  # requests the refilling client still sends, as it last said
        self._num_arrivals = 0
        self._arrived = asyncio.Event()
        self._burst_until = 0  # arrivals counted when the current burst is complete
        # The loop time of the burst's first arrival: each replica stamps the burst on its own
        # modelled clock (replicas' clocks differ: fp8_per_block's stall runs a busy one ahead).
        self._burst_loop_s = 0.0

    async def start(self) -> int | None:
        """Walk through vLLM's start-up (`startup.start_up`), then start the replicas' loops;
        None when ready, else an exit code."""
        code = await start_up(self.model, self.settings, self._compile_marker)
        if code is not None:
            return code
        for replica in self.replicas:
            replica.task = asyncio.create_task(self._run_loop(replica))
        self._epoch_offset_s = time.time() - asyncio.get_running_loop().time()
        self.is_ready = True
        return None

    # --- engine loop ---------------------------------------------------------------------------
    async def _run_loop(self, replica: _Replica) -> None:
        """Step the replica's scheduler on its modelled clock. Each step is slept to its
        deadline so tokens stream in real time, but every time the engine reports (token times,
        TTFT/ITL histograms, the trace) is modelled: a wake-up the busy host delays is caught up
        by the next steps' shorter sleeps, and what it cannot catch up (beyond CATCH_UP_S) is
        added to `lag_s`, never to any latency."""
        loop = asyncio.get_running_loop()
        while True:
            if not replica.scheduler.has_work:
                await self._idle(replica)
            if self.is_hung:
                await asyncio.Event().wait()  # a wedged engine: alive, silent
            plan = replica.scheduler.schedule(replica.clock_s)
            admissible_s = replica.scheduler.next_admissible_s()
            if plan is None and admissible_s is not None and admissible_s > replica.clock_s:
                # Idle while the next request is on its way through the API server
                # (calibration.API_LAG_PER_STREAM_S): later arrivals reach it later still.
                await asyncio.sleep(max(0.0, admissible_s + replica.lag_s - loop.time()))
                replica.clock_s = admissible_s
                continue
            if plan is None:  # work that cannot be scheduled yet: wait for a change
                await self._idle(replica)
                continue
            # A step starts now on the wall, whatever moved the modelled clock since the last
            # one (an idle replica that took a stamp from ahead of its own clock): the wall
            # sleep is this step's, never the gap between two clocks.
            replica.lag_s = min(replica.lag_s, loop.time() - replica.clock_s)
            step_s = plan.breakdown.total_s * self._slowdown * \
                self._rng.lognormvariate(0.0, self._sigma)
            replica.step_start_s, replica.step_end_s = replica.clock_s, replica.clock_s + step_s
            if replica.index == 0:  # the trace is rank 0's, as vLLM's first worker writes it
                self._profiler.record(plan, step_s, self._epoch_offset_s + replica.clock_s)
            if self.model.is_jit_while_serving:
                # The JIT stall is modelled in full but slept time-scaled, as start-up is: the
                # figures read the modelled clock, and a dry run need not wait out the JIT.
                replica.lag_s -= min(step_s, JIT_STEP_STALL_S) * (
                    1.0 - self.settings.startup_time_scale)
            deadline = replica.step_end_s + replica.lag_s
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            replica.lag_s += max(0.0, loop.time() - deadline - CATCH_UP_S)
            if self.is_hung:
                await asyncio.Event().wait()
            replica.clock_s, replica.step_start_s = replica.step_end_s, None
            arrivals_before = self._num_arrivals
            num_refills = min(self._complete(replica.scheduler, plan, replica.clock_s),
                              self._num_remaining)
            if num_refills:
                await self._await_refills(replica, arrivals_before + num_refills)

    async def _idle(self, replica: _Replica) -> None:
        """Wait for a request. Idle time passes on the modelled clock as on the wall, up to the
        first waiting request's arrival: the engine starts then, however late the loop woke."""
        loop = asyncio.get_running_loop()
        replica.wakeup.clear()
        replica.is_idle = not replica.scheduler.has_work
        try:
            await replica.wakeup.wait()
            if self._burst_until > self._num_arrivals:
                await self._await_arrivals(self._burst_until)
        finally:
            replica.is_idle = False
        waiting = replica.scheduler.waiting
        start_s = (min(r.arrival_s for r in waiting) if waiting
                   else replica.modelled_now(loop.time()))
        replica.clock_s = max(replica.clock_s, start_s)
        replica.lag_s = max(replica.lag_s, loop.time() - replica.clock_s)

    async def _await_refills(self, replica: _Replica, num_arrivals: int) -> None:
        """Hold the modelled clock at the step's end until `num_arrivals` requests have arrived
        (closed-loop refills) or REFILL_GRACE_S of wall time passed; the wait is lag."""
        loop = asyncio.get_running_loop()
        waited_from = loop.time()
        replica.step_start_s = replica.step_end_s = replica.clock_s  # arrivals stamp here
        try:
            await self._await_arrivals(num_arrivals)
        finally:
            replica.step_start_s = None
            replica.lag_s += loop.time() - waited_from

    async def _await_arrivals(self, num_arrivals: int) -> None:
        """Until `num_arrivals` requests have arrived in all, or REFILL_GRACE_S passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REFILL_GRACE_S
        while self._num_arrivals < num_arrivals and loop.time() < deadline:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
        if self._num_arrivals < num_arrivals:
            logger.warning("Simulated engine: %d announced request(s) did not arrive within "
                           "%g s; the modelled clock goes on without them.",
                           num_arrivals - self._num_arrivals, REFILL_GRACE_S)

    @property
    def _sigma(self) -> float:
        return self.settings.noise_sigma

    def _complete(self, scheduler: Scheduler, plan: StepPlan, now: float) -> int:
        """Apply a finished step; the number of ended requests whose client refills at once."""
        self.metrics.count_step(self.model, plan, data_parallel_size=len(self.replicas))
        events = scheduler.complete(plan, now)
        self.metrics.count_tokens(events, now)
        num_refills = 0
        for event in events:
            request = event.request
            stream = self._streams.get(request)
            if stream is not None:
                stream.events.put_nowait(event)
            if event.is_finished and request in self._refilled:
                self._refilled.discard(request)
                num_refills += 1
        self._update_gauges()
        return num_refills

    def _update_gauges(self) -> None:
        self.metrics.set_gauges([r.scheduler for r in self.replicas])

    # --- requests ------------------------------------------------------------------------------
    def request_started(self) -> None:
        """Count an arriving request and fire the request-count faults."""
        self._num_requests_started += 1
        count, faults = self._num_requests_started, self.faults
        if faults.crash_after_requests is not None and count > int(faults.crash_after_requests):
            logger.error("Simulated fault: engine core died after %d requests "
                         "(sim_crash_after_requests).", count - 1)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)  # abrupt on purpose: no cleanup, as a segfaulting worker
        if faults.hang_after_requests is not None and count > int(faults.hang_after_requests):
            if not self.is_hung:
                logger.warning("Simulated fault: engine hangs after %d requests "
                               "(sim_hang_after_requests).", count - 1)
            self.is_hung = True

    async def compile_on_first_request(self) -> None:
        """The `slow_first_request_s` fault: the first request waits while a thread keeps a
        core busy, as an engine JIT-compiling kernels on first use (the API answers meanwhile)."""
        seconds = float(self.faults.slow_first_request_s)
        if seconds and self._num_requests_started == 1:
            logger.info("Simulated fault: compiling kernels for %.1f s on the first request "
                        "(sim_slow_first_request_s).", seconds)
            await asyncio.to_thread(_spin_cpu, seconds)

    def should_fail_request(self) -> bool:
        return self._error_rng.random() < float(self.faults.error_rate)

    def modelled_time_s(self) -> float:
        """The modelled time now, on the furthest replica's clock: when an error answer
        refused a request (the level's duration spans it, as a wall clock's would)."""
        loop_time_s = asyncio.get_running_loop().time()
        return max(r.modelled_now(loop_time_s) for r in self.replicas)

    def note_arrival(self, burst_size: int = 0, num_remaining: int | None = None) -> None:
        """A completion request arrived (served, or answered with an error): an announced
        refill or burst member the engine waits for is kept either way."""
        if num_remaining is not None:
            self._num_remaining = num_remaining
        if burst_size > 1 and self._num_arrivals >= self._burst_until:  # a new burst
            self._burst_until = self._num_arrivals + burst_size
            self._burst_loop_s = asyncio.get_running_loop().time()
        self._num_arrivals += 1
        self._arrived.set()

    def _modelled_now(self, replica: _Replica, loop_time_s: float) -> float:
        """The modelled time at which `replica` takes a request arriving at `loop_time_s`.

        Each replica keeps its own modelled clock, and they drift apart: fp8_per_block's stall
        is modelled in full but slept time-scaled, so a busy replica's clock runs far ahead of
        an idle one's. An idle replica, which no step or token depends on, takes the furthest
        clock's time, so the replicas' stamps stay on one time line (a level's duration spans
        them); a busy one keeps its own, so no request is stamped after the step that serves
        it starts."""
        now = replica.modelled_now(loop_time_s)
        if replica.is_idle:
            now = max(now, *(r.modelled_now(loop_time_s) for r in self.replicas))
        return now

    async def generate(self, prompt_ids: list[int], max_tokens: int,
                       is_refilled: bool = False, burst_size: int = 0,
                       num_remaining: int | None = None) -> AsyncIterator[TokenEvent]:
        """The request's tokens as the engine produces them; each event's request carries its
        modelled arrival (`arrival_s`) and token time (`last_token_s`)."""
        loop = asyncio.get_running_loop()
        replica = min(self.replicas, key=lambda r: (r.load, r.index))
        arrival_s = self._modelled_now(replica, loop.time())
        self.note_arrival(burst_size, num_remaining)
        if burst_size > 1:  # a burst is stamped at its first request's arrival
            arrival_s = max(self._modelled_now(replica, self._burst_loop_s), replica.clock_s)
        request = SimRequest(uuid.uuid4().hex, len(prompt_ids), max_tokens, arrival_s,
                             block_hashes(prompt_ids, self.model.block_size))
        stream = _Stream(request)
        self._streams[request] = stream
        if is_refilled:
            self._refilled.add(request)
        replica.scheduler.add(request)
        self._update_gauges()
        replica.wakeup.set()
        last_s = request.arrival_s
        try:
            while True:
                event = await stream.events.get()
                now = event.time_s
                if not event.is_first:
                    self.metrics.itl.labels(model_name=self.metrics.model_name).observe(
                        now - last_s)
                last_s = now
                yield event
                if event.is_finished:
                    self.metrics.e2e.labels(model_name=self.metrics.model_name).observe(
                        now - request.admissible_s)
                    return
        finally:
            self._streams.pop(request, None)
            self._refilled.discard(request)
            if not request.is_finished:
                replica.scheduler.abort(request)  # the client went away
                self._update_gauges()

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.scheduler.reset_prefix_cache()
        if self.faults.unstable:  # a new level: the noisy neighbour draws again
            self._slowdown = 1.0 + float(self.faults.step_slowdown) + \
                self._neighbour_rng.uniform(0.0, float(self.faults.unstable))

    # --- profiler ------------------------------------------------------------------------------
    def start_profile(self) -> None:
        self._profiler.start()

    def stop_profile(self) -> Path | None:
        return self._profiler.stop()


def _spin_cpu(seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass
