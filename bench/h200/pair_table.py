"""The trials-per-hour pair (bench/h200/pair_before.yaml, pair_after.yaml) as a table: each
arm's trials, their walls and start-ups from the records, and trials per hour over the time
the arm's trials ran (first launch to last end, one GPU: in series). Usage, on the records
brought back from the device:
    python3 bench/h200/pair_table.py BEFORE_DIR AFTER_DIR
where each DIR holds the arm's `optuna.db` (results_dir of the study file)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna

from optimizer.results.trial_record import record_of


def arm(folder: Path) -> dict[str, Any]:
    """One arm's figures from its Optuna storage (the study it holds, whatever its name)."""
    storage = f"sqlite:///{folder / 'optuna.db'}"
    (summary,) = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    records = [r for t in study.trials if (r := record_of(t)) is not None
               and r.engine_started_unix_s is not None and r.engine_ended_unix_s is not None]
    if not records:
        raise SystemExit(f"{folder}: no trial with a start and an end")
    ends = [r.engine_ended_unix_s for r in records if r.engine_ended_unix_s is not None]
    begins = [r.engine_started_unix_s for r in records if r.engine_started_unix_s is not None]
    span = max(ends) - min(begins)
    starts = [(r.startup.get("total_s"), r.startup.get("compile_cache")) for r in records]
    return {"study": summary.study_name, "trials": len(records), "span_s": span,
            "per_hour": len(records) / span * 3600 if span > 0 else float("nan"),
            "starts": starts, "walls": [r.wall_s for r in records]}


def table(before: dict[str, Any], after: dict[str, Any]) -> str:
    lines = ["| arm | trials | wall min (first launch to last end) | trials/hour | "
             "start-ups s (compile cache) | trial walls s |", "|---|---|---|---|---|---|"]
    for name, a in (("before", before), ("after", after)):
        starts = ", ".join(f"{s:.0f} ({c})" if s is not None else f"? ({c})"
                           for s, c in a["starts"])
        walls = ", ".join(f"{w:.0f}" for w in a["walls"])
        lines.append(f"| {name} ({a['study']}) | {a['trials']} | {a['span_s'] / 60:.1f} | "
                     f"{a['per_hour']:.1f} | {starts} | {walls} |")
    ratio = after["per_hour"] / before["per_hour"] if before["per_hour"] else float("nan")
    lines += ["", f"after / before: {ratio:.2f}x trials per hour (one run of each arm, side by "
              "side on one machine; no interval)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(table(arm(args.before), arm(args.after)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
