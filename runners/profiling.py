"""The torch-profiler window of a run and the trace it leaves: `profile_after_levels` (a
window of its own after fixed levels or a trace's or conversations' probes; the staircase
profiles inside its stream instead: runners/capacity/staircase.py), `profile_level` (the load
either runs at), `read_trace` (the trace settled on disk, trimmed and summarised).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from runners.base import StepMetrics
from runners.credentials import auth_headers
from runners.load_level import LoadLevel
from runners.loadgen.level import run_level_sync
from runners.loadgen.requests import build_requests
from runners.session import EngineSession
from runners.workload import Workload

logger = logging.getLogger(__name__)

_TRACE_ARTIFACT_EVENTS = 20_000
_TRACE_SETTLE_TIMEOUT_S = 120.0  # a large eager trace takes seconds to write and gzip
# A profiled window's result: the trimmed trace (the artifact) and its summary.
Profiled = tuple[Path | None, Mapping[str, Any] | None]


def profile_after_levels(session: EngineSession, steps: Sequence[StepMetrics],
                         profile_dir: Path) -> Profiled:
    """A short profiled window after the measured levels, where the staircase did not
    take one inside its stream (fixed levels; a trace's or conversations' probes):
    profiling slows the engine, so no performance figure is ever taken from it. After
    such a capacity search it runs at the operating point's load (the highest that met the
    SLO; else the lightest probed), anew: `profile_num_requests` into an empty server, a
    lighter batch than a steady operating point holds. Its summary says so
    (`profile.is_in_stream` 0)."""
    s, workload, base_url, config = session, session.workload, session.base_url, session.config
    requests = build_requests(workload, workload.profile_num_requests,
                                      seed=workload.seed + 104729)
    level = profile_level(workload, steps)
    try:
        with httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False,
                          headers=auth_headers(s.api_key)) as client:
            client.post(f"{base_url}/start_profile").raise_for_status()
            start = time.monotonic()
            sent = run_level_sync(
                base_url, config.served_model_name, requests, level, workload.slo,
                timeout_s=workload.request_timeout_s, seed=workload.seed,
                stall_timeout_s=s.stall_timeout_s, api_key=s.api_key)
            window_s = time.monotonic() - start
            client.post(f"{base_url}/stop_profile").raise_for_status()
    except httpx.HTTPError as exc:
        logger.warning("profiling failed (%s); the trial keeps its measurements", exc)
        return None, None
    path, summary = read_trace(profile_dir)
    if summary is None:
        return path, None
    load = {"profile.request_rate_rps": level.request_rate_rps} \
        if level.request_rate_rps is not None else \
        {"profile.concurrency": float(level.max_concurrency or 0)}
    return path, {**summary, **load, "profile.window_s": window_s,
                  "profile.num_sent": float(len(sent.outputs)),
                  "profile.is_in_stream": 0.0}


def read_trace(profile_dir: Path) -> Profiled:
    """The trace a profiled window wrote under `profile_dir`, once settled: its trimmed copy
    (the artifact) and its summary; (None, None) where no trace came, (the trace, None) where
    it could not be read."""
    gpu_traces = _settled_traces(profile_dir, _TRACE_SETTLE_TIMEOUT_S)
    if not gpu_traces:
        logger.warning("no trace file under %s within %g s of /stop_profile", profile_dir,
                       _TRACE_SETTLE_TIMEOUT_S)
        return None, None
    from runners.profiler_trace.summary import summarize_many
    from runners.profiler_trace.trim import summarize_and_trim, trim

    # One file per rank of this capture (TP > 1): the newest of each rank.
    newest: dict[str, Path] = {}
    for candidate in gpu_traces:
        newest[candidate.name.split(".")[0]] = candidate
    ranks = sorted(newest.values())
    try:
        # The artifact is a trimmed copy (kernel events only): full traces run to
        # hundreds of MB; the full one stays in the trial's directory.
        trimmed = profile_dir.parent / "trace.trimmed.pt.trace.json.gz"
        note = f"kernel events of {ranks[0].name}, trimmed by nightshift"
        if len(ranks) > 1:
            summary = summarize_many(ranks)
            trim(ranks[0], trimmed, max_events=_TRACE_ARTIFACT_EVENTS, note=note)
        else:
            summary = summarize_and_trim(ranks[0], trimmed,
                                               max_events=_TRACE_ARTIFACT_EVENTS, note=note)
    except (ValueError, OSError) as exc:  # a cut or corrupt trace: keep the measurements
        logger.warning("trace %s could not be read (%s)", ranks[0], exc)
        return ranks[0], None
    return trimmed, summary


def profile_level(workload: Workload, steps: Sequence[StepMetrics]) -> LoadLevel:
    """The load a profile window runs at: a capacity search's operating point (its highest
    load within the SLO, else its lightest probe); else the last level as a closed loop."""
    probed = [s for s in steps if s.meets_slo is not None]
    if workload.capacity is not None and probed:
        within = [s for s in probed if s.meets_slo]
        search = workload.capacity
        pick = max(within, key=lambda s: search.load_of(s.level)) if within else \
            min(probed, key=lambda s: search.load_of(s.level))
        return pick.level
    level = workload.levels[-1]
    return LoadLevel(max_concurrency=level.max_concurrency or 16)


def _settled_traces(profile_dir: Path, timeout_s: float, poll_s: float = 1.0) -> list[Path]:
    """The GPU trace files under `profile_dir`, oldest first, once they exist and their sizes
    have stopped changing: the workers may still be writing (and gzipping) when /stop_profile
    answers, and a half-written file reads as a corrupt trace. Empty after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    previous: dict[Path, tuple[int, float]] | None = None
    while True:
        sizes: dict[Path, tuple[int, float]] = {}
        for path in profile_dir.rglob("*.pt.trace.json*"):
            if "async_llm" in path.name:  # the front-end's CPU-only trace
                continue
            try:
                stat = path.stat()
            except FileNotFoundError:  # renamed between listing and stat
                continue
            sizes[path] = (stat.st_size, stat.st_mtime)
        if sizes and sizes == previous:
            return sorted(sizes, key=lambda p: sizes[p][1])
        if time.monotonic() >= deadline:
            return []
        previous = sizes
        time.sleep(poll_s)
