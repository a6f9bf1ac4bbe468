"""A chrome trace read one event at a time (`iter_events`, `iter_gpu_events`): the text is
decoded chunk by chunk and forgotten once consumed, gzipped or not."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import IO, Any, Final

GPU_EVENT_CATEGORIES: Final = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})

_CHUNK_CHARS: Final = 1 << 18  # text read per refill: the parser's working set
_MAX_EVENT_CHARS: Final = 64 << 20  # one event larger than this means a corrupt file
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_SEPARATOR = re.compile(r"[ \t\n\r]*,?[ \t\n\r]*")


class _Reader:
    """A text buffer over a file that grows on demand and forgets what was consumed."""

    def __init__(self, handle: IO[str], chunk_chars: int) -> None:
        self.handle = handle
        self.chunk_chars = chunk_chars
        self.buf = ""
        self.pos = 0
        self.eof = False

    def fill(self) -> bool:
        """Read one more chunk; False at end of file."""
        if self.eof:
            return False
        try:
            chunk = self.handle.read(self.chunk_chars)
        except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as exc:
            # A profiler killed mid-write leaves a cut gzip stream: a bad trace, not an I/O fault.
            raise ValueError(f"the trace is truncated or not gzip/UTF-8 text ({exc}).") from exc
        if not chunk:
            self.eof = True
            return False
        # Drop the consumed head so the buffer stays about one chunk long.
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0
        return True

    def skip(self, pattern: re.Pattern[str]) -> None:
        while True:
            match = pattern.match(self.buf, self.pos)
            end = match.end() if match else self.pos
            self.pos = end
            if end < len(self.buf) or not self.fill():
                return

    def peek(self) -> str:
        if self.pos >= len(self.buf) or self.buf[self.pos] in " \t\n\r":
            self.skip(_WHITESPACE)
        return self.buf[self.pos] if self.pos < len(self.buf) else ""

    def expect(self, char: str, what: str) -> None:
        got = self.peek()
        if got != char:
            raise ValueError(f"expected {char!r} {what} but got {got or 'end of file'!r}.")
        self.pos += 1

    def value(self, decoder: json.JSONDecoder) -> Any:
        """Decode one JSON value at the cursor, reading more until it is complete."""
        if self.pos >= len(self.buf) or self.buf[self.pos] in " \t\n\r":
            self.skip(_WHITESPACE)
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.buf) - self.pos > _MAX_EVENT_CHARS or not self.fill():
                    raise ValueError(f"malformed JSON near character {exc.pos}: {exc.msg}.") \
                        from exc
                continue
            # A number cut at the chunk's end decodes too: make sure something follows it.
            if end >= len(self.buf) and self.fill():
                continue
            self.pos = end
            return value


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open("r", encoding="utf-8")


def iter_events(path: Path, *, chunk_chars: int = _CHUNK_CHARS) -> Iterator[dict[str, Any]]:
    """Every event of a chrome trace, in file order, one decoded object at a time.

    Reads both forms of the format: an object with a `traceEvents` array (what torch writes)
    and a bare array. Raises ValueError for a file that is not such a trace.
    """
    decoder = json.JSONDecoder()
    with _open_text(path) as handle:
        reader = _Reader(handle, chunk_chars)
        first = reader.peek()
        if first == "[":
            yield from _iter_array(reader, decoder)
            return
        reader.expect("{", f"at the start of {path.name} (a chrome trace)")
        while reader.peek() not in ("}", ""):
            key = reader.value(decoder)
            reader.expect(":", f"after key {key!r}")
            if key == "traceEvents":
                yield from _iter_array(reader, decoder)
            else:
                reader.value(decoder)  # metadata (deviceProperties, ...): small, skipped
            reader.skip(_SEPARATOR)


def _iter_array(reader: _Reader, decoder: json.JSONDecoder) -> Iterator[dict[str, Any]]:
    reader.expect("[", "to open traceEvents")
    while True:
        next_char = reader.peek()
        if next_char == "]":
            reader.pos += 1
            return
        if not next_char:
            raise ValueError("the traceEvents array is not closed (truncated file?).")
        event = reader.value(decoder)
        if isinstance(event, dict):
            yield event
        reader.skip(_SEPARATOR)


def iter_gpu_events(path: Path) -> Generator[dict[str, Any], None, None]:
    """The complete (`ph == "X"`) kernel, memcpy and memset events of a trace."""
    for event in iter_events(path):
        if event.get("ph") == "X" and event.get("cat") in GPU_EVENT_CATEGORIES:
            yield event
