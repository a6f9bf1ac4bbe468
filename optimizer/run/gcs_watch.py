"""Whether a joined Ray cluster's GCS is still there (`GcsWatch`): the daemon's own Ray is
watched through its GCS and raylet processes (`ray_cluster.local_ray_lost`), but a cluster
joined with `--ray-address` runs its GCS elsewhere, perhaps on another machine, and may bring
it back (Ray's GCS fault tolerance). So its GCS port is dialled (a TCP connect, closed at once;
at most once a second), and the GCS counts as lost once it has refused or not answered for
`grace_s` on end.

Ray's driver aborts the whole process once its GCS has been gone for its reconnect window
("Failed to connect to GCS within N seconds ... The program will terminate"; 60 s unless
`RAY_gcs_rpc_server_reconnect_timeout_s` says otherwise). The grace is half that window: a GCS
back within it costs nothing, and one that is not leaves the daemon the other half to re-queue
its trials, reap its engines and end "stopped" before Ray's abort. Imports no Ray."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping

# Ray's variable for its driver's reconnect window, and its default (Ray 2.60's RayConfig).
RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
RAY_RECONNECT_DEFAULT_S = 60.0
_DIAL_TIMEOUT_S = 1.0
_EVERY_S = 1.0


def grace_for(environ: Mapping[str, str]) -> float:
    """Half of Ray's driver reconnect window, as this process's environment sets it."""
    try:
        window = float(environ.get(RECONNECT_ENV, RAY_RECONNECT_DEFAULT_S))
    except ValueError:  # Ray would refuse it too; its default then
        window = RAY_RECONNECT_DEFAULT_S
    return max(1.0, window / 2)


def dial(host: str, port: int, timeout_s: float = _DIAL_TIMEOUT_S) -> bool:
    """Whether something accepts a TCP connection at host:port within `timeout_s`."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


class GcsWatch:
    """A joined cluster's GCS at `address` (HOST:PORT, as `ray.get_runtime_context()
    .gcs_address` gives it), dialled at most every `every_s` of `clock`."""

    def __init__(self, address: str, grace_s: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 connect: Callable[[str, int], bool] = dial, every_s: float = _EVERY_S) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self.host = host.strip("[]")
        self.port = int(port)
        self.grace_s = grace_for(os.environ) if grace_s is None else grace_s
        self._clock = clock
        self._connect = connect
        self._every_s = every_s
        self._dialled_at: float | None = None
        self._silent_since: float | None = None

    def lost(self) -> str | None:
        """Why the GCS counts as gone (it has not answered for `grace_s`), or None."""
        now = self._clock()
        if self._dialled_at is None or now - self._dialled_at >= self._every_s:
            self._dialled_at = now
            if self._connect(self.host, self.port):
                self._silent_since = None
            elif self._silent_since is None:
                self._silent_since = now
        if self._silent_since is None or now - self._silent_since < self.grace_s:
            return None
        return (f"the joined Ray cluster's GCS at {self.address} has not answered for "
                f"{now - self._silent_since:.0f} s (it ended, or its machine or the network to "
                f"it did; a GCS back within {self.grace_s:g} s would have been waited for)")
