"""What a `vllm bench serve` check recorded, and its verdict (issue 32), on the CPU: the
per-request timings and error kinds of vLLM 0.26's `--save-detailed` result (or bench.log), the
queue samples, one rate's verdict (`judge_rate`) and its table row, and the run's CSV files.
bench/gpu/bench_serve_check.py runs the check on the device and re-judges a run with these."""

from __future__ import annotations

import csv
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from runners.base import BenchmarkMetrics
from runners.capacity.slo import failures_miss
from runners.workload import Workload

TPOT_SLO_MS: Final = 15.0
# Judging rules (see judge_rate).
COMPLETION_TOLERANCE: Final = 0.05
# Failed requests miss a rate only above this fraction of its requests, nightshift's own rule
# and default (runners/capacity/slo.py `failures_miss`, `workload.max_failed_fraction`).
MAX_FAILED_FRACTION: Final = Workload().max_failed_fraction
FLAT_GROWTH_FRACTION: Final = 0.02


# --- recorded data ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestTiming:
    start_s: float  # s, the client's perf_counter at send (CLOCK_MONOTONIC on Linux)
    ttft_s: float  # s, 0 if no token came
    # s, send to the last token received: a failed request's last known time (0 if no token
    # came), since vLLM records no end for a failure (see `end_s`)
    latency_s: float
    output_len: int  # tokens
    is_ok: bool

    @property
    def end_s(self) -> float:
        """When the request left the client's in-flight set, as far as the record tells: its
        last token for a completed request; for a failed one, the last time vLLM's client
        recorded of it (its last token, or its send if none came). vLLM 0.26's client keeps no
        end for a failure (`latency` is set only once a 200 reply's stream ended:
        lib/endpoint_request_func.py:236-257; an exception leaves it 0), so its true end, the
        connection's close, lies between this and the run's end: the earliest bound is taken,
        so a failure is counted once, by the failure rule, and not again as a request that
        never ended."""
        return self.start_s + self.latency_s


@dataclass(frozen=True)
class QueueSample:
    t_s: float  # s, perf_counter (the same clock as RequestTiming.start_s)
    waiting: float  # vllm:num_requests_waiting
    running: float  # vllm:num_requests_running


def timings_from_detailed(result: Mapping[str, Any]) -> list[RequestTiming]:
    """Per-request timings from a `--save-detailed` result (serve.py:1194-1214): the end of a
    request is its start + TTFT + the sum of its ITLs (lib/endpoint_request_func.py:236-257);
    for a failed request that is the last token it received (its TTFT and ITLs as far as they
    came), or its send if none came."""
    out = []
    for start, ttft, itl, out_len, error in zip(
            result["start_times"], result["ttfts"], result["itls"], result["output_lens"],
            result["errors"], strict=True):
        ok = not error and ttft > 0
        out.append(RequestTiming(float(start), float(ttft), float(ttft) + float(sum(itl)),
                                 int(out_len), ok))
    return out


# The last line of a Python traceback: the exception's (dotted) type, then its message.
_EXCEPTION_LINE: Final = re.compile(
    r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Timeout))(?::\s*(?P<msg>.*))?$")
_KIND_CHARS: Final = 72


def error_kind(error: str) -> str:
    """A failed request's error as one short line: vLLM 0.26's client stores the whole
    traceback of an exception (lib/endpoint_request_func.py:261-264), whose last exception
    line is kept without its module (`ClientOSError [Errno 104] Connection reset by peer`),
    or the HTTP reason / its own message for a bad reply (lines 250-260), kept as it is."""
    lines = [line.rstrip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "no message"
    kind = lines[0]
    if kind.startswith("Traceback"):
        found = [m for line in lines if (m := _EXCEPTION_LINE.match(line))]
        if found:
            name, msg = found[-1]["type"].rsplit(".", 1)[-1], found[-1]["msg"]
            kind = f"{name} {msg}" if msg else name
        else:
            kind = lines[-1].strip()
    return kind if len(kind) <= _KIND_CHARS else kind[:_KIND_CHARS - 3] + "..."


def error_kinds_from_detailed(result: Mapping[str, Any]) -> dict[str, int]:
    """How many requests failed with each kind of error, most first, from a `--save-detailed`
    result (its `errors`, one per request: serve.py:1210): failed as `timings_from_detailed`
    counts them (an error, or no first token)."""
    kinds = Counter(error_kind(error) for error, ttft in zip(
        result.get("errors", []), result.get("ttfts", []), strict=True)
        if error or not ttft > 0)
    return dict(kinds.most_common())


_LOG_RATE: Final = re.compile(r"\brequest_rate=([0-9.eE+-]+|inf)\b")
_LOG_ERROR: Final = re.compile(r"^Error \d+: (.*)$")


def error_kinds_from_log(text: str) -> dict[float, dict[str, int]]:
    """The error kinds `vllm bench serve` printed, per rate, from bench.log (a run's benches,
    appended): each bench starts with its `Namespace(... request_rate=R ...)` line and prints
    its first 10 failed requests' errors as `Error i: <error>` (serve.py:661-665), before its
    result table. Only those 10: the counts are of the errors printed."""
    out: dict[float, Counter[str]] = {}
    rate: float | None = None
    entry: list[str] | None = None

    def close() -> None:
        if entry is not None and rate is not None:
            out.setdefault(rate, Counter())[error_kind("\n".join(entry))] += 1

    for line in text.splitlines():
        if line.startswith("Namespace("):
            close()
            entry = None
            found = _LOG_RATE.search(line)
            rate = float(found[1]) if found else None
        elif found_error := _LOG_ERROR.match(line):
            close()
            entry = [found_error[1]]
        elif entry is not None:
            if line.startswith(("tip: ", "=====")):
                close()
                entry = None
            else:
                entry.append(line)
    close()
    return {r: dict(kinds.most_common()) for r, kinds in out.items()}


_HEAVY = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
          "errors")


def slim_result(result: Mapping[str, Any]) -> dict[str, Any]:
    """The result JSON as vLLM writes it without --save-detailed: the fields it drops then
    (serve.py:2254-2268) dropped here."""
    return {k: v for k, v in result.items() if k not in _HEAVY}


def vllm_metrics(result: Mapping[str, Any]) -> BenchmarkMetrics:
    """vLLM's result as nightshift's `BenchmarkMetrics` (the same names, `duration` as
    `duration_s`), so that nightshift's own rules judge it; a statistic vLLM did not write
    (not asked with --percentile-metrics / --metric-percentiles) is None."""
    def count(key: str) -> int:
        return int(result.get(key) or 0)

    def number(key: str) -> float:
        return float(result.get(key) or 0.0)

    def stat(key: str) -> float | None:
        value = result.get(key)
        return None if value is None else float(value)

    goodput = result.get("request_goodput")
    latencies: dict[str, Any] = {f"{s}_{m}_ms": stat(f"{s}_{m}_ms")
                                 for s in ("mean", "median", "std", "p90", "p99")
                                 for m in ("ttft", "tpot", "itl", "e2el")}
    return BenchmarkMetrics(
        completed=count("completed"), failed=count("failed"), duration_s=number("duration"),
        total_input_tokens=count("total_input_tokens"),
        total_output_tokens=count("total_output_tokens"),
        request_throughput=number("request_throughput"),
        request_goodput=None if goodput is None else float(goodput),
        output_throughput=number("output_throughput"),
        total_token_throughput=number("total_token_throughput"),
        max_concurrency_seen=count("max_concurrent_requests"), **latencies)


def kinds_text(num_failed: int, kinds: Mapping[str, int]) -> str:
    """`ClientOSError [Errno 104] Connection reset by peer`: the error kinds known, most first,
    each with its count where more than one; `first 10: ...` where fewer are known than failed
    (bench.log prints only the first 10)."""
    known = sum(kinds.values())
    if not known:
        return "kind not recorded"
    listed = ", ".join(k if n == 1 else f"{k} x{n}" for k, n in kinds.items())
    return listed if known >= num_failed else f"first {known}: {listed}"


# --- judging ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    rate_rps: float  # offered (configured)
    num_prompts: int
    arrival_s: float  # s, first to last send
    window_s: float  # s, the judged window [first send + warm-up, last send]
    warmup_s: float  # s, one median request latency
    completed: int  # vLLM's count, whole run
    failed: int
    request_throughput_rps: float  # vLLM's: completed / (arrivals + drain)
    request_goodput_rps: float | None  # vLLM's, under the SLO given with --goodput
    offered_window_rps: float  # sends in the window / window_s
    # requests ended in the window / window_s: completed, and failed at their last known time
    # (`RequestTiming.end_s`; the failure rule judges those)
    completed_window_rps: float
    completed_ratio: float  # completed_window_rps / offered_window_rps
    p99_tpot_ms: float
    p99_ttft_ms: float
    waiting_growth: float | None  # requests: LSQ slope of num_requests_waiting x window_s
    waiting_max: float | None
    waiting_last: float | None  # the last sample in the window
    num_queue_samples: int
    is_slo_met: bool
    is_rate_kept: bool
    is_queue_flat: bool
    is_met: bool
    reasons: tuple[str, ...]  # why not met; empty when met
    max_failed_fraction: float  # failed requests above this fraction of them miss the rate
    failures: str | None  # "N of M failed: kinds", whether or not they missed; None if none
    is_failures_miss: bool  # more failed than max_failed_fraction: a reason above says so


def judge_rate(result: Mapping[str, Any], requests: Sequence[RequestTiming],
               queue: Sequence[QueueSample], rate_rps: float, *,
               tpot_slo_ms: float = TPOT_SLO_MS, ttft_slo_ms: float | None = None,
               completion_tolerance: float = COMPLETION_TOLERANCE,
               flat_growth_fraction: float = FLAT_GROWTH_FRACTION,
               max_failed_fraction: float = MAX_FAILED_FRACTION,
               error_kinds: Mapping[str, int] | None = None) -> Verdict:
    """One rate's verdict. Met iff all of:

    - SLO: vLLM's own p99 TPOT <= `tpot_slo_ms` (and p99 TTFT <= `ttft_slo_ms` if given), and
      no more than `max_failed_fraction` of the requests failed, judged by nightshift's own
      `failures_miss` (an overloaded server's errors are a missed SLO at that load; one
      connection reset in thousands is not). Failures within it are named, not hidden:
      `failures` counts them by `error_kinds`;
    - rate kept: in the steady window (first send + one median request latency, to the last
      send: no warm-up, no drain), requests ended / sends >= 1 - `completion_tolerance`. The
      difference of the two counts is the growth of what is in flight, so a server that keeps
      up reads ~1 (Poisson noise: ~1-2% at 1000+ sends) and one that falls behind by x reads
      ~1/(1 + x). A failed request ended too (its connection closed): it counts as ended at
      `RequestTiming.end_s`, the last time vLLM recorded of it, so that the failure rule above
      is the one rule that counts it (counted here as never ended, 3-5% failed, within the
      failure rule's bound, would miss this rule as well);
    - queue flat: the least-squares line through `vllm:num_requests_waiting` (1 s samples) over
      that window rises by at most `flat_growth_fraction` of the window's sends (at least 1
      request). A server 15% over capacity grows it by ~13% of its sends; 2% is a surplus the
      completion tolerance would not see either.
    """
    sends = sorted(r.start_s for r in requests)
    if not sends:
        raise ValueError("no requests in the result: nothing to judge")
    first, last = sends[0], sends[-1]
    ok = [r for r in requests if r.is_ok]
    warmup = float(np.median([r.latency_s for r in ok])) if ok else 0.0
    warmup = min(warmup, (last - first) / 2)
    t0, t1 = first + warmup, last
    window = max(t1 - t0, 1e-9)
    sent = sum(1 for s in sends if t0 <= s <= t1)
    done = sum(1 for r in requests if t0 <= r.end_s <= t1)
    ratio = done / sent if sent else 0.0
    in_window = [q for q in queue if t0 <= q.t_s <= t1]
    growth = w_max = w_last = None
    if len(in_window) >= 3:
        t = np.array([q.t_s for q in in_window])
        w = np.array([q.waiting for q in in_window])
        slope = float(np.polyfit(t - t[0], w, 1)[0])
        growth, w_max, w_last = slope * window, float(w.max()), float(w[-1])
    p99_tpot = float(result.get("p99_tpot_ms", math.nan))
    p99_ttft = float(result.get("p99_ttft_ms", math.nan))
    metrics = vllm_metrics(result)
    failed = metrics.failed
    kinds = kinds_text(failed, error_kinds or {})
    failures = f"{failed} of {metrics.completed + failed} failed: {kinds}" if failed else None
    reasons = []
    if not p99_tpot <= tpot_slo_ms:
        reasons.append(f"p99 TPOT {p99_tpot:.2f} ms > {tpot_slo_ms:g} ms")
    if ttft_slo_ms is not None and not p99_ttft <= ttft_slo_ms:
        reasons.append(f"p99 TTFT {p99_ttft:.0f} ms > {ttft_slo_ms:g} ms")
    too_many = failures_miss(metrics, max_failed_fraction)
    if too_many is not None:
        reasons.append(f"{too_many}: {kinds}")
    is_slo_met = not reasons
    is_rate_kept = ratio >= 1 - completion_tolerance
    if not is_rate_kept:
        reasons.append(f"ended {ratio:.3f} of the sends in the window "
                       f"(< {1 - completion_tolerance:.2f})")
    limit = max(1.0, flat_growth_fraction * sent)
    is_queue_flat = growth is not None and growth <= limit
    if growth is None:
        reasons.append(f"queue unknown: {len(in_window)} /metrics sample(s) in the window")
    elif not is_queue_flat:
        reasons.append(f"waiting queue grew {growth:.1f} requests over the window "
                       f"(> {limit:.1f})")
    goodput = result.get("request_goodput")
    return Verdict(
        rate_rps=rate_rps, num_prompts=len(requests), arrival_s=last - first, window_s=window,
        warmup_s=warmup, completed=int(result.get("completed", len(ok))), failed=failed,
        request_throughput_rps=float(result.get("request_throughput", math.nan)),
        request_goodput_rps=None if goodput is None else float(goodput),
        offered_window_rps=sent / window, completed_window_rps=done / window,
        completed_ratio=ratio, p99_tpot_ms=p99_tpot, p99_ttft_ms=p99_ttft,
        waiting_growth=growth, waiting_max=w_max, waiting_last=w_last,
        num_queue_samples=len(in_window), is_slo_met=is_slo_met, is_rate_kept=is_rate_kept,
        is_queue_flat=is_queue_flat, is_met=is_slo_met and is_rate_kept and is_queue_flat,
        reasons=tuple(reasons), max_failed_fraction=max_failed_fraction, failures=failures,
        is_failures_miss=too_many is not None)


TABLE_HEADER: Final = ("| config | rate req/s | sends | window s | ended/sent | "
                       "vLLM req/s | goodput req/s | p99 TPOT ms | p99 TTFT ms | waiting growth "
                       "(max) | met |\n|---|---|---|---|---|---|---|---|---|---|---|")


def table_row(config: str, v: Verdict) -> str:
    growth = ("n/a" if v.waiting_growth is None
              else f"{v.waiting_growth:+.1f} ({v.waiting_max:.0f})")
    goodput = "n/a" if v.request_goodput_rps is None else f"{v.request_goodput_rps:.2f}"
    met = "yes" if v.is_met else "no: " + "; ".join(v.reasons)
    if v.failures and not v.is_failures_miss:
        met += f" ({v.failures})"  # within the allowed fraction: shown, not counted
    return (f"| {config} | {v.rate_rps:g} | {v.num_prompts} | {v.window_s:.0f} | "
            f"{v.completed_ratio:.3f} | {v.request_throughput_rps:.2f} | {goodput} | "
            f"{v.p99_tpot_ms:.2f} | {v.p99_ttft_ms:.0f} | {growth} | {met} |")


# --- files -----------------------------------------------------------------------------------

REQUESTS_CSV: Final = "requests.csv"
QUEUE_CSV: Final = "queue.csv"
RESULTS_JSON: Final = "results.json"


def write_requests(path: Path, rate_rps: float, requests: Sequence[RequestTiming]) -> None:
    is_new = not path.exists()
    with path.open("a", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        if is_new:
            writer.writerow(["rate_rps", "start_s", "ttft_s", "latency_s", "output_len", "ok"])
        for r in requests:
            writer.writerow([rate_rps, f"{r.start_s:.6f}", f"{r.ttft_s:.6f}",
                             f"{r.latency_s:.6f}", r.output_len, int(r.is_ok)])


def read_requests(path: Path) -> dict[float, list[RequestTiming]]:
    out: dict[float, list[RequestTiming]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            out.setdefault(float(row["rate_rps"]), []).append(RequestTiming(
                float(row["start_s"]), float(row["ttft_s"]), float(row["latency_s"]),
                int(row["output_len"]), row["ok"] == "1"))
    return out


def read_queue(path: Path) -> dict[float, list[QueueSample]]:
    out: dict[float, list[QueueSample]] = {}
    with path.open(newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["waiting"] == "" or row["running"] == "":
                continue  # a scrape that failed
            out.setdefault(float(row["rate_rps"]), []).append(QueueSample(
                float(row["t_s"]), float(row["waiting"]), float(row["running"])))
    return out

