"""A pydantic validation error of the study file (or the benchmark library) as the one line a
user reads: the file, the field, what was wrong, how to fix it; a typo'd key with the key it
was most likely meant to be."""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import BaseModel, ValidationError

from optimizer.config.schema import StudySpec


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:  # a union member's tag (`str`, `list[str]`, `literal[..]`) is pydantic's
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith(("function-", "literal[", "list[")) and part != "str":
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _fields_at(loc: tuple[int | str, ...], root: type[BaseModel] = StudySpec) -> list[str]:
    """The valid keys of the model at a location, for did-you-mean suggestions."""
    model: Any = root
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        ann = field.annotation
        candidates = [ann, *getattr(ann, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type)
                      and issubclass(c, BaseModel)), None)
    return list(getattr(model, "model_fields", {}).keys()) if model else []


def format_validation_error(exc: ValidationError, source: str,
                            root: type[BaseModel] = StudySpec,
                            example: str = "examples/quickstart.yaml") -> str:
    """One line for the first problem: file, field, what was wrong, how to fix it; `root` is
    the schema validated (its keys are the did-you-mean candidates), `example` the file a
    missing key's message points to."""
    errors = exc.errors()
    # A typo'd key also makes its intended key "missing": report the typo, it is the cause.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = tuple(err["loc"])
    where = _loc(loc)
    if err["type"] == "extra_forbidden":
        key = str(loc[-1])
        valid = _fields_at(loc[:-1], root)
        close = difflib.get_close_matches(key, valid, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}."
        return f"{source}: unknown key {where!r}; {hint}"
    if err["type"] == "invalid_key" or loc[-1:] == ("[key]",):  # `1: x`, `~: x`
        parent = _loc(loc[:-2] if loc[-1:] == ("[key]",) else loc[:-1])
        return (f"{source}: {parent}: keys are names but got {err.get('input')!r:.60}; write "
                "the key as a name.")
    if err["type"] == "missing":
        return f"{source}: {where} is required; add it (see {example})."
    # pydantic names our classes ("a valid dictionary or instance of StartupSpec"): not the
    # user's words.
    msg = re.sub(r" or instance of \w+", "", str(err["msg"]).removeprefix("Value error, "))
    end = "" if msg.endswith((".", "?")) else "."
    if msg.startswith(where.split("[")[0]) and err["type"] == "value_error":
        return f"{source}: {msg}{end}"  # the check named the field itself (fixed_flags.x: ...)
    if where == "(top level)" and err["type"] == "value_error":
        return f"{source}: {msg}{end}"
    got = err.get("input")
    got_text = "" if isinstance(got, dict | list) or got is None else f" but got {got!r:.80}"
    if got is None and "input" in err:  # `key:` with nothing after it
        got_text = " but it is empty; give a value or remove the key"
    return f"{source}: {where}: {msg}{got_text}."
