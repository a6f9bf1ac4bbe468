"""An engine's log written through its pipe with real processes: no secret of the launch reaches
the disk while the engine runs or however it ends (its own exit, a crash, its teardown, the
launching process killed), the engine never waits on the pipe, and no thread is left."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from runners.credentials import API_KEY_ENV, launch_secrets, new_api_key
from runners.log_pump import LogPump
from runners.process import EngineProcess, reap_strays, tail

REPO_ROOT = Path(__file__).resolve().parents[2]

# An engine that prints its key: cut between two writes (each flushed, apart in time, so the
# pipe delivers them as two pieces), then whole, then "up", then ends as argv[1] says.
_ECHO = """
import os, sys, time
key = os.environ["VLLM_API_KEY"]
print("starting with key", key[:10], end="", flush=True)
time.sleep(0.2)
print(key[10:], "(split)", flush=True)
print("key", key, "again", flush=True)
print("up", flush=True)
how = sys.argv[1]
if how == "crash":
    raise RuntimeError("refused key " + key)
if how == "sigkill":
    print("dying with", key[:20], end="", flush=True)
    os.kill(os.getpid(), 9)
if how == "run":
    while True:
        print("still serving with", key, flush=True)
        time.sleep(0.05)
"""


def _pump_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("nightshift-log-pump")]


def _wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _start_echo(tmp_path: Path, how: str, key: str) -> EngineProcess:
    argv = [sys.executable, "-c", _ECHO, how]
    env = {API_KEY_ENV: key}
    return EngineProcess.start(argv, env, tmp_path / "server.log", tmp_path / "registry",
                               secrets=launch_secrets(argv, env))


@pytest.mark.parametrize("how", ["exit", "crash", "sigkill", "run"])
def test_an_engines_own_key_never_reaches_its_log_however_it_ends(tmp_path: Path,
                                                                   how: str) -> None:
    key = new_api_key()
    proc = _start_echo(tmp_path, how, key)
    log = tmp_path / "server.log"
    _wait_for(lambda: "up" in tail(log))
    while_running = log.read_bytes()  # what another reader of the file saw meanwhile
    if how != "run":
        proc.wait(timeout_s=20)
    proc.terminate(grace_s=5)
    text = log.read_text()
    assert key.encode() not in while_running, "not on disk while the engine ran"
    assert key not in text and key[:20] not in text and key[10:] not in text, text
    assert "starting with key <redacted> (split)\nkey <redacted> again\nup\n" in text, \
        "the key printed in two pieces is replaced whole, the lines around it kept"
    if how == "crash":
        assert "RuntimeError: refused key <redacted>" in text
    if how == "sigkill":
        assert text.endswith("up\ndying with <redacted>"), \
            "a key cut short by death is a start of the key: masked, not a secret's leftover"
    assert not _pump_threads(), "no log thread outlives the engine"


def test_sync_writes_what_the_pipe_holds_scrubbed_in_the_callers_thread(tmp_path: Path) -> None:
    # The pump's thread is not started: only `sync` can have written it.
    log = tmp_path / "server.log"
    pump = LogPump(log, ["s3cr3t-value"])
    try:
        os.write(pump.writer_fd, b"a s3cr3t-value b\nlast words s3cr")
        pump.sync()
        assert log.read_bytes() == b"a <redacted> b\nlast words ", \
            "what the engine wrote is on disk, less the start of a secret"
    finally:
        pump.close()
    assert log.read_bytes() == b"a <redacted> b\nlast words <redacted>", \
        "a secret's start of 4 characters at the end is masked"


# Much at once, then the line that says why, then an exit with no interpreter's wind-down.
_LAST_WORDS = "import os; os.write(1, b'x' * 900_000 + b'\\nlast words\\n'); os._exit(1)"


def test_a_log_read_as_soon_as_the_engine_has_exited_holds_its_last_line(tmp_path: Path) -> None:
    # A failure is classified from the log's tail right after the engine exits: the pipe must
    # not still hold the line that says why.
    for attempt in range(20):
        log = tmp_path / f"server{attempt}.log"
        proc = EngineProcess.start(
            [sys.executable, "-c", _LAST_WORDS],
            {}, log, tmp_path / "registry")
        assert proc.wait() == 1  # a blocking wait returns at the exit itself
        assert tail(log, 2000).endswith("last words\n"), attempt
        proc.terminate()


def test_an_engine_is_never_held_by_its_pipe_even_on_a_full_disk(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # /dev/full fails every write with ENOSPC: the pump drops what it cannot write, says so
    # once, and keeps draining, so the engine's 20 MB go out at its own pace.
    script = "import sys\nfor _ in range(20): sys.stdout.write('y' * 1_000_000 + '\\n')"
    with caplog.at_level(logging.WARNING, logger="runners.log_pump"):
        proc = EngineProcess.start([sys.executable, "-c", script], {}, Path("/dev/full"),
                                   tmp_path / "registry", secrets=["yyyy-not-there"])
        assert proc.wait(timeout_s=60) == 0, "the engine finished writing"
        proc.terminate()
    warnings = [r for r in caplog.records if "cannot write the engine's log" in r.message]
    assert len(warnings) == 1, caplog.text
    assert not _pump_threads()


def test_a_stray_holding_the_pipe_after_teardown_loses_it_and_leaves_no_thread(
        tmp_path: Path) -> None:
    # A grandchild that double-forked out of the engine's tree before the teardown (so neither
    # the group's signal nor the list of descendants reaches it) keeps the pipe open.
    pid_file = tmp_path / "stray.pid"
    script = textwrap.dedent(f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", '''
        import os, sys, time
        open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
        os.replace({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        while True:
            print("stray", flush=True)
            time.sleep(0.05)
        '''], start_new_session=True)
        time.sleep(120)
        """)
    # The middle process exits at once: its child is re-parented out of the tree.
    middle = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, "-c", {script!r}])
        """)
    proc = EngineProcess.start([sys.executable, "-c", middle], {}, tmp_path / "server.log",
                               tmp_path / "registry")
    _wait_for(pid_file.exists)
    stray = psutil.Process(int(pid_file.read_text()))
    try:
        _wait_for(lambda: "stray" in tail(tmp_path / "server.log"))
        started = time.monotonic()
        proc.terminate(grace_s=1)
        assert time.monotonic() - started < 10
        assert not _pump_threads(), "the pump stopped without the pipe's end"
        stray.wait(timeout=10)  # its next print meets a closed pipe: Python exits on EPIPE
    finally:
        if stray.is_running():
            stray.kill()


# A launching process (a runner) that starts an engine printing its key, says so, and waits to
# be killed; the engine goes on printing until it is reaped.
_RUNNER = """
import pathlib, sys
from runners.credentials import launch_secrets
from runners.process import EngineProcess
argv, env = [sys.executable, "-c", sys.argv[3], "run"], {"VLLM_API_KEY": sys.argv[4]}
proc = EngineProcess.start(argv, env, pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]),
                           secrets=launch_secrets(argv, env))
print(proc.pid, flush=True)
sys.stdin.read()
"""


def test_a_killed_runners_engine_never_writes_its_key_to_its_log(tmp_path: Path) -> None:
    # Issue 35: the daemon killed (kill -9) with its engine running; the next start reaps the
    # engine, and its log never held the key the dead runner alone knew.
    key = new_api_key()
    log, registry = tmp_path / "server.log", tmp_path / "registry"
    with subprocess.Popen(
            [sys.executable, "-c", _RUNNER, str(log), str(registry), _ECHO, key],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}) as runner:
        try:
            assert runner.stdout is not None
            engine = psutil.Process(int(runner.stdout.readline()))
            _wait_for(lambda: "still serving" in log.read_text())
            runner.send_signal(signal.SIGKILL)
            runner.wait(timeout=10)
            time.sleep(0.3)  # the engine prints on, into a pipe no one reads
        finally:
            runner.kill()
            reaped = reap_strays(registry)
    assert reaped in ([engine.pid], []), "the stray engine is reaped (or died of EPIPE)"
    assert not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE
    text = log.read_text()
    assert key not in text and "still serving with <redacted>" in text, text
