"""Checks of the vLLM flags a study passes through: `fixed_flags` (every trial's flags) and
`vllm.extra_args` (verbatim argv), each against the installed vLLM's flag table. Pure: one
sentence naming the field and the fix, or None."""

from __future__ import annotations

import contextlib
import difflib
import math
import re
from typing import TYPE_CHECKING

from optimizer.errors import Problem

if TYPE_CHECKING:
    from search_spaces.engine.tables import VllmFlags

# Flags nightshift sets on every engine itself, and the study key that says what they become.
# Each entry: what to write instead, as a clause.
OWNED_FLAGS: dict[str, str] = {
    "model": "set model.path instead",
    "host": "remove it: nightshift binds every engine to 127.0.0.1",
    "port": "remove it: nightshift gives every engine a free port",
    "uds": "remove it: nightshift talks to every engine over TCP on 127.0.0.1",
    "headless": "remove it: nightshift measures through the API server",
    "served-model-name": "set model.served_model_name instead",
    "load-format": "set model.load_format instead",
    "skip-tokenizer-init": "set model.skip_tokenizer_init instead",
    "profiler-config": "set workload.profile instead",
    "config": "set fixed_flags instead (a --config file could override what nightshift sets)",
    "api-key": "remove it: nightshift's load generator sends no API key",
}

_NUMBER_RE = re.compile(r"^-?\d+(\.\d*)?([eE][-+]?\d+)?$")


def _snake(kebab: str) -> str:
    return kebab.replace("-", "_")


# vLLM's flags that take its human-readable integers ("4k", "1K", "25.6k"): vLLM 0.26's
# arg_utils parses max_model_len with human_readable_int_or_auto.
HUMAN_READABLE_INT_FLAGS = frozenset({"max_model_len"})
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgG])")


def human_readable_int(text: str) -> int:
    """vLLM's `human_readable_int`: "4k" is 4,000, "4K" 4,096 (k/m/g decimal, K/M/G binary,
    decimals with decimal suffixes only), else a plain integer. Raises ValueError."""
    text = text.strip()
    match = _HUMAN_INT.fullmatch(text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * {"k": 10**3, "m": 10**6, "g": 10**9}[suffix])
    if "." in number:
        raise ValueError(f"decimals are not allowed with binary suffixes like {suffix}; did "
                         f"you mean {number}{suffix.lower()}?")
    return int(number) * {"K": 2**10, "M": 2**20, "G": 2**30}[suffix]


def fixed_flag_problem(name: object, value: object,
                       table: VllmFlags | None = None) -> str | None:
    """Why `fixed_flags.<name>: <value>` would not run, or None: a flag of vLLM (any flag of the
    installed vLLM's release, else of 0.26; or of `table`) with a value of its type, or a
    simulated-engine fault. A flag the release removed or renamed is named with the release
    that did, from the flag tables."""
    from runners.simulated.faults import FAULT_PREFIX
    from runners.vllm.flags import flag_table
    from search_spaces import KNOWN_FLAGS
    from search_spaces.engine.releases import flag_change
    from search_spaces.engine.tables import flag_name, value_problem
    from search_spaces.known_flags import value_problem as space_value_problem

    if not isinstance(name, str) or not name.isprintable() or len(name) > 100:
        return f"fixed_flags: keys are vLLM flag names such as max_num_seqs but got {name!r:.60}"
    where = f"fixed_flags.{name}"
    if name.startswith(FAULT_PREFIX):
        return _fault_problem(name, value)
    table = table or flag_table()
    kebab = table.resolve(name)
    if name.replace("_", "-") in OWNED_FLAGS:
        return f"{where}: nightshift sets --{name.replace('_', '-')} itself; " \
               f"{OWNED_FLAGS[name.replace('_', '-')]}"
    # A space's own name counts only where it stands for a nested setting (cudagraph_mode ->
    # compilation_config.cudagraph_mode); any other name must be a flag of the table.
    if kebab is None and (name not in KNOWN_FLAGS or KNOWN_FLAGS[name].cli_name is None):
        change = flag_change(name, table.version)
        if change is not None and change.new_name is not None:
            return f"{where}: {change.sentence}; use {_snake(change.new_name)}"
        if change is not None and change.change == "removed":
            return f"{where}: {change.sentence}; remove it for vLLM {table.version}"
        close = difflib.get_close_matches(name, list(KNOWN_FLAGS), n=1) or \
            [_snake(c) for c in [table.closest(name)] if c is not None]
        hint = f"did you mean {close[0]!r}?" if close else "see `vllm serve --help`."
        version = ".".join(table.version.split(".")[:2])
        return f"{where}: not a vLLM {version} engine flag; {hint}"
    if "-" in name:
        return f"{where}: spell vLLM flags in snake_case here ({_snake(name)})"
    if kebab is not None:
        problem, shown = value_problem(table.types[kebab], value), kebab
    else:  # a space's own name for a nested setting (cudagraph_mode)
        problem = space_value_problem(name, value)
        shown = flag_name(KNOWN_FLAGS[name].cli_name or name)
    if problem is not None:
        return f"{where}: {problem}; give a value --{shown} accepts"
    return None


def _fault_problem(name: str, value: object) -> str | None:
    from dataclasses import fields

    from runners.simulated.faults import FAULT_PREFIX, Faults

    kinds = {f"{FAULT_PREFIX}{f.name}": str(f.type) for f in fields(Faults)}
    where = f"fixed_flags.{name}"
    if name not in kinds:
        close = difflib.get_close_matches(name, list(kinds), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid: {', '.join(sorted(kinds))}."
        return f"{where}: not a simulated-engine fault; {hint}"
    kind = kinds[name]
    if value is None:
        return None
    if kind.startswith("bool"):
        ok = isinstance(value, bool)
    elif kind.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and \
            math.isfinite(value) and value >= 0
    if not ok:
        want = {"bool": "true or false", "int": "a whole number >= 0"}.get(
            kind.split(" ")[0], "a finite number >= 0")
        return f"{where}: must be {want} but got {value!r:.60}"
    try:
        Faults.from_mapping({name: value})
    except ValueError as exc:
        return Problem(f"{where}: {str(exc).rstrip('.')}", exc)
    return None


def _arg_flag(token: str) -> str | None:
    """The flag an `extra_args` token names, as written (`--max-num-seqs`, `-tp`); None for a
    value."""
    if not token.startswith("-") or token == "-" or _NUMBER_RE.match(token):
        return None
    if re.match(r"^-O(\d|\.|=|$)", token):  # -O3, -O.level=3: vLLM's optimization level
        return "optimization-level"
    if token.startswith("--"):
        return token[2:].split("=", 1)[0].split(".", 1)[0]
    return token.split("=", 1)[0].split(".", 1)[0]


def extra_args_problem(args: list[str]) -> str | None:
    """Why `vllm.extra_args` would not run as meant, or None: each flag is one of vLLM's, not
    one nightshift sets itself or searches (extra_args come last, so theirs would win)."""
    from runners.vllm.flags import flag_table
    from search_spaces import KNOWN_FLAGS

    table = flag_table()
    for index, token in enumerate(args):
        where = f"vllm.extra_args[{index}]"
        if not token or "\n" in token or "\0" in token or len(token) > 10_000:
            return f"{where}: expected one command-line word but got {token!r:.60}"
        written = _arg_flag(token)
        if written is None:
            if index == 0:
                return f"{where}: {token!r:.60} is not a flag; extra_args start with a --flag"
            continue
        if written.startswith("-"):  # a short alias such as -tp
            kebab = table.aliases.get(written)
        elif written.startswith("no-") and table.resolve(written[3:]) is not None:
            kebab = table.resolve(written[3:])
        else:
            kebab = table.resolve(written)
        if kebab is None:
            close = table.closest(written.lstrip("-"))
            hint = f"did you mean --{close}?" if close else "see `vllm serve --help`."
            version = ".".join(table.version.split(".")[:2])
            return f"{where}: {token!r:.60} is not a flag of vLLM {version}; {hint}"
        if kebab in OWNED_FLAGS:
            return f"{where}: nightshift sets --{kebab} itself; {OWNED_FLAGS[kebab]}"
        if _snake(kebab) in KNOWN_FLAGS:
            return (f"{where}: --{kebab} is a flag a nightshift space may search, and "
                    "extra_args (passed last) would override every trial's value; set "
                    f"fixed_flags.{_snake(kebab)} to fix it instead")
        problem = _extra_value_problem(args, index, written, kebab)
        if problem is not None:
            return f"{where}: {problem}"
    return None


def _extra_value_problem(args: list[str], index: int, written: str, kebab: str) -> str | None:
    """Why the value `args[index]` gives its flag would be refused by vLLM's parser, or None.
    Checked where the table knows the type: a boolean takes no value; an int, float or choice
    flag takes one (`--x=v` or the next word). Dotted (`--x.y=v`) and `-O3` forms pass."""
    from runners.vllm.flags import flag_table
    from search_spaces.engine.tables import value_problem

    token = args[index]
    if "." in token.split("=", 1)[0] or written == "optimization-level":
        return None
    flag = flag_table().types[kebab]
    following = args[index + 1] if index + 1 < len(args) else None
    is_value_next = following is not None and _arg_flag(following) is None
    if flag.kind == "bool" or written.startswith("no-"):
        if "=" in token or is_value_next:
            shown = token if "=" in token else f"{token} {following}"
            return f"--{written} takes no value but got {shown!r:.60}; drop the value"
        return None
    if flag.kind not in ("int", "float", "choice"):
        return None
    raw = token.split("=", 1)[1] if "=" in token else (following if is_value_next else None)
    if raw is None:
        return f"--{kebab} needs a value; give it as --{kebab}=VALUE or as the next word"
    value: object = raw
    if flag.kind == "float" or (flag.kind == "int" and re.fullmatch(r"-?\d+", raw)):
        with contextlib.suppress(ValueError):  # a word stays a word: refused below
            value = int(raw) if flag.kind == "int" else float(raw)
    problem = value_problem(flag, value)
    return None if problem is None else f"--{kebab} {problem}"
