"""What every section of the study file's schema builds on: the strict base model, the path
field, the registry check of a plug-in name, and the bounds a study may ask for."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")  # a study's name: a directory name

# Bounds on what a study may ask for, so that a typo (10**9 requests) is refused up front rather
# than exhausting memory hours later. Each is far beyond any real benchmark.
MAX_TOKENS = 10_000_000  # one prompt or output: longer than any model's context today
MAX_REQUESTS = 100_000  # per load level (and warm-up)
# The load generator holds a level's prompts in memory as token ids, about 36 bytes a token in
# Python: 2*10^7 tokens is ~0.7 GB.
MAX_PROMPT_TOKENS_PER_LEVEL = 20_000_000
MAX_CONCURRENCY = 100_000
MAX_RATE_RPS = 1_000_000.0
MAX_SECONDS = 86_400.0  # a timeout or a level's duration: one day
MAX_SEED = 2**32 - 1  # numpy's seeds (Optuna's samplers, the load generator)
# The study file itself: a study is a page of YAML, never megabytes.
MAX_FILE_BYTES = 1_000_000
MAX_PROMPTS_FILE_BYTES = 1 << 30
MAX_TRACE_FILE_BYTES = 1 << 30
# Gamma shape: 1000 gives gaps within ~3% of 1/rate, as regular as a benchmark needs.
MAX_BURSTINESS = 1000.0
MAX_SHARED_PREFIXES = 1024


def _nonempty_path(value: Any) -> Any:
    if isinstance(value, str) and not value.strip():
        # pydantic would take "" as Path("."): the study file's own directory.
        raise ValueError("expected a path (or leave the key out)")
    return value


# A file or directory the study names, resolved against the study file's directory.
FilePath = Annotated[Path, Field(strict=False), BeforeValidator(_nonempty_path)]


def registered(field: str, name: object, registry: Mapping[str, object],
               also: tuple[str, ...] = ()) -> str:
    """`name` when it is a key of the plug-in `registry` (or one of `also`); else a ValueError
    that names the field, lists the valid names and shows what was given."""
    valid = [*registry, *also]
    if not isinstance(name, str) or name not in valid:
        raise ValueError(f"{field}: expected one of {', '.join(map(repr, valid))} but got "
                         f"{name!r:.60}")
    return name



class StrictSpec(BaseModel):
    """A section of the study file."""

    # strict: no `true` for an int, no "5" for a number; allow_inf_nan: no .inf or .nan.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)



def yaml_off(value: Any) -> Any:
    """YAML 1.1 reads a bare `off` as false: the word meant."""
    return "off" if value is False else value
