"""Benchmark: the CPU time the informed start (`sampler: screen`) spends drawing its candidates
(optimizer/search/screen.py `sample_candidates`, SCREEN_CANDIDATES of them), on each bundled
space: the draw from the distributions it does now against asking a scratch
`RandomSampler(seed)` study once per config, as it did before; and whether the two give the
same configs in the same order. The last row is a small space (hopper with all but three
params fixed at their defaults): fewer configs than SCREEN_CANDIDATES, so every one of the
3 * SCREEN_CANDIDATES draws is made.

    python bench/screen_candidates.py [--repeats 5] [--seed 0] \
        [--out bench/data/screen_candidates.json]

CPU time (`time.process_time`), the least of `--repeats` runs: the machine's load shows in
wall time, not in what the code costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import optuna

from optimizer.search.screen import sample_candidates
from optimizer.search.searcher import SCREEN_CANDIDATES
from search_spaces import bundled_spaces, load_space


def asked(sample: Callable[[optuna.trial.BaseTrial], Mapping[str, Any]], count: int,
          seed: int) -> list[dict[str, Any]]:
    """The candidates as the screen drew them before 2026-12-06: a scratch RandomSampler
    study asked up to 3 * count times (tests/optimizer/search/test_screen.py holds the direct
    draw to it)."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    seen: dict[str, dict[str, Any]] = {}
    for _ in range(3 * count):
        params = dict(sample(study.ask()))
        seen.setdefault(repr(sorted(params.items(), key=lambda kv: kv[0])), params)
        if len(seen) >= count:
            break
    return list(seen.values())


def _cpu_s(draw: Callable[[], list[dict[str, Any]]], repeats: int
           ) -> tuple[float, list[dict[str, Any]]]:
    best, out = float("inf"), []
    for _ in range(repeats):
        start = time.process_time()
        out = draw()
        best = min(best, time.process_time() - start)
    return best, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rows = []
    spaces = [(name, load_space(name).resolve({})) for name in bundled_spaces()]
    hopper = load_space("hopper").resolve({})
    searched = [p.name for p in hopper.params if not p.is_fixed]
    small, _ = hopper.with_fixed({k: v for k, v in hopper.defaults().items()
                                  if k in searched[3:]})
    spaces.append((f"hopper, {small.size()} configs", small))
    for name, space in spaces:
        before_s, before = _cpu_s(partial(asked, space.sample, SCREEN_CANDIDATES, args.seed),
                                  args.repeats)
        after_s, after = _cpu_s(partial(sample_candidates, space.sample, SCREEN_CANDIDATES,
                                        seed=args.seed), args.repeats)
        rows.append({"space": name, "num_candidates": len(after),
                     "asked_study_cpu_s": round(before_s, 4),
                     "direct_draw_cpu_s": round(after_s, 4),
                     "is_identical": before == after})
        print(f"{name:20s} {len(after):5d} candidates  study asked: {before_s:.3f} s  "
              f"direct draw: {after_s:.3f} s  identical: {before == after}")
    if args.out is not None:
        args.out.write_text(json.dumps({"seed": args.seed, "repeats": args.repeats,
                                        "rows": rows}, indent=2) + "\n")
    return 0 if all(r["is_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
