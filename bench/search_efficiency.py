"""Benchmark: does the shipped search policy find a good config for fewer GPU-seconds than
random search? One that can fail: at least 200 seeds a policy, grids where several knobs
interact, a bootstrap interval and a rank test.

Each grid is a table of every config's figures, built once and cached under bench/data/
(`grid_<name>.json`; `--rebuild` builds it again): three from the simulated engine's virtual-time
benchmark (modelled, never measured) and one from the H200's records. Every policy is replayed over
each table by the real search policy (`bench/replay.py`, which drives
`optimizer.search.controller.SearchController`), paying a config's GPU-seconds when it is launched;
the figure of merit is the GPU-seconds spent until a trial within 3% of the table's best was
measured. A seed that never got there (the policy ran out of new configs) counts as the whole
grid's cost.

    python -m bench.search_efficiency --seeds 200          # a few minutes; grids cached
    python -m bench.search_efficiency --seeds 20           # a quick check

It ends with one line per grid:
`GRID: shipped/random median GPU-s to within 3% = R [lo, hi] (bootstrap 95%), Mann-Whitney p = P`
R < 1 is the shipped policy finding it for less; an interval that holds 1 is no edge shown.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from scipy.stats import mannwhitneyu

from bench import replay

DATA = Path(__file__).resolve().parent / "data"
SHIPPED = "screen+tpe"  # the study file's defaults: sampler screen, pruner bottleneck
POLICIES: dict[str, tuple[str, str]] = {  # name -> (sampler, pruner), the study file's names
    "random": ("random", "none"),
    "tpe+pruning": ("tpe", "bottleneck"),  # the shipped defaults before issue 36
    # The informed start (the shipped default since issue 36): SCREEN_TRIALS
    # (optimizer/search/searcher.py) configs from the analytic screen, refitted to each
    # measurement, then TPE (optimizer/search/samplers.py ScreenSampler,
    # optimizer/search/screen.py).
    "screen+tpe": ("screen", "bottleneck"),
}
RANDOM_SEED_OFFSET = 100_000  # random's seeds differ from the others': independent arms
BOOTSTRAP = 2000

# Grids built on the simulated engine: (hardware preset, model shape, workload, space).
# `prefix_tokens`: every prompt starts with the same prefix of that many tokens (a system
# prompt), then `input_len` tokens of its own.
SIM_GRIDS: dict[str, dict[str, Any]] = {
    # Decode-heavy under a tight TPOT SLO on an H100: the KV cache binds (2048-token prompts at
    # 256 in flight), so fp8 KV and fp8 weights buy batch, max_num_seqs trades batch against
    # TPOT, and the token budget shapes how prefills interrupt decodes.
    "decode-tight": {
        "hardware": "h100-8x-nvlink", "model": "llama-3.1-8b", "max_model_len": 4096,
        "input_len": 2048, "output_len": 256, "prefix_tokens": 0, "levels": [128, 256],
        "slo_ttft_ms": 3000.0, "slo_tpot_ms": 30.0,
        "space": {"kv_cache_dtype": ["auto", "fp8"], "quantization": ["none", "fp8"],
                  "max_num_seqs": [64, 96, 128, 192, 256],
                  "max_num_batched_tokens": [2048, 4096, 8192],
                  "gpu_memory_utilization": [0.85, 0.9, 0.95]},
    },
    # A shared 1536-token system prompt before 256 tokens of each request's own, under a tight
    # TTFT SLO: prefix caching, the token budget, the batch and the KV dtype.
    "shared-prefix": {
        "hardware": "h100-8x-nvlink", "model": "qwen2.5-7b", "max_model_len": 4096,
        "input_len": 256, "output_len": 128, "prefix_tokens": 1536, "levels": [64, 128],
        "slo_ttft_ms": 400.0, "slo_tpot_ms": 25.0,
        "space": {"enable_prefix_caching": [True, False], "kv_cache_dtype": ["auto", "fp8"],
                  "max_num_seqs": [32, 64, 128, 256],
                  "max_num_batched_tokens": [1024, 2048, 4096, 8192],
                  "quantization": ["none", "fp8"]},
    },
}
# The tables bench/replay.py keeps: the 1152-config simulated grid (easy: 96 configs within
# 3%), and the H200 grid study's complete sub-grid (4 measured configs).
KEPT: dict[str, tuple[str, dict[str, str]]] = {
    "sim-1152": ("sim_grid.json", {}),
    "h200-measured": ("h200_grid.json", {"kv_cache_dtype": "auto"}),
}
GRIDS = ("sim-1152", "decode-tight", "shared-prefix", "h200-measured")


def _prompts(spec: Mapping[str, Any], count: int) -> list[list[int]]:
    prefix = list(range(1, 1 + int(spec["prefix_tokens"])))
    own = int(spec["input_len"])
    return [prefix + [50_000 + i * own + j for j in range(own)] for i in range(count)]


def build_sim_grid(name: str) -> dict[str, Any]:
    """Every config of one simulated grid through the engine's virtual-time benchmark: one
    closed-loop wave of `concurrency` requests a level."""
    from runners.base import EngineConfig
    from runners.hardware import load_preset
    from runners.simulated.benchmark import simulate_benchmark
    from runners.simulated.performance import PerformanceModel

    spec = SIM_GRIDS[name]
    hardware = load_preset(str(spec["hardware"]))
    space: dict[str, list[Any]] = spec["space"]
    rows = []
    for values in itertools.product(*space.values()):
        params = dict(zip(space, values, strict=True))
        flags = {k: v for k, v in params.items() if v != "none"}
        flags["max_model_len"] = spec["max_model_len"]
        model = PerformanceModel.from_config(EngineConfig(str(spec["model"]), flags), hardware,
                                             is_compile_cache_warm=True)
        if model.check() is not None:
            rows.append({"params": params, "failed": True, "startup_s": replay.FAILED_STARTUP_S,
                         "levels": [], "value": None, "gpu_s": replay.FAILED_STARTUP_S})
            continue
        levels = []
        for concurrency in spec["levels"]:
            prompts = _prompts(spec, concurrency) if spec["prefix_tokens"] else None
            run = simulate_benchmark(
                model, input_len=int(spec["input_len"]) + int(spec["prefix_tokens"]),
                output_len=int(spec["output_len"]), max_concurrency=concurrency,
                num_requests=concurrency, prompts=prompts)
            good = sum(1 for ttft, tpot in run.per_request
                       if ttft * 1e3 <= spec["slo_ttft_ms"] and tpot * 1e3 <= spec["slo_tpot_ms"])
            levels.append({"concurrency": concurrency, "value": good / run.duration_s,
                           "request_throughput": len(run.per_request) / run.duration_s,
                           "measure_s": run.duration_s})
        startup_s = model.startup().total_s
        rows.append({"params": params, "failed": False, "startup_s": startup_s,
                     "levels": levels, "value": max(lv["value"] for lv in levels),
                     "gpu_s": startup_s + sum(lv["measure_s"] for lv in levels)})
    return {"source": f"simulated engine, grid {name} (virtual-time benchmark; modelled, "
                      "not measured)",
            "objective": f"goodput (req/s meeting TTFT p99 {spec['slo_ttft_ms']:.0f} ms and "
                         f"TPOT p99 {spec['slo_tpot_ms']:.0f} ms)",
            "workload": {k: v for k, v in spec.items() if k != "space"}, "space": space,
            "rows": rows}


def load_grid(name: str, *, rebuild: bool = False) -> dict[str, Any]:
    """A grid's table: the cached one under bench/data/, built first where missing."""
    if name in KEPT:
        file, only = KEPT[name]
        data = json.loads((DATA / file).read_text())
        return replay.restrict(data, only) if only else data
    path = DATA / f"grid_{name}.json"
    if rebuild or not path.is_file():
        started = time.monotonic()
        sys.stderr.write(f"building grid {name} (cached in {path}) ...\n")
        data = build_sim_grid(name)
        path.write_text(json.dumps(data))
        sys.stderr.write(f"  {len(data['rows'])} configs in {time.monotonic() - started:.0f} s\n")
    return json.loads(path.read_text())


def screen_load(grid: str) -> tuple[str, str, Any, dict[str, Any]]:
    """What the screen knows of a grid's workload: (model, hardware preset, load, fixed
    flags), as its study file would say it."""
    from optimizer.search.screen import ScreenLoad

    if grid in SIM_GRIDS:
        s = SIM_GRIDS[grid]
        return s["model"], s["hardware"], ScreenLoad(
            int(s["input_len"]) + int(s["prefix_tokens"]), int(s["output_len"]),
            tuple(s["levels"]), s["slo_ttft_ms"], s["slo_tpot_ms"], int(s["prefix_tokens"])), \
            {"max_model_len": s["max_model_len"]}
    if grid == "sim-1152":
        w = replay.SIM_WORKLOAD
        return str(w["model"]), str(w["hardware"]), ScreenLoad(
            int(w["input_len"]), int(w["output_len"]), tuple(w["levels"]),  # type: ignore[arg-type]
            float(w["slo_ttft_ms"]), float(w["slo_tpot_ms"])), \
            {"max_model_len": w["max_model_len"]}
    # bench/h200/grid.yaml
    return "qwen2.5-7b", "h200", ScreenLoad(512, 256, (16, 64), 1500.0, 10.0), \
        {"max_model_len": 4096}


def predictions(grid: str, table: replay.Table) -> tuple[list[dict[str, Any]], list[float]]:
    """Every config of the grid and the screen's prediction for it (CPU time, no GPU)."""
    from optimizer.search.screen import screen
    from runners.hardware import load_preset

    model, preset, load, fixed = screen_load(grid)
    configs = table.grid_order()
    return configs, screen(configs, model=model, hardware=load_preset(preset), load=load,
                           fixed_flags=fixed)


def costs(table: replay.Table, policy: str, seeds: Sequence[int], *,
          screened: tuple[list[dict[str, Any]], list[float]] | None = None,
          progress: Callable[[], None] = lambda: None) -> list[float]:
    """GPU-seconds to within 3% of the best, one a seed; a seed that never got there counts as
    the grid's whole cost."""
    from optimizer.search.samplers import ScreenSampler, _tpe
    from optimizer.search.searcher import SCREEN_TRIALS

    sampler, pruner = POLICIES[policy]
    out = []
    for seed in seeds:
        chosen: str | optuna.samplers.BaseSampler = sampler
        if sampler == "screen":
            assert screened is not None, "the screen needs the grid's predictions"
            chosen = ScreenSampler(*screened, fallback=_tpe(seed, 6), n_screen=SCREEN_TRIALS)
        spent = replay._replay_optuna(table, chosen, seed, pruner=pruner)
        out.append(spent if math.isfinite(spent) else table.grid_cost_s)
        progress()
    return out


def compare(shipped: Sequence[float], baseline: Sequence[float], *, seed: int = 0,
            rounds: int = BOOTSTRAP) -> dict[str, float]:
    """Median(shipped) / median(baseline), its percentile bootstrap 95% interval (seeds
    resampled within each arm) and the two-sided Mann-Whitney U test's p."""
    a, b = np.asarray(shipped, dtype=float), np.asarray(baseline, dtype=float)
    rng = np.random.default_rng(seed)
    ratios = np.median(rng.choice(a, (rounds, a.size)), axis=1) / \
        np.median(rng.choice(b, (rounds, b.size)), axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    p = float(mannwhitneyu(a, b, alternative="two-sided").pvalue) if \
        len(set(a) | set(b)) > 1 else 1.0
    return {"ratio": float(np.median(a) / np.median(b)), "lo": float(lo), "hi": float(hi),
            "p": p, "shipped_median": float(np.median(a)), "random_median": float(np.median(b))}


def line(grid: str, c: Mapping[str, float]) -> str:
    return (f"{grid}: shipped/random median GPU-s to within 3% = {c['ratio']:.2f} "
            f"[{c['lo']:.2f}, {c['hi']:.2f}] (bootstrap 95%), Mann-Whitney p = {c['p']:.2g}")


def run(grids: Sequence[str], seeds: int, *, rebuild: bool = False,
        out: Path | None = None) -> list[str]:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lines, result = [], {}
    for grid in grids:
        table = replay.Table(load_grid(grid, rebuild=rebuild))
        within = sum(1 for r in table.rows.values()
                     if r["value"] is not None and r["value"] >= table.target)
        per_policy = {}
        screened = predictions(grid, table)
        for policy in POLICIES:
            started = time.monotonic()
            offset = RANDOM_SEED_OFFSET if policy == "random" else 0
            per_policy[policy] = costs(table, policy, range(offset, offset + seeds),
                                       screened=screened)
            sys.stderr.write(f"{grid} {policy}: median {statistics.median(per_policy[policy]):.0f}"
                             f" GPU-s over {seeds} seeds ({time.monotonic() - started:.0f} s)\n")
        c = compare(per_policy[SHIPPED], per_policy["random"])
        others = {p: compare(per_policy[p], per_policy["random"])
                  for p in POLICIES if p not in (SHIPPED, "random")}
        for p, o in others.items():
            sys.stderr.write(f"  ({p}/random: {o['ratio']:.2f} [{o['lo']:.2f}, {o['hi']:.2f}], "
                             f"p = {o['p']:.2g})\n")
        result[grid] = {"configs": len(table.rows), "within_3pct": within,
                        "grid_cost_s": table.grid_cost_s, "costs": per_policy, **c,
                        "others_vs_random": others}
        sys.stderr.write(f"{grid}: {len(table.rows)} configs, {within} within 3% of the best; "
                         f"medians shipped {c['shipped_median']:.0f}, random "
                         f"{c['random_median']:.0f} GPU-s (grid {table.grid_cost_s:.0f})\n")
        lines.append(line(grid, c))
    if out is not None:
        out.write_text(json.dumps({"seeds": seeds, "shipped": SHIPPED, "grids": result},
                                  indent=1))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds a policy (default 200)")
    parser.add_argument("--grid", action="append", choices=GRIDS, default=None,
                        help="only this grid (repeatable); default all")
    parser.add_argument("--rebuild", action="store_true",
                        help="build the simulated grids again rather than read the cache")
    parser.add_argument("--out", type=Path, default=None, help="write every seed's figures")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be at least 2 (a rank test needs more than one a policy)")
    for text in run(args.grid or GRIDS, args.seeds, rebuild=args.rebuild, out=args.out):
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
