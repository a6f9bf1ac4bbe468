"""The table of what `vllm serve` accepts, one per vLLM release: each flag's type, choices, bounds,
default and `--no-` form, as the release's `EngineArgs` and config classes declare them.

One table per release is bundled as `search_spaces/engine/flags_<minor>.json` (0.26 to 0.34; a
patch release that changes no flag shares its minor's table, listed in its `releases`), each read
from that release's wheel by `scripts/vllm_flag_table.py` (never edited by hand). `bundled_flags`
picks a release's table (`DEFAULT_VERSION` when none is named); `runners.vllm.flags` adds the
installed vLLM's own parser for a release no table is bundled for. A study's `fixed_flags` and
`vllm.extra_args`, `nightshift audit`, `regress`, the search spaces (their defaults and value
sets) and the rendered commands (`search_spaces.engine.render`) all read it.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Literal

FlagKind = Literal["bool", "int", "float", "str", "choice", "json", "list", "any"]
# The version assumed where vLLM is not installed and none is declared: the release nightshift's
# rules, knobs and simulated engine were checked against (docs/knobs.md, docs/h200-study.md).
DEFAULT_VERSION = "0.26.0"
_HUMAN_INT = re.compile(r"^\d+(\.\d+)?[kKmMgGtT]?$")


@dataclass(frozen=True)
class FlagType:
    """What one flag takes, as vLLM's parser would check it."""

    kind: FlagKind
    choices: tuple[str, ...] = ()  # for "choice", as written on a command line
    ge: float | None = None  # inclusive lower bound, where vLLM's config states one
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    is_human_readable: bool = False  # an int that vLLM also takes as "8k", "1G" (or "auto")
    # A boolean whose False differs from leaving it out (its default is on or "auto"): False is
    # spelled `--no-<flag>`. Any other boolean False is left out (a store_true flag has no
    # `--no-` form, and argparse would exit 2).
    is_negatable: bool = False
    # For a "str" flag that also names the release's own values (`--quantization`: its
    # `QuantizationMethods`): those values; a plugin may register others, so not checked.
    known_values: tuple[str, ...] = ()


@dataclass(frozen=True)
class VllmFlags:
    """Every `vllm serve` flag of one vLLM version: type, negation, default, aliases, and the
    environment variables that version reads."""

    version: str
    source: str  # for messages: "vLLM 0.26.0's flags (bundled table)"
    types: Mapping[str, FlagType]  # kebab-case name -> type
    aliases: Mapping[str, str] = field(default_factory=dict)  # -tp -> tensor-parallel-size
    env_vars: frozenset[str] = frozenset()  # the environment variables this version reads
    # vLLM's value for a flag not given, by kebab-case name (a nested setting dotted:
    # `compilation-config.cudagraph_mode`); None: decided at start-up. Only flags listed here
    # have a known default.
    defaults: Mapping[str, object] = field(default_factory=dict)
    releases: tuple[str, ...] = ()  # the releases this table holds for (a minor's patches)
    # flag -> the config field its default names (`SchedulerConfig.max_num_seqs`): a flag
    # removed where one naming the same field appears was renamed.
    config_fields: Mapping[str, str] = field(default_factory=dict)
    # Variables the release names as removed and refuses at start (0.34's
    # `removed_environment_variables`): name -> vLLM's hint.
    removed_env: Mapping[str, str] = field(default_factory=dict)
    # Renames this table declares itself (old -> new, kebab-case): a simulated variant's.
    renamed: Mapping[str, str] = field(default_factory=dict)

    def engine_facts(self) -> dict[str, Any]:
        """This release as the plain data a search space resolves against (`context["engine"]`,
        which may also come from an installed parser no table is bundled for): its version,
        flags, defaults and the value sets of its choice flags (and the release's own values of
        a flag such as --quantization, which a plugin may extend: a space searches only the
        release's)."""
        return {"vllm_version": self.version, "flags": sorted(self.types),
                "defaults": dict(self.defaults),
                "choices": {k: list(t.choices or t.known_values) for k, t in self.types.items()
                            if t.choices or t.known_values}}

    @property
    def names(self) -> frozenset[str]:
        """Every long flag, kebab-case."""
        return frozenset(self.types)

    @property
    def bool_flags(self) -> frozenset[str]:
        return frozenset(k for k, t in self.types.items() if t.kind == "bool")

    def is_negatable(self, key: str) -> bool:
        """`key` (snake_case or kebab-case) is a boolean whose False is `--no-<flag>`."""
        flag = self.types.get(flag_name(key).partition(".")[0])
        return flag is not None and flag.is_negatable

    def default(self, key: str) -> object:
        """vLLM's value for the flag `key` (snake_case or kebab-case, nested dotted) left unset;
        KeyError where the table does not know it."""
        return self.defaults[flag_name(key)]

    def resolve(self, name: str) -> str | None:
        """The kebab-case flag `name` means (snake_case, kebab-case or a short alias), or None."""
        kebab = self.aliases.get(name) or name.replace("_", "-")
        return kebab if kebab in self.types else None

    def closest(self, name: str) -> str | None:
        close = difflib.get_close_matches(name.replace("_", "-"), list(self.types), n=1)
        return close[0] if close else None


class UnknownVersionError(ValueError):
    """A vLLM version no bundled table holds and that is not installed here."""


def version_key(version: str) -> tuple[int, ...]:
    """`0.27.1+cu129` -> (0, 27, 1): releases in order (a local tag and a pre-release suffix
    are ignored)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) if not piece.isdigit() else piece
        if not digits:
            break
        parts.append(int(digits))
        if digits != piece:
            break
    return tuple(parts)


@functools.cache
def bundled_tables() -> tuple[VllmFlags, ...]:
    """Every bundled table, oldest release first."""
    tables = [flags_from_data(json.loads(entry.read_text()))
              for entry in resources.files("search_spaces.engine").iterdir()
              if entry.name.startswith("flags_") and entry.name.endswith(".json")]
    return tuple(sorted(tables, key=lambda t: version_key(t.version)))


def bundled_versions() -> tuple[str, ...]:
    """Every release a bundled table holds for, oldest first."""
    return tuple(sorted({r for t in bundled_tables() for r in t.releases}, key=version_key))


def has_table(version: str) -> bool:
    """Whether a bundled table holds for `version` (a local tag such as `+cu129` aside)."""
    return bundled_for(version) is not None


def bundled_for(version: str) -> VllmFlags | None:
    """The bundled table that holds for `version`, or None."""
    key = version_key(version)
    return next((t for t in bundled_tables() if any(version_key(r) == key for r in t.releases)),
                None)


def bundled_flags(version: str | None = None) -> VllmFlags:
    """The bundled table of `version` (`DEFAULT_VERSION` when None); `UnknownVersionError`
    where none is bundled for it."""
    table = bundled_for(version or DEFAULT_VERSION)
    if table is None:
        raise UnknownVersionError(
            f"vLLM {version}: no flag table is bundled for it (bundled: "
            f"{', '.join(bundled_versions())}); install that vLLM here or give one of those")
    return table


def flags_from_data(data: Mapping[str, Any]) -> VllmFlags:
    """A table from the bundled JSON's shape: `flags` (name -> "bool" or "value"), `types`,
    `aliases`, `env_vars`, `negatable`, `defaults`, `releases` and `config_fields`; a new flag
    is one entry in `flags` (and `types` for a value type other than "any")."""
    negatable = set(data.get("negatable", ()))
    defaults: dict[str, Any] = dict(data.get("defaults", {}))
    types: dict[str, FlagType] = {}
    for name, kind in data["flags"].items():
        entry = data.get("types", {}).get(name) or {"type": "bool" if kind == "bool" else "any"}
        types[name] = FlagType(kind=entry["type"],
                               choices=tuple(str(c) for c in entry.get("choices", ())),
                               ge=entry.get("ge"), gt=entry.get("gt"), le=entry.get("le"),
                               lt=entry.get("lt"),
                               is_human_readable=bool(entry.get("human_readable")),
                               is_negatable=name in negatable,
                               known_values=tuple(str(c) for c in entry.get("known_values", ())))
    unknown = {n for n in (negatable | set(defaults)) if n.partition(".")[0] not in types}
    if unknown:  # a typo in the table itself: caught by the tests that load it
        raise ValueError(f"flag table: defaults/negatable name unknown flags {sorted(unknown)}")
    releases = tuple(data.get("releases") or (data["vllm_version"],))
    shown = releases[0] if len(releases) == 1 else f"{releases[0]}-{releases[-1]}"
    return VllmFlags(version=data["vllm_version"],
                     source=f"vLLM {shown}'s flags (bundled table)",
                     types=types, aliases=data.get("aliases", {}),
                     env_vars=frozenset(data.get("env_vars", ())), defaults=defaults,
                     releases=releases, config_fields=data.get("config_fields", {}),
                     removed_env=data.get("removed_env_vars", {}))


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def value_problem(flag: FlagType, value: object) -> str | None:
    """Why vLLM would refuse `value` for a flag of this type, or None. None (no flag) always
    passes; so does anything for a flag whose type the table does not know."""
    if value is None or flag.kind == "any":
        return None
    if flag.kind == "bool":
        return None if isinstance(value, bool) else f"must be true or false but got {_show(value)}"
    if isinstance(value, bool):
        return f"takes a value, not {_show(value)}"
    if flag.kind == "int":
        if isinstance(value, str) and flag.is_human_readable and (
                _HUMAN_INT.match(value) or value == "auto"):
            return None
        if not isinstance(value, int):
            spelled = " (or a size such as 8k)" if flag.is_human_readable else ""
            return f"must be an integer{spelled} but got {_show(value)}"
        return _bound_problem(flag, value)
    if flag.kind == "float":
        if not isinstance(value, int | float) or not math.isfinite(value):
            return f"must be a finite number but got {_show(value)}"
        return _bound_problem(flag, value)
    if flag.kind == "choice":  # compared as argparse compares them: as written (`16`)
        if isinstance(value, str | int) and str(value) in flag.choices:
            return None
        close = difflib.get_close_matches(str(value), flag.choices, n=1)
        hint = f"; did you mean {close[0]!r}" if close else ""
        return f"must be one of {', '.join(flag.choices)} but got {_show(value)}{hint}"
    if flag.kind == "str":
        return None if isinstance(value, str | int | float) else \
            f"must be a single value but got {_show(value)}"
    if flag.kind == "json":
        return None if isinstance(value, dict | str) else \
            f"must be a mapping (passed as JSON) but got {_show(value)}"
    # list: one value or a list of values (nargs="+")
    items = value if isinstance(value, list) else [value]
    if any(isinstance(v, dict | list | bool) for v in items):
        return f"must be a value or a list of values but got {_show(value)}"
    return None


def _bound_problem(flag: FlagType, value: float) -> str | None:
    if flag.ge is not None and value < flag.ge:
        return f"must be >= {flag.ge:g} but got {_show(value)}"
    if flag.gt is not None and value <= flag.gt:
        return f"must be > {flag.gt:g} but got {_show(value)}"
    if flag.le is not None and value > flag.le:
        return f"must be <= {flag.le:g} but got {_show(value)}"
    if flag.lt is not None and value >= flag.lt:
        return f"must be < {flag.lt:g} but got {_show(value)}"
    return None


def flag_name(key: str) -> str:
    """`max_num_seqs` -> `max-num-seqs`; `compilation_config.cudagraph_mode` keeps the part after
    the dot as vLLM spells it (`--compilation-config.cudagraph_mode`)."""
    head, dot, tail = key.partition(".")
    return head.replace("_", "-") + dot + tail
