"""The one renderer of engine flags: snake_case flags -> `vllm serve` argv or a `--config` mapping,
at the process boundary only, and the one spelling of a boolean's `--no-` form.

As vLLM's own `ParameterSweepItem.apply_to_cmd`: kebab-case keys up to a dot, mappings as JSON;
unlike it, a False becomes `--no-<flag>` only where the release's table says the flag has that
form (`bool_flag`), and an engine config's flags spell such a False `no_<flag>: True` (a YAML
`false` is dropped by vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from search_spaces.engine.tables import VllmFlags, flag_name


def bool_flag(key: str, value: bool, is_negatable: bool) -> dict[str, bool]:
    """A boolean flag as an engine config's flags hold it: `{key: True}`; for False,
    `{no_<key>: True}` where the flag is negatable (vLLM's default is on or decided at start-up:
    `VllmFlags.is_negatable`), else nothing (False is vLLM's default, and a flag without a
    `--no-` form would be refused)."""
    if value:
        return {key: True}
    return {f"no_{key}": True} if is_negatable else {}


def flag_args(key: str, value: object, table: VllmFlags) -> list[str]:
    """One snake_case flag as argv elements; [] when the flag is to be left out."""
    if value is None:
        return []
    if isinstance(value, bool):
        return [f"--{flag_name(k)}" for k in bool_flag(key, value, table.is_negatable(key))]
    name = flag_name(key)
    if isinstance(value, Mapping):
        return [f"--{name}", json.dumps(dict(value), separators=(",", ":"))]
    if isinstance(value, list | tuple):
        # vLLM's list flags are nargs="+": `--cudagraph-capture-sizes 1 2 4`.
        return [f"--{name}", *(str(v) for v in value)] if value else []
    return [f"--{name}", str(value)]


def to_argv(flags: Mapping[str, object], table: VllmFlags) -> list[str]:
    """snake_case flags as `vllm serve` arguments, in the mapping's order."""
    return [arg for key, value in flags.items() for arg in flag_args(key, value, table)]


def to_config_dict(flags: Mapping[str, object], table: VllmFlags) -> dict[str, Any]:
    """snake_case flags as `vllm serve MODEL --config x.yaml` reads them: kebab-case keys, and
    never a YAML `false` (vLLM drops it silently) but `no-<flag>: true` where False differs from
    leaving the flag out; a mapping as the JSON its flag parses (the config-file loader turns
    values into argv strings)."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out.update({flag_name(k): True
                        for k in bool_flag(key, value, table.is_negatable(key))})
        elif isinstance(value, Mapping):
            out[flag_name(key)] = json.dumps(dict(value), separators=(",", ":"))
        else:
            out[flag_name(key)] = value
    return out
