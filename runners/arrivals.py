"""When a load level sends each request: bursty (gamma) arrivals as `vllm bench serve
--burstiness` draws them, and trace replay (a JSONL of timed requests read and checked here).

Arrivals follow vLLM 0.26's `get_request` (vllm/benchmarks/serve.py:393-503): gaps drawn from a
gamma distribution of shape `burstiness` and scale 1 / (rate x burstiness), so the mean gap is
1 / rate whatever the burstiness (1 = exponential gaps, a Poisson process; below 1 burstier,
above 1 more regular; infinite = evenly spaced), then rescaled so the last arrival falls at
exactly num / rate (serve.py:472-485). vLLM draws from numpy's global RandomState after its
dataset sampling; here each level draws from its own `numpy.random.default_rng(seed)`, so the
distribution and the rescaling are vLLM's, the exact numbers are not (they are deterministic in
the seed, and independent of the prompts).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Field names of vLLM 0.26's `timed_trace` dataset defaults (vllm/benchmarks/datasets/
# datasets.py:1755-1772: --timed-trace-label-timestamp/-input-length/-output-length).
TRACE_TIMESTAMP = "timestamp"
TRACE_INPUT_LENGTH = "input_length"
TRACE_OUTPUT_LENGTH = "output_length"
TRACE_PROMPT = "prompt"  # optional: text or token ids; else input_length tokens are synthesised
MAX_TRACE_LINES = 1_000_000


def _gaps_s(rng: np.random.Generator, rate_rps: float, burstiness: float,
            size: int | None) -> np.ndarray | float:
    if math.isinf(burstiness):  # the limit of the gamma: constant gaps (serve.py:458-461)
        return np.full(size, 1.0 / rate_rps) if size is not None else 1.0 / rate_rps
    # numpy's standard_gamma with shape 1 *is* its standard_exponential: burstiness 1 draws the
    # very numbers `exponential(1 / rate)` draws.
    theta = 1.0 / (rate_rps * burstiness)
    return rng.gamma(shape=burstiness, scale=theta, size=size)


def check_burstiness(burstiness: float) -> None:
    if not burstiness > 0 or math.isnan(burstiness):
        raise ValueError(f"burstiness must be > 0 (1 = Poisson, lower = burstier) but got "
                         f"{burstiness}.")


def arrival_offsets_s(num: int, request_rate_rps: float | None, seed: int,
                      burstiness: float = 1.0) -> list[float]:
    """Send times, in seconds from the level's start, of `num` arrivals at `request_rate_rps`
    with gamma gaps of shape `burstiness` (1 = Poisson), rescaled so the last falls at exactly
    num / rate, as vLLM's `get_request`. All zeros for an infinite rate (None). Deterministic in
    (num, seed, burstiness)."""
    check_burstiness(burstiness)
    if request_rate_rps is None or math.isinf(request_rate_rps) or num == 0:
        return [0.0] * num
    rng = np.random.default_rng(seed)
    offsets = np.cumsum(_gaps_s(rng, request_rate_rps, burstiness, num))
    if offsets[-1] > 0:
        offsets *= (num / request_rate_rps) / offsets[-1]
    return [float(x) for x in offsets]


def open_ended_offsets_s(request_rate_rps: float | None, seed: int,
                         burstiness: float = 1.0) -> Iterator[float]:
    """Send times without end, for duration-bound levels (no rescaling possible): the same
    gamma gaps, the n-th time deterministic in (seed, burstiness)."""
    check_burstiness(burstiness)
    if request_rate_rps is None or math.isinf(request_rate_rps):
        yield from itertools.repeat(0.0)
        return
    rng = np.random.default_rng(seed)
    t = 0.0
    while True:
        t += float(_gaps_s(rng, request_rate_rps, burstiness, None))
        yield t


# ---------------------------------------------------------------------------------------------
# Trace replay


@dataclass(frozen=True)
class TraceEntry:
    """One line of a trace: when the request arrived and what it asked for."""

    arrival_s: float  # seconds after the trace's first arrival
    input_len: int  # tokens (of `prompt` when given as token ids)
    output_len: int  # tokens; sent as max_tokens with ignore_eos
    prompt: str | list[int] | None = None  # None: synthesise input_len token ids


def read_trace(path: Path, timestamp_unit_s: float = 1.0,
               max_gap_s: float | None = None) -> list[TraceEntry]:
    """The trace's requests in file order, arrival times relative to the first line.

    Each line is a JSON object with `timestamp` (a number, or a string of one as vLLM's
    `float(ts)` reads it: relative or absolute, in units of `timestamp_unit_s` seconds; 0.001
    for milliseconds, as vLLM's --timed-trace-sec-multiplier), `input_length` and
    `output_length` (tokens), optionally `prompt` (text, or token ids whose count is then the
    input length). Timestamps must not decrease and must span more than 0 s. A gap between
    consecutive arrivals longer than `max_gap_s` (an idle night in a day's trace) is replayed
    as `max_gap_s`. Raises ValueError naming `file:line` and the fix (OSError or
    UnicodeDecodeError where the file cannot be read)."""
    if not timestamp_unit_s > 0 or not math.isfinite(timestamp_unit_s):
        raise ValueError(f"timestamp_unit_s must be a finite number > 0 but got "
                         f"{timestamp_unit_s}.")
    if max_gap_s is not None and not max_gap_s > 0:
        raise ValueError(f"max_gap_s must be > 0 (None: the gaps as recorded) but got "
                         f"{max_gap_s}.")
    raw: list[tuple[float, int, int, str | list[int] | None]] = []
    last: float | None = None
    with path.open(encoding="utf-8-sig") as f:  # -sig: a byte-order mark is no JSON
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if len(raw) >= MAX_TRACE_LINES:
                raise ValueError(f"{path}:{line_no}: a trace holds at most {MAX_TRACE_LINES:,} "
                                 "requests; cut the file.")
            entry = _parse_trace_line(path, line_no, line)
            if last is not None and entry[0] < last:
                raise ValueError(
                    f"{path}:{line_no}: '{TRACE_TIMESTAMP}' {entry[0]:g} is earlier than the "
                    f"line before ({last:g}); sort the trace by {TRACE_TIMESTAMP}.")
            last = entry[0]
            raw.append(entry)
    if not raw:
        raise ValueError(f"{path}: expected JSONL lines with '{TRACE_TIMESTAMP}', "
                         f"'{TRACE_INPUT_LENGTH}' and '{TRACE_OUTPUT_LENGTH}' but the file is "
                         "empty.")
    first = raw[0][0]
    if len(raw) < 2 or raw[-1][0] <= first:
        raise ValueError(f"{path}: expected timestamps spanning more than 0 s over at least two "
                         f"requests but got {len(raw)} request(s) at {first:g}; a trace replays "
                         "arrivals in time.")
    if max_gap_s is None:
        return [TraceEntry((t - first) * timestamp_unit_s, n_in, n_out, prompt)
                for t, n_in, n_out, prompt in raw]
    out = []
    arrival_s, previous = 0.0, first
    for t, n_in, n_out, prompt in raw:
        arrival_s += min((t - previous) * timestamp_unit_s, max_gap_s)
        previous = t
        out.append(TraceEntry(arrival_s, n_in, n_out, prompt))
    return out


def _count(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def json_object(where: str, line: str) -> dict[str, Any]:
    """One JSONL line that must hold a JSON object (a trace's, a prompts file's); ValueError
    naming `where` otherwise."""
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: expected a JSON object but got invalid JSON ({exc}).") from exc
    except RecursionError as exc:
        raise ValueError(f"{where}: expected a JSON object but got JSON nested too deeply to "
                         "read.") from exc
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected a JSON object but got {type(entry).__name__}.")
    return entry


def _parse_trace_line(path: Path, line_no: int, line: str
                      ) -> tuple[float, int, int, str | list[int] | None]:
    where = f"{path}:{line_no}"
    entry = json_object(where, line)
    ts = entry.get(TRACE_TIMESTAMP)
    if isinstance(ts, str):  # "1712.5": vLLM reads a timestamp with float()
        with contextlib.suppress(ValueError):
            ts = float(ts)
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise ValueError(f"{where}: '{TRACE_TIMESTAMP}' must be a finite number (seconds, or "
                         f"units of timestamp_unit_s) but got {ts!r:.60}.")
    prompt = entry.get(TRACE_PROMPT)
    if prompt is not None and not (
            (isinstance(prompt, str) and prompt)
            or (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                        for t in prompt))):
        raise ValueError(f"{where}: '{TRACE_PROMPT}' must be a non-empty string or list of "
                         f"token ids but got {prompt!r:.60}.")
    n_in = _count(entry.get(TRACE_INPUT_LENGTH))
    if isinstance(prompt, list):
        n_in = len(prompt)
    if n_in is None:
        raise ValueError(f"{where}: '{TRACE_INPUT_LENGTH}' must be an integer >= 1 (tokens) but "
                         f"got {entry.get(TRACE_INPUT_LENGTH)!r:.60}.")
    n_out = _count(entry.get(TRACE_OUTPUT_LENGTH))
    if n_out is None:
        raise ValueError(f"{where}: '{TRACE_OUTPUT_LENGTH}' must be an integer >= 1 (tokens) "
                         f"but got {entry.get(TRACE_OUTPUT_LENGTH)!r:.60}.")
    return float(ts), n_in, n_out, prompt


def trace_rate_rps(arrivals_s: Sequence[float]) -> float:
    """The mean request rate of a replay's arrivals: (n - 1) gaps over the span."""
    span = arrivals_s[-1] - arrivals_s[0] if arrivals_s else 0.0
    if len(arrivals_s) < 2 or not span > 0:
        raise ValueError("a trace's mean rate needs two arrivals more than 0 s apart.")
    return (len(arrivals_s) - 1) / span


def trace_prefix_len(arrivals_s: Sequence[float], request_rate_rps: float | None,
                     duration_s: float | None) -> int:
    """How many of a trace's first arrivals a replay at `request_rate_rps` bounded by
    `duration_s` (a capacity probe's) sends, where that rate is the mean rate of the part it
    replays (`trace_offsets_s` of those arrivals): the first floor(rate x duration) + 1, whose
    gaps at that rate span the duration at most; more where those arrive at one instant (no
    rate to scale them to: the first later arrival joins them). All of them without a rate or
    a bound, or where they fit."""
    num = len(arrivals_s)
    if request_rate_rps is None or duration_s is None or math.isinf(request_rate_rps) or \
            num < 2:
        return num
    prefix = max(2, min(num, math.floor(request_rate_rps * duration_s + 1e-9) + 1))
    while prefix < num and not arrivals_s[prefix - 1] > arrivals_s[0]:
        prefix += 1
    return prefix


def trace_offsets_s(arrivals_s: Sequence[float], request_rate_rps: float | None
                    ) -> list[float]:
    """Send times of a trace replay: the recorded times from the first arrival, compressed or
    stretched so their mean rate is `request_rate_rps` (the gaps keep their shape); as recorded
    when None."""
    if not arrivals_s:
        return []
    first = arrivals_s[0]
    times = [t - first for t in arrivals_s]
    if request_rate_rps is None or len(times) < 2 or not times[-1] > 0:
        return times
    if math.isinf(request_rate_rps):
        return [0.0] * len(times)
    factor = trace_rate_rps(times) / request_rate_rps
    return [t * factor for t in times]
