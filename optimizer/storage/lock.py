"""One daemon per Optuna study, wherever it is started: a file lock keyed by the storage and
the study name (`StudyLock`), and for a server RDB shared by several hosts a lease in the storage
(`StorageLease`); `status` and `stop` read who holds them."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optuna.storages import BaseStorage

from optimizer.config import StudyConfig
from optimizer.errors import StudyLockedError, translate

logger = logging.getLogger(__name__)

LOCK_DIR = Path.home() / ".cache" / "nightshift" / "locks"  # for storages not in a local file


def is_local_file_storage(url: str) -> bool:
    """Whether the storage is a SQLite file on this machine (its lock file sits beside it)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # SQLAlchemy's parse errors vary by version; the storage check reports
        return False
    database = parsed.database if parsed.get_backend_name() == "sqlite" else None
    return bool(database) and database != ":memory:" and not str(database).startswith("file:")


def study_lock_path(cfg: StudyConfig) -> Path:
    """The lock file of one Optuna study: keyed by the storage and the study name, not by the
    directory the daemon is started from (two daemons on one study fail each other's trials).
    A SQLite storage keeps it next to its database file; a server RDB (postgresql, mysql)
    under LOCK_DIR, named by a hash of the URL and the name: that covers daemons on this host,
    and a `StorageLease` those on others."""
    from sqlalchemy.engine import make_url

    name = cfg.name
    slug = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    if slug != name:  # two names that sanitise alike must not share a lock
        slug += "-" + hashlib.sha256(name.encode()).hexdigest()[:8]
    if is_local_file_storage(cfg.storage_url):
        db = Path(str(make_url(cfg.storage_url).database)).expanduser().resolve()
        return db.parent / f"{db.name}.{slug}.lock"
    digest = hashlib.sha256(f"{cfg.storage_url}\0{name}".encode()).hexdigest()[:16]
    return LOCK_DIR / f"{slug}-{digest}.lock"


class StudyLock:
    """An exclusive `flock` on the study's lock file (`study_lock_path`), holding the daemon's
    pid and host for `status` and `stop`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self, study: str, storage: str = "") -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            holder = read_lock(self.path) or {}
            raise translate(
                exc, f"study {study!r} is already run by pid {holder.get('pid', '?')} on "
                f"{holder.get('host', '?')} (started in {holder.get('cwd', '?')}, lock "
                f"{self.path}); `nightshift stop` it first or give this study another "
                "name or storage.", into=StudyLockedError) from exc
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.time(), "study": study,
                                 "storage": _without_password(storage),
                                 "cwd": os.getcwd()}).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


LEASE_ATTR = "nightshift.daemon"  # the study's system attribute naming the daemon that runs it
LEASE_TTL_S = 60.0  # a lease not renewed for this long is a dead daemon's
LEASE_SETTLE_S = 1.0  # after writing a lease, re-read it this much later: two starts race


class StorageLease:
    """The lock of a study in a server RDB (postgresql, mysql), shared by daemons on several
    hosts: a study system attribute naming the holder (host, pid, a random token) with a
    heartbeat a thread renews every LEASE_TTL_S / 4. A lease not renewed for LEASE_TTL_S is a
    dead daemon's and is taken over (hosts' clocks must agree within that). Two starts racing
    for a free lease both write and re-read it LEASE_SETTLE_S later: the last writer holds it,
    the other refuses."""

    def __init__(self, storage: BaseStorage, study_id: int, name: str) -> None:
        self.storage = storage
        self.study_id = study_id
        self.name = name
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.is_lost = False  # another daemon took the lease (this one stalled past the TTL)

    def _read(self) -> dict[str, Any]:
        lease = self.storage.get_study_system_attrs(self.study_id).get(LEASE_ATTR)
        return lease if isinstance(lease, dict) else {}

    def _write(self, lease: Mapping[str, Any]) -> None:
        self.storage.set_study_system_attr(self.study_id, LEASE_ATTR, dict(lease))

    def _refuse(self, holder: Mapping[str, Any]) -> StudyLockedError:
        return StudyLockedError(
            f"study {self.name!r} is already run by pid {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')} (its lease in the storage was renewed "
            f"{max(0.0, time.time() - float(holder.get('heartbeat', 0))):.0f} s ago); "
            "`nightshift stop` it first or give this study another name or storage.")

    def acquire(self) -> None:
        holder = self._read()
        if holder.get("token") and time.time() - float(holder.get("heartbeat", 0)) < LEASE_TTL_S:
            raise self._refuse(holder)
        mine = {"token": self.token, "pid": os.getpid(), "host": socket.gethostname(),
                "started": time.time(), "heartbeat": time.time()}
        self._write(mine)
        time.sleep(LEASE_SETTLE_S)
        holder = self._read()
        if holder.get("token") != self.token:
            raise self._refuse(holder)
        self._thread = threading.Thread(target=self._renew, args=(mine,), daemon=True,
                                        name="nightshift-lease")
        self._thread.start()

    def _renew(self, mine: dict[str, Any]) -> None:
        while not self._stop.wait(LEASE_TTL_S / 4):
            try:
                if self._read().get("token") != self.token:
                    self.is_lost = True
                    logger.error("another daemon took study %r's lease (this one was not "
                                 "heard from for %g s); stopping", self.name, LEASE_TTL_S)
                    return
                self._write({**mine, "heartbeat": time.time()})
            except Exception as exc:  # a storage hiccup: the next beat tries again
                logger.warning("could not renew the study's lease (%s: %s)",
                               type(exc).__name__, str(exc)[:200])

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            if self._read().get("token") == self.token:
                self._write({})
        except Exception as exc:  # the lease then runs out after LEASE_TTL_S
            logger.warning("could not release the study's lease (%s: %s)",
                           type(exc).__name__, str(exc)[:200])


def read_lease(storage: BaseStorage, study_id: int) -> dict[str, Any] | None:
    """The daemon holding a study's lease in the storage, or None when no live one does."""
    lease = storage.get_study_system_attrs(study_id).get(LEASE_ATTR)
    if not isinstance(lease, dict) or not lease.get("token") or \
            time.time() - float(lease.get("heartbeat", 0)) >= LEASE_TTL_S:
        return None
    return lease


def _without_password(url: str) -> str:
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy parses: keep nothing of it
        return ""


def read_lock(path: Path) -> dict[str, Any] | None:
    """The running daemon's record, or None when no daemon holds the lock."""
    if not path.is_file():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = path.read_text()
            try:
                data = json.loads(text) if text else {}
            except json.JSONDecodeError:
                data = {}
            return data if isinstance(data, dict) else {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
