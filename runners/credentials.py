"""Secrets in a launch: which names are secret, how they are kept out of what is written
(records, MLflow, exports, logs), and each engine's own API key.

A secret is passed to an engine through its environment, never its argv (any local user reads
argv with `ps -eww`). What is written keeps the variable's name and drops its value. What an
engine prints is scrubbed of its launch's secret values (`StreamScrubber`) before it reaches the
disk (runners/log_pump.py).
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import AnyStr

from runners.atomic import write_atomic

# vLLM reads its API key from this variable as from `--api-key` (vllm/envs.py: VLLM_API_KEY;
# entrypoints/openai/api_server.py: `args.api_key or envs.VLLM_API_KEY`).
API_KEY_ENV = "VLLM_API_KEY"

# A variable is secret by a word of its name (HF_TOKEN, OPENAI_API_KEY, AWS_SECRET_ACCESS_KEY,
# DB_PASSWORD), never by a part of a word: VLLM_..._TOKENS and TOKENIZERS_PARALLELISM are knobs.
_SECRET_NAME = re.compile(r"(?:^|_)(?:TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIALS?)(?:_|$)",
                          re.IGNORECASE)

# vLLM serve's flags whose value is a secret (the bundled 0.26 table: hf-token, api-key), and
# the variable vLLM reads the same secret from instead (huggingface_hub reads HF_TOKEN).
SECRET_FLAGS: Mapping[str, str] = {"--hf-token": "HF_TOKEN", "--api-key": API_KEY_ENV}

REDACTED = "<redacted>"

# Shorter values are not scrubbed: a secret of 1-3 characters would mask every such string in a
# log ("1" every digit 1: HF_HUB_DISABLE_IMPLICIT_TOKEN=1 is a switch whose name says TOKEN),
# cutting the figures the log's parsers read, while hiding little (3 bytes are at most 2**24
# guesses).
MIN_SECRET_CHARS = 4


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's (or flag's) name says it holds a secret."""
    return _SECRET_NAME.search(name) is not None


def is_secret_flag(token: str) -> bool:
    """Whether an argv token is one of vLLM's secret flags (`--hf-token` or `--hf-token=x`)."""
    return token.partition("=")[0] in SECRET_FLAGS


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with each secret's value replaced by a reference to the variable (`${HF_TOKEN}`):
    what a record or an export may hold."""
    return {k: f"${{{k}}}" if is_secret_name(k) else v for k, v in env.items()}


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with the value of each secret flag replaced (`--hf-token <redacted>`)."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif is_secret_flag(token):
            flag, eq, _ = token.partition("=")
            out.append(f"{flag}={REDACTED}" if eq else token)
            hide_next = not eq
        else:
            out.append(token)
    return out


def secret_values(env: Mapping[str, str]) -> list[str]:
    """The values of the secrets in `env`, for scrubbing text (a log line) that may echo them."""
    return [v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_SECRET_CHARS]


def launch_secrets(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """The secret values a launch holds, for scrubbing what its engine prints: those of the
    variables whose names say secret (the engine's whole environment: the caller's, the study
    file's, its API key) and of vLLM's secret flags in `argv`; longest first, so that a secret
    holding another is replaced whole."""
    values = set(secret_values(env))
    for token, after in itertools.pairwise([*argv, ""]):
        flag, eq, value = token.partition("=")
        if flag in SECRET_FLAGS:
            values.add(value if eq else after)
    return sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=lambda v: (-len(v), v))


def scrub(text: str, values: Iterable[str]) -> str:
    """`text` with every occurrence of each of `values` replaced by <redacted>: one marker for
    each run of occurrences that overlap (a secret holding another is replaced whole). An end
    that is a secret's start of `MIN_SECRET_CHARS` or more, cut short (an engine killed while
    printing it), is replaced too."""
    return _redacted(text, [v for v in values if v], REDACTED)[0]


def scrub_file(path: Path, values: Sequence[str]) -> bool:
    """Rewrite the file at `path` (a log) as `scrub` would, whole or not at all
    (runners/atomic.py); whether anything was replaced. A file that cannot be read is left as
    it is."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    secrets_ = [v.encode() for v in values if v]
    if not any(v in data for v in secrets_):
        return False
    write_atomic(path, _redacted(data, secrets_, REDACTED.encode())[0])
    return True


class StreamScrubber:
    """`scrub` for text that arrives in pieces (an engine's output read from a pipe): what
    `feed` returns for each piece, then `flush` at the end, joined, is `scrub` of the whole,
    wherever the pieces were cut. A piece's end that may be the start of a secret (`hf_ab` of
    `hf_abc123`) is held back until what follows decides it: fewer bytes than the longest
    secret, and only ever such a start."""

    def __init__(self, values: Iterable[str]) -> None:
        self._values = sorted({v.encode() for v in values if v}, key=len, reverse=True)
        self._held = b""
        # How many leading bytes of `_held` continue an occurrence whose marker already went
        # out (it overlapped the cut): masked with no second marker.
        self._masked = 0

    def feed(self, data: bytes) -> bytes:
        """The scrubbed bytes of `data` (and of what was held) that are decided."""
        text = self._held + data
        cut = _cut_short_from(text, self._values)
        out, self._masked = _redacted(text, self._values, REDACTED.encode(), cut=cut,
                                      masked=self._masked)
        self._held = text[cut:]
        return out

    def flush(self) -> bytes:
        """What is held, scrubbed: the stream has ended."""
        out, _ = _redacted(self._held, self._values, REDACTED.encode(), masked=self._masked)
        self._held, self._masked = b"", 0
        return out


def _cut_short_from(text: AnyStr, values: Sequence[AnyStr]) -> int:
    """The first position whose rest of `text` is a secret's start cut short (in a stream, an
    occurrence may begin there and end in the next piece); len(text) if none."""
    longest = max(map(len, values), default=0)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        rest = text[start:]
        if any(len(v) > len(rest) and v.startswith(rest) for v in values):
            return start
    return len(text)


def _redacted(text: AnyStr, values: Sequence[AnyStr], marker: AnyStr, *, cut: int | None = None,
              masked: int = 0) -> tuple[AnyStr, int]:
    """`text[:cut]` with each run of overlapping occurrences of `values` replaced by `marker`,
    and how many characters past `cut` the last run that began before it reaches (masked in
    the next piece). The first `masked` characters continue a run already marked: masked with
    no marker of their own. Without `cut`, `text` ends there: a secret's start cut short by
    the end is an occurrence where it is `MIN_SECRET_CHARS` long or more."""
    end = len(text) if cut is None else cut
    spans = [(0, masked)] if masked else []
    if cut is None and len(text) - (short := _cut_short_from(text, values)) >= MIN_SECRET_CHARS:
        spans.append((short, len(text)))
    for value in values:
        start = text.find(value)
        while start != -1:
            spans.append((start, start + len(value)))
            start = text.find(value, start + 1)
    runs: list[list[int]] = []
    for start, stop in sorted(spans):
        if start >= end:
            break  # begins in what is held: decided with the next piece
        if runs and start < runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    pieces: list[AnyStr] = []
    pos = 0
    for start, stop in runs:
        pieces.append(text[pos:start])
        if not (start == 0 and masked):
            pieces.append(marker)
        pos = min(stop, end)
    pieces.append(text[pos:end])
    # A run still open at the cut; or, where nothing was decided (cut 0), the continuation.
    beyond = max(0, masked - end, runs[-1][1] - end if runs else 0)
    return marker[:0].join(pieces), beyond


def new_api_key() -> str:
    """A random key for one engine's life, held only by the process that launched it."""
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header an engine started with `api_key` asks for (vLLM's: a bearer token)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
