"""Owns engine processes: launch in their own process group with a registry record and a
scrubbed log (runners/log_pump.py), readiness, teardown of the whole tree, and reaping of strays
a dead daemon left behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import psutil

from runners.credentials import auth_headers
from runners.log_pump import LogPump, sync_log

logger = logging.getLogger(__name__)

_CREATE_TIME_TOLERANCE_S = 0.01  # psutil's create_time is stable to the clock tick (10 ms)
_KILL_WAIT_S = 5.0  # after SIGKILL: only an uninterruptible (D-state) process takes longer
_HEALTH_REQUEST_TIMEOUT_S = 5.0

Readiness = Literal["ready", "exited", "timeout"]


class SupportsIsAlive(Protocol):
    def is_alive(self) -> bool: ...


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a process group; a group already gone (or not ours) is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _ask_group_to_exit(pgid: int) -> None:
    """SIGTERM to a process group, then SIGCONT: a stopped process (SIGSTOP, a debugger, a
    terminal's job control) holds a pending SIGTERM until it runs again, and would otherwise
    sit out the whole grace period to be SIGKILLed without its own cleanup."""
    _signal_group(pgid, signal.SIGTERM)
    _signal_group(pgid, signal.SIGCONT)


def _descendants(pid: int) -> list[psutil.Process]:
    """The live process tree below `pid`, including any that left its process group."""
    try:
        children: list[psutil.Process] = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    return children


def _kill_procs(procs: Sequence[psutil.Process]) -> None:
    for proc in procs:
        # psutil refuses to signal a pid that was reused since the Process object was made.
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(procs), timeout=_KILL_WAIT_S)


class EngineProcess:
    """One engine process and everything it spawns.

    Started in a new session (its own process group), so SIGTERM/SIGKILL reach vLLM's API
    server, engine core and workers at once. A JSON record in the registry directory lets a
    restarted daemon find and kill it (`reap_strays`) should this daemon die first.
    """

    def __init__(self, popen: subprocess.Popen[bytes], argv: Sequence[str], log_path: Path,
                 record_path: Path, pump: LogPump) -> None:
        self._popen = popen
        self._pump = pump
        self.argv = tuple(argv)
        self.log_path = log_path
        self.record_path = record_path
        self._is_closed = False

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
              registry_dir: Path, *, secrets: Sequence[str] = ()) -> EngineProcess:
        """Launch `argv` (no shell) with os.environ plus `env`, stdout and stderr appended to
        `log_path` with each of `secrets` replaced by <redacted> before it is written
        (runners/log_pump.py). Raises OSError when argv[0] cannot be executed."""
        if not argv:
            raise ValueError("EngineProcess.start needs a command but argv is empty.")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        registry_dir.mkdir(parents=True, exist_ok=True)
        pump = LogPump(log_path, secrets)
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=pump.writer_fd,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            pump.close()
            raise
        pump.start()
        record_path = registry_dir / f"{popen.pid}.json"
        proc = cls(popen, argv, log_path, record_path, pump)
        try:
            _write_record(record_path, {
                "pid": popen.pid,
                # setsid made it the leader of a group whose id is its pid.
                "pgid": popen.pid,
                "argv": list(argv),
                "create_time": _create_time(popen.pid),
                "log_path": str(log_path),
            })
        except OSError:
            proc.terminate(grace_s=0)
            raise
        logger.debug("started pid %d: %s (log %s)", popen.pid, " ".join(argv), log_path)
        return proc

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def pgid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: killed by that signal), else None."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def is_stopped(self) -> bool:
        """Whether its leader is stopped (SIGSTOP, a debugger); False once it is gone."""
        try:
            status = psutil.Process(self.pid).status()
        except psutil.Error:
            return False
        return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for it to exit on its own; its exit status, or None if still running."""
        try:
            return self._popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, grace_s: float = 20.0) -> int | None:
        """Stop the whole tree: SIGTERM to the group, up to `grace_s` for it to exit, then
        SIGKILL to the group and to any descendant that left it; then its log is written to the
        end and closed. Removes the registry record.

        Idempotent and safe on a process that already exited. Returns the exit status (None
        only if the process survived SIGKILL, which is logged).
        """
        if self._is_closed:
            return self._popen.returncode
        # Listed before signalling: once the leader dies its children are re-parented and can
        # no longer be found from it.
        descendants = _descendants(self.pid)
        deadline = time.monotonic() + grace_s
        _ask_group_to_exit(self.pgid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout=grace_s)
        in_group = [p for p in descendants if _pgid_of(p) == self.pgid]
        psutil.wait_procs(in_group, timeout=max(0.0, deadline - time.monotonic()))
        _signal_group(self.pgid, signal.SIGKILL)
        _kill_procs(descendants)
        try:
            self._popen.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            self._pump.close()
            logger.error("pid %d survived SIGKILL for %.0f s (uninterruptible sleep?); "
                         "leaving its record %s for reap_strays", self.pid, _KILL_WAIT_S,
                         self.record_path)
            return None
        self._pump.close()
        self.record_path.unlink(missing_ok=True)
        self._is_closed = True
        logger.debug("pid %d ended with status %s", self.pid, self._popen.returncode)
        return self._popen.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()


def _pgid_of(proc: psutil.Process) -> int | None:
    try:
        return os.getpgid(proc.pid)
    except ProcessLookupError:
        return None


def _create_time(pid: int) -> float | None:
    try:
        create_time: float = psutil.Process(pid).create_time()
    except psutil.Error:
        return None  # already gone: the record will never match a live process
    return create_time


def _write_record(path: Path, record: Mapping[str, Any]) -> None:
    # Write then rename: a daemon killed mid-write must not leave a half record behind.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)


def _matching_process(record: Mapping[str, Any]) -> psutil.Process | None:
    """The live process the record describes, or None when it is gone or its pid was reused
    by another process (different create time)."""
    pid, create_time = record.get("pid"), record.get("create_time")
    if not isinstance(pid, int) or not isinstance(create_time, int | float):
        return None
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > _CREATE_TIME_TOLERANCE_S:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return proc


def reap_strays(registry_dir: Path, grace_s: float = 5.0, *,
                under: Path | None = None) -> list[int]:
    """Kill the engines recorded in `registry_dir` that are still alive, and clear the records.

    A record is acted on only when its pid is alive with the recorded create time, so a pid
    since reused by an unrelated process is never touched. Call it once at daemon start,
    before launching engines; with `under`, only engines whose log lies below that directory
    (one trial's, after its worker died) are reaped. Returns the pids killed.
    """
    if not registry_dir.is_dir():
        return []
    killed = []
    for path in sorted(registry_dir.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            logger.warning("unreadable process record %s; removing it", path)
            record = None
        if under is not None and not (isinstance(record, dict) and Path(
                str(record.get("log_path", ""))).is_relative_to(under)):
            continue
        proc = _matching_process(record) if isinstance(record, dict) else None
        if proc is not None and isinstance(record, dict):
            recorded_pgid = record.get("pgid")
            pgid: int = recorded_pgid if isinstance(recorded_pgid, int) else proc.pid
            logger.warning("killing stray engine pid %d (group %d) from %s: %s",
                           proc.pid, pgid, path, " ".join(map(str, record.get("argv", []))))
            descendants = _descendants(proc.pid)
            _ask_group_to_exit(pgid)
            psutil.wait_procs([proc, *descendants], timeout=grace_s)
            _signal_group(pgid, signal.SIGKILL)
            _kill_procs([proc, *descendants])
            killed.append(proc.pid)
        path.unlink(missing_ok=True)
    return killed


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it before the
    engine binds it: a launch that fails with "address in use" is retryable)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def is_port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether binding `host:port` fails, as the engine's own bind would."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def wait_healthy(base_url: str, proc: SupportsIsAlive, timeout_s: float,
                 poll_s: float = 0.5, api_key: str | None = None) -> Readiness:
    """Poll GET `<base_url>/health` until it answers 200.

    "exited" as soon as the process is found dead (checked before every poll and before
    declaring a timeout, so a crash is never reported as slowness); "timeout" only for a
    process alive at the deadline.
    """
    url = base_url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout_s
    request_timeout = httpx.Timeout(min(_HEALTH_REQUEST_TIMEOUT_S, max(poll_s, 1.0)))
    with httpx.Client(timeout=request_timeout, trust_env=False,
                      headers=auth_headers(api_key)) as client:
        while True:
            if not proc.is_alive():
                return "exited"
            try:
                if client.get(url).status_code == 200:
                    return "ready"
            except httpx.HTTPError:
                pass  # not listening yet, or busy loading: keep polling
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout" if proc.is_alive() else "exited"
            time.sleep(min(poll_s, remaining))


def tail(path: Path, max_bytes: int = 64_000) -> str:
    """The last `max_bytes` of a log as text, starting at a line boundary; "" when missing.
    An engine's log is first brought up to date with what the engine wrote (`sync_log`): its
    output reaches the file through a pipe, a moment after the engine wrote it."""
    sync_log(path)
    try:
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    if len(data) < size:
        # Drop the partial first line the cut made.
        newline = data.find(b"\n")
        if newline != -1:
            data = data[newline + 1:]
    return data.decode("utf-8", errors="replace")
