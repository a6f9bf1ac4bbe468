"""Benchmark: trials per hour, replayed on the H200's measured start-up costs (not a measurement).

A study's configs run through the shipped search policy
(`optimizer.search.controller.SearchController`, its start-up plan on or off:
`startup.order_by_compile_key`, `startup.compile_cache`) on a clock driven by a cost model whose
parts were measured on one H200 (vLLM 0.26, Qwen2.5-7B shape; issue 23, docs/h200-study.md): a
compiled start 100-153 s when it compiles (cold) and 60-79 s when vLLM loads its compile cache
(warm), an eager start 53-63 s, ~120 s of measurement a trial (4 capacity probes of the default 30
s), and once per fresh machine the ~104 s silent gap before `init engine` that the first start
showed (trial0.log; taken to be FlashInfer's sampler build, which the `flashinfer_sampler_off`
saver skips; not measured apart). Which start is cold is decided by the compile-key estimate
(runners/vllm/compile_cache.py) against the cache the replay has filled: a key is warm once a trial
of it has started, on the shared cache; never, on a per-trial one. Two trials of one key starting
together both compile.

    python bench/trial_cost.py --out bench/data/trial_cost.json

Rows: the H200 grid (bench/h200/grid.yaml, 48 configs) and 40 configs drawn from a space that
mixes knobs inside vLLM's compile key with knobs outside it (8 keys), on one GPU and on two,
asked in random order and asked one key after another (as a sampler exploiting a region does).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Seconds, (low, high) as measured on the H200; the replay takes the middle and both ends.
WARM_START_S = (60.0, 79.0)
COLD_START_S = (100.0, 153.0)
EAGER_START_S = (53.0, 63.0)
MEASURE_S = 120.0  # 4 capacity probes of 30 s (CapacitySpec.probe_duration_s default)
FRESH_MACHINE_S = 104.0  # trial0.log: graph capture 13:50:09 -> JIT monitor 13:51:53

# Knobs inside vLLM's compile key, and outside it (docs/startup-cost.md).
KEY_KNOBS: dict[str, list[Any]] = {
    "kv_cache_dtype": ["auto", "fp8"], "quantization": ["none", "fp8"],
    "max_num_batched_tokens": [8192, 2048]}
FREE_KNOBS: dict[str, list[Any]] = {
    "gpu_memory_utilization": [0.92, 0.85, 0.95], "enable_prefix_caching": [True, False],
    "max_num_seqs": [1024, 256, 512], "scheduling_policy": ["fcfs", "priority"]}


def grid_configs() -> list[dict[str, Any]]:
    """The H200 grid study's configs, in its order: the defaults, then its seed trials."""
    study = yaml.safe_load((ROOT / "bench" / "h200" / "grid.yaml").read_text())
    names = ["attention_backend", "kv_cache_dtype", "quantization", "enforce_eager",
             "max_num_batched_tokens"]
    defaults = {"attention_backend": "auto", "kv_cache_dtype": "auto", "quantization": "none",
                "enforce_eager": False, "max_num_batched_tokens": 8192}
    return [defaults, *({**defaults, **{k: v for k, v in seed.items() if k in names}}
                        for seed in study["seed_trials"])]


def knob_configs(num: int = 40, seed: int = 0) -> list[dict[str, Any]]:
    """`num` distinct configs drawn at random (the order a sampler might ask them in)."""
    space = {**KEY_KNOBS, **FREE_KNOBS}
    every = [dict(zip(space, values, strict=True))
             for values in itertools.product(*space.values())]
    rng = random.Random(seed)
    defaults = every[0]
    return [defaults, *rng.sample(every[1:], num - 1)]


@dataclass(frozen=True)
class Arm:
    label: str
    compile_cache: str  # "shared" or "per_trial"
    order_by_compile_key: bool
    saver: bool = False  # flashinfer_sampler_off: the fresh machine's first start skips the gap


ARMS = (
    Arm("per-trial cache (isolation)", "per_trial", False),
    Arm("before: shared cache, asked order (today)", "shared", False),
    Arm("after: shared cache + start-up plan", "shared", True),
    Arm("after + flashinfer_sampler_off (gap not measured apart)", "shared", True, saver=True),
)


def _policy(configs: Sequence[Mapping[str, Any]], arm: Arm, num_gpus: int) -> Any:
    from optimizer.config import parse_study
    from optimizer.search.controller import SearchController
    from optimizer.storage.study import make_pruner, make_sampler
    from search_spaces import parse_space

    names = list(configs[0])
    values = {n: list(dict.fromkeys(c[n] for c in configs)) for n in names}
    cfg = parse_study({
        "name": "trial-cost", "engine": "simulated",
        "model": {"path": "qwen2.5-7b", "load_format": "dummy", "skip_tokenizer_init": True},
        "workload": {"input_len": 128, "output_len": 16, "levels": [{"concurrency": 16}],
                     "num_requests": 16},
        "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 10}, "budget": {"trials": len(configs)},
        "sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"},
        "confirm_rounds": 0, "fixed_flags": {"max_model_len": 4096},
        "startup": {"compile_cache": arm.compile_cache,
                    "order_by_compile_key": arm.order_by_compile_key}})
    space = parse_space({"name": "trial-cost", "parameters": {
        n: {"type": "categorical", "choices": v, "default": v[0]} for n, v in values.items()}}
    ).resolve({})
    study = optuna.create_study(directions=cfg.directions, pruner=make_pruner(cfg),
                                sampler=make_sampler(cfg))
    policy = SearchController(cfg, space, study, workload=cfg.workload,
                              total_gpus=num_gpus)
    policy.prepare([dict(c) for c in configs[1:]])
    return policy


def _metrics() -> Any:
    from runners.base import BenchmarkMetrics

    zero = {f"{s}_{m}_ms": 1.0 for s in ("mean", "median", "std", "p90", "p99")
            for m in ("ttft", "tpot", "itl", "e2el")}
    return BenchmarkMetrics(completed=16, failed=0, duration_s=MEASURE_S, total_input_tokens=1,
                            total_output_tokens=1, request_throughput=1.0, request_goodput=1.0,
                            output_throughput=1.0, total_token_throughput=1.0, **zero)


def replay_arm(configs: Sequence[Mapping[str, Any]], arm: Arm, num_gpus: int,
               end: int) -> dict[str, Any]:
    """Run every config through the policy on the modelled clock; `end` picks the cost model's
    low (0), middle (1) or high (2) figures."""
    from runners.base import EngineInfo, RunResult, StepMetrics
    from runners.vllm.compile_cache import compile_key

    def pick(span: tuple[float, float]) -> float:
        return (span[0], (span[0] + span[1]) / 2, span[1])[end]

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    policy = _policy(configs, arm, num_gpus)
    on_disk: set[str] = set()
    events: list[tuple[float, int, str, Any, str]] = []
    clock, order, first_start = 0.0, itertools.count(), True
    counts = {"warm": 0, "cold": 0, "none": 0}
    launched = 0
    while True:
        while (running := policy.next_launch(lambda n: len(policy.running) < num_gpus)) \
                is not None:
            key = compile_key(running.config)
            if key is None:
                kind, start_s = "none", pick(EAGER_START_S)
            elif arm.compile_cache == "shared" and key.digest in on_disk:
                kind, start_s = "warm", pick(WARM_START_S)
            else:
                kind, start_s = "cold", pick(COLD_START_S)
            if first_start and not arm.saver:
                start_s += FRESH_MACHINE_S
            first_start = False
            counts[kind] += 1
            launched += 1
            heapq.heappush(events, (clock + start_s, next(order), "served", running, kind))
        if not events:
            break
        clock, _, what, running, kind = heapq.heappop(events)
        key = compile_key(running.config)
        if what == "served":
            if key is not None:
                on_disk.add(key.digest)
            policy.on_step(running, StepMetrics(step=0, level=policy.workload.levels[0],
                                                metrics=_metrics()))
            heapq.heappush(events, (clock + MEASURE_S, next(order), "done", running, kind))
        else:
            step = StepMetrics(step=0, level=policy.workload.levels[0], metrics=_metrics())
            policy.on_result(running, RunResult(status="complete", steps=(step,),
                                                argv=("vllm",),
                                                engine=EngineInfo(compile_cache=kind)))
    return {"trials": launched, "hours": clock / 3600, "trials_per_hour": launched / clock * 3600,
            **{f"num_{k}": v for k, v in counts.items()}}


def run(num_gpus_list: Sequence[int] = (1, 2)) -> dict[str, Any]:
    knobs = knob_configs()
    by_key = [knobs[0], *sorted(knobs[1:], key=lambda c: [str(c[k]) for k in KEY_KNOBS])]
    scenarios = {"H200 grid (48 configs, grid.yaml order)": grid_configs(),
                 "key + non-key knobs (40 configs, random order)": knobs,
                 "the same 40, one key after another": by_key}
    rows = []
    for (name, configs), num_gpus in itertools.product(scenarios.items(), num_gpus_list):
        if name.startswith("H200 grid") and num_gpus > 1:
            continue
        for arm in ARMS:
            figures = [replay_arm(configs, arm, num_gpus, end) for end in (0, 1, 2)]
            rows.append({"scenario": name, "num_gpus": num_gpus, "arm": arm.label,
                         "trials_per_hour": [round(f["trials_per_hour"], 2) for f in figures],
                         **{k: figures[1][k] for k in ("trials", "num_warm", "num_cold",
                                                       "num_none")}})
    return {"source": "replay on measured H200 component costs (not a measurement)",
            "costs_s": {"warm_start": WARM_START_S, "cold_start": COLD_START_S,
                        "eager_start": EAGER_START_S, "measure": MEASURE_S,
                        "fresh_machine_once": FRESH_MACHINE_S},
            "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = run()
    for row in result["rows"]:
        low, mid, high = row["trials_per_hour"]
        sys.stdout.write(f"{row['scenario']:<48} {row['num_gpus']} GPU  {row['arm']:<58} "
                         f"{mid:5.1f} trials/h ({low:.1f}-{high:.1f})  cold {row['num_cold']:>2} "
                         f"warm {row['num_warm']:>2} eager {row['num_none']:>2}\n")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
