"""A profiled window of the staircase's stream: the operating point's load re-established
(or kept) and warmed up as a step is, then /start_profile and /stop_profile around a window of
it; `ProfileWindow` says what the window covered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from runners.capacity.driver import StaircaseDriver
from runners.capacity.plan import StepPlan
from runners.capacity.step import extend_window, settle, sleep_until

logger = logging.getLogger(__name__)

# A profiled window is kept open past its planned length, up to this many times it (or 10 s
# more, whichever is longer), until it has sent the requests it was sized for.
_MAX_WINDOW_STRETCH = 4.0


@dataclass(frozen=True)
class ProfileWindow:
    """What a profiled window of the stream covered: the load it ran at, how long the stream
    had run at that load before it, and what was in flight during it. Profiling slows the
    engine: no performance figure is taken from this window."""

    axis: str  # "request_rate" or "concurrency"
    load: float  # requests/s or concurrent requests
    warmup_s: float  # s the stream had run at `load` when the window began
    window_s: float  # s between /start_profile and /stop_profile's call
    num_sent: int  # requests sent in the window
    num_ended: int  # requests (any) that ended in the window
    mean_in_flight: float  # requests, time-weighted over the window
    is_settled: bool  # the in-flight count had stopped rising when the window began
    is_operating_point: bool  # the highest load that met the SLO (else the lightest probed)
    lifetime_s: float  # s, the request life that sized the warm-up (as a step's)

    def as_summary(self) -> dict[str, float]:
        """The window as `profile.*` figures beside the trace's own (a trial's record keeps
        them as `trace.profile.*`)."""
        unit = "request_rate_rps" if self.axis == "request_rate" else "concurrency"
        return {f"profile.{unit}": self.load, "profile.warmup_s": self.warmup_s,
                "profile.window_s": self.window_s, "profile.num_sent": float(self.num_sent),
                "profile.num_ended": float(self.num_ended),
                "profile.mean_in_flight": self.mean_in_flight,
                "profile.is_settled": 1.0 if self.is_settled else 0.0,
                "profile.is_operating_point": 1.0 if self.is_operating_point else 0.0,
                "profile.lifetime_s": self.lifetime_s,
                "profile.is_in_stream": 1.0}


def profile_window(driver: StaircaseDriver, plan: StepPlan, *, since_s: float | None,
                   num_requests: int, is_operating_point: bool,
                   check_engine: Callable[[], None], start_profile: Callable[[], object],
                   stop_profile: Callable[[], object]) -> ProfileWindow:
    """Profile a window of the running stream at `plan.load`, in steady state: the stream is
    set to that load (unless `since_s` says it has run at it since then), warmed up as a step
    is (`plan.warmup_s`, and an open loop's settling wait up to `plan.max_warmup_s`), then
    `start_profile` and `stop_profile` bound a window that sent `num_requests`: planned as
    their span at the load, and kept open past it until they were sent, up to
    `_MAX_WINDOW_STRETCH` times its plan (or 10 s more). A sender that runs late (a starved
    host; a high rate's window is under a second) had sent none of them in a planned window of
    0.6 s on the CI's 2-core host (2026-12-07): the trace then covered an idle stream."""
    if since_s is None or driver.load != plan.load:
        driver.set_load(plan.load)
        since_s = driver.now()
    sleep_until(driver, since_s + plan.warmup_s, check_engine, None)
    is_settled = settle(driver, since_s, plan, check_engine, None) \
        if driver.axis == "request_rate" else True
    per_s = plan.load if driver.axis == "request_rate" else plan.load / plan.lifetime_s
    start = driver.now()
    start_profile()
    planned_s = max(1, num_requests) / per_s
    sleep_until(driver, start + planned_s, check_engine, None)
    extend_window(driver, start, replace(
        plan, window_s=planned_s, min_requests=max(1, num_requests),
        max_window_s=max(_MAX_WINDOW_STRETCH * planned_s, planned_s + 10.0)),
        check_engine, None)
    end = driver.now()
    stop_profile()
    num_sent = len(driver.sent_between(start, end))
    if num_sent < num_requests:
        logger.warning("the profiled window sent %d of the %d requests it was sized for in "
                       "%.1f s (its bound): the trace covers fewer (a late client)", num_sent,
                       num_requests, end - start)
    return ProfileWindow(axis=driver.axis, load=plan.load, warmup_s=start - since_s,
                         window_s=end - start, num_sent=num_sent,
                         num_ended=driver.num_ended_between(start, end),
                         mean_in_flight=driver.mean_in_flight(start, end),
                         is_settled=is_settled, is_operating_point=is_operating_point,
                         lifetime_s=plan.lifetime_s)
