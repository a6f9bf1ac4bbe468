"""Benchmark: nightshift's own overhead per trial, from a finished study's records.

A trial's wall time (Optuna's start to finish) splits into: the engine's start-up to readiness,
warm-up and the measured load levels (the last level's `elapsed_s`, counted from launch), what
follows the last level inside the runner (the profiled window, if any, and the teardown of the
process group), and what lies outside the runner: asking Optuna, dispatching the Ray actor,
MLflow logging, telling Optuna. The last two are overhead; the goal is <= 5% of a trial.

    python bench/overhead.py RESULTS/optuna.db STUDY_NAME [--out bench/data/overhead.json]

On the simulated engine start-up sleeps are time-scaled, so shares there overstate the overhead
of a real trial: read the H200 study's figures for that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import optuna

from optimizer.results.trial_record import is_repeat, record_of


def breakdown(db: Path, study_name: str) -> dict[str, Any]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{db}")
    rows = []
    for trial in study.get_trials(deepcopy=False):
        record = record_of(trial)
        if record is None or record.state != "complete" or not record.steps \
                or trial.datetime_start is None or trial.datetime_complete is None \
                or is_repeat(trial):
            continue
        steps = record.steps
        total = (trial.datetime_complete - trial.datetime_start).total_seconds()
        engine = float(steps[-1]["elapsed_s"])  # launch -> end of the last level
        runner = float(record.wall_s or engine)  # launch -> torn down
        # The simulated engine reports its modelled start-up, which it slept time-scaled.
        startup = min(float(record.metrics.get("engine.startup_s") or 0.0), engine)
        rows.append({"trial": trial.number, "total_s": total, "startup_s": startup,
                     "measure_s": engine - startup, "after_levels_s": runner - engine,
                     "outside_runner_s": total - runner})
    totals = {k: sum(r[k] for r in rows) for k in ("total_s", "startup_s", "measure_s",
                                                   "after_levels_s", "outside_runner_s")}
    share = (totals["outside_runner_s"] / totals["total_s"]) if totals["total_s"] else 0.0
    return {"study": study_name, "trials": rows, "totals": totals,
            "outside_runner_share": share,
            "after_levels_share": totals["after_levels_s"] / totals["total_s"]
            if totals["total_s"] else 0.0,
            "median_outside_runner_s": statistics.median(r["outside_runner_s"] for r in rows)
            if rows else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db", type=Path)
    parser.add_argument("study")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = breakdown(args.db, args.study)
    sys.stdout.write("trial   total s  start-up s  measure s  after levels s  outside s\n")
    for r in result["trials"]:
        sys.stdout.write(f"{r['trial']:>5} {r['total_s']:9.1f} {r['startup_s']:11.1f} "
                         f"{r['measure_s']:10.1f} {r['after_levels_s']:15.1f} "
                         f"{r['outside_runner_s']:10.1f}\n")
    sys.stdout.write(f"outside the runner (daemon, Ray, MLflow): "
                     f"{result['outside_runner_share']:.1%} of trial time; after the last "
                     f"level (profile + teardown): {result['after_levels_share']:.1%}\n")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
