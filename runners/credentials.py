"""Secrets in a launch: which names are secret, how they are kept out of what is written
(records, MLflow, exports, logs), and each engine's own API key.

A secret is passed to an engine through its environment, never its argv (any local user reads
argv with `ps -eww`). What is written keeps the variable's name and drops its value.
"""

from __future__ import annotations

import itertools
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

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
    return [v for k, v in env.items() if is_secret_name(k) and len(v) >= 4]


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
    return sorted((v for v in values if len(v) >= 4), key=lambda v: (-len(v), v))


def scrub(text: str, values: Iterable[str]) -> str:
    """`text` with each of `values` replaced by <redacted>."""
    for value in values:
        text = text.replace(value, REDACTED)
    return text


def scrub_file(path: Path, values: Sequence[str]) -> bool:
    """Rewrite the file at `path` (an engine's log) with each of `values` replaced by
    <redacted>, whole or not at all (runners/atomic.py); whether anything was replaced. A file
    that cannot be read is left as it is."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    secrets_ = [v.encode() for v in values]
    if not any(v in data for v in secrets_):
        return False
    for value in secrets_:
        data = data.replace(value, REDACTED.encode())
    write_atomic(path, data)
    return True


def new_api_key() -> str:
    """A random key for one engine's life, held only by the process that launched it."""
    return secrets.token_urlsafe(32)


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header an engine started with `api_key` asks for (vLLM's: a bearer token)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
