"""A small, valid chrome trace of a trace's GPU events (`trim`), alone or in the same read as
its summary (`summarize_and_trim`): for test fixtures and tracker artifacts."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from runners.profiler_trace.events import iter_gpu_events
from runners.profiler_trace.summary import REORDER_WINDOW, summarize_events

_KEPT_ARGS: Final = ("device", "stream", "correlation")


def _slim(event: Mapping[str, Any], ts: float) -> dict[str, Any]:
    """A GPU event with only what the analysis reads."""
    args = event.get("args")
    args = args if isinstance(args, Mapping) else {}
    return {"ph": "X", "cat": event.get("cat"), "name": event.get("name", ""),
            "pid": event.get("pid", 0), "tid": event.get("tid", 0), "ts": ts,
            "dur": event.get("dur", 0.0), "args": {k: args[k] for k in _KEPT_ARGS if k in args}}


def _write_trimmed(kept: list[dict[str, Any]], source: Path, out_path: Path, max_events: int,
                   start_offset_us: float, note: str | None) -> None:
    trace = {"schemaVersion": 1, "displayTimeUnit": "ms",
             "nightshift_trim": {"source": source.name, "max_events": max_events,
                                 "start_offset_us": start_offset_us, "note": note or ""},
             "traceEvents": kept}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if out_path.name.endswith(".gz"):
        # mtime=0: the same input gives the same bytes, so a re-trimmed fixture diffs clean.
        with out_path.open("wb") as raw, \
                gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped:
            zipped.write(json.dumps(trace).encode("utf-8"))
    else:
        out_path.write_text(json.dumps(trace), encoding="utf-8")


def trim(path: Path, out_path: Path, max_events: int = 2000, *,
         start_offset_us: float = 0.0, note: str | None = None) -> int:
    """Write a small, valid chrome trace of the GPU events (kernels, memcpy, memset) of `path`
    that start at least `start_offset_us` after the first one, at most `max_events` of them,
    with only the args the analysis reads. Gzipped when `out_path` ends in `.gz`. Stops reading
    once it has enough. Returns the number of events written.

    For fixtures and tracker artifacts: the full trace of a real run is tens of MB."""
    if max_events < 1:
        raise ValueError(f"max_events must be >= 1 but got {max_events}.")
    kept: list[dict[str, Any]] = []
    origin: float | None = None
    events = iter_gpu_events(path)
    for event in events:
        try:
            ts = float(event["ts"])
        except (KeyError, TypeError, ValueError):
            continue
        origin = ts if origin is None else origin
        if ts - origin < start_offset_us:
            continue
        kept.append(_slim(event, ts))
        if len(kept) >= max_events:
            break
    events.close()  # closes the file now, not when the generator is collected
    _write_trimmed(kept, path, out_path, max_events, start_offset_us, note)
    return len(kept)


def summarize_and_trim(path: Path, out_path: Path, max_events: int = 2000, *,
                       note: str | None = None,
                       reorder_window: int = REORDER_WINDOW) -> dict[str, float]:
    """`summarize(path)` and `trim(path, out_path, max_events)` in one read of the file: a
    torch trace keeps its GPU events after its CPU ones, so a separate trim reads most of the
    file again before its first kernel."""
    if max_events < 1:
        raise ValueError(f"max_events must be >= 1 but got {max_events}.")
    kept: list[dict[str, Any]] = []

    def keeping_the_first() -> Iterator[dict[str, Any]]:
        for event in iter_gpu_events(path):
            if len(kept) < max_events:
                with contextlib.suppress(KeyError, TypeError, ValueError):  # no usable ts
                    kept.append(_slim(event, float(event["ts"])))
            yield event

    summary = summarize_events(keeping_the_first(), reorder_window=reorder_window)
    _write_trimmed(kept, path, out_path, max_events, 0.0, note)
    return summary
