"""Say what the kept H200 grid store (tests/fixtures/h200/grid/mlruns) is, in the store itself,
and take back the one figure it showed that was never the trial's (issue 22). Run once from the
repo root:
`python bench/h200/annotate_grid_store.py`; running it again changes nothing.

What it changes, and why each is true (docs/h200-study.md, study 4; docs/h200/grid/daemon.log):
- trial 6 (fp8 KV + fp8 weights) measured both load levels, then `nightshift stop --now` cut
  its profiled window: Optuna holds it FAILED (interrupted, re-queued) with no value. Its run
  carried `objective.goodput` 37.97 as if that were its objective; that metric is removed. Its
  per-level `request_goodput` (14.9 at 16 concurrent, 38.0 at 64) was measured and stays.
- the study's run is KILLED because the session's device time ended after 6 of the grid's 48
  configs (stopped before its budget, as `Tracker.finish_study` marks it), not because anything
  crashed: its description and the experiment's say so, with what did and did not run.
- the experiment is marked as one of runs and given a view of its runs table (as
  `Tracker.mark_experiment` does for a new study), with this store's own metric names: it was
  written before the `headline.*` names, so its `request_goodput` at step 0 holds both the
  16-concurrent level and a copy of the headline level (the chart jumps there; the latest value,
  step 1, is the 64-concurrent level, the headline).
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from mlflow import MlflowClient

STORE = Path("tests/fixtures/h200/grid/mlruns/mlflow.db")
EXPERIMENT = "h200-grid"
STUDY_NOTE = (
    "H200 showcase, kept as the device wrote it (2026-12-03, vLLM 0.26.0, one H200): the grid "
    "study's first 6 of 48 configs, measured. The session's device time ended during trial 6: "
    "`nightshift stop --now` cut it, so this study run is KILLED (stopped before its budget, "
    "not crashed) and trial 6 is FAILED (interrupted, re-queued; its two levels were measured, "
    "it has no objective value). The confirmation round never ran. See docs/h200-study.md, "
    "study 4.")
TRIAL_6_NOTE = (
    "Interrupted, not measured to the end: both load levels ran (request_goodput 14.9 req/s at "
    "16 concurrent, 38.0 at 64), then `nightshift stop --now` cut its profiled window. Optuna "
    "holds it FAILED with no value and re-queued it; it has no objective.")
VIEW = {"searchFilter": "tags.`nightshift.kind` != 'study'",
        "orderByKey": "metrics.`objective.goodput`", "orderByAsc": False,
        "selectedColumns": ["tags.`conclusion`", "metrics.`objective.goodput`",
                            "metrics.`request_goodput`", "metrics.`output_throughput`",
                            "metrics.`p99_tpot_ms`", "tags.`state`", "tags.`bottleneck`"]}


def main() -> None:
    client = MlflowClient(f"sqlite:///{STORE}")
    exp = client.get_experiment_by_name(EXPERIMENT)
    assert exp is not None, f"{STORE} has no experiment {EXPERIMENT!r}"
    exp_id = str(exp.experiment_id)
    runs = {r.info.run_name: r for r in client.search_runs([exp_id])}
    trial_6 = runs["trial-006"]
    assert trial_6.info.status == "FAILED" and trial_6.data.tags["failure_reason"] == \
        "interrupted", "trial 6 is the interrupted one"
    # MLflow has no API to delete a metric: the store's own two tables hold it.
    with sqlite3.connect(STORE) as db:
        for table in ("metrics", "latest_metrics"):
            db.execute(f"DELETE FROM {table} WHERE run_uuid = ? AND key = 'objective.goodput'",
                       (trial_6.info.run_id,))
    client.set_tag(trial_6.info.run_id, "mlflow.note.content", TRIAL_6_NOTE)
    parent = runs[EXPERIMENT]
    assert parent.data.tags["nightshift.kind"] == "study" and parent.info.status == "KILLED"
    client.set_tag(parent.info.run_id, "mlflow.note.content", STUDY_NOTE)
    client.set_tag(parent.info.run_id, "nightshift.showcase", "incomplete: 6 of 48 configs")
    client.set_experiment_tag(exp_id, "mlflow.note.content", STUDY_NOTE)
    client.set_experiment_tag(exp_id, "mlflow.experimentKind", "custom_model_development")
    state = json.dumps(VIEW, sort_keys=True)
    previous = json.loads(exp.tags.get("mlflow.sharedViewState.nightshift") or "{}")
    if previous.get("state") != state:
        now_ms = int(time.time() * 1000)
        client.set_experiment_tag(exp_id, "mlflow.sharedViewState.nightshift", json.dumps(
            {"name": "nightshift", "createdAt": now_ms, "updatedAt": now_ms, "state": state}))


if __name__ == "__main__":
    main()
