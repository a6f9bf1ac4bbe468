"""Run a simulated study on a multi-node Ray test cluster (`ray.cluster_utils.Cluster`: a head
without GPUs and two worker nodes of one declared GPU each, all on this machine), optionally
removing a worker node while trials run on both, and print what each trial did as JSON.

A process of its own: the test session's local Ray (tests/conftest.py) cannot share a process
with a second cluster.

    python -m tests.cluster_driver STUDY.yaml [--kill-node]
    python -m tests.cluster_driver --reap REGISTRY_DIR   # reap_on_other_nodes on that cluster
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import optuna
import ray
import yaml
from ray.cluster_utils import Cluster

from optimizer.cli import main as nightshift


def _running(db: Path, name: str) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=f"sqlite:///{db}")
    except Exception:  # not created yet
        return 0
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state == optuna.trial.TrialState.RUNNING)


def reap(registry: Path) -> int:
    """An engine recorded in `registry` as a dead daemon's worker would have left it, then
    `reap_on_other_nodes` from a driver on the head: which node reaped what, and whether the
    engine is gone."""
    from optimizer.run.ray_cluster import reap_on_other_nodes
    from runners.process import EngineProcess

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    engine = EngineProcess.start(["sleep", "300"], {}, registry.parent / "stray.log", registry)
    reaped = reap_on_other_nodes(registry)
    deadline = time.monotonic() + 30  # the kill lands on another node's task: wait for it
    while engine.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"reaped": reaped, "pid": engine.pid, "alive": engine.is_alive(),
                      "driver_node": ray.get_runtime_context().get_node_id(),
                      "worker_nodes": [n.node_id for n in nodes],
                      "records_left": [p.name for p in registry.glob("*.json")]}))
    ray.shutdown()
    cluster.shutdown()
    return 0


def main(argv: list[str]) -> int:
    if argv[0] == "--reap":
        return reap(Path(argv[1]))
    study_path = Path(argv[0])
    kill = "--kill-node" in argv
    spec = yaml.safe_load(study_path.read_text())
    db = Path(spec["results_dir"]) / "optuna.db"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    killed: list[str] = []

    def kill_when_both_busy() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _running(db, spec["name"]) < 2:
            time.sleep(0.2)
        time.sleep(2.0)  # both engines are up and serving
        cluster.remove_node(nodes[1])
        killed.append(nodes[1].node_id)

    if kill:
        threading.Thread(target=kill_when_both_busy, daemon=True).start()
    code = nightshift(["start", str(study_path), "--no-progress",
                       "--ray-address", cluster.address])
    study = optuna.load_study(study_name=spec["name"], storage=f"sqlite:///{db}")
    trials = []
    for t in study.get_trials(deepcopy=False):
        record = t.user_attrs.get("record") or {}
        trials.append({"number": t.number, "state": record.get("state"),
                       "failure_reason": record.get("failure_reason"),
                       "host": record.get("host"), "retry_of": t.user_attrs.get("retry_of")})
    print(json.dumps({"exit_code": code, "killed_node": killed[0] if killed else None,
                      "trials": trials}))
    ray.shutdown()  # the driver first: a cluster refuses to remove the node it is attached to
    cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
