"""The capacity search on one running engine as a steady staircase: one continuous stream of
requests whose offered load steps from one level to the next, each step judged on a measured
window; then, where asked, the profile taken inside the same stream at the operating point.

What an operator checks a capacity claim by (GuideLLM's warm-up/cool-down exclusion, MLPerf's
server scenario, `vllm bench serve` at a constant rate): a step's first `warmup_s` is excluded
(the server fills up to the step's load); the requests *sent* in the next `window_s` are the
measured ones; arrivals keep flowing at the same load until every measured request has ended,
so the last measured requests are served under the same load as the first (no drain bias);
then the next step's load starts at once (no restart, no idle drain between steps). A step
meets the SLO only when its measured requests' p99s are within it, its requests succeeded,
the requests that ended in the window kept up with those sent in it (completed rate equal to
the offered rate, within the tolerance and the count's noise) and the server's waiting queue
stayed flat. A step that missed has its backlog cancelled (the requests are ours), so the next
step starts from an empty server, not from a drain.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from runners import prometheus
from runners.base import Failure, FailureReason, OnStep, RunStatus, StepMetrics
from runners.capacity.driver import STOPPED_ERROR, StaircaseDriver
from runners.capacity.judge import Verdict, WindowCounts, judge_window
from runners.capacity.plan import lifetime_estimate_s, plan_hold, plan_step
from runners.capacity.profile_window import profile_window
from runners.capacity.search import CapacitySearch, Probe
from runners.capacity.slo import certain_miss, missed_in_warmup
from runners.capacity.step import StepRun, measure_step, offered_note
from runners.capacity.stream_source import endless_requests
from runners.credentials import auth_headers
from runners.levels import mean_prompt_tokens, mean_tokens
from runners.loadgen.metrics import compute_metrics
from runners.loadgen.requests import build_requests
from runners.profiling import Profiled, profile_level, read_trace
from runners.session import Abort, EngineSession

logger = logging.getLogger(__name__)

_STREAM_POOL = 8192  # a file's or dataset's requests a capacity stream takes before it cycles


def run_staircase(session: EngineSession, steps: list[StepMetrics], on_step: OnStep | None,
                  profile_dir: Path | None) -> tuple[RunStatus, Profiled | None]:
    """The capacity search on one continuous stream of requests: each probe is a step of the
    staircase, judged on its steady-state window, appended to `steps` and shown to `on_step`
    (True: stop, "stopped"). With `profile_dir`, once the search has ended, a window of the
    same stream at the operating point's load, in steady state, is profiled
    (`profile_window`); else the second value is None."""
    s, workload, proc, log_path = session, session.workload, session.proc, session.log_path
    base_url, config = session.base_url, session.config
    search = workload.capacity
    assert search is not None
    s.reset_prefix_cache()  # once: the stream's hit rate is its steady one
    is_text = workload.prompts_file is not None or workload.dataset is not None
    # A file's or a dataset's requests in one pass of up to _STREAM_POOL (then cycled, with
    # the loader's warning where the source holds fewer); synthesised ones drawn afresh.
    requests = endless_requests(
        lambda num, seed: build_requests(workload, num, seed=seed),
        _STREAM_POOL if is_text else 512, workload.seed * 1000, is_finite_source=is_text)
    may_share = is_text or workload.shared_prefix is not None
    history: list[Probe] = []
    lifetime_s = lifetime_estimate_s(workload)
    met_loads: list[float] = []

    def check_engine() -> None:
        if not proc.is_alive():
            raise Abort(s.failure("run"))
        if driver.stalled:
            raise Abort(Failure(
                FailureReason.HANG,
                f"{s.name} (pid {proc.pid}) stopped producing tokens for "
                f"{s.stall_timeout_s:g} s; see {log_path}.", s.log_excerpt()))
        if driver.error is not None:  # a bug of ours: no load flows; say so at once
            raise Abort(Failure(
                FailureReason.INTERNAL,
                f"the load generator's stream failed: {driver.error!r}.", ""))

    first = search.next_load(history)
    if first is None:
        return "complete", None
    is_profiled = profile_dir is not None
    driver = StaircaseDriver(
        base_url, config.served_model_name, requests, axis=search.axis,
        timeout_s=workload.request_timeout_s, seed=workload.seed,
        burstiness=workload.burstiness, stall_timeout_s=s.stall_timeout_s,
        api_key=s.api_key)
    driver.start(first)
    try:
        item: tuple[float, bool] | None = (first, False)  # (load, is a hold)
        while item is not None:
            load, is_hold = item
            index = len(steps)
            plan = plan_hold(search, load, lifetime_s) if is_hold else \
                plan_step(search, load, lifetime_s)
            run = measure_step(
                driver, base_url, plan, repeats=workload.repeats,
                request_timeout_s=workload.request_timeout_s, check_engine=check_engine,
                is_first=index == 0, decide=lambda ended, most: certain_miss(
                    ended, workload.slo, workload.max_failed_fraction, most),
                # A stream's first step starts on an emptied prefix cache: where prompts may
                # share prefixes its first requests' first tokens come later than steady ones.
                warmup_decide=functools.partial(
                    missed_in_warmup, slo=workload.slo, tolerance=search.tolerance,
                    is_ttft_judged=not (index == 0 and may_share)))
            check_engine()
            step, verdict = judge_step(s, run, index)
            if verdict.is_overload_errors and not is_hold and (load <= search.low or any(
                    load <= met for met in met_loads)):
                # Errors at a load the config serves within the SLO (or at the lightest
                # load of interest) are the config's, not overload's. A hold's are a miss:
                # its long window's swings may overload what a short window served.
                first_error = next((o.error for outs, _ in run.windows for o in outs
                                    if not o.success), "")
                raise Abort(Failure(
                    FailureReason.TOO_MANY_ERRORS,
                    f"{verdict.reason} at load {step.level.label}, a load it should serve; "
                    f"first error: {first_error[:200]}.", s.log_excerpt()))
            served = search.served_of(
                step.metrics, step.server_metrics,
                mean_input_tokens=None if is_text else mean_prompt_tokens(workload),
                mean_output_tokens=None if is_text else mean_tokens(workload.output_len))
            if served is None and not step.meets_slo and step.completed_rate_rps and \
                    step.offered_rate_rps and search.axis == "request_rate" and \
                    step.completed_rate_rps < step.offered_rate_rps * (1 - search.tolerance):
                # Fell behind in its window, no drain bias: what it served steers the next.
                served = step.completed_rate_rps
            if is_hold and not step.meets_slo:
                history[:] = supersede_history(history, load, served)
                steps[:] = supersede_steps(search, steps, step)
            else:
                history.append((load, bool(step.meets_slo), served))
            steps.append(step)
            logger.info("capacity %s %d at %s: SLO %s%s (served %s); bracket %s",
                        "hold" if is_hold else "step", index, step.level.label,
                        "met" if step.meets_slo else "missed",
                        f" ({verdict.reason})" if verdict.reason else "",
                        "?" if served is None else f"{served:.3g}",
                        search.bracket(history, unapplied_of(search, steps)).describe())
            if step.meets_slo:
                met_loads.append(load)
                if step.metrics.p90_e2el_ms is not None:  # a missed step's lives queued
                    lifetime_s = lifetime_estimate_s(
                        workload, measured_e2el_s=step.metrics.p90_e2el_ms / 1000.0)
            item = next_measurement(search, history, holds_of(search, steps))
            # After the last step the stream goes on at the profile's load, where asked.
            follow = item[0] if item is not None else \
                search.load_of(profile_level(workload, steps)) if is_profiled else None
            if not step.meets_slo:
                # The next load first, then the backlog (ours) cancelled: the stream never
                # refills at the load that missed, and the next step starts from an empty
                # server, not from a drain (its cancel waits 10 s at most: on a starved
                # client host what still runs then runs on into the next step).
                if follow is not None:
                    driver.set_load(follow)
                cancelled = driver.cancel_in_flight()
                if cancelled:
                    logger.info("%s %d missed; %d requests in flight cancelled before "
                                "the next", "hold" if is_hold else "step", index, cancelled)
            if on_step is not None and on_step(step):
                return "stopped", None
        if profile_dir is None:
            return "complete", None
        return "complete", _profile_stream(s, driver, steps, run, lifetime_s, check_engine,
                                           profile_dir)
    finally:
        driver.close()


def holds_of(search: CapacitySearch, steps: Sequence[StepMetrics]) -> list[tuple[float, bool]]:
    """(load, met the SLO) of each hold among `steps`, in order."""
    return [(search.load_of(s.level), bool(s.meets_slo)) for s in steps if s.is_hold]


def unapplied_of(search: CapacitySearch, steps: Sequence[StepMetrics]) -> list[float]:
    """The loads of `steps` whose load was not applied (`Verdict.is_load_unapplied`): they
    steer the search as misses do, but end no bracket (`CapacitySearch.bracket`)."""
    return [search.load_of(s.level) for s in steps
            if s.server_metrics.get("steady.is_load_unapplied", 0.0) > 0]


def next_measurement(search: CapacitySearch, history: Sequence[Probe],
                     holds: Sequence[tuple[float, bool]]) -> tuple[float, bool] | None:
    """What the stream measures next: a step while the search narrows the bracket (until the
    first hold), then holds (`CapacitySearch.next_hold`); None when done. A hold that missed
    where no step had met below it leaves nothing to hold: the steps walk on down from it
    toward `low` (`CapacitySearch.next_load`, the hold counted as a miss at its load) until
    they have found a bracket below it, which is then held."""
    if not holds or is_walking_down(history, holds):
        load = search.next_load(history)
        if load is not None:
            return load, False
    hold = search.next_hold(history, holds)
    return (hold, True) if hold is not None else None


def is_walking_down(history: Sequence[Probe], holds: Sequence[tuple[float, bool]]) -> bool:
    """Whether the last hold missed with no step met below it before it ran: the probes after
    its own (the last at its load: the steps after it run below it) are steps again."""
    if not holds or holds[-1][1]:
        return False
    load = holds[-1][0]
    at = max((k for k, p in enumerate(history) if p[0] == load and not p[1]), default=None)
    if at is None:
        return False
    return not any(p[1] and p[0] < load for p in history[:at])


def supersede_history(history: Sequence[Probe], missed_load: float,
                      served: float | None) -> list[Probe]:
    """The probes after a hold at `missed_load` missed: the steps that met at or above it
    count as missed (a short window's p99 is about its median: docs/h100-steady.md), and the hold
    is a miss at its load."""
    out: list[Probe] = []
    for probe in history:
        load, ok = probe[0], probe[1]
        out.append((load, ok and load < missed_load, probe[2] if len(probe) > 2 else None))
    out.append((missed_load, False, served))
    return out


def supersede_steps(search: CapacitySearch, steps: Sequence[StepMetrics],
                    hold: StepMetrics) -> list[StepMetrics]:
    """The steps after `hold` missed: each step (not a hold) that met at or above its load is
    marked missed, saying which hold overturned it; the record keeps its figures."""
    load = search.load_of(hold.level)
    window_s = hold.server_metrics.get("steady.window_s", 0.0)
    out = []
    for step in steps:
        if step.meets_slo and not step.is_hold and search.load_of(step.level) >= load:
            step = replace(step, meets_slo=False, miss_reason=(
                f"met in its {step.server_metrics.get('steady.window_s', 0.0):.0f} s window, "
                f"but the hold at {hold.level.label} (step {hold.step}, a {window_s:.0f} s "
                f"window) missed: {hold.miss_reason or 'the SLO'}"))
        out.append(step)
    return out


def _profile_stream(session: EngineSession, driver: StaircaseDriver,
                    steps: Sequence[StepMetrics], last: StepRun, lifetime_s: float,
                    check_engine: Callable[[], None], profile_dir: Path) -> Profiled:
    """The profile inside the steady operating point: the stream at the operating point's
    load (the highest that met the SLO, else the lightest probed), warmed up as a step is
    (or already there: the last step ran at it and met), then a window of
    `profile_num_requests` arrivals between /start_profile and /stop_profile. What it
    covered goes beside the trace's figures (`ProfileWindow.as_summary`)."""
    workload, base_url = session.workload, session.base_url
    search = workload.capacity
    assert search is not None
    level = profile_level(workload, steps)
    load = search.load_of(level)
    is_operating_point = any(s.meets_slo for s in steps)
    # The last step ran at this load and met: the stream has been at it since that step
    # began, in steady state.
    since_s = last.window_start_s - last.warmup_s if steps and steps[-1].meets_slo and \
        search.load_of(steps[-1].level) == load else None
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False,
                          headers=auth_headers(session.api_key)) as client:
            window = profile_window(
                driver, plan_step(search, load, lifetime_s), since_s=since_s,
                num_requests=workload.profile_num_requests,
                is_operating_point=is_operating_point, check_engine=check_engine,
                start_profile=lambda: client.post(
                    f"{base_url}/start_profile").raise_for_status(),
                stop_profile=lambda: client.post(
                    f"{base_url}/stop_profile").raise_for_status())
    except httpx.HTTPError as exc:
        logger.warning("profiling failed (%s); the trial keeps its measurements", exc)
        return None, None
    except Abort as abort:  # the measured steps are over: a profiler's trouble is not theirs
        logger.warning("the engine failed in the profiled window (%s); the trial keeps its "
                       "measurements", abort.failure.message)
        return None, None
    logger.info("profiled %.1f s of the stream at %s (%s; %.0f s at that load before, "
                "%.1f in flight)", window.window_s, level.label,
                "the operating point" if is_operating_point else
                "the lightest load probed: none met the SLO", window.warmup_s,
                window.mean_in_flight)
    path, summary = read_trace(profile_dir)
    if summary is None:
        return path, None
    return path, {**summary, **window.as_summary()}

def judge_step(session: EngineSession, run: StepRun, index: int) -> tuple[StepMetrics, Verdict]:
    """A staircase step as a `StepMetrics` (the median window where repeated) and its
    verdict."""
    workload, started = session.workload, session.started
    search = workload.capacity
    assert search is not None
    level = search.level(run.plan.load)
    if level.request_rate_rps is not None and workload.burstiness != 1.0:
        level = replace(level, burstiness=workload.burstiness)
    is_closed = search.axis == "concurrency"
    per_window: list[tuple[Any, WindowCounts, Verdict]] = []
    for outputs, counts in run.windows:
        ours = [o for o in outputs if o.error != STOPPED_ERROR]
        metrics = compute_metrics(ours or outputs, counts.window_s, workload.slo)
        verdict = judge_window(
            metrics, counts, workload.slo, max_failed_fraction=workload.max_failed_fraction,
            tolerance=search.tolerance, is_saturated=run.is_saturated,
            is_closed_loop=is_closed,
            concurrency=run.plan.load if is_closed else None,
            min_requests=run.plan.min_requests,
            min_window_s=0.0 if run.decided_early else run.plan.min_window_s,
            max_window_s=run.plan.max_window_s)
        per_window.append((metrics, counts, verdict))
    server = dict(run.server)
    server["is_saturated"] = 1.0 if run.is_saturated else 0.0
    server["steady.warmup_s"] = run.warmup_s
    server["steady.is_hold"] = 1.0 if run.plan.is_hold else 0.0
    if not per_window:  # stopped in its warm-up: what it served until then
        ours = [o for o in run.early_outputs if o.error != STOPPED_ERROR]
        metrics = compute_metrics(ours, max(run.early_duration_s, 1e-9), workload.slo)
        if run.missed_in_warmup is not None:
            # Its figures are its warm-up's ended requests, with no offered or completed rate:
            # a warm-up's completions trail its arrivals and say nothing of what it serves.
            verdict = Verdict(False, run.missed_in_warmup)
        else:
            verdict = judge_window(
                metrics, None, workload.slo, max_failed_fraction=workload.max_failed_fraction,
                tolerance=search.tolerance, is_saturated=True, is_closed_loop=is_closed)
        step = StepMetrics(step=index, level=level, metrics=metrics, server_metrics=server,
                           elapsed_s=time.monotonic() - started, meets_slo=False,
                           miss_reason=verdict.reason)
        return step, verdict
    order = sorted(range(len(per_window)),
                   key=lambda k: per_window[k][0].output_throughput)
    metrics, counts, verdict = per_window[order[len(order) // 2]]
    # Repeated windows: the step meets the SLO only if every window did.
    reason_counts = counts  # the window the reason is of
    missed = next(((c, v) for _, c, v in per_window if not v.meets_slo), None)
    if missed is not None:
        reason_counts, verdict = missed
    if not run.is_settled and verdict.meets_slo:
        verdict = Verdict(False, f"not steady: the in-flight count still rose after "
                                 f"{run.warmup_s:.0f} s of warm-up")
    if not run.is_finished and verdict.meets_slo:
        verdict = Verdict(False, "measured requests still running when the wait for them ended")
    if run.decided_early is not None:
        # Its window is the part it ran: the figures are of those requests, and the verdict
        # is theirs (a miss: more were over a bound than the p99 of any longer window allows).
        cut = (f"stopped after {counts.window_s:.0f} of {run.plan.window_s:.0f} s: "
               f"{run.decided_early}")
        verdict = Verdict(False, f"{verdict.reason}; {cut}" if not verdict.meets_slo else cut,
                          is_overload_errors=verdict.is_overload_errors,
                          is_load_unapplied=verdict.is_load_unapplied)
        server["steady.planned_window_s"] = run.plan.window_s
    # A missed hold says what its window offered, off its label (a step's short window is off by
    # chance: its record has the rate); a load not applied has said what it was offered.
    if run.plan.is_hold and not (is_closed or verdict.meets_slo or verdict.is_load_unapplied):
        offered = offered_note(run.plan.load, reason_counts.num_sent, reason_counts.window_s)
        if offered is not None:
            verdict = replace(verdict, reason=f"{verdict.reason}; {offered}")
    server.update({
        "steady.window_s": counts.window_s,
        "steady.lifetime_s": run.plan.lifetime_s,
        "steady.num_measured": float(counts.num_sent),
        "steady.num_ended_in_window": float(counts.num_ended),
        "steady.mean_in_flight": counts.mean_in_flight,
        "steady.is_settled": 1.0 if run.is_settled else 0.0,
        "is_saturated": 1.0 if run.is_saturated else 0.0})
    # (sent_span_s: the simulated engine's window, its sends on the client's clock)
    server.update({f"steady.{name}": value for name, value in (
        ("waiting_rise", counts.waiting_rise), ("in_flight_rise", counts.in_flight_rise),
        ("sent_span_s", counts.sent_span_s)) if value is not None})
    if counts.late_bound_s is not None:
        server["steady.num_sent_late"] = float(counts.num_sent_late)
        server["steady.late_bound_s"] = counts.late_bound_s
    if verdict.is_load_unapplied:
        server["steady.is_load_unapplied"] = 1.0
    if counts.server_mean_in_system is not None:
        server["steady.server_mean_in_system"] = counts.server_mean_in_system
    if any(o.modelled_span_s is not None for outs, _ in run.windows for o in outs):
        server["is_modelled_clock"] = 1.0
    hit_rate = prometheus.prefix_cache_hit_rate(server)
    if hit_rate is not None:
        server["prefix_cache_hit_rate"] = hit_rate
    server.update(prometheus.spec_decode_acceptance(server))
    util = session.sampler.gpu_util_mean_pct_since(run.window_start_s) \
        if session.sampler else None
    if util is not None:
        server["gpu_util_mean_pct"] = util
    step = StepMetrics(
        step=index, level=level, metrics=metrics, server_metrics=server,
        elapsed_s=time.monotonic() - started, meets_slo=verdict.meets_slo,
        repeats=tuple(m for m, _, _ in per_window) if len(per_window) > 1 else (),
        miss_reason=verdict.reason,
        offered_rate_rps=counts.num_sent / counts.window_s,
        completed_rate_rps=counts.num_ended / counts.window_s)
    return step, verdict
