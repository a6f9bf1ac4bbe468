"""The flag table of the vLLM a launch runs: the bundled table of its release
(`search_spaces.engine.tables`), else the installed vLLM's own argument parser, read as a table.

The installed vLLM's version picks the table (vLLM is not imported; its own parser serves only a
release no table is bundled for); where vLLM is not installed, a declared version
(`--vllm-version`) does, else `DEFAULT_VERSION`.
"""

from __future__ import annotations

import functools
from typing import Any

from search_spaces.engine.tables import (
    DEFAULT_VERSION,
    FlagKind,
    FlagType,
    UnknownVersionError,
    VllmFlags,
    bundled_flags,
    bundled_for,
    bundled_tables,
    version_key,
)


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
        parser = make_arg_parser(FlexibleArgumentParser())
    except Exception:  # absent, or present without its GPU stack (building the parser infers
        return None    # the device: "Failed to infer device type"): the bundled table serves
    return flags_from_parser(parser, version=str(vllm.__version__),
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
    bundled = bundled_for(version)
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
