"""`write_atomic`: a file is written whole or not at all, whatever happens mid-write (a full
disk, kill -9), and is private to the user."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from runners.atomic import write_atomic

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "library.yaml"
    write_atomic(path, "cases: [good]\n")

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    # mock.patch as last resort: a real full disk cannot be made in a test's tmp_path.
    monkeypatch.setattr("runners.atomic.os.fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "cases: [good, new]\n" * 1000)
    assert path.read_text() == "cases: [good]\n", "the previous file is untouched"
    assert [p.name for p in tmp_path.iterdir()] == ["library.yaml"], "no temporary file left"


def test_kill_9_during_writes_leaves_one_whole_version(tmp_path: Path) -> None:
    path = tmp_path / "pareto.png"
    size = 4_000_000
    script = textwrap.dedent(f"""
        import sys
        from runners.atomic import write_atomic
        n = 0
        while True:
            write_atomic({str(path)!r}, bytes([65 + n % 2]) * {size})
            n += 1
            if n == 2:
                print("writing", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                            stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"writing\n"
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()
    data = path.read_bytes()
    assert len(data) == size and len(set(data)) == 1, "a whole version, never a cut one"


def test_a_written_file_is_private_unless_asked(tmp_path: Path) -> None:
    write_atomic(tmp_path / "report.html", "<html></html>")
    write_atomic(tmp_path / "serve.sh", "#!/bin/sh\n", mode=0o700)
    assert (tmp_path / "report.html").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "serve.sh").stat().st_mode & 0o777 == 0o700
