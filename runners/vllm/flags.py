"""The one table of what `vllm serve` accepts, and the one renderer of flags onto its command line.

One table per vLLM release is bundled as `runners/vllm/flags_<minor>.json` (0.26 to 0.34; a
patch release that changes no flag shares its minor's table, listed in its `releases`), each read
from that release's wheel by `scripts/vllm_flag_table.py`: value types, choices, bounds and
defaults as vLLM's sources state them, and the booleans whose False is `--no-<flag>`. The
installed vLLM's version picks the table (vLLM is not imported; its own parser serves only a
release no table is bundled for); where vLLM is not installed, a declared version
(`--vllm-version`) does, else `DEFAULT_VERSION`. A study's `fixed_flags` and `vllm.extra_args`,
`nightshift audit`, `regress`, the search spaces and the exported commands all read it, and
`flag_change` tells from the tables which release removed or renamed a flag.
The renderer turns snake_case flags into argv (`--max-num-seqs 256`, `--no-enable-prefix-caching`)
or a `vllm serve --config` mapping at the process boundary, as vLLM's own
`ParameterSweepItem.apply_to_cmd` does (kebab-case keys up to a dot, mappings as JSON); unlike
it, a False becomes `--no-<flag>` only where the table says the flag has that form.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
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
        """This release as the plain data a search space resolves against (`context["engine"]`:
        search_spaces may not import runners): its version, flags, defaults and the value
        sets of its choice flags (and the release's own values of a flag such as
        --quantization, which a plugin may extend: a space searches only the release's)."""
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
              for entry in resources.files("runners.vllm").iterdir()
              if entry.name.startswith("flags_") and entry.name.endswith(".json")]
    return tuple(sorted(tables, key=lambda t: version_key(t.version)))


def bundled_versions() -> tuple[str, ...]:
    """Every release a bundled table holds for, oldest first."""
    return tuple(sorted({r for t in bundled_tables() for r in t.releases}, key=version_key))


def has_table(version: str) -> bool:
    """Whether a bundled table holds for `version` (a local tag such as `+cu129` aside)."""
    return _bundled_for(version) is not None


def _bundled_for(version: str) -> VllmFlags | None:
    key = version_key(version)
    return next((t for t in bundled_tables() if any(version_key(r) == key for r in t.releases)),
                None)


def bundled_flags(version: str | None = None) -> VllmFlags:
    """The bundled table of `version` (`DEFAULT_VERSION` when None); `UnknownVersionError`
    where none is bundled for it."""
    table = _bundled_for(version or DEFAULT_VERSION)
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


def installed_flags() -> VllmFlags | None:
    """The installed vLLM's own parser as a table; None where vLLM does not import."""
    try:
        import vllm
        import vllm.envs as vllm_envs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        try:  # 0.29 moved the frontend's arguments to launchers/
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
        except ImportError:
            from vllm.entrypoints.openai.cli_args import make_arg_parser
    except Exception:  # absent, or present without its GPU stack: the bundled table serves
        return None
    return flags_from_parser(make_arg_parser(FlexibleArgumentParser()),
                             version=str(vllm.__version__),
                             env_vars=frozenset(vllm_envs.environment_variables))


def flags_from_parser(parser: Any, version: str,
                      env_vars: frozenset[str] = frozenset()) -> VllmFlags:
    """A table from an argparse parser (vLLM's `make_arg_parser`): kinds from each action's
    type, nargs and choices; no bounds (argparse does not state them)."""
    import argparse

    types: dict[str, FlagType] = {}
    aliases: dict[str, str] = {}
    defaults: dict[str, object] = {}
    for action in parser._actions:
        longs = [o[2:] for o in action.option_strings if o.startswith("--")]
        if not longs:
            continue
        kind: FlagKind
        choices: tuple[str, ...] = ()
        type_name = getattr(action.type, "__name__", "")
        if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
            kind = "bool"
        elif action.choices:
            kind, choices = "choice", tuple(str(c) for c in action.choices)
        elif action.nargs in ("+", "*"):
            kind = "list"
        elif action.type is int or "human_readable_int" in type_name:
            kind = "int"
        elif action.type is float:
            kind = "float"
        elif action.type in (None, str):
            kind = "str"
        else:
            kind = "any"
        # argparse's default is vLLM's where it is not None ("decided at start-up", left out
        # of `defaults`); a boolean with a `--no-` form and a default other than False is
        # negatable.
        is_optional_bool = isinstance(action, argparse.BooleanOptionalAction)
        flag = FlagType(kind=kind, choices=choices,
                        is_human_readable="human_readable_int" in type_name,
                        is_negatable=is_optional_bool and action.default is not False)
        for name in longs:
            if not (name.startswith("no-") and name[3:] in longs):
                types[name] = flag
                if action.default is not None and action.default is not argparse.SUPPRESS:
                    defaults[name] = action.default
        for short in (o for o in action.option_strings if not o.startswith("--")):
            aliases[short] = longs[0]
    return VllmFlags(version=version, source=f"installed vLLM {version}'s argument parser",
                     types=types, aliases=aliases, env_vars=env_vars, defaults=defaults)


def installed_version() -> str | None:
    """The installed vLLM's version from its metadata (vLLM is not imported); None where it is
    not installed."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def flag_table(version: str | None = None) -> VllmFlags:
    """The table of `version`, else of the installed vLLM, else of `DEFAULT_VERSION`: the
    bundled one where a table is bundled for it (no vLLM import), else the installed parser's
    where that version is installed and imports. `UnknownVersionError` where neither holds."""
    return _flag_table(version or installed_version() or DEFAULT_VERSION)


@functools.cache
def _flag_table(version: str) -> VllmFlags:
    bundled = _bundled_for(version)
    if bundled is not None:
        return bundled
    installed = installed_version()
    parsed = installed_flags() if installed and version_key(installed) == version_key(
        version) else None
    if parsed is None:
        bundled_flags(version)  # raises, naming the bundled releases
    assert parsed is not None
    return parsed


def table_for(version: str) -> VllmFlags:
    """The table for launching vLLM `version` (see `flag_table`); for a release no table is
    bundled for and whose parser does not import, the newest bundled release before it (the
    renderer needs only which booleans take `--no-`; vLLM's own parser has the last word)."""
    try:
        return flag_table(version)
    except UnknownVersionError:
        older = [t for t in bundled_tables() if version_key(t.version) <= version_key(version)]
        return older[-1] if older else bundled_flags()


@dataclass(frozen=True)
class FlagChange:
    """What the bundled tables say about a flag `version` does not take."""

    flag: str  # kebab-case, no dashes
    change: Literal["removed", "renamed", "added later"]
    release: str  # the first release without it (removed, renamed) or with it (added later)
    last_release: str | None = None  # the last release that took it (removed, renamed)
    new_name: str | None = None  # renamed: the flag naming the same config field

    @property
    def sentence(self) -> str:
        if self.change == "renamed":
            return (f"--{self.flag} was renamed --{self.new_name} in vLLM {self.release} "
                    f"(the last release with --{self.flag}: {self.last_release})")
        if self.change == "removed":
            return (f"--{self.flag} was removed in vLLM {self.release} (the last release with "
                    f"it: {self.last_release})")
        return f"--{self.flag} is first a flag of vLLM {self.release}"


def flag_change(name: str, version: str,
                tables: Sequence[VllmFlags] | None = None) -> FlagChange | None:
    """Why vLLM `version` does not take the flag `name` (kebab- or snake_case), from the bundled
    tables: the latest release up to `version` that removed it (renamed where a flag added in
    that same release names the config field it named), or the first later release that has
    it. None where `version` takes it or no bundled table ever had it. `tables`: others than
    the bundled ones, oldest first."""
    flag = flag_name(name).partition(".")[0]
    key = version_key(version)
    tables = bundled_tables() if tables is None else tables
    here = [t for t in tables if version_key(t.version) <= key]
    if here and flag in here[-1].types:
        return None
    for before, after in reversed(list(itertools.pairwise(here))):
        if flag in before.types and flag not in after.types:
            field_name = before.config_fields.get(flag)
            new = [f for f in after.types if f not in before.types and field_name is not None
                   and after.config_fields.get(f) == field_name]
            return FlagChange(flag, "renamed" if len(new) == 1 else "removed",
                              release=after.releases[0], last_release=before.releases[-1],
                              new_name=new[0] if len(new) == 1 else None)
    later = next((t for t in tables if version_key(t.version) > key and flag in t.types), None)
    if later is not None:
        return FlagChange(flag, "added later", release=later.releases[0])
    return None


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


# ---------------------------------------------------------------------------------------------
# The renderer: snake_case flags -> argv or a `--config` mapping, at the process boundary only.

def flag_name(key: str) -> str:
    """`max_num_seqs` -> `max-num-seqs`; `compilation_config.cudagraph_mode` keeps the part after
    the dot as vLLM spells it (`--compilation-config.cudagraph_mode`)."""
    head, dot, tail = key.partition(".")
    return head.replace("_", "-") + dot + tail


def flag_args(key: str, value: object, table: VllmFlags | None = None) -> list[str]:
    """One snake_case flag as argv elements; [] when the flag is to be left out."""
    name = flag_name(key)
    if value is None:
        return []
    if isinstance(value, bool):
        if value:
            return [f"--{name}"]
        return [f"--no-{name}"] if (table or flag_table()).is_negatable(key) else []
    if isinstance(value, Mapping):
        return [f"--{name}", json.dumps(dict(value), separators=(",", ":"))]
    if isinstance(value, list | tuple):
        # vLLM's list flags are nargs="+": `--cudagraph-capture-sizes 1 2 4`.
        return [f"--{name}", *(str(v) for v in value)] if value else []
    return [f"--{name}", str(value)]


def to_argv(flags: Mapping[str, object], table: VllmFlags | None = None) -> list[str]:
    """snake_case flags as `vllm serve` arguments, in the mapping's order."""
    return [arg for key, value in flags.items() for arg in flag_args(key, value, table)]


def to_config_dict(flags: Mapping[str, object],
                   table: VllmFlags | None = None) -> dict[str, Any]:
    """snake_case flags as `vllm serve MODEL --config x.yaml` reads them: kebab-case keys, and
    never a YAML `false` (vLLM drops it silently) but `no-<flag>: true` where False differs from
    leaving the flag out; a mapping as the JSON its flag parses (the config-file loader turns
    values into argv strings)."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if value is None:
            continue
        name = flag_name(key)
        if isinstance(value, bool):
            if value:
                out[name] = True
            elif (table or flag_table()).is_negatable(key):
                out[f"no-{name}"] = True
            continue
        if isinstance(value, Mapping):
            out[name] = json.dumps(dict(value), separators=(",", ":"))
            continue
        out[name] = value
    return out
