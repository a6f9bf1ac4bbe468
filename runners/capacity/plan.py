"""Sizing a step of the steady staircase: how long a request lives near the capacity, hence
the step's warm-up (two lives, up to four while an open loop's in-flight count still rises) and
its measured window (enough requests, within bounds). Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from runners.capacity.search import CapacitySearch
from runners.capacity.stream_source import GAP_BLOCK, hold_gap_block
from runners.workload import LengthDistribution, Workload

_MIN_LIFETIME_S = 1.0  # s; the least warm-up a step gets
_UNKNOWN_TPOT_S = 0.05  # s a token, where the SLO sets no TPOT bound
_UNKNOWN_TTFT_S = 2.0  # s, likewise for the first token
_LIFETIME_QUANTILE = 0.95  # a step's warm-up is this quantile of a request's life
# A step's warm-up, in request lives. One life fills an empty server to the step's count in
# theory, but the count keeps climbing as the batch grows and each request's life with it: on
# the H100 (Qwen3-8B shape, 10.8 req/s, 2026-12-06) a step after a cancelled backlog ran 137
# requests one life in and 145 after 1.7 lives, where `vllm bench serve` held 152-170 for three
# minutes; a window measured on the ramp read TPOT p99 14.0 ms against vLLM's 17.4 ms.
_WARMUP_LIVES = 2.0
_MAX_WARMUP_LIVES = 4.0


@dataclass(frozen=True)
class StepPlan:
    """How one step is measured: `warmup_s` excluded, then the requests sent in `window_s`."""

    load: float  # requests/s or concurrent requests
    warmup_s: float  # s of load before the window (two request lives), so the server is full
    window_s: float  # s in which the measured requests are sent
    lifetime_s: float  # s, the request life that sized the warm-up
    expected_requests: float  # requests the window should send (rate x window; a closed loop's
    # concurrency x window / life)
    # s; an open loop's warm-up goes on past `warmup_s`, up to this, while its in-flight count
    # still rises (`is_in_flight_settled`)
    max_warmup_s: float = 0.0
    is_hold: bool = False  # a hold (`plan_hold`): the long window
    # a rate's arrivals conditioned on their count over blocks of this many
    # (runners/capacity/stream_source.py `ArrivalGaps`): a step's 64; a hold's about four lives'
    gap_block: int = GAP_BLOCK
    # A step's window goes on past `window_s`, up to `max_window_s` (None: unbounded), until it
    # has sent `min_requests` (a closed loop sends only as its requests end: past its knee they
    # live longer than sized); and a window shorter than `min_window_s` is no measurement.
    min_requests: int = 0
    min_window_s: float = 0.0  # s
    max_window_s: float | None = None  # s


def _quantile_tokens(dist: LengthDistribution, q: float) -> float:
    """The q-quantile of a length distribution (its upper clip wins)."""
    if dist.kind == "fixed":
        value = float(dist.mean)
    elif dist.kind == "uniform":  # the bounds `loadgen.sample_length` draws between
        low = dist.low if dist.low is not None else 1
        high = dist.high if dist.high is not None else 2 * dist.mean - low
        value = low + q * (max(low, high) - low)
    elif dist.kind == "normal":
        value = dist.mean + 1.645 * dist.std
    elif dist.kind == "lognormal":
        value = dist.mean * math.exp(1.645 * dist.std - dist.std ** 2 / 2)
    else:
        value = float(dist.mean)
    if dist.high is not None:
        value = min(value, float(dist.high))
    return max(value, 1.0)


def lifetime_estimate_s(workload: Workload, *,
                        measured_e2el_s: float | None = None) -> float:
    """How long a request lives near the capacity, at the 95th percentile: its first token
    within the TTFT bound and each further token within the TPOT bound (a config that meets
    the SLO serves no slower; where the SLO sets no bound, 2 s and 50 ms), with the longest
    answers (512 tokens for a trace's or a dataset's, whose lengths are not known here), never
    shorter than the last step that met the SLO (its p90 end-to-end latency)."""
    slo = workload.slo
    tpot_s = slo.tpot_p99_ms / 1000.0 if slo.tpot_p99_ms is not None else _UNKNOWN_TPOT_S
    ttft_s = slo.ttft_p99_ms / 1000.0 if slo.ttft_p99_ms is not None else _UNKNOWN_TTFT_S
    out_tokens = 512.0 if workload.trace is not None or workload.dataset is not None else \
        _quantile_tokens(workload.output_len, _LIFETIME_QUANTILE)
    estimate = ttft_s + max(out_tokens - 1.0, 0.0) * tpot_s
    if slo.e2el_ms is not None:
        estimate = min(estimate, slo.e2el_ms / 1000.0)
    if measured_e2el_s is not None and math.isfinite(measured_e2el_s):
        estimate = max(estimate, measured_e2el_s)
    return min(max(estimate, _MIN_LIFETIME_S), workload.request_timeout_s)


def plan_step(search: CapacitySearch, load: float, lifetime_s: float) -> StepPlan:
    """The warm-up and window of a step at `load`: the warm-up two request lives (the server's
    in-flight count settles once every request it held before the step has ended, and then the
    lives lengthen as its batch grows: see _WARMUP_LIVES), up to four for an open loop whose
    count still rises; the window
    long enough to send `search.min_window_requests` requests and at least
    `search.min_window_s`, at most `search.max_window_s` (a light step must not take many
    minutes: it then measures fewer requests, and its record says how many)."""
    # A closed loop sends its concurrency once a request life.
    per_s = load if search.axis == "request_rate" else load / lifetime_s
    window_s = max(search.min_window_s, search.min_window_requests / per_s)
    if search.max_window_s is not None:
        window_s = min(window_s, search.max_window_s)
    warmup_s = search.warmup_s if search.warmup_s is not None else \
        _WARMUP_LIVES * lifetime_s
    return StepPlan(load=load, warmup_s=warmup_s, window_s=window_s, lifetime_s=lifetime_s,
                    expected_requests=per_s * window_s,
                    max_warmup_s=max(warmup_s, _MAX_WARMUP_LIVES * lifetime_s),
                    min_requests=search.min_window_requests, min_window_s=search.min_window_s,
                    max_window_s=search.max_window_s)


def plan_hold(search: CapacitySearch, load: float, lifetime_s: float) -> StepPlan:
    """A hold at `load`: warmed up as a step is, then a window of at least `search.hold_s` and
    `search.hold_lives` request lives (never cut by `max_window_s`: the hold is what certifies
    the claim), whatever `min_window_requests` asks. The batch swings with the arrival count
    over about one life, so a window of N lives samples about N swings: on the H100
    (2026-12-06) the medians of consecutive 15 s windows of one 180 s `vllm bench serve` run
    (12 lives) spread 13.5-16.0 ms around its 14.8 ms whole-run median. A rate's arrivals
    come in blocks of about four lives' worth (`hold_gap_block`): the swings stay, the window
    offers its load (`ArrivalGaps` says why)."""
    step = plan_step(search, load, lifetime_s)
    window_s = max(search.hold_s, search.hold_lives * lifetime_s, step.window_s)
    per_s = step.expected_requests / step.window_s if step.window_s > 0 else 0.0
    return replace(step, window_s=window_s, expected_requests=per_s * window_s, is_hold=True,
                   min_requests=0, max_window_s=None,
                   gap_block=hold_gap_block(per_s, lifetime_s))
