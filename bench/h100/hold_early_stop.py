"""When a hold's early stop (runners/capacity/step.py `hold_until`) would have decided, replayed
on a `vllm bench serve` run's per-request records (bench/gpu/bench_serve_check.py's
requests.csv) as if the run were a hold at its rate: every 2 s, the requests sent so far and
ended by then, against the most its arrivals could still send in the run's length. A
replay on measured requests, not a measurement of the rule on a GPU.

    python3 bench/h100/hold_early_stop.py docs/h100/session12/requests.csv 10.166 --tpot-ms 15
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from runners.capacity.slo import p99_over_at_most
from runners.capacity.step import most_requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("requests_csv", type=Path)
    parser.add_argument("rate", type=float)
    parser.add_argument("--tpot-ms", type=float, required=True, help="the SLO's TPOT p99 bound")
    args = parser.parse_args(argv)
    rows = sorted((r for r in csv.DictReader(args.requests_csv.open(encoding="utf-8"))
                   if abs(float(r["rate_rps"]) - args.rate) < 1e-9),
                  key=lambda r: float(r["start_s"]))
    if not rows:
        print(f"no request at {args.rate} req/s in {args.requests_csv}", file=sys.stderr)
        return 2
    t0 = float(rows[0]["start_s"])
    length_s = float(rows[-1]["start_s"]) - t0
    sends = [float(r["start_s"]) - t0 for r in rows]
    ended = [(float(r["start_s"]) - t0 + float(r["latency_s"]),
              (float(r["latency_s"]) - float(r["ttft_s"])) / (int(r["output_len"]) - 1) * 1e3)
             for r in rows if r["ok"] == "1" and int(r["output_len"]) > 1]
    over_all = sum(tpot > args.tpot_ms for _, tpot in ended)
    print(f"{args.rate:g} req/s: {len(rows)} requests over {length_s:.0f} s, {over_all} over "
          f"{args.tpot_ms:g} ms")
    t = 2.0
    while t < length_s:
        sent = sum(s < t for s in sends)
        over = sum(end <= t and tpot > args.tpot_ms for end, tpot in ended)
        most = most_requests(sent, args.rate, length_s - t, 1.0)
        if p99_over_at_most(over, most):
            print(f"stopped at {t:.0f} s of {length_s:.0f}: {over} ended over the bound, of at "
                  f"most {most} requests")
            return 0
        t += 2.0
    print("not stopped: it runs its whole window")
    return 0


if __name__ == "__main__":
    sys.exit(main())
