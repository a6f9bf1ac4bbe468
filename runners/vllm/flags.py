"""The one table of what `vllm serve` accepts, and the one renderer of flags onto its command line.

The table is the installed vLLM's own argument parser where vLLM imports, else the table of
0.26's flags bundled as `runners/vllm/flags_0.26.json` (read from the wheel by
`scripts/vllm_flag_table.py`: value types, choices and bounds as vLLM's sources state them),
plus the defaults and negatable booleans nightshift relies on, kept by hand (`defaults_source`
in the file says from where). A study's
`fixed_flags` and `vllm.extra_args`, `nightshift audit` and the exported commands all read it.
The renderer turns snake_case flags into argv (`--max-num-seqs 256`, `--no-enable-prefix-caching`)
or a `vllm serve --config` mapping at the process boundary, as vLLM's own
`ParameterSweepItem.apply_to_cmd` does (kebab-case keys up to a dot, mappings as JSON); unlike
it, a False becomes `--no-<flag>` only where the table says the flag has that form.
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


def bundled_flags() -> VllmFlags:
    """vLLM 0.26's flags as the bundled table records them."""
    return _bundled()


@functools.cache
def _bundled() -> VllmFlags:
    return flags_from_data(
        json.loads(resources.files("runners.vllm").joinpath("flags_0.26.json").read_text()))


def flags_from_data(data: Mapping[str, Any]) -> VllmFlags:
    """A table from the bundled JSON's shape: `flags` (name -> "bool" or "value"), `types`,
    `aliases`, `env_vars`, `negatable` and `defaults`; a new flag is one entry in `flags` (and
    `types` for a value type other than "any")."""
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
                               is_negatable=name in negatable)
    unknown = {n for n in (negatable | set(defaults)) if n.partition(".")[0] not in types}
    if unknown:  # a typo in the table itself: caught by the tests that load it
        raise ValueError(f"flag table: defaults/negatable name unknown flags {sorted(unknown)}")
    return VllmFlags(version=data["vllm_version"],
                     source=f"vLLM {data['vllm_version']}'s flags (bundled table)",
                     types=types, aliases=data.get("aliases", {}),
                     env_vars=frozenset(data.get("env_vars", ())), defaults=defaults)


def installed_flags() -> VllmFlags | None:
    """The installed vLLM's own parser as a table; None where vLLM does not import."""
    try:
        import vllm
        import vllm.envs as vllm_envs
        from vllm.entrypoints.openai.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
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


@functools.cache
def flag_table() -> VllmFlags:
    """The installed vLLM's parser where it imports, else the bundled 0.26 table."""
    return installed_flags() or bundled_flags()


def table_for(version: str) -> VllmFlags:
    """The table for launching vLLM `version`: the bundled one where it is that release (no
    vLLM import), else the installed parser's (or the bundled one where vLLM does not import)."""
    bundled = bundled_flags()
    return bundled if version.split("+")[0] == bundled.version else flag_table()


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
