"""Benchmark: GPU-seconds the pruner saves on the simulated engine, at the same result quality.

Runs one study twice, side by side in one run of this script, identical but for the pruner
(`bottleneck` vs `none`): same space, sampler seed, workload and budget. With `--sampler random`
(the default) both runs evaluate the very same configs in the same order (a seeded random
sampler does not look at results), so the only difference is where trials stopped, and the
result quality is checked config for config: was the unpruned run's best kept? With `tpe` the
runs diverge as soon as a pruned trial informs the sampler differently.

GPU-seconds of a trial = its GPUs x (modelled engine start-up + the load levels it measured);
the simulated engine's start-up is the modelled one (its sleep is time-scaled). A level lasts
`--level-s` seconds of load (a capacity sweep on a real server takes minutes per level, as
`vllm bench sweep` does); with seconds-long levels against minutes of start-up no pruner can
save anything, which the first run of this benchmark showed (`--level-s 0`: fixed request
counts). Prints a table and writes JSON.

    python bench/pruning_savings.py --trials 12 --out bench/data/pruning_savings.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import optuna
import yaml

from optimizer.cli import main as nightshift
from optimizer.results.trial_record import record_of
from optimizer.storage.study import is_search_trial

STUDY: dict[str, Any] = {
    "engine": "simulated",
    "model": {"path": "qwen2.5-7b", "load_format": "dummy", "skip_tokenizer_init": True},
    "workload": {"input_len": 512, "output_len": 64,
                 "levels": [{"concurrency": 4}, {"concurrency": 16}, {"concurrency": 32},
                            {"concurrency": 64}],
                 "num_requests": 64, "warmup_requests": 2},
    "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 12},
    "objective": "goodput",
    "search_space": "hopper",
    "sampler": {"name": "tpe", "seed": 7, "n_startup_trials": 6},
    "simulated": {"hardware": "h200", "num_gpus": 2, "startup_time_scale": 0.002},
    "confirm_rounds": 0,  # the final re-measurement is the same for both: not compared here
}


def gpu_seconds(trial: optuna.trial.FrozenTrial) -> float:
    record = record_of(trial)
    if record is None:
        return 0.0
    tp = int(record.flags.get("tensor_parallel_size") or 1)
    startup = float(record.metrics.get("engine.startup_s") or 0.0)
    measured = sum(float(s["metrics"].get("duration_s", 0.0)) for s in record.steps)
    return tp * (startup + measured)


def run(pruner: str, trials: int, root: Path, sampler: str, level_s: float) -> dict[str, Any]:
    name = f"bench-{pruner}"
    workload = dict(STUDY["workload"])
    if level_s > 0:
        workload.update(duration_s=level_s, num_requests=None)
    study = {**STUDY, "name": name, "budget": {"trials": trials}, "pruner": {"name": pruner},
             "workload": workload, "sampler": {**STUDY["sampler"], "name": sampler},
             "results_dir": str(root / name), "tracking_uri": f"sqlite:///{root}/mlflow.db"}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(study))
    if nightshift(["start", str(path), "--no-progress"]) != 0:
        raise SystemExit(f"study {name} failed")
    loaded = optuna.load_study(study_name=name, storage=f"sqlite:///{root / name}/optuna.db")
    finished = [t for t in loaded.trials if t.state.is_finished() and is_search_trial(t)]
    complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
    best = max(complete, key=lambda t: float(t.value or 0.0), default=None)
    return {"pruner": pruner, "trials": len(finished),
            "pruned": sum(t.state == optuna.trial.TrialState.PRUNED for t in finished),
            "gpu_seconds": sum(gpu_seconds(t) for t in finished),
            "best_goodput": float(best.value or 0.0) if best else 0.0,
            "best_params": best.params if best else None,
            "trials_detail": [{"number": t.number, "state": t.state.name,
                               "gpu_seconds": round(gpu_seconds(t), 1),
                               "value": t.value, "params": t.params} for t in finished]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--sampler", choices=("random", "tpe"), default="random")
    parser.add_argument("--level-s", type=float, default=20.0,
                        help="seconds of load per level; 0 = a fixed 32 requests per level")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="nightshift-bench-"))
    try:
        rows = [run(pruner, args.trials, root, args.sampler, args.level_s)
                for pruner in ("none", "bottleneck")]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base, pruned = rows
    summary = {"rows": rows, "sampler": args.sampler, "level_s": args.level_s,
               "levels": [lv["concurrency"] for lv in STUDY["workload"]["levels"]],
               "gpu_seconds_ratio": pruned["gpu_seconds"] / base["gpu_seconds"],
               "best_goodput_ratio": pruned["best_goodput"] / base["best_goodput"],
               "same_best_config": pruned["best_params"] == base["best_params"],
               "engine": "simulated (h200 preset; modelled, not measured)"}
    for row in rows:
        sys.stdout.write(f"{row['pruner']:>10}: {row['trials']} trials, {row['pruned']} pruned, "
                         f"{row['gpu_seconds']:.0f} GPU-s, best goodput "
                         f"{row['best_goodput']:.2f} req/s\n")
    sys.stdout.write(f"pruning: {summary['gpu_seconds_ratio']:.2f}x the GPU-seconds, "
                     f"{summary['best_goodput_ratio']:.2f}x the best goodput, same best config: "
                     f"{summary['same_best_config']}\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
