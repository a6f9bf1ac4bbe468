"""Repeat stability of the steady staircase on the simulated engine (issue 32): one config's
capacity searched N times, each on a fresh engine with its own seed, each with the profile a
study takes (`profile: true`: a window of the stream at the operating point); prints each
bracket and bottleneck label (the daemon's classifier, with the trace and without it) with the
operating point's FLOP term over its byte term (`compute_over_memory`: within
`Thresholds.ridge_margin` of 1 the label is compute-and-memory-bound), whether the capacities
agree within the search's tolerance and whether the labels are the same.
Simulated figures, never measurements; on a busy host the simulated engine's open loops crowd
on its modelled clock (NOTES.md), so run it on a quiet one.

    python -m bench.repeat_stability --runs 3
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from pathlib import Path

from optimizer import bottleneck
from runners.base import EngineConfig, RunResult
from runners.capacity.search import CapacitySearch
from runners.engine import EngineRunner
from runners.hardware import load_preset
from runners.model_info import load_model_info
from runners.simulated.launcher import SimulatedLauncher
from runners.workload import SLO, LengthDistribution, Workload

HARDWARE = "h200"
MODEL = "qwen2.5-7b"
OBJECTIVE = "goodput"  # a capacity search's: the label describes its operating point


def verdict_of(result: RunResult, config: EngineConfig, *,
               with_trace: bool) -> bottleneck.Verdict:
    """The bottleneck verdict the daemon records for this result (`SearchPolicy.verdict`, TP 1),
    from all its evidence or with the trace left out (a study without `profile`)."""
    evidence = bottleneck.evidence_from(
        result, config, load_preset(HARDWARE), load_model_info(MODEL), objective=OBJECTIVE,
        trace_summary=None if with_trace else {})
    return bottleneck.classify(evidence)


def figures(verdict: bottleneck.Verdict) -> str:
    """The operating point's FLOP term over its byte term, as the label was decided on, with
    the step mix's two utilisations where it had one (the decode roofline's ratio has none)."""
    ev = verdict.evidence
    if "compute_over_memory" not in ev:
        return "no roofline ratio"
    ratio = f"FLOP term {ev['compute_over_memory']:.3f}x the byte term"
    if "compute_utilization" not in ev or "bandwidth_utilization" not in ev:
        return f"{ratio} (the decode roofline's; no step mix)"
    return (f"{ratio}: {ev['compute_utilization']:.1%} of the FLOP ceiling, "
            f"{ev['bandwidth_utilization']:.1%} of the bandwidth ceiling")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1 but got {args.runs}.")
    logging.basicConfig(level=logging.WARNING)
    # A SIGTERM (`timeout`, a job's end) unwinds as an exit, so each run's engine is closed: it
    # used to outlive the script.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    search = CapacitySearch("request_rate", low=1, high=64, tolerance=0.1, max_probes=8,
                            min_window_requests=150, min_window_s=3, hold_s=30)
    workload = Workload(input_len=LengthDistribution(mean=512),
                        output_len=LengthDistribution(mean=128),
                        slo=SLO(ttft_p99_ms=1000, tpot_p99_ms=10), num_warmup_requests=4,
                        capacity=search, profile=True)
    config = EngineConfig(model=MODEL, load_format="dummy", skip_tokenizer_init=True)
    mets: list[float] = []
    labels: list[tuple[str, str]] = []  # (with the trace, without it) per run
    ratios: list[float] = []  # the operating point's FLOP term over its byte term, per run
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            runner = EngineRunner(SimulatedLauncher(HARDWARE, startup_time_scale=0.01, seed=run),
                                  Path(tmp) / "registry")
            started = time.monotonic()
            try:
                result = runner.run(config, workload, Path(tmp) / "w")
            finally:
                runner.close()
            traced = verdict_of(result, config, with_trace=True)
            pair = (traced.label, verdict_of(result, config, with_trace=False).label)
        labels.append(pair)
        if "compute_over_memory" in traced.evidence:
            ratios.append(traced.evidence["compute_over_memory"])
        bracket = result.capacity
        trace = result.trace_summary or {}
        profiled = f"profiled at {trace['profile.request_rate_rps']:.3g} req/s" \
            if "profile.request_rate_rps" in trace else "no profile"
        print(f"run {run}: {result.status}, {bracket.describe() if bracket else 'no bracket'} "
              f"({bracket.status if bracket else '-'}, {len(result.steps)} steps, "
              f"{time.monotonic() - started:.0f} s); label {pair[0]} (without the trace: "
              f"{pair[1]}); {profiled}; at {traced.load or 'no load'}: {figures(traced)}")
        if bracket is not None and bracket.met_load:
            mets.append(bracket.met_load)
    if len(mets) == args.runs:
        spread = max(mets) / min(mets) - 1
        print(f"capacity over {args.runs} runs: {min(mets):.3g}-{max(mets):.3g} req/s, spread "
              f"{spread:.1%} ({'within' if spread <= search.tolerance else 'beyond'} the "
              f"{search.tolerance:.0%} tolerance) [simulated]")
    else:
        print(f"capacity: {args.runs - len(mets)} of {args.runs} runs met the SLO at no load "
              "[simulated]")
    if ratios:
        margin = bottleneck.DEFAULT_THRESHOLDS.ridge_margin
        print(f"FLOP term over byte term at the operating points: {min(ratios):.3f}-"
              f"{max(ratios):.3f} (compute-and-memory-bound within [{1 / (1 + margin):.3f}, "
              f"{1 + margin:.3f}]) [simulated]")
    for k, name in ((0, "with the trace"), (1, "without the trace")):
        seen = sorted({pair[k] for pair in labels})
        print(f"label {name}: {'the same in every run' if len(seen) == 1 else 'differs'} "
              f"({', '.join(seen)}) [simulated]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
