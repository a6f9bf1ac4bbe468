"""Measuring a load level on a running engine, one bounded run of requests at a time: fixed
levels, and a trace's or conversations' capacity probes (`runners/capacity/probes.py`); each
level starts from a cold prefix cache and is judged for crashes, stalls, errors and saturation.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from runners import arrivals, conversations, prometheus
from runners.applied_load import judge_level_load
from runners.base import Failure, FailureReason, OnStep, RunStatus, StepMetrics
from runners.capacity.search import CapacitySearch
from runners.load_level import LoadLevel
from runners.loadgen.level import run_level_sync
from runners.loadgen.metrics import prompt_len_gap
from runners.loadgen.requests import build_requests
from runners.session import Abort, EngineSession
from runners.workload import LengthDistribution, Workload

logger = logging.getLogger(__name__)

_DURATION_POOL = 4096  # requests synthesised for a duration-bound level (cycled)
_LONG_TRACE_GAP_S = 60.0  # a replayed trace idle this long is worth a word in the log


def run_levels(session: EngineSession, steps: list[StepMetrics],
               on_step: OnStep | None) -> RunStatus:
    """The workload's fixed levels in order, each appended to `steps` and shown to `on_step`
    (True: stop, "stopped")."""
    for index, level in enumerate(session.workload.levels):
        step = measure_repeated(session, index, level)
        steps.append(step)
        if on_step is not None and on_step(step):
            return "stopped"
    return "complete"


def measure_repeated(session: EngineSession, index: int, level: LoadLevel,
                     max_duration_s: float | None = None) -> StepMetrics:
    """A level measured `workload.repeats` times; its median run stands for it."""
    runs = [measure_level(session, index, level, max_duration_s)
            for _ in range(max(1, session.workload.repeats))]
    if len(runs) == 1:
        return runs[0]
    median = sorted(runs, key=lambda s: s.metrics.output_throughput)[len(runs) // 2]
    return replace(median, repeats=tuple(s.metrics for s in runs),
                   elapsed_s=runs[-1].elapsed_s)


def measure_level(session: EngineSession, index: int, level: LoadLevel,
                  max_duration_s: float | None = None) -> StepMetrics:
    """One load level on the running server; raises `Abort` when the engine failed.

    `max_duration_s` (a capacity probe's bound) stops sending new requests after that long,
    whether the level is bounded by requests or by `workload.duration_s`."""
    s, workload, proc, log_path = session, session.workload, session.proc, session.log_path
    base_url, config, started = session.base_url, session.config, session.started
    if level.request_rate_rps is not None and level.burstiness is None and \
            workload.trace is None and workload.burstiness != 1.0:
        # The level's record and label say the arrivals it was sent: the workload's gamma.
        level = replace(level, burstiness=workload.burstiness)
    num = workload.num_requests or _DURATION_POOL
    send_offsets_s: list[float] | None = None
    num_in_trace = 0
    if workload.trace is not None:  # the whole trace (or its first num_requests), once
        entries = workload.trace.entries  # parsed once per study (TraceReplay)
        num_in_trace = num = min(workload.num_requests or len(entries), len(entries))
        arrivals_s = [e.arrival_s for e in entries[:num]]
        trace_bound_s = max_duration_s if workload.num_requests or \
            workload.duration_s is None else \
            min(workload.duration_s, max_duration_s or workload.duration_s)
        is_probe = max_duration_s is not None and level.request_rate_rps is not None
        if is_probe:
            # A capacity probe replays the trace's first requests that its rate fits in its
            # time bound, at that rate: the probe's rate (and the bracket) is the rate of the
            # part replayed, not the whole trace's mean, which a cut replay never offered.
            num = arrivals.trace_prefix_len(arrivals_s, level.request_rate_rps,
                                            trace_bound_s)
        send_offsets_s = arrivals.trace_offsets_s(arrivals_s[:num], level.request_rate_rps)
        if is_probe and trace_bound_s is not None and send_offsets_s[-1] <= trace_bound_s:
            trace_bound_s = None  # the part is the bound: every request of it is sent
        max_duration_s = trace_bound_s
        longest_gap_s = max((b - a for a, b in itertools.pairwise(send_offsets_s)),
                            default=0.0)
        if longest_gap_s > _LONG_TRACE_GAP_S:
            logger.warning("level %d (%s) replays a gap of %.0f s between two requests of "
                           "the trace (the level lasts %.0f s at least); "
                           "workload.trace.max_gap_s cuts idle gaps", index, level.label,
                           longest_gap_s, send_offsets_s[-1])
    # The same prompts for every trial: the seed depends only on the level's index.
    if workload.multi_turn is not None:
        dialogues = conversations.build_conversations(workload, num,
                                                      seed=workload.seed * 1000 + index)
        num_sent = float(sum(len(c.turns) for c in dialogues))
        is_estimated = any(c.is_estimated for c in dialogues)
    else:
        requests = build_requests(workload, num, seed=workload.seed * 1000 + index)
        num_sent = float(len(requests))
        is_estimated = any(r.is_prompt_len_estimated for r in requests)
    # Each level starts from a cold prefix cache, so levels (and trials) compare: a level
    # must not be served from the blocks its predecessor computed (a shared-prefix
    # workload's hit rate is then the level's own: its first request of each prefix misses).
    s.reset_prefix_cache()
    before = prometheus.scrape(base_url, api_key=s.api_key)
    level_start_s = time.monotonic()
    # An open-loop level (a request rate) above what the engine serves grows its queue
    # without end: stop it once the queue has clearly grown; it is a saturated level.
    saturated = threading.Event() if level.request_rate_rps is not None else None
    # A trace is never cycled: its time bound is `max_duration_s` (set above).
    duration_s = None if workload.num_requests or send_offsets_s is not None \
        else workload.duration_s
    if duration_s is not None and max_duration_s is not None:
        duration_s, max_duration_s = min(duration_s, max_duration_s), None
    # The queue's rise that means "saturated" scales with what the level sends: a time
    # bound sends at most rate x duration of a large request pool.
    bound_s = duration_s if duration_s is not None else max_duration_s
    if bound_s is not None and level.request_rate_rps is not None:
        num_sent = min(num_sent, level.request_rate_rps * bound_s)
    poller = prometheus.MetricsPoller(
        base_url, saturated=saturated,
        saturation_rise_requests=max(16.0, 0.1 * num_sent), api_key=s.api_key)
    poller.start()
    turns: dict[str, float] = {}
    try:
        if workload.multi_turn is not None:
            result, turn_outputs, num_cut = conversations.run_conversations_sync(
                base_url, config.served_model_name, dialogues, level, workload.slo,
                timeout_s=workload.request_timeout_s, tokenizer_dir=workload.tokenizer_dir,
                stall_timeout_s=s.stall_timeout_s, stop_event=saturated,
                duration_s=duration_s if duration_s is not None else max_duration_s,
                max_context_len=workload.dataset.max_total_len
                if workload.dataset is not None else None, api_key=s.api_key)
            turns = conversations.turn_metrics(turn_outputs, num_cut)
        else:
            result = run_level_sync(
                base_url, config.served_model_name, requests, level, workload.slo,
                timeout_s=workload.request_timeout_s, seed=workload.seed + index,
                duration_s=duration_s, max_duration_s=max_duration_s,
                stall_timeout_s=s.stall_timeout_s, stop_event=saturated,
                burstiness=workload.burstiness_of(level), send_offsets_s=send_offsets_s,
                api_key=s.api_key)
    finally:
        polled = poller.stop()
    is_saturated = bool(saturated is not None and saturated.is_set() and result.stopped)
    # An engine that died mid-level closes its sockets before it is reaped: wait a
    # moment so a crash is not mistaken for failed requests.
    if (result.metrics.failed and proc.wait(timeout_s=0.5) is not None) or \
            not proc.is_alive() or result.server_gone:
        raise Abort(s.failure("run"))
    if result.stalled:
        raise Abort(Failure(
            FailureReason.HANG,
            f"{s.name} (pid {proc.pid}) stopped producing tokens for "
            f"{s.stall_timeout_s:g} s at load {level.label}; see {log_path}.",
            s.log_excerpt()))
    m = result.metrics
    total = m.completed + m.failed
    if is_saturated:  # the cancelled requests are ours, not the engine's failures
        logger.info("level %d (%s) stopped early: the queue kept growing (saturated)",
                    index, level.label)
    elif total and m.failed / total > workload.max_failed_fraction:
        first_error = next((o.error for o in result.outputs if not o.success), "")
        raise Abort(Failure(
            FailureReason.TOO_MANY_ERRORS,
            f"{m.failed} of {total} requests failed at load {level.label} (allowed "
            f"{workload.max_failed_fraction:.0%}); first error: {first_error[:200]}.",
            s.log_excerpt()))
    after = prometheus.scrape(base_url, api_key=s.api_key)
    server = {**prometheus.delta(before, after), **polled,
              "is_saturated": 1.0 if is_saturated else 0.0}
    # Over the whole level (the scrapes around it), not the poller's first-to-last sample.
    hit_rate = prometheus.prefix_cache_hit_rate(server)
    if hit_rate is not None:
        server["prefix_cache_hit_rate"] = hit_rate
    server.update(prometheus.spec_decode_acceptance(server))
    if result.is_modelled_clock:  # the record says its times are a model's clock
        server["is_modelled_clock"] = 1.0
    # The client's prompt lengths against the server's usage.prompt_tokens; and whether
    # the client's were estimates (text without the model's tokenizer).
    server.update(prompt_len_gap(result.outputs))
    server["prompt_len_is_estimated"] = 1.0 if is_estimated else 0.0
    server.update(turns)
    if send_offsets_s is not None:
        server.update(_trace_replayed(send_offsets_s, len(result.outputs), level,
                                      num_in_trace))
    # Whether the client applied the load the level is labelled with, by the staircase's
    # rules and tolerance (runners/applied_load.py: a multi-turn level over the span in which
    # every slot still had conversations left, or not at all where that was too short).
    applied = judge_level_load(
        level, result.sends, result.outputs, poller.samples,
        workload.capacity.tolerance if workload.capacity is not None
        else CapacitySearch.tolerance)
    server.update(applied.as_server_metrics())
    if applied.reason is not None:
        logger.warning("level %d (%s): %s", index, level.label, applied.reason)
    elif applied.note is not None:
        logger.info("level %d (%s): %s", index, level.label, applied.note)
    # NVML over this level alone: the run's mean mixes light and heavy levels.
    util = s.sampler.gpu_util_mean_pct_since(level_start_s) if s.sampler else None
    if util is not None:
        server["gpu_util_mean_pct"] = util
    logger.info("level %d (%s): %.2f req/s, %.0f tok/s, TPOT p99 %s", index,
                level.label, m.request_throughput, m.output_throughput,
                "n/a (no request had a second token)" if m.p99_tpot_ms is None
                else f"{m.p99_tpot_ms:.1f} ms")
    return StepMetrics(step=index, level=level, metrics=m, server_metrics=server,
                       elapsed_s=time.monotonic() - started, miss_reason=applied.reason)


def mean_prompt_tokens(workload: Workload) -> float | None:
    """The mean prompt a level sends, shared prefix included; None when the prompts come from
    a file, a trace or a dataset, or grow over a conversation's turns (not known without
    reading them)."""
    if workload.prompts_file is not None or workload.trace is not None or \
            workload.dataset is not None or workload.multi_turn is not None:
        return None
    shared = workload.shared_prefix
    extra = shared.fraction * shared.num_tokens if shared is not None else 0.0
    return mean_tokens(workload.input_len) + extra


def mean_tokens(dist: LengthDistribution) -> float:
    """The mean length a distribution draws (a uniform one's `mean` may be left unset)."""
    if dist.kind == "uniform" and dist.low is not None and dist.high is not None:
        return (dist.low + dist.high) / 2
    return float(dist.mean)


def _trace_replayed(offsets_s: Sequence[float], num_sent: int, level: LoadLevel,
                    num_in_trace: int) -> dict[str, float]:
    """How much of a trace a level replayed: the requests sent of the trace's, and, where it
    sent fewer (a capacity probe replays a part; a time bound or saturation cut it), the mean
    rate they were sent at: a fixed level's rate is the whole trace's, which a cut replay did
    not offer; a probe's is its part's, unless saturation cut that."""
    out = {"trace_num_replayed": float(num_sent),
           "trace_num_requests": float(num_in_trace)}
    if 0 < num_sent < num_in_trace:
        try:
            rate: float | None = arrivals.trace_rate_rps(offsets_s[:num_sent])
        except ValueError:  # one request sent, or all at one instant: no rate
            rate = None
        if rate is not None:
            out["trace_replayed_rate_rps"] = rate
        if num_sent < len(offsets_s):
            logger.warning("level %s sent %d of the trace's %d requests before it ended; "
                           "they were sent at %s, where the level's rate is %s", level.label,
                           num_sent, num_in_trace, "?" if rate is None else f"{rate:.3g} req/s",
                           "the whole trace's" if len(offsets_s) == num_in_trace else
                           f"that of its first {len(offsets_s)}")
        else:
            logger.info("level %s replayed the trace's first %d of %d requests, at %s",
                        level.label, num_sent, num_in_trace,
                        "?" if rate is None else f"{rate:.3g} req/s")
    return out
