"""The lock a process holds while it creates or opens a SQLite store (Optuna's or MLflow's), or
reads what its file is: an exclusive `flock` on the store's folder. Optuna, MLflow and SQLite
create a store unguarded: a second process opening it meanwhile finds an empty file, or collides
on alembic's schema-version stamp or a table. Standard library only, so every opener and reader
of a store's file (the study store, the tracking store, the checks before a start) can take it."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_held = threading.local()  # the folders this thread holds: the lock is re-entrant in a thread


@contextlib.contextmanager
def creating_store(url: str) -> Iterator[bool]:
    """Held while a process opens the SQLite store at `url`, creating it where it is new, or
    looks at what its file is (`existing_storage`, `sqlite_file_problem`). Yields whether the
    folder exists (where it does not, no store is being created there); where it cannot be locked
    (unreadable, or a file system without `flock`) nothing is held. Re-entrant within a thread
    (a second `flock` through another descriptor would wait on the first forever)."""
    if not url.startswith("sqlite:///"):
        yield True
        return
    folder = os.path.abspath(Path(url.removeprefix("sqlite:///")).parent)
    held: set[str] = _held.__dict__.setdefault("folders", set())
    if folder in held:
        yield True
        return
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        yield False
        return
    except OSError:
        yield True
        return
    held.add(folder)
    try:
        with contextlib.suppress(OSError):  # a file system without flock (NFS): unguarded
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        held.discard(folder)
        os.close(fd)  # closing drops the lock
