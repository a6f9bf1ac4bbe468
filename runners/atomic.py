"""`write_atomic`: every file nightshift writes is written whole or not at all.

The bytes go to a temporary file in the same directory, are flushed to disk (fsync), and only
then replace the file by name (`os.replace`, atomic on POSIX). A crash (kill -9) or a full disk
mid-write leaves the previous file as it was, never a cut one. The file is private to the user
(0600, as `tempfile.mkstemp` makes it) unless `mode` says otherwise.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *,
                 mode: int = 0o600, encoding: str = "utf-8") -> None:
    """Write `data` to `path` whole or not at all; raises OSError (the file is then unchanged
    and no temporary file is left)."""
    path = Path(path)
    payload = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if mode != 0o600:
            tmp.chmod(mode)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and exc.filename is None:  # fsync's: say which file
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (best effort: not every file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
