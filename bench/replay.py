"""Benchmark: search efficiency, replayed on a table of measured configs.

Every config of a grid is measured once (on the H200 by a grid study, or here on the simulated
engine's virtual-time benchmark); then each search strategy is replayed against the table as
nightshift runs it, paying each config's GPU-seconds (start-up + load levels) when it first
asks for it: grid (the Cartesian product in order, as vLLM's `auto_tune` and `bench sweep`
walk it), random, TPE (nightshift's settings), TPE with nightshift's MarginPruner (a pruned
trial pays start-up and its first level only), and GP where torch is installed. A config asked
again costs nothing (the daemon never launches one twice), and 200 such repeats in a row end
the search unfinished (the daemon's "space exhausted"). The figure of merit is the
GPU-seconds spent until a trial within 3% of the grid's best was measured, median over seeds,
as a share of the whole grid's cost (what a grid search pays to know its best).

    python bench/replay.py build-sim --out bench/data/sim_grid.json      # ~2 min, 1152 configs
    python bench/replay.py replay bench/data/sim_grid.json --out bench/data/replay_sim.json
    python bench/replay.py from-study RESULTS/optuna.db h200-grid --out bench/data/h200_grid.json
    python bench/replay.py replay bench/data/h200_grid.json --only kv_cache_dtype=auto

`--only KEY=VALUE` replays the complete sub-grid of a table still being measured (a grid study
resumes across device sessions; the replay needs every config of the grid it walks).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from optimizer.outcomes import MAX_CONSECUTIVE_DUPLICATES
from optimizer.pruning import MarginPruner
from optimizer.study import is_search_trial

WITHIN = 0.97  # "found": a trial at >= 97% of the grid's best objective
SIM_SPACE: dict[str, list[Any]] = {
    "attention_backend": ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"],
    "kv_cache_dtype": ["auto", "fp8"],
    "quantization": ["none", "fp8"],
    "enforce_eager": [False, True],
    "max_num_batched_tokens": [2048, 4096, 8192, 16384],
    "max_num_seqs": [64, 128, 256, 512],
    "gpu_memory_utilization": [0.85, 0.9, 0.95],
}
SIM_WORKLOAD = {"input_len": 512, "output_len": 128, "levels": [16, 64], "num_requests": 128,
                "slo_ttft_ms": 1000.0, "slo_tpot_ms": 10.0, "model": "qwen2.5-7b",
                "hardware": "h200", "max_model_len": 4096}
FAILED_STARTUP_S = 30.0  # a config that fails at start costs about this much (H200: 28-30 s)


def _key(params: Mapping[str, Any]) -> str:
    return json.dumps(params, sort_keys=True)


# --- the simulated table ----------------------------------------------------------------------


def build_sim_table() -> dict[str, Any]:
    """Every config of SIM_SPACE through the simulated engine's virtual-time benchmark."""
    from rich.progress import track

    from runners.base import EngineConfig
    from runners.hardware import load_preset
    from runners.simulated.model import PerformanceModel, simulate_benchmark

    w = SIM_WORKLOAD
    hardware = load_preset(str(w["hardware"]))
    names = list(SIM_SPACE)
    rows = []
    configs = list(itertools.product(*SIM_SPACE.values()))
    for values in track(configs, description="simulating the grid"):
        params = dict(zip(names, values, strict=True))
        flags = {k: v for k, v in params.items() if v not in ("none", False)}
        flags["max_model_len"] = w["max_model_len"]
        model = PerformanceModel.from_config(EngineConfig(str(w["model"]), flags), hardware,
                                             is_compile_cache_warm=True)
        startup_s = model.startup().total_s
        if model.check_memory() is not None:
            rows.append({"params": params, "failed": True, "startup_s": FAILED_STARTUP_S,
                         "levels": [], "value": None, "gpu_s": FAILED_STARTUP_S})
            continue
        levels = []
        for concurrency in w["levels"]:  # type: ignore[attr-defined]
            run = simulate_benchmark(model, input_len=int(w["input_len"]),
                                     output_len=int(w["output_len"]),
                                     max_concurrency=concurrency,
                                     num_requests=int(w["num_requests"]))
            good = sum(1 for ttft, tpot in run.per_request
                       if ttft * 1e3 <= w["slo_ttft_ms"] and tpot * 1e3 <= w["slo_tpot_ms"])
            levels.append({"concurrency": concurrency, "value": good / run.duration_s,
                           "measure_s": run.duration_s})
        rows.append({"params": params, "failed": False, "startup_s": startup_s,
                     "levels": levels, "value": max(lv["value"] for lv in levels),
                     "gpu_s": startup_s + sum(lv["measure_s"] for lv in levels)})
    return {"source": "simulated engine (virtual-time benchmark; modelled, not measured)",
            "objective": "goodput (req/s meeting TTFT p99 1 s and TPOT p99 10 ms)",
            "workload": w, "space": SIM_SPACE, "rows": rows}


# --- a measured table, from a grid study's records --------------------------------------------


def table_from_study(db: Path, study_name: str) -> dict[str, Any]:
    """A table from a study that ran a grid (bench/h200/grid.yaml): each config's per-level
    goodput and durations and its start-up, from the records the daemon kept in Optuna."""
    study = optuna.load_study(study_name=study_name, storage=f"sqlite:///{db}")
    rows: dict[str, dict[str, Any]] = {}
    space: dict[str, list[Any]] = {}
    for trial in study.get_trials(deepcopy=False):
        record = trial.user_attrs.get("record") or {}
        if not trial.state.is_finished() or not is_search_trial(trial) or \
                record.get("state") not in ("complete", "failed"):
            continue  # a repeat or a final re-measurement (confirm) is not a grid point
        params = dict(record["params"])
        if record["state"] == "failed":
            if record.get("failure_reason") in ("daemon_lost", "interrupted", "worker_lost"):
                continue  # lost to infrastructure: its re-run is the measurement
            wall = float(record.get("wall_s") or FAILED_STARTUP_S)
            row = {"params": params, "failed": True, "startup_s": wall, "levels": [],
                   "value": None, "gpu_s": wall}
        else:
            levels = [{"concurrency": s["level"].get("max_concurrency"),
                       "value": float(s["metrics"]["request_goodput"]),
                       "measure_s": float(s["metrics"]["duration_s"])} for s in record["steps"]]
            startup = float(record["metrics"].get("engine.startup_s") or 0.0)
            row = {"params": params, "failed": False, "startup_s": startup, "levels": levels,
                   "value": max(lv["value"] for lv in levels),
                   "gpu_s": startup + sum(lv["measure_s"] for lv in levels)}
        rows[_key(params)] = row
        for k, v in params.items():
            if v not in space.setdefault(k, []):
                space[k].append(v)
    return {"source": f"nightshift study {study_name} ({db})", "objective": "goodput",
            "space": space, "rows": list(rows.values())}


def restrict(data: Mapping[str, Any], only: Mapping[str, str]) -> dict[str, Any]:
    """The rows of a table whose params match every KEY=VALUE of `only` (values compared as
    text), with the space those rows span: a complete sub-grid of a table still being filled."""
    unknown = sorted(set(only) - set(data["space"]))
    if unknown:
        raise SystemExit(f"--only {unknown[0]}: not a parameter of this table; use one of "
                         f"{', '.join(data['space'])}.")
    rows = [r for r in data["rows"]
            if all(str(r["params"].get(k)) == v for k, v in only.items())]
    # The table's values in its order (its grid order), restricted to what the rows span.
    space = {k: spanned for k, values in data["space"].items()
             if (spanned := [v for v in values if any(r["params"].get(k) == v for r in rows)])}
    where = ", ".join(f"{k}={v}" for k, v in only.items())
    return {**data, "source": f"{data['source']}, only {where}", "space": space, "rows": rows}


# --- replay -----------------------------------------------------------------------------------


class Table:
    def __init__(self, data: Mapping[str, Any]) -> None:
        self.space: dict[str, list[Any]] = dict(data["space"])
        self.rows = {_key(r["params"]): r for r in data["rows"]}
        missing = [p for p in itertools.product(*self.space.values())
                   if _key(dict(zip(self.space, p, strict=True))) not in self.rows]
        if missing:
            raise SystemExit(f"the table lacks {len(missing)} configs of its grid (e.g. "
                             f"{missing[0]}); measure the whole grid, or replay a complete "
                             "sub-grid with --only KEY=VALUE.")
        values = [r["value"] for r in self.rows.values() if r["value"] is not None]
        self.best = max(values)
        self.target = WITHIN * self.best
        self.grid_cost_s = sum(r["gpu_s"] for r in self.rows.values())

    def grid_order(self) -> list[dict[str, Any]]:
        return [dict(zip(self.space, p, strict=True))
                for p in itertools.product(*self.space.values())]


def _replay_grid(table: Table) -> float:
    spent = 0.0
    for params in table.grid_order():
        row = table.rows[_key(params)]
        spent += row["gpu_s"]
        if row["value"] is not None and row["value"] >= table.target:
            return spent
    return spent


def _replay_optuna(table: Table, sampler: optuna.samplers.BaseSampler, *,
                   prune: bool, max_asks: int) -> float:
    """GPU-seconds until a trial within 3% of the best, nightshift's way: each config paid
    once; with `prune`, MarginPruner may stop a trial after its first level."""
    pruner = MarginPruner(n_startup_trials=4, min_relative_gap=0.10) if prune \
        else optuna.pruners.NopPruner()
    study = optuna.create_study(direction="maximize", sampler=sampler, pruner=pruner)
    distributions = {k: optuna.distributions.CategoricalDistribution(v)
                     for k, v in table.space.items()}
    seen: dict[str, tuple[TrialState, float | None]] = {}
    # The defaults run first in every study: the first grid config stands in for them.
    study.enqueue_trial(table.grid_order()[0])
    spent = 0.0
    repeats = 0
    for _ in range(max_asks):
        trial = study.ask(distributions)
        key = _key(trial.params)
        if key in seen:  # the daemon reuses the outcome and launches nothing
            state, value = seen[key]
            study.tell(trial, value if state == TrialState.COMPLETE else None,
                       state=state)
            repeats += 1
            if repeats >= MAX_CONSECUTIVE_DUPLICATES:  # the daemon's end: "space exhausted"
                return math.inf
            continue
        repeats = 0
        row = table.rows[key]
        if row["failed"]:
            spent += row["gpu_s"]
            seen[key] = (TrialState.FAIL, None)
            study.tell(trial, state=TrialState.FAIL)
            continue
        spent += row["startup_s"]
        state, value = TrialState.COMPLETE, row["value"]
        for step, level in enumerate(row["levels"]):
            spent += level["measure_s"]
            best_so_far = max(lv["value"] for lv in row["levels"][:step + 1])
            trial.report(best_so_far, step)
            if step < len(row["levels"]) - 1 and trial.should_prune():
                state, value = TrialState.PRUNED, None
                break
        seen[key] = (state, value)
        study.tell(trial, value, state=state) if state == TrialState.COMPLETE else \
            study.tell(trial, state=state)
        if state == TrialState.COMPLETE and value is not None and value >= table.target:
            return spent
    return math.inf


def _tpe(seed: int) -> optuna.samplers.BaseSampler:
    with warnings.catch_warnings():  # nightshift's own settings (optimizer/study.py)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=6, multivariate=True,
                                          group=True, constant_liar=True)


def _gp(seed: int) -> optuna.samplers.BaseSampler | None:
    try:
        import torch  # noqa: F401  (GPSampler needs it)
    except ImportError:
        return None
    return optuna.samplers.GPSampler(seed=seed, n_startup_trials=6)


STRATEGIES: dict[str, tuple[Callable[[int], optuna.samplers.BaseSampler | None], bool]] = {
    "random": (lambda seed: optuna.samplers.RandomSampler(seed=seed), False),
    "tpe": (_tpe, False),
    "tpe+pruning": (_tpe, True),
    "gp": (_gp, False),
}


def replay(data: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    from rich.progress import track

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    table = Table(data)
    grid_s = _replay_grid(table)
    results: dict[str, Any] = {"grid": {"gpu_s_to_target": [grid_s]}}
    max_asks = 4 * len(table.rows)
    for name, (make, prune) in STRATEGIES.items():
        costs = []
        for seed in track(list(seeds), description=name):
            sampler = make(seed)
            if sampler is None:
                break
            costs.append(_replay_optuna(table, sampler, prune=prune, max_asks=max_asks))
        results[name] = {"gpu_s_to_target": costs}
    summary: dict[str, Any] = {}
    for name, result in results.items():
        costs = result["gpu_s_to_target"]
        if not costs:
            summary[name] = {"skipped": "GPSampler needs torch"}
            continue
        median = statistics.median(costs)
        summary[name] = {"median_gpu_s": median, "share_of_grid": median / table.grid_cost_s,
                         "min_gpu_s": min(costs), "max_gpu_s": max(costs), "runs": len(costs),
                         "reached": sum(math.isfinite(c) for c in costs)}
    return {"source": data["source"], "objective": data["objective"],
            "configs": len(table.rows), "best": table.best, "within": WITHIN,
            "grid_cost_s": table.grid_cost_s, "seeds": list(seeds), "summary": summary}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    build = sub.add_parser("build-sim", help="measure SIM_SPACE on the simulated engine")
    build.add_argument("--out", type=Path, required=True)
    convert = sub.add_parser("from-study", help="a table from a grid study's Optuna records")
    convert.add_argument("db", type=Path)
    convert.add_argument("study")
    convert.add_argument("--out", type=Path, required=True)
    run = sub.add_parser("replay", help="replay the strategies against a table")
    run.add_argument("table", type=Path)
    run.add_argument("--seeds", type=int, default=20)
    run.add_argument("--out", type=Path, default=None)
    run.add_argument("--only", action="append", default=[], metavar="KEY=VALUE",
                     help="replay the sub-grid where KEY is VALUE (repeatable)")
    args = parser.parse_args()
    if args.cmd == "build-sim":
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(build_sim_table()))
        return 0
    if args.cmd == "from-study":
        table = table_from_study(args.db, args.study)
        args.out.write_text(json.dumps(table, indent=1))
        sys.stdout.write(f"{len(table['rows'])} configs measured\n")
        return 0
    bad = [o for o in args.only if "=" not in o]
    if bad:
        parser.error(f"--only {bad[0]}: write KEY=VALUE, e.g. --only kv_cache_dtype=auto")
    data = json.loads(args.table.read_text())
    if args.only:
        data = restrict(data, dict(o.split("=", 1) for o in args.only))
    result = replay(data, range(args.seeds))
    sys.stdout.write(f"{result['configs']} configs, grid cost {result['grid_cost_s']:.0f} GPU-s, "
                     f"best {result['best']:.3g}; GPU-s to reach {WITHIN:.0%} of it "
                     f"(median over {args.seeds} seeds):\n")
    for name, s in result["summary"].items():
        if "skipped" in s:
            sys.stdout.write(f"  {name:>12}: skipped ({s['skipped']})\n")
            continue
        sys.stdout.write(f"  {name:>12}: {s['median_gpu_s']:8.0f} GPU-s = "
                         f"{s['share_of_grid']:6.1%} of the grid's cost "
                         f"(range {s['min_gpu_s']:.0f}-{s['max_gpu_s']:.0f}; "
                         f"{s['reached']} of {s['runs']} seeds reached it)\n")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
