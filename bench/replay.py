"""Benchmark: search efficiency, replayed on a table of measured configs.

Every config of a grid is measured once (on the H200 by a grid study, or here on the simulated
engine's virtual-time benchmark); then each search strategy is replayed against the table by the
shipped search policy (`optimizer.search.controller.SearchController`, the one the daemon drives,
with the samplers and pruners of the study file's registries), paying each config's GPU-seconds
(start-up + the load levels it ran) when the policy launches it: grid (the Cartesian product in
order, as vLLM's `auto_tune` and `bench sweep` walk it), random, TPE, TPE with the default pruner
(`bottleneck`: a pruned trial pays start-up and the levels it ran), and GP where torch is
installed. A config asked again costs nothing (the policy never launches one twice), and 200 such
repeats in a row end the search unfinished (the policy's "space exhausted"). The figure of merit is
the GPU-seconds spent until a trial within 3% of the grid's best was measured, median over seeds,
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna

from optimizer.results.trial_record import record_of
from optimizer.storage.study import is_search_trial

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
    from runners.simulated.benchmark import simulate_benchmark
    from runners.simulated.performance import PerformanceModel

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
                           "request_throughput": len(run.per_request) / run.duration_s,
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
        record = record_of(trial)
        if record is None or not trial.state.is_finished() or not is_search_trial(trial) or \
                record.state not in ("complete", "failed"):
            continue  # a repeat or a final re-measurement (confirm) is not a grid point
        params = dict(record.params)
        if record.state == "failed":
            if record.failure_reason in ("daemon_lost", "interrupted", "worker_lost"):
                continue  # lost to infrastructure: its re-run is the measurement
            wall = float(record.wall_s or FAILED_STARTUP_S)
            row = {"params": params, "failed": True, "startup_s": wall, "levels": [],
                   "value": None, "gpu_s": wall}
        else:
            levels = [{"concurrency": s["level"].get("max_concurrency"),
                       "value": float(s["metrics"]["request_goodput"]),
                       "request_throughput": float(s["metrics"].get("request_throughput")
                                                   or s["metrics"]["request_goodput"]),
                       "measure_s": float(s["metrics"]["duration_s"])} for s in record.steps]
            startup = float(record.metrics.get("engine.startup_s") or 0.0)
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


def _level_metrics(level: Mapping[str, Any]) -> Any:
    """A table level as the figures a runner reports: goodput, duration and, where the table
    has it, the request throughput (the policy judges a level only where the SLO was missed,
    goodput below throughput; a table without throughput gives it no level to judge)."""
    from runners.base import BenchmarkMetrics

    goodput = float(level["value"])
    duration = float(level["measure_s"]) or 1.0
    throughput = float(level.get("request_throughput") or goodput)
    latencies = {f"{s}_{m}_ms": 0.0 for s in ("mean", "median", "std", "p90", "p99")
                 for m in ("ttft", "tpot", "itl", "e2el")}
    completed = max(1, round(throughput * duration))
    return BenchmarkMetrics(completed=completed, failed=0, duration_s=duration,
                            total_input_tokens=0, total_output_tokens=0,
                            request_throughput=throughput, request_goodput=goodput,
                            output_throughput=0.0, total_token_throughput=0.0, **latencies)


def _study_config(table: Table, sampler: str, seed: int, pruner: str) -> Any:
    """The shipped study config for a replay: the sampler and pruner by name (their defaults
    otherwise), one level per table level, the budget the whole table."""
    from optimizer.config import parse_study

    levels = [{"concurrency": int(lv.get("concurrency") or 1)}
              for lv in next(r for r in table.rows.values() if r["levels"])["levels"]]
    return parse_study({
        "name": "replay", "engine": "simulated",
        "model": {"path": "qwen2.5-7b", "load_format": "dummy", "skip_tokenizer_init": True},
        "workload": {"input_len": 128, "output_len": 16, "levels": levels, "num_requests": 16},
        "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 10},
        "search_space": "default", "budget": {"trials": len(table.rows)},
        "sampler": {"name": sampler, "seed": seed}, "pruner": {"name": pruner},
        "confirm_rounds": 0})  # the study is opened in memory by the replay, not from here


def _space(table: Table) -> Any:
    """The table's grid as a search space; each param's first value stands for vLLM's
    default (the defaults run first in every study)."""
    from search_spaces import parse_space

    return parse_space({"name": "replay", "parameters": {
        name: {"type": "categorical", "choices": values, "default": values[0]}
        for name, values in table.space.items()}}).resolve({})


def _replay_optuna(table: Table, sampler: str | optuna.samplers.BaseSampler, seed: int, *,
                   pruner: str) -> float:
    """GPU-seconds until a trial within 3% of the best, by the shipped search policy
    (`optimizer.search.controller.SearchController`: the defaults first, a repeat reused and
    never paid, a config failure told as the worst value with a violated constraint, pruning by
    the study's pruner): each config paid once; a pruned trial pays its start-up and the levels
    it ran."""
    from optimizer.search.controller import SearchController
    from optimizer.storage.study import make_pruner, make_sampler
    from runners.base import Failure, FailureReason, RunResult, StepMetrics

    cfg = _study_config(table, sampler if isinstance(sampler, str) else "tpe", seed, pruner)
    space = _space(table)
    study = optuna.create_study(  # a sampler object: a test's own, in place of the registry's
        directions=cfg.directions, pruner=make_pruner(cfg),
        sampler=make_sampler(cfg) if isinstance(sampler, str) else sampler)
    policy = SearchController(cfg, space, study, workload=cfg.workload,
                              total_gpus=1)
    policy.prepare()
    spent = 0.0
    while (running := policy.next_launch(lambda num_gpus: not policy.running)) is not None:
        row = table.rows[_key({k: running.params[k] for k in table.space})]
        if row["failed"]:
            spent += row["gpu_s"]
            policy.on_result(running, RunResult(status="failed", failure=Failure(
                FailureReason.OOM_AT_START, "failed at start in the measured table")))
            continue
        spent += row["startup_s"]
        steps: list[StepMetrics] = []
        status = "complete"
        for index, level in enumerate(row["levels"]):
            spent += level["measure_s"]
            step = StepMetrics(step=index, level=cfg.workload.levels[index],
                               metrics=_level_metrics(level))
            steps.append(step)
            if policy.on_step(running, step):
                status = "stopped"
                break
        policy.on_result(running, RunResult(status=status, steps=tuple(steps)))  # type: ignore[arg-type]
        if status == "complete" and row["value"] is not None and row["value"] >= table.target:
            return spent
    return math.inf


def _gp_available() -> bool:
    try:
        import torch  # noqa: F401  (GPSampler needs it)
    except ImportError:
        return False
    return True


# name -> (the sampler's registry name, the pruner's): the study file's own names.
STRATEGIES: dict[str, tuple[str, str]] = {
    "random": ("random", "none"),
    "tpe": ("tpe", "none"),
    "tpe+pruning": ("tpe", "bottleneck"),  # the shipped defaults before issue 36
    "gp": ("gp", "none"),
}


def replay(data: Mapping[str, Any], seeds: Sequence[int]) -> dict[str, Any]:
    from rich.progress import track

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    table = Table(data)
    grid_s = _replay_grid(table)
    results: dict[str, Any] = {"grid": {"gpu_s_to_target": [grid_s]}}
    for name, (sampler, pruner) in STRATEGIES.items():
        costs = []
        if sampler == "gp" and not _gp_available():
            results[name] = {"gpu_s_to_target": costs}
            continue
        for seed in track(list(seeds), description=name):
            costs.append(_replay_optuna(table, sampler, seed, pruner=pruner))
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
