"""A study on an existing multi-node Ray cluster (Ray's own test cluster, several nodes with
declared GPUs on this machine): trials spread across nodes, results come back to the driver,
and a node that dies mid-trial fails that trial (`node_lost`), which is re-run on the nodes
left while the study goes on. One study shows all of it (a cluster started costs ~25 s of a
2-core machine's CPU): its first two trials run one on each node until one node goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.builders import WORKLOAD, write_study

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(tmp_path: Path, *extra: str, trials: int, duration_s: float) -> dict[str, Any]:
    path = write_study(
        tmp_path, name="cluster", trials=trials, max_parallel_trials=2, pruner={"name": "none"},
        workload={**WORKLOAD, "duration_s": duration_s, "num_requests": None},
        # A node of one GPU (the space is resolved for it); the cluster has two such nodes.
        simulated={"hardware": "h200", "num_gpus": 1, "startup_time_scale": 0.002})
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "tests.cluster_driver", str(path), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("{")][-1]
    return dict(json.loads(last))


def test_trials_spread_over_the_nodes_and_a_node_dying_mid_trial_costs_one_rerun(
        tmp_path: Path) -> None:
    # Levels of a few seconds each: long enough for a node to die under a running trial (it
    # goes 2 s after both trials are RUNNING, before a trial's two levels of 2.5 s are done).
    # A budget of 3: after the rerun, a fresh trial shows the study going on.
    out = _run(tmp_path, "--kill-node", trials=3, duration_s=2.5)
    assert out["exit_code"] == 0 and out["killed_node"]
    trials = out["trials"]
    lost = [t for t in trials if t["failure_reason"] == "node_lost"]
    assert len(lost) == 1, f"the trial on the removed node failed as node_lost: {trials}"
    # Trials 0 and 1 started together, each on a node's only GPU: one on each node.
    (other,) = [t for t in trials if t["number"] in (0, 1) and t is not lost[0]]
    assert other["state"] == "complete" and " node " in other["host"], \
        "the trial on the node left finished there, its result back at the driver"
    reruns = [t for t in trials if t["retry_of"] == lost[0]["number"]]
    assert len(reruns) == 1 and reruns[0]["state"] == "complete", \
        "it was re-queued once and measured on the node left"
    complete = [t for t in trials if t["state"] == "complete"]
    assert len(complete) == 3, "the study still reached its budget of three measured trials"
    assert [t for t in complete if t["retry_of"] is None and t["number"] > 1], \
        "a fresh trial after the rerun: the study went on"
    assert all(out["killed_node"][:12] not in t["host"] for t in complete)
    registry = tmp_path / "results" / "engines"
    assert not list(registry.glob("*.json")), "no engine outlives its trial, the lost one too"


def test_a_dead_daemons_engines_on_other_nodes_are_reaped(tmp_path: Path) -> None:
    """A worker on another node launched an engine and recorded it on that node's disk; the
    daemon that starts after a crash reaps it with a task pinned to the node (here every node
    shares this machine's disk, so the record is where the task looks)."""
    registry = tmp_path / "engines"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "tests.cluster_driver", "--reap", str(registry)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert not out["alive"], "the recorded engine was killed"
    assert out["records_left"] == []
    assert [out["pid"]] in out["reaped"].values()
    assert out["driver_node"] not in out["reaped"], "the driver's own node is reaped locally"
    assert set(out["reaped"]) <= set(out["worker_nodes"])
