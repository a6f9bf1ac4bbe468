"""Local mode's Ray is the daemon's own and listens on loopback only, whatever the environment
holds: each study runs as `nightshift start` in a process of its own (a Ray per process), and
every socket of it and its descendants (the driver, Ray's GCS, raylet, agents, monitor and
workers, the simulated engines) is listed while it runs.

| fault                          | injected by                    | outcome                      |
|--------------------------------|--------------------------------|------------------------------|
| RAY_ADDRESS names no cluster   | RAY_ADDRESS=127.0.0.1:9 (at    | its own Ray, on loopback     |
|                                | start_local_ray's layer)       |                              |
| RAY_ADDRESS names a live Ray   | a second Ray the test starts   | its own Ray, not the other   |
| a socket beyond loopback       | (none: checked on every socket | every socket of the study on |
|                                | of a running local study)      | 127.0.0.0/8 or ::1           |
| local raylet killed            | psutil kill of the raylet, a   | a lost worker's GPUs are not |
|                                | Ray in a process of its own    | placed again: 0 GPUs, stop   |
| ray.resources no node has      | a cluster without them         | one line, exit 2, no writes  |
| SIGTERM to the daemon's        | os.killpg of a real daemon's   | Ray is in sessions of its    |
| process group, a trial in      | group; Ray's GCS reconnect     | own: the trial finishes,     |
| flight (SIGHUP to the group:   | window cut to 3 s              | "stopped" + resume line,     |
| test_daemon.py, confirmation)  |                                | nothing left running         |
| a joined cluster's GCS gone    | psutil kill of the GCS of a    | the executor says Ray is     |
|                                | Ray joined by address (Ray's   | lost after half the window,  |
|                                | window cut to 8 s)             | before Ray's abort           |

(Rows of tests/test_faults.py's table.)
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from optuna import Study
from optuna.trial import TrialState

from runners.process import reap_strays
from tests.builders import load, trial_runs, write_study

REPO = Path(__file__).resolve().parents[1]
_OTHER_RAY = """
import json, sys, time
import ray
ctx = ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
print(json.dumps({"address": ctx.address_info["gcs_address"],
                  "node": ray.get_runtime_context().get_node_id()}), flush=True)
sys.stdin.read()  # until the test closes it
ray.shutdown()
"""


def _env(**extra: str) -> dict[str, str]:
    """The test's environment for a child that imports this tree and starts or joins a Ray
    (without Ray's token auth), with `extra` added."""
    return {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled", **extra}


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _label(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())[:160] or process.name()
    except psutil.Error:
        return "?"


def _sockets(root: psutil.Process) -> list[tuple[str, str, int, str, str]]:
    """(process, local ip, local port, status, peer) of every inet socket of `root` and all its
    descendants; processes that end while being read are skipped. The peer ("ip:port", or ""
    for none) names where a connection off loopback went: once, under two CPU spinners, a
    study's Ray dashboard process held one from 192.0.2.2 (the machine's address) whose peer
    was not recorded.

    The machine's socket tables are read once and kept for the tree's pids: asking each process
    for its own re-reads every table per process (0.11 s of CPU a look for a study's tree
    against 0.03 s), and the look is taken ten times a second while the study runs."""
    try:
        tree = {p.pid: p for p in (root, *root.children(recursive=True))}
    except psutil.Error:
        return []
    mine = [c for c in psutil.net_connections(kind="inet") if c.pid in tree and c.laddr]
    labels = {pid: _label(tree[pid]) for pid in {c.pid for c in mine}}
    return [(labels[c.pid], c.laddr.ip, c.laddr.port, c.status,
             f"{c.raddr.ip}:{c.raddr.port}" if c.raddr else "") for c in mine]


def _run_study(tmp_path: Path, *, trials: int) -> tuple[
        int, str, list[tuple[str, str, int, str, str]]]:
    """`nightshift start` on a simulated local study in a process of its own, with the test's
    environment; its exit code, stderr and every socket seen while it ran."""
    path = write_study(tmp_path, trials=trials, workload={
        "input_len": 64, "output_len": 16, "levels": [{"concurrency": 4}],
        "duration_s": 2.0, "num_requests": None, "warmup_requests": 0},
        simulated={"hardware": "h200", "num_gpus": 1, "startup_time_scale": 0.002})
    env = _env(PYTHONUNBUFFERED="1")
    seen: set[tuple[str, str, int, str, str]] = set()
    with open(tmp_path / "daemon.err", "w") as err:
        daemon = subprocess.Popen([sys.executable, "-m", "optimizer.cli", "start", str(path),
                                   "--no-progress"], cwd=REPO, env=env,
                                  stdout=subprocess.DEVNULL, stderr=err)
        try:
            root = psutil.Process(daemon.pid)
            deadline = time.monotonic() + 280
            while daemon.poll() is None and time.monotonic() < deadline:
                seen.update(_sockets(root))
                time.sleep(0.1)
        finally:
            if daemon.poll() is None:
                daemon.kill()
            code = daemon.wait(30)
    return code, (tmp_path / "daemon.err").read_text(), sorted(seen)


@pytest.fixture
def other_ray(clean_environ: dict[str, str]) -> Iterator[dict[str, Any]]:
    """A second Ray on this machine, as a `ray start` left running would be, in a process of
    the test's own (ended by its pid)."""
    proc = subprocess.Popen([sys.executable, "-c", _OTHER_RAY], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        assert proc.stdout is not None
        yield {**json.loads(proc.stdout.readline()), "pid": proc.pid}
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()


def _trial_hosts(tmp_path: Path) -> list[str]:
    return [str((t.user_attrs.get("record") or {}).get("host", ""))
            for t in load(tmp_path).trials if t.state.is_finished()]


# The daemon's own Ray, started where RAY_ADDRESS names nothing: what `start_local_ray` did.
_LOCAL_RAY = """
import json, os, ray
from optimizer.run.ray_cluster import start_local_ray
start_local_ray(num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False)
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address,
                  "nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
                  "gpus": ray.cluster_resources().get("GPU"),
                  "env": os.environ.get("RAY_ADDRESS")}), flush=True)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_local_ray_starts_whatever_the_ray_address_in_the_environment_names(
        clean_environ: dict[str, str]) -> None:
    # At the layer that starts Ray (the daemon's whole study beside a live Ray that
    # RAY_ADDRESS names is the next test's).
    env = _env(RAY_ADDRESS="127.0.0.1:9")  # nothing listens there
    done = subprocess.run([sys.executable, "-c", _LOCAL_RAY], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    assert not out["gcs"].endswith(":9") and out["nodes"] == ["127.0.0.1"], \
        f"a Ray of its own on loopback, not a join of 127.0.0.1:9: {out}"
    assert out["gpus"] == 1.0 and out["env"] == "127.0.0.1:9", \
        "what was asked for, and the environment given back as it was"


@pytest.mark.slow
def test_a_local_study_runs_its_own_ray_on_loopback_only_beside_another_cluster(
        tmp_path: Path, other_ray: dict[str, Any]) -> None:
    os.environ["RAY_ADDRESS"] = other_ray["address"]
    code, err, sockets = _run_study(tmp_path, trials=2)
    assert code == 0, err[-3000:]
    hosts = _trial_hosts(tmp_path)
    assert len(hosts) == 2 and all(" node " in h for h in hosts)
    assert not [h for h in hosts if other_ray["node"][:12] in h], \
        "no trial ran on the cluster RAY_ADDRESS names: local mode starts its own Ray"

    listening = [s for s in sockets if s[3] == psutil.CONN_LISTEN]
    for part in ("gcs_server", "raylet", "runners.simulated", "optimizer.cli"):
        assert [s for s in listening if part in s[0]], f"{part} was seen listening: {sockets}"
    beyond = [s for s in sockets if not _is_loopback(s[1])]
    assert not beyond, f"every socket of the study is on loopback; not these: {beyond}"



def test_a_cluster_no_node_of_which_has_the_ray_resources_is_refused_before_any_write(
        tmp_path: Path, other_ray: dict[str, Any]) -> None:
    # Issue 35, item 5: trials sat "running" for as long as one waited; now one line naming
    # the field and the fix, exit 2, with results/ and mlruns/ untouched.
    path = write_study(tmp_path, trials=1, ray={"address": other_ray["address"],
                                                "resources": {"tuning_pool": 1}})
    env = _env()
    done = subprocess.run([sys.executable, "-m", "optimizer.cli", "start", str(path),
                           "--no-progress"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=240)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(lines) == 1 and "ray.resources: no node of the Ray cluster has" in lines[0] \
        and "ray start --resources" in lines[0], lines
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists(), \
        "refused before anything is written"

# A local Ray of its own (health checks every 0.5 s, so its GCS counts a dead raylet out in
# about 1.5 s rather than 15) whose raylet is killed: what the daemon's executor then says.
_RAYLET_KILLED = """
import json, sys, time
import psutil, ray
from optimizer.run.ray_executor import RayExecutor
ray.init(address="local", num_cpus=1, num_gpus=1, include_dashboard=False, log_to_driver=False,
         _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 3})
tree = psutil.Process().children(recursive=True)
executor = RayExecutor(None, total_gpus=1)
answers = {"before": executor.shrink_to_live(20.0, placing_gpus=1)}
for raylet in [p for p in tree if p.name() == "raylet"]:
    raylet.kill()
started = time.monotonic()
answers["after"] = executor.shrink_to_live(20.0, placing_gpus=1)
answers["after_s"] = time.monotonic() - started
print(json.dumps(answers), flush=True)
ray.shutdown()
for p in tree:  # whatever of its Ray outlived the raylet
    try:
        p.kill()
    except psutil.Error:
        pass
"""


@pytest.mark.slow
def test_a_dead_local_raylet_leaves_no_gpu_to_place_a_trial_on(
        clean_environ: dict[str, str]) -> None:
    """Ray's GCS counts a dead raylet alive until its health checks time out, so the GPU count
    alone would keep the daemon launching on it: a lost worker's GPUs must be placed again."""
    proc = subprocess.Popen([sys.executable, "-c", _RAYLET_KILLED], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env())
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait(10)
    # Ray's driver prints the dead raylet's log to stdout too, before or after the answers.
    lines = [line for line in out.splitlines() if line.startswith('{"before"')]
    assert lines, f"the Ray child gave no answers: {err[-2000:]}"
    answers = json.loads(lines[0])
    assert answers["before"] == 1, "a live raylet places the lost worker's GPU again"
    assert answers["after"] == 0, "no GPU left to launch on once the raylet is dead"
    assert answers["after_s"] < 20, "known within the placement deadline, not waited forever"


@pytest.mark.parametrize(("probe", "listed", "expected"), [
    ("raylet_died", 2, 0),   # Ray said its local raylet died: nothing can be placed
    ("not_placed", 2, 2),    # not placed in time proves nothing: the GPUs Ray lists count
    ("not_placed", 1, 1),
    ("placed", 2, 2),
])
def test_only_a_dead_raylet_not_a_slow_placement_leaves_no_gpu(
        monkeypatch: pytest.MonkeyPatch, probe: str, listed: int, expected: int) -> None:
    """A healthy daemon on a shared cluster (another job's demand placed first) or with a dead
    actor's GPUs slow to come back must not stop. Ray's answers are stood in for by string
    path (no Ray here can be made slow to place on purpose)."""
    from optimizer.run import ray_executor

    executor = ray_executor.RayExecutor(None, total_gpus=2)  # type: ignore[arg-type]
    monkeypatch.setattr(executor, "_probe_placement", lambda num_gpus, timeout_s: probe)
    monkeypatch.setattr(ray_executor, "live_gpus", lambda timeout_s=30.0: listed)
    assert executor.shrink_to_live(1.0, placing_gpus=1) == expected


class _NeverReady:
    """Ray's answers stood in for: refs that are never ready, and a Ray that is lost once
    `lost_after` waits have passed (its GCS ended under a call on a dead worker)."""

    def __init__(self, lost_after: int) -> None:
        self.lost_after = lost_after
        self.waits: list[float] = []
        self.asked: list[str] = []

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None
             ) -> tuple[list[Any], list[Any]]:
        self.waits.append(timeout or 0.0)
        return [], list(refs)

    def lost(self) -> str | None:
        return "the local Ray's gcs_server ended" if len(self.waits) >= self.lost_after else None

    def ask(self, what: str) -> Any:
        self.asked.append(what)
        return what


def test_a_call_on_a_worker_returns_once_its_ray_is_gone_not_at_its_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop's cancel, the workers' shutdown and a placement probe wait on Ray in slices
    and return once Ray is gone (`ray_lost`), not at their 120, 60 and 30 s timeouts: a
    dead worker's call waits out its whole timeout when the GCS that would say the actor died
    is gone with it, and the daemon must see its Ray gone and wind down (once, in six clean-
    clone runs, it did not before Ray's driver aborted it, 64 s after the signal)."""
    from optimizer.run import ray_executor

    ray = _NeverReady(lost_after=3)
    monkeypatch.setattr(ray_executor.ray, "wait", ray.wait)
    monkeypatch.setattr(ray_executor, "ray_lost", ray.lost)
    monkeypatch.setattr(ray_executor.ray, "get", lambda *a, **k: ray.ask("get"))
    monkeypatch.setattr(ray_executor.ray, "kill", lambda *a, **k: ray.ask("kill"))
    assert not ray_executor.wait_watching(["ref"], 120.0)
    assert len(ray.waits) == 3 and max(ray.waits) <= 1.0, ray.waits

    class Actor:
        cancel = shutdown = type("Method", (), {"remote": lambda self: "ref"})()

    ray.waits.clear()
    ray_executor.RayTrialHandle(Actor(), "run").cancel(timeout_s=120.0)
    assert len(ray.waits) == 3 and ray.asked == [], "no get on a cancel Ray never answered"
    executor = ray_executor.RayExecutor(None, total_gpus=1)  # type: ignore[arg-type]
    executor._slots.append(ray_executor._Slot(Actor(), 1))
    executor.shutdown()
    assert not executor._slots and ray.asked == [], "Ray gone: nothing asked of it, no kill"
    ray.waits.clear()
    monkeypatch.setattr(ray_executor, "_placement_probe", type(
        "Task", (), {"options": lambda self, **k: Actor.cancel})())
    assert executor._probe_placement(1, 30.0) == "raylet_died"
    assert len(ray.waits) == 3 and ray.asked == []


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _stopped_mid_trial(tmp_path: Path, stop: Callable[[int, list[psutil.Process]], None],
                       **env: str) -> Study:
    """`nightshift start` on a one-GPU simulated study in a session of its own (a group of its
    own, as a shell's job is: not pytest's), with `env` added to the test's environment;
    `stop(daemon_pid, its_descendants)` is called once trial 0's engine is starting up, on a
    tree where Ray's GCS and raylet run. Whatever the stop, the study must end as a stopped
    one: exit 0, "stopped" with its resume line, never Ray's abort, nothing of it left running
    and no engine left behind (the daemon reaped it). The study, as its storage holds it."""
    path = write_study(tmp_path, trials=2, workload={
        "input_len": 64, "output_len": 16, "levels": [{"concurrency": 4}],
        "num_requests": 8, "warmup_requests": 0},
        simulated={"hardware": "h200", "num_gpus": 1, "startup_time_scale": 0.08})
    log = tmp_path / "daemon.log"
    seen: dict[int, psutil.Process] = {}
    with open(log, "w") as out:
        daemon = subprocess.Popen([sys.executable, "-m", "optimizer.cli", "start", str(path),
                                   "--no-progress"], cwd=tmp_path,
                                  env=_env(PYTHONUNBUFFERED="1", **env), stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    engines = tmp_path / "results" / "engines"
    try:
        deadline = time.monotonic() + 240
        while not list(engines.glob("*.json")):  # trial 0's engine is starting up
            assert daemon.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no engine was launched in time"
            time.sleep(0.2)
        seen.update((p.pid, p) for p in _descendants(daemon.pid))
        names = {p.name() for p in seen.values()}
        assert {"gcs_server", "raylet"} <= names, names
        stop(daemon.pid, list(seen.values()))
        while daemon.poll() is None and time.monotonic() < deadline:
            seen.update((p.pid, p) for p in _descendants(daemon.pid))
            time.sleep(0.2)
        code = daemon.wait(1)
    finally:
        if daemon.poll() is None:
            os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(30)
        orphans = reap_strays(engines)  # an engine left in a session of its own, if any
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "study e2e stopped" in text and "resume with: nightshift start" in text, text[-3000:]
    assert "Failed to connect to GCS" not in text
    left = [p for p in seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"nothing of the study outlives it: {[_label(p) for p in left]}"
    assert not orphans and not list(engines.glob("*.json")), \
        "no engine left behind: the daemon reaped its engine"
    return load(tmp_path)


@pytest.mark.slow
def test_a_stop_signal_to_the_daemons_process_group_finishes_its_trial_on_a_ray_still_up(
        tmp_path: Path, clean_environ: dict[str, str]) -> None:
    """What `timeout` or `kill -- -PGID` (SIGTERM) sends reaches every process of the
    daemon's group. Ray's processes are in sessions of their own, so the daemon alone takes
    it: the trial in flight finishes and the study ends "stopped" with its resume line,
    nothing of it left running. Before, the raylet and GCS took it too and the driver aborted
    once Ray's GCS reconnect window passed (60 s; 3 s here, so that a trial whose engine
    starts for ~15 s outlasts it). A closed terminal's SIGHUP to the group is
    tests/optimizer/test_daemon.py's stop in the confirmation round."""
    study = _stopped_mid_trial(tmp_path, lambda pid, tree: os.killpg(pid, signal.SIGTERM),
                               RAY_gcs_rpc_server_reconnect_timeout_s="3")
    record = study.trials[0].user_attrs.get("record") or {}
    assert record.get("state") == "complete", "the trial in flight finished, on Ray still up"
    assert len(study.trials) == 1, "no trial launched after the stop"


def _terminate_daemon_and_ray(pid: int, tree: list[psutil.Process]) -> None:
    """SIGTERM to the daemon and every process of its Ray at once, as systemd's
    KillMode=control-group sends it; not to the engine."""
    ray_tree = [p for p in tree if "runners.simulated" not in _label(p)]
    for process in [psutil.Process(pid), *ray_tree]:
        with contextlib.suppress(psutil.Error):
            process.terminate()


@pytest.mark.slow
def test_a_ray_killed_with_the_daemon_requeues_its_trial_reaps_its_engine_and_says_stopped(
        tmp_path: Path, clean_environ: dict[str, str]) -> None:
    """systemd's KillMode=control-group sends SIGTERM to every process of the unit, Ray's
    own sessions too: the daemon must not die in Ray's abort ("Failed to connect to GCS"). It
    sees its Ray gone, fails and re-queues the trial in flight, reaps its engine, ends its
    MLflow runs and says "stopped" with its resume line. The engine (in a session of its own,
    and slow to end, as vLLM is) is left out of the signal: the daemon must end it."""
    study = _stopped_mid_trial(tmp_path, _terminate_daemon_and_ray)
    record = study.trials[0].user_attrs.get("record") or {}
    assert record.get("state") == "failed" and record.get("failure_reason") == "interrupted", \
        record
    assert [t for t in study.trials if t.state == TrialState.WAITING
            and t.user_attrs.get("retry_of") == 0], "the trial is re-queued for the resume"
    assert not [r for r in trial_runs(tmp_path) if r.info.status == "RUNNING"], \
        "no MLflow run left running"


# A driver that joins a Ray of another process by address, as `nightshift start --ray-address`
# does (`init_ray`), and says what the daemon's executor answers before and after the test
# kills that Ray's GCS (a line on stdin says it has).
_JOINED = """
import json, sys, time
from optimizer.run.ray_cluster import init_ray
from optimizer.run.ray_executor import RayExecutor
executor = RayExecutor(None, total_gpus=init_ray(None, sys.argv[1]))
print(json.dumps({"before": executor.lost()}), flush=True)
sys.stdin.readline()
started = time.monotonic()
while (lost := executor.lost()) is None and time.monotonic() - started < 30:
    time.sleep(0.1)
print(json.dumps({"after": lost, "after_s": time.monotonic() - started}), flush=True)
"""


def _json_line(stream: Any) -> dict[str, Any]:
    """The next line of `stream` that is a JSON object (Ray may print its own lines)."""
    for line in stream:
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError("the driver ended without answering")


@pytest.mark.slow
def test_a_joined_clusters_gcs_gone_is_seen_before_rays_driver_would_abort(
        other_ray: dict[str, Any]) -> None:
    """The daemon's own Ray is watched through its processes; a joined cluster's GCS runs
    elsewhere. Its end must be seen (then the daemon fails and re-queues its trials, reaps its
    engines and ends "stopped", as for its own Ray: the next test up) within half of Ray's
    reconnect window (8 s here, so 4 s), before Ray's driver aborts the process."""
    gcs = [p for p in psutil.Process(other_ray["pid"]).children(recursive=True)
           if p.name() == "gcs_server"]
    assert len(gcs) == 1, gcs
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled",
           "RAY_gcs_rpc_server_reconnect_timeout_s": "8"}
    driver = subprocess.Popen([sys.executable, "-c", _JOINED, other_ray["address"]], cwd=REPO,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    assert driver.stdin is not None and driver.stdout is not None
    try:
        before = _json_line(driver.stdout)
        gcs[0].kill()
        driver.stdin.write("gone\n")
        driver.stdin.flush()
        after = _json_line(driver.stdout)
    finally:
        for process in (*_descendants(driver.pid), psutil.Process(driver.pid),
                        psutil.Process(other_ray["pid"])):  # its Ray ends with it
            with contextlib.suppress(psutil.Error):
                process.kill()
        driver.wait(30)
        driver.stdin.close()
        driver.stdout.close()
    assert before == {"before": None}, "a joined cluster whose GCS answers is not lost"
    assert after["after"] is not None and other_ray["address"] in after["after"], after
    # the grace itself (half the window) is test_gcs_watch.py's, on an injected clock
    assert after["after_s"] < 8.0, f"seen before Ray's 8 s window ends: {after}"
