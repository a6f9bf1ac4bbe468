"""Streaming analysis of torch-profiler chrome traces (`*.pt.trace.json[.gz]`): GPU kernel time by
category, GPU busy time as the union over streams, launch gaps, top kernels, and trimming.

A trace is read one event at a time (never loaded whole), so a profile of hundreds of MB costs
memory in proportion to one read chunk plus a bounded reorder window, not to the file.
"""

from __future__ import annotations

import contextlib
import gzip
import heapq
import json
import logging
import math
import re
import zlib
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

logger = logging.getLogger(__name__)

GPU_EVENT_CATEGORIES: Final = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
CATEGORIES: Final = ("gemm", "attention", "communication", "norm", "activation", "rope",
                     "quantize", "kv_write", "other", "memcpy", "memset")

# vLLM's own map (tools/profiler/nsys_profile_tools/vllm_engine_model.json), first match wins,
# reordered where its order misfiles real names: communication and KV writes first (their names
# are unambiguous, and `reshape_and_cache_flash_kernel` says "flash"); attention before GEMM
# because FlashAttention's template arguments name cutlass types; and no bare "flash" for
# attention, which would take FlashInfer's norm, activation and sampling kernels.
_KERNEL_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    ("communication", re.compile(
        r"nccl(Dev)?Kernel|cross_device_reduce|(?i:all_?reduce|all_?gather|reduce_?scatter)")),
    ("kv_write", re.compile(r"reshape_and_cache|concat_and_cache")),
    ("attention", re.compile(
        r"flash::|flash_fwd|FlashAttn|fmha|_attn_|attention|reduce_segments|BatchDecode|"
        r"BatchPrefill|paged_attention|flex_attn|(?i:mla_)")),
    ("gemm", re.compile(
        r"(?i:gemm|gemv)|nvjet|cutlass|cublas|wgmma|xmma|scaled_mm|_mm_|matmul|"
        r"fused_moe_kernel|GroupProblemShape|group_gemm_starts|bmm_|[Mm]arlin")),
    ("norm", re.compile(r"_norm_|Norm|rms_?norm|layer_?norm")),
    ("activation", re.compile(r"act_and_mul|(silu|gelu)_and_mul|activation::")),
    ("rope", re.compile(r"[Rr]otary|_rope|rope_")),
    ("quantize", re.compile(r"fp8_quant|_quant_|quant_kernel|cvt_|quantize")),
)

# torch.compile (Inductor) names its generated kernels after the ops it fused into them:
# `triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_..._silu_...` (H200, fp8 weights) is
# the dynamic fp8 quantization of the activation that *feeds* a scaled_mm, not a GEMM. Pointwise
# and reduction kernels (`poi`, `red`, `per`) never multiply matrices (Inductor's own matmul
# templates are `triton_tem_`), so they are filed by what they fuse, first match wins.
_INDUCTOR_FUSED: Final = re.compile(r"^triton_(poi|red|per)_fused")
_INDUCTOR_PATTERNS: Final[tuple[tuple[str, re.Pattern[str]], ...]] = (
    # amax (abs + max) and a clamp to the fp8 range: per-tensor dynamic quantization.
    ("quantize", re.compile(r"_abs_.*clamp|clamp.*_abs_|quant|fp8|e4m3")),
    ("norm", re.compile(r"rms_norm|layer_norm|_norm_|group_norm")),
    ("activation", re.compile(r"silu|gelu|relu|act_and_mul")),
    ("rope", re.compile(r"rotary|_rope")),
)

_CHUNK_CHARS: Final = 1 << 18  # text read per refill: the parser's working set
_MAX_EVENT_CHARS: Final = 64 << 20  # one event larger than this means a corrupt file
_REORDER_WINDOW: Final = 1 << 14  # kernels held back to put slightly out-of-order events right
# Gap histogram: 50 log bins per decade from 10 ns to 10 s (4.7% wide), plus a bin for zero.
_GAP_BINS_PER_DECADE: Final = 50
_GAP_MIN_US: Final = 0.01
_GAP_NUM_BINS: Final = 9 * _GAP_BINS_PER_DECADE
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*,?[ \t\n\r]*")


def classify_kernel(name: str, cat: str = "kernel") -> str:
    """The category of one GPU event: memcpy/memset by its `cat`, kernels by name."""
    if cat == "gpu_memcpy":
        return "memcpy"
    if cat == "gpu_memset":
        return "memset"
    if _INDUCTOR_FUSED.match(name):
        for category, pattern in _INDUCTOR_PATTERNS:
            if pattern.search(name):
                return category
        return "other"
    for category, pattern in _KERNEL_PATTERNS:
        if pattern.search(name):
            return category
    return "other"


# --- streaming reader ---------------------------------------------------------------------------


class _Reader:
    """A text buffer over a file that grows on demand and forgets what was consumed."""

    def __init__(self, handle: IO[str], chunk_chars: int) -> None:
        self.handle = handle
        self.chunk_chars = chunk_chars
        self.buf = ""
        self.pos = 0
        self.eof = False

    def fill(self) -> bool:
        """Read one more chunk; False at end of file."""
        if self.eof:
            return False
        try:
            chunk = self.handle.read(self.chunk_chars)
        except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
            # A profiler killed mid-write leaves a cut gzip stream: a bad trace, not an I/O fault.
            raise ValueError(f"the trace is truncated or not gzip/UTF-8 text ({exc}).") from exc
        if not chunk:
            self.eof = True
            return False
        # Drop the consumed head so the buffer stays about one chunk long.
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0
        return True

    def skip(self, pattern: re.Pattern[str]) -> None:
        while True:
            match = pattern.match(self.buf, self.pos)
            end = match.end() if match else self.pos
            self.pos = end
            if end < len(self.buf) or not self.fill():
                return

    def peek(self) -> str:
        if self.pos >= len(self.buf) or self.buf[self.pos] in " \t\n\r":
            self.skip(_WHITESPACE)
        return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def expect(self, char: str, what: str) -> None:
        got = self.peek()
        if got != char:
            raise ValueError(f"expected {char!r} {what} but got {got or 'end of file'!r}.")
        self.pos += 1

    def value(self, decoder: json.JSONDecoder) -> Any:
        """Decode one JSON value at the cursor, reading more until it is complete."""
        if self.pos >= len(self.buf) or self.buf[self.pos] in " \t\n\r":
            self.skip(_WHITESPACE)
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.buf) - self.pos > _MAX_EVENT_CHARS or not self.fill():
                    raise ValueError(f"malformed JSON near character {exc.pos}: {exc.msg}.") \
                        from exc
                continue
            # A number cut at the chunk's end decodes too: make sure something follows it.
            if end >= len(self.buf) and self.fill():
                continue
            self.pos = end
            return value


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def iter_events(path: Path, *, chunk_chars: int = _CHUNK_CHARS) -> Iterator[dict[str, Any]]:
    """Every event of a chrome trace, in file order, one decoded object at a time.

    Reads both forms of the format: an object with a `traceEvents` array (what torch writes)
    and a bare array. Raises ValueError for a file that is not such a trace.
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as handle:
        reader = _Reader(handle, chunk_chars)
        first = reader.peek()
        if first == "[":
            yield from _iter_array(reader, decoder)
            return
        reader.expect("{", f"at the start of {path.name} (a chrome trace)")
        while reader.peek() not in ("}", ""):
            key = reader.value(decoder)
            reader.expect(":", f"after key {key!r}")
            if key == "traceEvents":
                yield from _iter_array(reader, decoder)
            else:
                reader.value(decoder)  # metadata (deviceProperties, ...): small, skipped
            reader.skip(_SEPARATOR)


def _iter_array(reader: _Reader, decoder: json.JSONDecoder) -> Iterator[dict[str, Any]]:
    reader.expect("[", "to open traceEvents")
    while True:
        next_char = reader.peek()
        if next_char == "]":
            reader.pos += 1
            return
        if not next_char:
            raise ValueError("the traceEvents array is not closed (truncated file?).")
        event = reader.value(decoder)
        if isinstance(event, dict):
            yield event
        reader.skip(_SEPARATOR)


def iter_gpu_events(path: Path) -> Generator[dict[str, Any], None, None]:
    """The complete (`ph == "X"`) kernel, memcpy and memset events of a trace."""
    for event in iter_events(path):
        if event.get("ph") == "X" and event.get("cat") in GPU_EVENT_CATEGORIES:
            yield event


# --- accumulation -------------------------------------------------------------------------------


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

    def __init__(self, reorder_window: int = _REORDER_WINDOW) -> None:
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


# --- public analysis ----------------------------------------------------------------------------


def summarize(path: Path, *, reorder_window: int = _REORDER_WINDOW) -> dict[str, float]:
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
                     reorder_window: int = _REORDER_WINDOW) -> dict[str, float]:
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
                       reorder_window: int = _REORDER_WINDOW) -> dict[str, float]:
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
