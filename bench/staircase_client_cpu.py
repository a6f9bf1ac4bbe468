"""Benchmark: the load generator's CPU in a saturated staircase step, its requests spread over
httpx clients of at most 32 in flight each (shipped) against one client for the whole stream
(as before 2026-12-06), side by side on one simulated engine.

A saturated step sends its rate until the server's waiting queue has grown over five /metrics
samples a second apart (about 4.3 s), by which time some 1,700 requests are in flight. On one
client, httpcore 1.0's pool walks all of its connections for each queued request whenever a
request starts or ends; spread over clients, each walk covers 32 at most.

    python -m bench.staircase_client_cpu --rounds 5 [--rate 400] \
        [--out bench/data/staircase_client_cpu.json]

The figure is the CPU time of the driver's own thread (`time.thread_time`, the client's work,
measured on this host) per request it sent, and the requests it sent against those its rate
owed. The server is the simulated engine (eager decode, 32 sequences: a few dozen requests a
second), whose replies are a model's; the client's CPU is a measurement. Arms alternate within
each round on one server; the ratio is shipped over one client, per round. The one-client arm
keeps its idle connections (the code before also closed them once it held more than 256 and
reconnected), so it flatters the code before, if anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from runners.base import EngineConfig
from runners.capacity import driver as staircase_driver
from runners.capacity.driver import StaircaseDriver
from runners.capacity.plan import StepPlan
from runners.capacity.step import measure_step
from runners.capacity.stream_source import endless_requests
from runners.loadgen.requests import build_requests
from runners.process import EngineProcess, free_port, wait_healthy
from runners.simulated.launcher import SimulatedLauncher
from runners.workload import LengthDistribution, Workload

_ONE_CLIENT = 10 ** 9  # requests a client may hold: the whole stream on one


def saturated_step(url: str, rate_rps: float, requests_per_client: int,
                   seed: int) -> dict[str, float]:
    """One saturated step on a fresh driver: its driver thread's CPU and what it sent."""
    workload = Workload(input_len=LengthDistribution("uniform", 128, 64, 192),
                        output_len=LengthDistribution("uniform", 64, 32, 96))
    requests = endless_requests(lambda n, s: build_requests(workload, n, seed=s), 512, seed,
                                False)
    cpu: dict[str, float] = {}
    run_thread = StaircaseDriver._run_thread

    def timed(self: StaircaseDriver) -> None:
        start = time.thread_time()
        try:
            run_thread(self)
        finally:
            cpu["driver_s"] = time.thread_time() - start

    shipped = staircase_driver._REQUESTS_PER_CLIENT
    StaircaseDriver._run_thread = timed  # type: ignore[method-assign]
    staircase_driver._REQUESTS_PER_CLIENT = requests_per_client
    try:
        driver = StaircaseDriver(url, "model", requests, axis="request_rate", timeout_s=60,
                                 seed=seed)
        plan = StepPlan(load=rate_rps, warmup_s=30.0, window_s=5.0, lifetime_s=1.0,
                        expected_requests=rate_rps * 5.0, max_warmup_s=30.0)
        driver.start(rate_rps)
        try:
            run = measure_step(driver, url, plan, repeats=1, request_timeout_s=60,
                               check_engine=lambda: None, is_first=True)
            sent = len(driver.sent_between(-float("inf"), float("inf")))
            driver.cancel_in_flight()
        finally:
            driver.close()
    finally:
        StaircaseDriver._run_thread = run_thread  # type: ignore[method-assign]
        staircase_driver._REQUESTS_PER_CLIENT = shipped
    if not run.is_saturated:
        raise RuntimeError(f"the step at {rate_rps} req/s was not saturated; raise --rate.")
    return {"driver_cpu_s": cpu["driver_s"], "num_sent": float(sent),
            "num_owed": rate_rps * run.early_duration_s, "step_s": run.early_duration_s,
            "cpu_ms_per_request": 1000.0 * cpu["driver_s"] / max(sent, 1)}


def compare(rounds: int, rate_rps: float) -> dict[str, Any]:
    launcher = SimulatedLauncher("h200", startup_time_scale=0.01, seed=0)
    config = EngineConfig(model="qwen2.5-7b", flags={"enforce_eager": True,
                                                     "max_num_seqs": 32},
                          load_format="dummy", skip_tokenizer_init=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        argv, env = launcher.command(config, port, Path(tmp), None)
        proc = EngineProcess.start(argv, env, Path(tmp) / "server.log", Path(tmp))
        try:
            url = f"http://127.0.0.1:{port}"
            if wait_healthy(url, proc, 120.0) != "ready":
                raise RuntimeError(f"the simulated engine did not start; see {tmp}/server.log")
            for k in range(rounds):
                arms = [("one_client", _ONE_CLIENT),
                        ("spread", staircase_driver._REQUESTS_PER_CLIENT)]
                if k % 2:
                    arms.reverse()
                row: dict[str, Any] = {"round": k}
                for name, per_client in arms:
                    row[name] = saturated_step(url, rate_rps, per_client, seed=k)
                    time.sleep(2.0)  # the cancelled backlog leaves the server
                row["ratio"] = row["spread"]["cpu_ms_per_request"] / \
                    row["one_client"]["cpu_ms_per_request"]
                rows.append(row)
        finally:
            proc.terminate()
    ratios = [r["ratio"] for r in rows]
    return {"rate_rps": rate_rps, "rounds": rows,
            "median_ratio": statistics.median(ratios),
            "min_ratio": min(ratios), "max_ratio": max(ratios)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = compare(args.rounds, args.rate)
    for row in result["rounds"]:
        one, spread = row["one_client"], row["spread"]
        print(f"round {row['round']}: one client {one['cpu_ms_per_request']:.2f} ms CPU/request "
              f"({one['num_sent']:.0f} of {one['num_owed']:.0f} sent in {one['step_s']:.1f} s), "
              f"spread {spread['cpu_ms_per_request']:.2f} ({spread['num_sent']:.0f} of "
              f"{spread['num_owed']:.0f} in {spread['step_s']:.1f} s): ratio {row['ratio']:.2f}")
    print(f"spread/one client CPU per request: median {result['median_ratio']:.2f} "
          f"(rounds {result['min_ratio']:.2f}-{result['max_ratio']:.2f})")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
