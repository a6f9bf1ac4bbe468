"""The compile ledger: one JSON line per engine start whose log said its torch.compile cache was
warm or cold, kept in the shared cache root (`<VLLM_CACHE_ROOT>/nightshift-compiled-keys.jsonl`),
so that every nightshift process on a host (a study's trials, `nightshift regress`) knows the keys
the others compiled there. Appended with one O_APPEND write a line, read incrementally; a
missing, unreadable or corrupt ledger is never fatal (docs/startup-cost.md).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from runners.base import EngineConfig, EngineInfo
from runners.vllm.compile_cache import compile_key

logger = logging.getLogger(__name__)

LEDGER_NAME = "nightshift-compiled-keys.jsonl"
_STATES = ("warm", "cold")  # a start that loaded or compiled: its artefact is on disk


def ledger_path(cache_root: Path | str) -> Path:
    return Path(cache_root) / LEDGER_NAME


@dataclass(frozen=True)
class LedgerEntry:
    """One start of an engine on a shared cache root, as its log told it."""

    compile_key: str  # nightshift's estimate (runners/vllm/compile_cache.py compile_key)
    vllm_key: str | None  # vLLM's own hash directory, from the log (EngineInfo.compile_cache_dir)
    vllm_version: str  # as the log printed it: the key holds under this version only
    engine: str  # the launcher's name ("vllm", "simulated"): a simulated start warms no vLLM
    compile_cache: str  # "warm" or "cold": what the log said the start did
    writer: str  # who started it: "study:<name>", "regress:<case>"
    written_unix_s: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)  # the process that wrote the line


def entry_of(config: EngineConfig, engine: EngineInfo, *, engine_name: str,
             writer: str) -> LedgerEntry | None:
    """The line a start adds, or None where it says nothing the ledger keeps: no warm or cold
    reading in the log, a config that compiles nothing or whose cache is off, no version."""
    key = compile_key(config)
    if key is None or not key.is_cached or engine.compile_cache not in _STATES or \
            not engine.engine_version:
        return None
    return LedgerEntry(compile_key=key.digest, vllm_key=engine.compile_cache_dir,
                       vllm_version=engine.engine_version, engine=engine_name,
                       compile_cache=str(engine.compile_cache), writer=writer)


def append_entry(cache_root: Path | str, entry: LedgerEntry) -> bool:
    """Append `entry` as one line with one write to a file opened O_APPEND (whole lines from
    concurrent writers do not interleave on a local file system). A last line left torn by a
    writer that died mid-write is ended first, so it spoils only itself. Never raises: a
    ledger that cannot be written costs later predictions, never this trial."""
    path = ledger_path(cache_root)
    line = json.dumps(asdict(entry), sort_keys=True).encode() + b"\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size > 0 and os.pread(fd, 1, size - 1) != b"\n":
                line = b"\n" + line
            written = os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("could not append to the compile ledger %s (%s); other processes will "
                       "predict this key cold", path, exc)
        return False
    if written != len(line):
        logger.warning("the compile ledger %s took %d of %d bytes (disk full?); the line is "
                       "torn and will be skipped", path, written, len(line))
        return False
    return True


class CompileLedger:
    """The keys a cache root's ledger says were compiled there under one vLLM version and
    engine. `compiled_keys` reads only what was appended since its last call (one `stat` when
    nothing was), so the search policy can ask before every launch. A missing ledger is an
    empty one; an unreadable one or a corrupt line is skipped with one warning per ledger."""

    def __init__(self, cache_root: Path | str, *, vllm_version: str, engine: str) -> None:
        self.path = ledger_path(cache_root)
        self.vllm_version = vllm_version
        self.engine = engine
        self.num_skipped_lines = 0  # corrupt lines, and torn ones once a later line ended them
        self._keys: set[str] = set()
        self._offset = 0  # bytes read up to the end of the last whole line
        self._file_id: tuple[int, int] | None = None
        self._is_warned = False

    def compiled_keys(self) -> frozenset[str]:
        try:
            with open(self.path, "rb") as handle:
                stat = os.fstat(handle.fileno())
                file_id = (stat.st_dev, stat.st_ino)
                if file_id != self._file_id or stat.st_size < self._offset:
                    # A new or truncated ledger: what the old one said no longer holds.
                    self._keys.clear()
                    self._offset = 0
                    self._file_id = file_id
                if stat.st_size > self._offset:
                    handle.seek(self._offset)
                    data = handle.read(stat.st_size - self._offset)
                    end = data.rfind(b"\n") + 1  # a line still being written waits
                    self._take(data[:end])
                    self._offset += end
        except FileNotFoundError:
            self._keys.clear()
            self._offset = 0
            self._file_id = None
        except OSError as exc:
            self._warn(f"could not read the compile ledger {self.path} ({exc}); keys other "
                       "processes compiled are predicted cold")
        return frozenset(self._keys)

    def _take(self, data: bytes) -> None:
        for raw in data.split(b"\n"):
            if not raw.strip():
                continue
            entry = _parse(raw)
            if entry is None:
                self.num_skipped_lines += 1
                self._warn(f"skipped a corrupt line of the compile ledger {self.path} "
                           f"({raw[:80]!r}); its key, if any, is predicted cold")
                continue
            if entry["vllm_version"] == self.vllm_version and entry["engine"] == self.engine:
                self._keys.add(entry["compile_key"])

    def _warn(self, message: str) -> None:
        if not self._is_warned:
            self._is_warned = True
            logger.warning("%s", message)


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        entry = json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError both
        return None
    if not isinstance(entry, dict) or entry.get("compile_cache") not in _STATES or \
            not all(isinstance(entry.get(k), str) and entry[k]
                    for k in ("compile_key", "vllm_version", "engine")):
        return None
    return entry


__all__ = ["LEDGER_NAME", "CompileLedger", "LedgerEntry", "append_entry", "entry_of",
           "ledger_path"]
