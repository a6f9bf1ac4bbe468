"""How a `vllm bench serve` run's TPOT moves over time: per-request TPOT (vLLM's definition:
(latency - TTFT) / (output tokens - 1)) of the requests sent in consecutive windows of one rate,
beside the whole run's percentiles. Reads bench/gpu/bench_serve_check.py's requests.csv.

    python3 bench/h100/window_spread.py docs/h100/session11/requests.csv 10.7 --window-s 15
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by linear interpolation (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    low = int(pos)
    high = min(low + 1, len(xs) - 1)
    return xs[low] + (xs[high] - xs[low]) * (pos - low)


def tpots(path: Path, rate: float) -> list[tuple[float, float]]:
    """(s since the rate's first send, TPOT ms) of each successful request of `rate`."""
    rows = [r for r in csv.DictReader(path.open(encoding="utf-8"))
            if abs(float(r["rate_rps"]) - rate) < 1e-9 and r["ok"] == "1"
            and int(r["output_len"]) > 1]
    if not rows:
        return []
    t0 = min(float(r["start_s"]) for r in rows)
    return sorted((float(r["start_s"]) - t0,
                   (float(r["latency_s"]) - float(r["ttft_s"])) / (int(r["output_len"]) - 1)
                   * 1000.0) for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests_csv", type=Path)
    parser.add_argument("rate", type=float)
    parser.add_argument("--window-s", type=float, default=15.0)
    args = parser.parse_args(argv)
    data = tpots(args.requests_csv, args.rate)
    if not data:
        print(f"no successful request at {args.rate} req/s in {args.requests_csv}")
        return 1
    whole = [t for _, t in data]
    print(f"whole run: {len(whole)} requests, TPOT p50 {quantile(whole, 0.5):.2f} ms, "
          f"p99 {quantile(whole, 0.99):.2f} ms")
    print("| window start s | requests | TPOT p50 ms | TPOT p99 ms |\n|---|---|---|---|")
    start = 0.0
    end = data[-1][0]
    p50s = []
    while start <= end:
        window = [t for s, t in data if start <= s < start + args.window_s]
        if window:
            p50s.append(quantile(window, 0.5))
            print(f"| {start:.0f} | {len(window)} | {p50s[-1]:.2f} | "
                  f"{quantile(window, 0.99):.2f} |")
        start += args.window_s
    print(f"window medians span {min(p50s):.2f}-{max(p50s):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
