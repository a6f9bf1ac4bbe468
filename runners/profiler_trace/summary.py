"""GPU time of a trace, summed: by kernel category, busy time as the union over streams, launch
gaps (`summarize`, `summarize_many`), and the kernels with the most time (`top_kernels`)."""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from runners.profiler_trace.events import iter_gpu_events
from runners.profiler_trace.kernels import CATEGORIES, classify_kernel

logger = logging.getLogger(__name__)

REORDER_WINDOW: Final = 1 << 14  # kernels held back to put slightly out-of-order events right
# Gap histogram: 50 log bins per decade from 10 ns to 10 s (4.7% wide), plus a bin for zero.
_GAP_BINS_PER_DECADE: Final = 50
_GAP_MIN_US: Final = 0.01
_GAP_NUM_BINS: Final = 9 * _GAP_BINS_PER_DECADE


def _stream_key(event: Mapping[str, Any]) -> tuple[Any, Any]:
    args = event.get("args")
    args = args if isinstance(args, Mapping) else {}
    # Kineto puts the device in pid and the stream in tid as well as in args; either will do.
    return args.get("device", event.get("pid")), args.get("stream", event.get("tid"))


@dataclass
class _StreamStats:
    busy_us: float = 0.0  # sum of its kernels' durations
    last_end_us: float | None = None
    gap_bins: list[int] = field(default_factory=lambda: [0] * (_GAP_NUM_BINS + 1))
    num_gaps: int = 0

    def add_gap(self, gap_us: float) -> None:
        self.num_gaps += 1
        if gap_us <= 0.0:
            self.gap_bins[0] += 1
            return
        index = int(math.log10(max(gap_us, _GAP_MIN_US) / _GAP_MIN_US) * _GAP_BINS_PER_DECADE)
        self.gap_bins[1 + min(index, _GAP_NUM_BINS - 1)] += 1

    def median_gap_us(self) -> float | None:
        if not self.num_gaps:
            return None
        half, seen = self.num_gaps / 2.0, 0
        for index, count in enumerate(self.gap_bins):
            seen += count
            if seen >= half:
                if index == 0:
                    return 0.0
                # The geometric centre of the bin: within 2.3% of any gap that fell in it.
                return float(_GAP_MIN_US * 10 ** ((index - 0.5) / _GAP_BINS_PER_DECADE))
        return None  # unreachable: the counts add up to num_gaps


class _Accumulator:
    """Folds GPU events into totals. The busy-time union and per-stream gaps need events in
    start order; traces are nearly sorted, so a min-heap of `reorder_window` events restores the
    order with bounded memory. An event later than the window is still counted (its time, its
    kernel) but may be under-counted in busy time: `num_late_kernels` says how many."""

    def __init__(self, reorder_window: int = REORDER_WINDOW) -> None:
        self.reorder_window = reorder_window
        self.category_us: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
        self.categories: dict[str, str] = {}  # name -> category, classified once per name
        self.stream_ids: dict[tuple[Any, Any], int] = {}
        self.stream_list: list[_StreamStats] = []
        self.num_kernels = 0
        self.first_start_us = math.inf
        self.last_end_us = -math.inf
        self.busy_us = 0.0
        self.num_late_kernels = 0
        self._heap: list[tuple[float, float, int]] = []
        self._segment: tuple[float, float] | None = None
        self._watermark_us = -math.inf

    def add(self, event: Mapping[str, Any]) -> None:
        try:
            start = float(event["ts"])
            dur = max(float(event.get("dur", 0.0)), 0.0)
        except (KeyError, TypeError, ValueError):
            return  # a GPU event without a time says nothing about time
        name = str(event.get("name", ""))
        category = self.categories.get(name)
        if category is None:
            category = classify_kernel(name, str(event.get("cat", "kernel")))
            self.categories[name] = category
        self.category_us[category] += dur
        self.num_kernels += 1
        end = start + dur
        self.first_start_us = min(self.first_start_us, start)
        self.last_end_us = max(self.last_end_us, end)
        key = _stream_key(event)
        stream = self.stream_ids.get(key)
        if stream is None:
            stream = self.stream_ids[key] = len(self.stream_list)
            self.stream_list.append(_StreamStats())
        self.stream_list[stream].busy_us += dur
        heapq.heappush(self._heap, (start, end, stream))
        if len(self._heap) > self.reorder_window:
            self._consume(*heapq.heappop(self._heap))

    def _consume(self, start: float, end: float, stream_id: int) -> None:
        if start < self._watermark_us:
            self.num_late_kernels += 1
        self._watermark_us = max(self._watermark_us, start)
        segment = self._segment
        if segment is None:
            self._segment = (start, end)
        elif start <= segment[1]:
            # A late event before the open segment is clipped to it: undercount, never double.
            self._segment = (segment[0], max(segment[1], end))
        else:
            self.busy_us += segment[1] - segment[0]
            self._segment = (start, end)
        stream = self.stream_list[stream_id]
        if stream.last_end_us is not None:
            stream.add_gap(start - stream.last_end_us)
            stream.last_end_us = max(stream.last_end_us, end)
        else:
            stream.last_end_us = end

    def finish(self) -> None:
        while self._heap:
            self._consume(*heapq.heappop(self._heap))
        if self._segment is not None:
            self.busy_us += self._segment[1] - self._segment[0]
            self._segment = None
        if self.num_late_kernels:
            logger.warning("%d kernels arrived more than %d events out of order; GPU busy time "
                           "may be under-counted", self.num_late_kernels, self.reorder_window)

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {"num_kernels": float(self.num_kernels)}
        total_us = sum(self.category_us.values())
        out["kernel_time_s"] = total_us / 1e6
        if not self.num_kernels:
            return out
        for category, us in self.category_us.items():
            out[f"{category}_s"] = us / 1e6
            out[f"{category}_share"] = us / total_us if total_us > 0 else 0.0
        span_us = self.last_end_us - self.first_start_us
        out["kernel_span_s"] = span_us / 1e6
        out["gpu_busy_s"] = self.busy_us / 1e6
        if span_us > 0:
            busy_fraction = min(1.0, self.busy_us / span_us)
            out["gpu_busy_fraction"] = busy_fraction
            out["idle_gap_share"] = 1.0 - busy_fraction
        busiest = max(self.stream_list, key=lambda s: s.busy_us)
        median = busiest.median_gap_us()
        if median is not None:
            out["median_gap_us"] = median
        out["num_streams"] = float(len(self.stream_list))
        out["num_late_kernels"] = float(self.num_late_kernels)
        return out


def _accumulate(events: Iterable[Mapping[str, Any]], reorder_window: int) -> _Accumulator:
    acc = _Accumulator(reorder_window)
    for event in events:
        acc.add(event)
    acc.finish()
    return acc


def summarize(path: Path, *, reorder_window: int = REORDER_WINDOW) -> dict[str, float]:
    """GPU-time summary of one rank's trace.

    Keys: `num_kernels` (kernel, memcpy and memset events), `kernel_time_s` (their summed
    durations), `{category}_s` and `{category}_share` (of `kernel_time_s`) for every name in
    `CATEGORIES`, `kernel_span_s` (first start to last end), `gpu_busy_s` (union over all
    streams), `gpu_busy_fraction` (busy / span), `idle_gap_share` (1 - that), `median_gap_us`
    (between consecutive kernels on the stream with the most kernel time; 4.7% resolution),
    `num_streams`, `num_late_kernels`. A trace without GPU events gives only the first two.
    Raises ValueError for a file that is not a chrome trace, OSError when it cannot be read.
    """
    return summarize_events(iter_gpu_events(path), reorder_window=reorder_window)


def summarize_events(events: Iterable[Mapping[str, Any]], *,
                     reorder_window: int = REORDER_WINDOW) -> dict[str, float]:
    """`summarize` over GPU events already in hand (kernel, memcpy, memset `X` events)."""
    return _accumulate(events, reorder_window).summary()


def summarize_many(paths: Sequence[Path]) -> dict[str, float]:
    """The mean of each key over several ranks' traces (a key missing from some ranks is
    averaged over those that have it), plus `num_ranks`. Under TP every rank runs the same
    kernels, so the mean is the typical rank; a straggler shows in its own summary."""
    if not paths:
        raise ValueError("summarize_many needs at least one trace path but got none.")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for path in paths:
        for key, value in summarize(path).items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    out = {key: sums[key] / counts[key] for key in sums}
    out["num_ranks"] = float(len(paths))
    return out


@dataclass(frozen=True)
class KernelTime:
    name: str
    total_s: float  # summed duration of every launch
    count: int  # launches
    category: str


def top_kernels(path: Path, n: int = 10) -> list[KernelTime]:
    """The `n` kernels (by exact name) with the most GPU time, most first."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    categories: dict[str, str] = {}
    for event in iter_gpu_events(path):
        name = str(event.get("name", ""))
        try:
            dur = max(float(event.get("dur", 0.0)), 0.0)
        except (TypeError, ValueError):
            continue
        totals[name] = totals.get(name, 0.0) + dur
        counts[name] = counts.get(name, 0) + 1
        if name not in categories:
            categories[name] = classify_kernel(name, str(event.get("cat", "kernel")))
    ranked = sorted(totals, key=lambda k: totals[k], reverse=True)[:n]
    return [KernelTime(k, totals[k] / 1e6, counts[k], categories[k]) for k in ranked]
