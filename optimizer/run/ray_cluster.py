"""The Ray cluster around the executor: start a local Ray bound to 127.0.0.1 (`init_ray`,
`start_local_ray`) or join one, count its live GPUs (`live_gpus`, `largest_node_gpus`), say why
no node can take a trial placed as the study asks (`placement_problem`), probe a GPU node's
hardware (`probe_on_cluster`) and reap the engines a dead daemon left on other nodes
(`reap_on_other_nodes`). With `ray_executor`, the only modules of `optimizer` that import Ray.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayError

from optimizer.errors import ConfigError, NightshiftError, translate
from optimizer.run.gcs_watch import GcsWatch

logger = logging.getLogger(__name__)


def live_gpus(timeout_s: float = 30.0) -> int:
    """The GPUs of the cluster's live nodes; raises TimeoutError when Ray's GCS does not answer
    within `timeout_s` (`ray.nodes()` blocks while it tries to reconnect to a GCS gone)."""
    nodes = [n for n in cluster_nodes(timeout_s) if n.get("Alive")]
    return int(sum(n.get("Resources", {}).get("GPU", 0) for n in nodes))


def cluster_nodes(timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """`ray.nodes()`, or TimeoutError when Ray's GCS does not answer within `timeout_s`."""
    answer: list[list[dict[str, Any]]] = []
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            answer.append(ray.nodes())  # type: ignore[no-untyped-call]
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    thread = threading.Thread(target=ask, daemon=True, name="nightshift-ray-nodes")
    thread.start()
    thread.join(timeout_s)
    if failure:
        raise failure[0]
    if not answer:
        raise TimeoutError(f"ray.nodes() did not answer within {timeout_s:.0f} s")
    return answer[0]


def largest_node_gpus() -> int:
    """The most GPUs one live node of the cluster has: a trial's GPUs must share a node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    return int(max((n.get("Resources", {}).get("GPU", 0) for n in nodes), default=0))


def placement_problem(nodes: Sequence[Mapping[str, Any]], accelerator_type: str | None,
                      resources: Mapping[str, float]) -> str | None:
    """Why no live node of the cluster (`ray.nodes()`) can take a trial placed by
    `ray.accelerator_type` and `ray.resources`, or None. Ray would queue such a task for ever,
    silently: the study would sit "running" with nothing launched."""
    if not accelerator_type and not resources:
        return None
    alive = [dict(n.get("Resources") or {}) for n in nodes if n.get("Alive")]
    wanted = dict(resources)
    if accelerator_type:
        wanted[f"accelerator_type:{accelerator_type}"] = 0.001  # as Ray asks for it
    if any(all(node.get(k, 0.0) >= v for k, v in wanted.items()) for node in alive):
        return None
    have = sorted({k for node in alive for k in node if k.startswith("accelerator_type:")})
    if accelerator_type and f"accelerator_type:{accelerator_type}" not in \
            {k for node in alive for k in node}:
        kinds = ", ".join(k.partition(":")[2] for k in have) or "none declared"
        return (f"ray.accelerator_type: no node of the Ray cluster is a {accelerator_type!r} "
                f"(its nodes: {kinds}); name one of those or leave it out")
    custom = sorted({k for node in alive for k in node
                     if k not in ("CPU", "GPU", "memory", "object_store_memory")
                     and not k.startswith(("node:", "accelerator_type:"))})
    return (f"ray.resources: no node of the Ray cluster has {dict(wanted)} (custom resources "
            f"there: {', '.join(custom) or 'none'}); start the nodes with `ray start "
            "--resources` or leave ray.resources out")


def cluster_placement_problem(accelerator_type: str | None,
                              resources: Mapping[str, float]) -> str | None:
    """`placement_problem` on the joined cluster's live nodes."""
    return placement_problem(ray.nodes(), accelerator_type, resources)  # type: ignore[no-untyped-call]


def _reap(registry_dir: str) -> list[int]:
    from runners.process import reap_strays

    return reap_strays(Path(registry_dir))


def reap_on_other_nodes(registry_dir: Path, timeout_s: float = 60.0) -> dict[str, list[int]]:
    """Kill the engines a dead daemon left on the cluster's other live nodes: a worker there
    launched them and recorded them under `registry_dir` on that node's disk, which the daemon
    cannot read. One task pinned to each node reaps them (`runners.process.reap_strays`, which
    acts only on a pid alive with its recorded create time). Call with the study lock held.
    Returns node id -> pids killed, for the nodes where any were."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        return {}
    here = ray.get_runtime_context().get_node_id()
    pending = {}
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if not node.get("Alive") or node["NodeID"] == here:
            continue
        strategy = NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False)
        pending[node["NodeID"]] = ray.remote(_reap).options(
            num_cpus=0, scheduling_strategy=strategy).remote(str(registry_dir))
    reaped: dict[str, list[int]] = {}
    for node_id, ref in pending.items():
        try:
            pids = ray.get(ref, timeout=timeout_s)
        except (GetTimeoutError, RayError) as exc:
            logger.warning("could not reap stray engines on node %s (%s: %s); they may still "
                           "hold its GPUs", node_id[:12], type(exc).__name__, str(exc)[:200])
            continue
        if pids:
            reaped[node_id] = list(pids)
    return reaped


def _probe_hardware() -> dict[str, Any]:
    from runners.hardware_probe import probe

    return probe().to_dict()


def probe_on_cluster(accelerator_type: str | None = None,
                     resources: Mapping[str, float] | None = None,
                     timeout_s: float = 300.0) -> Any:
    """The hardware profile of a GPU node of the cluster (the driver may have no GPU), read by
    a one-GPU task placed as the study's trials will be."""
    from runners.hardware import HardwareProfile

    options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0, "resources": dict(resources or {})}
    if accelerator_type:
        options["accelerator_type"] = accelerator_type
    task = ray.remote(_probe_hardware).options(**options)
    try:
        data = ray.get(task.remote(), timeout=timeout_s)
    except GetTimeoutError as exc:  # no node fits what the study asks of one: bad input
        raise translate(exc, f"ray: no GPU node of the cluster took a probe within "
                        f"{timeout_s:g} s; check ray.accelerator_type and ray.resources against "
                        "the cluster's nodes (`ray status`).", into=ConfigError) from exc
    return HardwareProfile.from_dict(data)


def _session_popen(base: type[subprocess.Popen[Any]]) -> type[subprocess.Popen[Any]]:
    """`base` (Ray's `ConsolePopen`) starting its process in a new session."""

    class SessionPopen(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    return SessionPopen


# The processes of the local Ray this daemon started (name, process): GCS and raylet.
_LOCAL_RAY: list[tuple[str, psutil.Process]] = []
# How long Ray's driver waits for a GCS gone before it aborts the whole process ("Failed to
# connect to GCS within N seconds ... The program will terminate"; 60 s by default). A local
# Ray's GCS never comes back, and the daemon watches it itself (`local_ray_lost`): the window
# is made long so that Ray's abort never cuts the daemon's wind-down (trials re-queued,
# engines reaped, MLflow runs ended, the "stopped" line). A value in the environment wins.
_GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
_GCS_RECONNECT_S = 24 * 3600


def local_ray_lost() -> str | None:
    """Which of the local Ray's GCS and raylet (started by `start_local_ray`) have ended, as
    a line; None while both run, or for a cluster joined by address (its GCS may come back)."""
    gone = []
    for name, process in _LOCAL_RAY:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                gone.append(name)
        except psutil.Error:  # reaped, or its pid reused: either way not our process
            gone.append(name)
    if not gone:
        return None
    return (f"the local Ray's {' and '.join(gone)} ended under the daemon (a signal to every "
            "process of the unit, as systemd's KillMode=control-group sends, or a crash)")


# The GCS of the cluster this daemon joined by HOST:PORT or auto (`init_ray`); none for its own
# Ray, or for a Ray Client (ray://) connection, whose GCS the driver does not reach itself.
_JOINED_GCS: list[GcsWatch] = []


def ray_lost() -> str | None:
    """Why the Ray under the daemon is gone, as a line: its own Ray's GCS or raylet ended
    (`local_ray_lost`), or the joined cluster's GCS has not answered for its grace
    (optimizer/run/gcs_watch.py); None while it is there."""
    return local_ray_lost() or next(
        (line for watch in _JOINED_GCS if (line := watch.lost()) is not None), None)


# The variable Ray 2.60 reads for its authentication mode ("token" or "disabled"; unset: Ray
# decides, and says so on stderr).
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def settle_token_auth(address: str | None) -> None:
    """Decide Ray's authentication mode as Ray 2.60's `ray.init` would, without its notice.

    With RAY_AUTH_MODE unset, `ray.init` enables token authentication for a new local cluster
    (`enable_token_auth_by_default`), and for `address="auto"` where a token exists
    (`maybe_enable_token_auth_if_token_available`); each time it logs "Token authentication is
    enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out ...", which read like
    an action asked of the user on every `nightshift start`. This takes the same decision
    first, by Ray's own `_enable_token_auth` (RAY_AUTH_MODE=token in this process's
    environment, which the GCS, raylet and workers inherit, and Ray's configuration read
    again: it read the variable when `ray` was imported); `ray.init` then finds the mode set
    and says nothing. An explicit address Ray never switches to tokens, nor does this. A
    RAY_AUTH_MODE the user set is kept, whatever it says."""
    if AUTH_MODE_ENV in os.environ:
        return
    from ray._private.authentication.authentication_token_setup import _enable_token_auth
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]

    if address is None or (address == "auto" and AuthenticationTokenLoader.instance()
                           .has_token(ignore_auth_mode=True)):
        _enable_token_auth()


LOOPBACK = "127.0.0.1"
# Ray resolves a loopback `_node_ip_address` to the machine's address unless it believes
# multi-node clusters are off (ray/_private/services.py `resolve_ip_for_localhost` and
# `get_node_ip_address`); this switch, read by `ray._private.ray_constants` at import, says so.
_RAY_CLUSTERS_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_ray(num_gpus: int | None, address: str | None = None) -> int:
    """Join `address` or start a local cluster (declaring `num_gpus` for the simulated engine);
    returns the GPUs the cluster has."""
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "configure_logging": False}
        if address:
            _LOCAL_RAY.clear()  # a cluster of its own: its GCS may come back
            settle_token_auth(address)
            ray.init(address=address, **kwargs)
            _JOINED_GCS[:] = [] if address.startswith("ray://") else \
                [GcsWatch(ray.get_runtime_context().gcs_address)]
        else:
            start_local_ray(num_gpus=num_gpus, num_cpus=max(2, (num_gpus or 0) + 2), **kwargs)
    resources: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
    return int(resources.get("GPU", 0))


def start_local_ray(**kwargs: Any) -> None:
    """A Ray of the daemon's own on this machine, bound to 127.0.0.1 only, whatever the
    environment holds.

    `address="local"` starts a new cluster even with `RAY_ADDRESS` set or a `ray start` left
    running (which `ray.init()` without an address would join). Ray 2.60 binds its gRPC servers
    (GCS, raylet and object manager, every core worker and the driver), the runtime-env agent,
    the autoscaler monitor's metrics server and (by its source; in a minimal install it opens
    no port) the dashboard agent to loopback when the node's IP is a loopback one; the
    dashboard process gets `--host=127.0.0.1`, Ray's default. `ray.init` would turn
    `_node_ip_address="127.0.0.1"` into the machine's address unless multi-node clusters are
    switched off, so the switch is off for this call: in the environment, for the processes Ray
    starts (its workers inherit the raylet's), and in the constant already imported, for this
    process. Raises `NightshiftError` (Ray shut down again) if the node came up on another
    address all the same.

    Every process Ray starts here (GCS, raylet, dashboard, log monitor; the raylet's workers
    and agents are its children) runs in a session of its own (`setsid`): a signal sent to
    the daemon's process group (SIGHUP from a closed terminal, SIGTERM from `timeout` or
    `kill -- -PGID`) reaches the daemon alone, which then finishes its trials on a Ray still
    up. Before, the raylet and GCS took the signal too and the driver aborted 60 s later
    ("Failed to connect to GCS"), its trial left running and its engine orphaned. Ray starts
    them all through `services.start_ray_process`, which opens `services.ConsolePopen`; that
    class is swapped for one that adds `start_new_session=True` for this call only. Ray's
    own fate-sharing is kept: the children still get PR_SET_PDEATHSIG (SIGKILL on the
    daemon's death) from Ray's `preexec_fn`, which runs after the `setsid`, and
    `ray.shutdown()` (at exit) still ends them by pid. Ray blocks SIGINT in them, as
    before."""
    from ray._private import ray_constants, services

    saved = {name: os.environ.get(name)
             for name in ("RAY_ADDRESS", _RAY_CLUSTERS_SWITCH, _GCS_RECONNECT_ENV)}
    saved_switch = ray_constants.ENABLE_RAY_CLUSTER
    saved_popen = services.ConsolePopen
    _LOCAL_RAY.clear()
    _JOINED_GCS.clear()
    os.environ.pop("RAY_ADDRESS", None)
    os.environ[_RAY_CLUSTERS_SWITCH] = "0"
    os.environ.setdefault(_GCS_RECONNECT_ENV, str(_GCS_RECONNECT_S))
    ray_constants.ENABLE_RAY_CLUSTER = False
    services.ConsolePopen = _session_popen(saved_popen)  # type: ignore[misc,assignment]
    settle_token_auth(None)
    try:
        ray.init(address="local", _node_ip_address=LOOPBACK, **kwargs)
    finally:
        services.ConsolePopen = saved_popen  # type: ignore[misc]
        ray_constants.ENABLE_RAY_CLUSTER = saved_switch
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    nodes = [n.get("NodeManagerAddress") for n in ray.nodes()]  # type: ignore[no-untyped-call]
    if nodes != [LOOPBACK]:
        ray.shutdown()
        raise NightshiftError(f"the local Ray came up on {', '.join(map(str, nodes))}, not "
                              f"{LOOPBACK} only; this Ray version binds differently: pin ray "
                              "2.60 or pass --ray-address to use a cluster you run.")
    _LOCAL_RAY[:] = [(p.name(), p) for p in psutil.Process().children()
                     if p.name() in ("gcs_server", "raylet")]
