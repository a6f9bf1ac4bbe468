"""`LogPump`: an engine's stdout and stderr, through one pipe, scrubbed of its launch's secrets
(runners/credentials.py `StreamScrubber`) as they are written to its log. No secret the launch
knows reaches the disk: not while the engine runs, not when it crashes, not after the process
that launched it is killed (the engine's next write then fails with EPIPE; nothing lands).

A thread of the launching process drains the pipe as the engine writes, a piece at a time:
the engine waits only where it prints more than the pipe holds (1 MiB where Linux allows it)
before the thread gets to run (docs/reliability.md gives the measured cost). The thread ends
when every writer has closed the pipe, or at `close` (a writer that outlived its engine's
teardown gets EPIPE from then on). `sync` lets a reader see everything the engine wrote up to
the call.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import selectors
import threading
from collections.abc import Sequence
from pathlib import Path

from runners.credentials import StreamScrubber

logger = logging.getLogger(__name__)

_PIPE_BYTES = 1 << 20  # asked of the kernel (Linux's default 64 KiB fills in ms under load)
_DEFAULT_PIPE_BYTES = 1 << 16  # what Linux gives a pipe where it refuses the larger size
_PIECE_BYTES = 1 << 16  # one read, scrub and write
_CLOSE_WAIT_S = 1.0  # for the pipe's end after teardown, before the pump stops without it

# The pumps writing a log now, by its absolute path: `sync_log` finds them there.
_LIVE: dict[Path, LogPump] = {}
_LIVE_LOCK = threading.Lock()


class LogPump:
    """The pipe an engine writes to and the thread that writes it, scrubbed, to `log_path`
    (opened for appending). Use: `pump = LogPump(path, secrets)`; pass `pump.writer_fd` as the
    child's stdout and stderr; `pump.start()` once the child is launched (or `close()` if the
    launch failed); `close()` once the engine's process tree is gone."""

    def __init__(self, log_path: Path, secrets: Sequence[str]) -> None:
        self.log_path = log_path.absolute()
        # Pipes are not inherited (O_CLOEXEC): the child gets only its stdout's and stderr's dup.
        self._read_fd, self.writer_fd = os.pipe()
        self._wake_read, self._wake_write = os.pipe()
        try:
            self._file = log_path.open("ab", buffering=0)
        except OSError:
            for fd in (self._read_fd, self.writer_fd, self._wake_read, self._wake_write):
                _close_fd(fd)
            raise
        self._pipe_bytes = _enlarge(self._read_fd)
        os.set_blocking(self._read_fd, False)
        self._scrubber = StreamScrubber(secrets)
        # Held for each piece from its read to its write, and while the pump winds up: a
        # `sync` that takes it sees every earlier piece on disk.
        self._lock = threading.Lock()
        self._is_drained = False  # the read end is closed: nothing more will come
        self._has_write_failed = False
        self._is_closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"nightshift-log-pump-{self.log_path.name}")

    def start(self) -> None:
        """Start writing: the child holds its copy of the pipe, ours is closed so that the
        pipe ends when the child's tree has gone."""
        _close_fd(self.writer_fd)
        with _LIVE_LOCK:
            _LIVE[self.log_path] = self
        self._thread.start()

    def sync(self) -> None:
        """Write, in the caller's thread, what the pipe holds now: every byte the engine wrote
        before the call is on disk when this returns (less a cut-short secret's start, held
        until what follows decides it). Bounded: reads at most what the pipe can hold."""
        self._drain(limit_bytes=self._pipe_bytes)

    def close(self, wait_s: float = _CLOSE_WAIT_S) -> None:
        """Write what is left and stop, the thread ended when this returns. Call it once the
        engine's process tree is gone: waits up to `wait_s` for the pipe to end; a process
        outside the tree that still holds it loses it (logged). Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._thread.is_alive():
            self._thread.join(wait_s)
            if self._thread.is_alive():
                logger.warning("a process outside the engine's tree still holds its output "
                               "(log %s); its later output is not logged", self.log_path)
                os.write(self._wake_write, b"x")
                self._thread.join()
        elif not self._is_drained:  # never started: the launch failed
            _close_fd(self.writer_fd)
            self._wind_up()
        with _LIVE_LOCK:
            if _LIVE.get(self.log_path) is self:
                del _LIVE[self.log_path]
        for fd in (self._wake_read, self._wake_write):
            _close_fd(fd)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self._read_fd, selectors.EVENT_READ)
                selector.register(self._wake_read, selectors.EVENT_READ)
                while True:
                    ready = {key.fd for key, _ in selector.select()}
                    # Bounded, so that a writer faster than the disk cannot keep the pump
                    # from seeing `close`'s wake-up.
                    if not self._drain(limit_bytes=self._pipe_bytes) or self._wake_read in ready:
                        return
        except Exception:
            # Fail closed: never write unscrubbed, never leave the engine on a full pipe.
            logger.exception("the log pump of %s failed; the engine's later output is not "
                             "logged", self.log_path)
        finally:
            self._wind_up()

    def _drain(self, limit_bytes: int) -> bool:
        """Read, scrub and write pieces until the pipe is empty (True) or has ended (False),
        or `limit_bytes` were read (True)."""
        num_read = 0
        while num_read < limit_bytes:
            with self._lock:
                if self._is_drained:
                    return False
                try:
                    data = os.read(self._read_fd, _PIECE_BYTES)
                except BlockingIOError:
                    return True
                if not data:
                    return False
                num_read += len(data)
                self._write(self._scrubber.feed(data))
        return True

    def _wind_up(self) -> None:
        """Close the read end (a writer still alive gets EPIPE, never a full pipe), write what
        the scrubber held, close the log."""
        with self._lock:
            if self._is_drained:
                return
            self._is_drained = True
            _close_fd(self._read_fd)
            try:
                self._write(self._scrubber.flush())
            finally:
                self._file.close()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                num_written = self._file.write(view)
                if not num_written:
                    break
                view = view[num_written:]
        except OSError as exc:
            # A full disk: the engine goes on; what it prints meanwhile is lost, said once.
            if not self._has_write_failed:
                logger.warning("cannot write the engine's log %s (%s); its output is dropped "
                               "while this lasts", self.log_path, exc)
            self._has_write_failed = True


def sync_log(path: Path) -> None:
    """Bring the log at `path` up to date with what its engine wrote, where a pump writes it
    now; nothing otherwise."""
    with _LIVE_LOCK:
        pump = _LIVE.get(path.absolute())
    if pump is not None:
        pump.sync()


def _enlarge(fd: int) -> int:
    """Ask for a larger pipe (Linux `F_SETPIPE_SZ`); the size it has."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        return _DEFAULT_PIPE_BYTES
    try:
        size: int = fcntl.fcntl(fd, set_size, _PIPE_BYTES)
    except OSError:  # above /proc/sys/fs/pipe-max-size for this user
        return _DEFAULT_PIPE_BYTES
    return size


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
