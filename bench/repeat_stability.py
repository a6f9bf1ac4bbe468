"""Repeat stability of the steady staircase on the simulated engine (issue 32): one config's
capacity searched N times, each on a fresh engine with its own seed; prints each bracket and
whether they agree within the search's tolerance. Simulated figures, never measurements; on a
busy host the simulated engine's open loops crowd on its modelled clock (NOTES.md), so run
it on a quiet one.

    python -m bench.repeat_stability --runs 3
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from runners.base import EngineConfig
from runners.capacity_search import CapacitySearch
from runners.engine import EngineRunner
from runners.simulated.launcher import SimulatedLauncher
from runners.workload import SLO, LengthDistribution, Workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    search = CapacitySearch("request_rate", low=1, high=64, tolerance=0.1, max_probes=8,
                            min_window_requests=150, min_window_s=3)
    workload = Workload(input_len=LengthDistribution(mean=512),
                        output_len=LengthDistribution(mean=128),
                        slo=SLO(ttft_p99_ms=1000, tpot_p99_ms=10), num_warmup_requests=4,
                        capacity=search)
    config = EngineConfig(model="qwen2.5-7b", load_format="dummy", skip_tokenizer_init=True)
    mets: list[float] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.01, seed=run),
                                  Path(tmp) / "registry")
            started = time.monotonic()
            try:
                result = runner.run(config, workload, Path(tmp) / "w")
            finally:
                runner.close()
        bracket = result.capacity
        print(f"run {run}: {result.status}, {bracket.describe() if bracket else 'no bracket'} "
              f"({bracket.status if bracket else '-'}, {len(result.steps)} steps, "
              f"{time.monotonic() - started:.0f} s)")
        if bracket is not None and bracket.met_load:
            mets.append(bracket.met_load)
    if len(mets) == args.runs and mets:
        spread = max(mets) / min(mets) - 1
        print(f"capacity over {args.runs} runs: {min(mets):.3g}-{max(mets):.3g} req/s, spread "
              f"{spread:.1%} ({'within' if spread <= search.tolerance else 'beyond'} the "
              f"{search.tolerance:.0%} tolerance) [simulated]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
