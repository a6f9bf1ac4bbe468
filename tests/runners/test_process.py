"""Engine process ownership with real processes: group teardown down to grandchildren, the
registry record, stray reaping with its pid-reuse guard, readiness, ports and log tails."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import psutil
import pytest

from runners.process import (
    EngineProcess,
    free_port,
    is_port_in_use,
    reap_strays,
    tail,
    wait_healthy,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# A parent that spawns a grandchild (in its group, or in a new session: escaped), writes the
# grandchild's pid to argv[1], then sleeps. With argv[3] == "ignore-term" it ignores SIGTERM.
_PARENT = """
import signal, subprocess, sys, time
if sys.argv[3] == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=sys.argv[2] == "escape")
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
print("parent up", flush=True)
time.sleep(120)
"""


def _is_gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)
    return path.read_text()


def _start_family(tmp_path: Path, mode: str = "group", term: str = "default"
                  ) -> tuple[EngineProcess, int]:
    pid_file = tmp_path / "grandchild.pid"
    proc = EngineProcess.start([sys.executable, "-c", _PARENT, str(pid_file), mode, term], {},
                               tmp_path / "engine.log", tmp_path / "registry")
    return proc, int(_wait_for_file(pid_file))


def test_terminate_kills_child_and_grandchild_and_removes_record(tmp_path: Path) -> None:
    proc, grandchild = _start_family(tmp_path)
    assert proc.record_path.exists()
    assert proc.is_alive() and not _is_gone(grandchild)
    assert proc.terminate(grace_s=5) == -signal.SIGTERM
    assert _is_gone(proc.pid) and _is_gone(grandchild), "the whole group must be gone"
    assert not proc.record_path.exists(), "a clean teardown leaves no record to reap"
    assert not proc.is_alive()


def test_terminate_escalates_to_sigkill_and_kills_escaped_descendants(tmp_path: Path) -> None:
    # The pid file is written after the SIGTERM handler is set: ignoring is in force now.
    proc, grandchild = _start_family(tmp_path, mode="escape", term="ignore-term")
    assert proc.terminate(grace_s=0.5) == -signal.SIGKILL, "SIGTERM ignored: SIGKILL"
    assert _is_gone(grandchild), "a descendant in its own session must not survive"


def test_a_stopped_engine_is_resumed_to_take_its_sigterm_not_killed_after_the_grace(
        tmp_path: Path) -> None:
    proc, grandchild = _start_family(tmp_path)
    os.killpg(proc.pgid, signal.SIGSTOP)  # a hung engine, or one a debugger holds
    started = time.monotonic()
    assert proc.terminate(grace_s=30) == -signal.SIGTERM, \
        "a stopped group gets SIGCONT after SIGTERM and ends on the SIGTERM"
    assert time.monotonic() - started < 10, "without sitting out the grace period"
    assert _is_gone(grandchild)


def test_a_sigstopped_engine_reads_stopped(tmp_path: Path) -> None:
    proc = EngineProcess.start([sys.executable, "-c", "import time; time.sleep(120)"], {},
                               tmp_path / "engine.log", tmp_path / "registry")
    try:
        assert not proc.is_stopped()
        os.killpg(proc.pgid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not proc.is_stopped():
            assert time.monotonic() < deadline, "a SIGSTOPped engine reads stopped"
            time.sleep(0.02)
    finally:
        proc.terminate(grace_s=5)
    assert not proc.is_stopped(), "gone: not stopped"


def test_terminate_is_idempotent_and_safe_after_exit(tmp_path: Path) -> None:
    proc = EngineProcess.start([sys.executable, "-c", "raise SystemExit(3)"], {},
                               tmp_path / "engine.log", tmp_path / "registry")
    assert proc.wait(timeout_s=10) == 3
    assert proc.returncode == 3
    assert proc.terminate() == 3
    assert proc.terminate() == 3
    assert not proc.record_path.exists()


def test_context_manager_terminates(tmp_path: Path) -> None:
    with EngineProcess.start([sys.executable, "-c", "import time; time.sleep(60)"], {},
                             tmp_path / "engine.log", tmp_path / "registry") as proc:
        assert proc.is_alive()
    assert not proc.is_alive() and _is_gone(proc.pid)


def test_env_additions_and_both_streams_reach_the_log(tmp_path: Path,
                                                      clean_environ: dict[str, str]) -> None:
    script = ("import os, sys; print(os.environ['NIGHTSHIFT_TEST_VAR']); "
              "print('to stderr', file=sys.stderr); print(os.environ['PATH'] != '')")
    log = tmp_path / "logs" / "engine.log"
    proc = EngineProcess.start([sys.executable, "-c", script], {"NIGHTSHIFT_TEST_VAR": "hello"},
                               log, tmp_path / "registry")
    assert proc.wait(timeout_s=10) == 0
    proc.terminate()
    text = log.read_text()
    assert "hello" in text and "to stderr" in text and "True" in text


def test_record_describes_the_process(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    with EngineProcess.start(argv, {}, tmp_path / "engine.log", tmp_path / "registry") as proc:
        record = json.loads(proc.record_path.read_text())
        assert proc.record_path == tmp_path / "registry" / f"{proc.pid}.json"
        assert record["pid"] == proc.pid and record["pgid"] == proc.pid
        assert record["argv"] == argv
        assert record["log_path"] == str(tmp_path / "engine.log")
        assert record["create_time"] == psutil.Process(proc.pid).create_time()
        assert os.getpgid(proc.pid) == proc.pid, "the engine leads its own process group"


def test_reap_strays_kills_a_recorded_engine_and_its_group(tmp_path: Path) -> None:
    proc, grandchild = _start_family(tmp_path)
    # As a restarted daemon: only the registry directory is known.
    assert reap_strays(tmp_path / "registry", grace_s=5) == [proc.pid]
    assert _is_gone(proc.pid) and _is_gone(grandchild)
    assert list((tmp_path / "registry").iterdir()) == []
    proc.terminate()  # reaps the zombie; must be safe after someone else killed it


def test_reap_strays_spares_a_reused_pid(tmp_path: Path) -> None:
    with EngineProcess.start([sys.executable, "-c", "import time; time.sleep(60)"], {},
                             tmp_path / "engine.log", tmp_path / "registry") as proc:
        record = json.loads(proc.record_path.read_text())
        record["create_time"] -= 1000.0  # as if the recorded engine died and the pid was reused
        proc.record_path.write_text(json.dumps(record))
        assert reap_strays(tmp_path / "registry") == []
        assert proc.is_alive(), "a process that merely has the recorded pid must not be killed"
        assert not proc.record_path.exists(), "every record is cleared"


def test_reap_strays_clears_dead_and_corrupt_records(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "1234567.json").write_text(json.dumps(
        {"pid": 4_000_000, "pgid": 4_000_000, "argv": ["x"], "create_time": 1.0}))
    (registry / "99.json").write_text("{not json")
    assert reap_strays(registry) == []
    assert list(registry.iterdir()) == []
    assert reap_strays(tmp_path / "absent") == []


def test_wait_healthy_reports_exit_at_once(tmp_path: Path) -> None:
    proc = EngineProcess.start([sys.executable, "-c", "raise SystemExit(1)"], {},
                               tmp_path / "engine.log", tmp_path / "registry")
    with proc:
        state = wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=30, poll_s=0.1)
    assert state == "exited", "a dead engine is not waited on until the timeout"


def test_wait_healthy_times_out_on_a_silent_live_process(tmp_path: Path) -> None:
    with EngineProcess.start([sys.executable, "-c", "import time; time.sleep(60)"], {},
                             tmp_path / "engine.log", tmp_path / "registry") as proc:
        started = time.monotonic()
        state = wait_healthy(f"http://127.0.0.1:{free_port()}", proc, timeout_s=0.6,
                             poll_s=0.1)
        elapsed = time.monotonic() - started
    assert state == "timeout"
    assert elapsed >= 0.6, "the whole timeout, however fast the host"


def test_wait_healthy_sees_a_ready_server(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "tests.runners.echo_engine", "--port", str(port)]
    with EngineProcess.start(argv, {"PYTHONPATH": str(REPO_ROOT)}, tmp_path / "engine.log",
                             tmp_path / "registry") as proc:
        state = wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=30, poll_s=0.1)
        assert state == "ready", tail(tmp_path / "engine.log")
        assert is_port_in_use(port)


def test_free_port_is_bindable_and_is_port_in_use_sees_a_listener() -> None:
    port = free_port()
    assert not is_port_in_use(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        assert is_port_in_use(port)


def test_tail_starts_at_a_line_boundary(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    text = tail(log, max_bytes=100)
    assert text.endswith("line 999\n")
    assert text.startswith("line "), "the cut line is dropped"
    assert len(text.encode()) <= 100
    assert tail(log, max_bytes=10**6) == log.read_text()
    assert tail(tmp_path / "missing.log") == ""


@pytest.mark.parametrize("argv", [[], ["/nonexistent/binary-for-test"]])
def test_start_refuses_what_cannot_run(tmp_path: Path, argv: list[str]) -> None:
    with pytest.raises((ValueError, OSError)):
        EngineProcess.start(argv, {}, tmp_path / "engine.log", tmp_path / "registry")
    assert not list((tmp_path / "registry").glob("*.json")), "no record without a process"
