"""How the space loader and the rule engine compare, show and look up values: YAML scalars
kept apart (`true` is not 1, `"8"` is not 8), one-line renderings for messages, and the context
look-up that tells a missing key from a None."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any


class _Missing:
    """A context key the caller did not provide: no condition on it holds."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING: Any = _Missing()


def show(value: object, limit: int = 60) -> str:
    """A value as it may appear in a one-line message: repr, no newlines, bounded length."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: object, options: Iterable[str]) -> str:
    """`; did you mean 'x'?` for the closest option, or an empty string."""
    if not isinstance(word, str):
        return ""
    # Case-insensitive: `PCIe` should find `pcie` and `flash_attn` should find `FLASH_ATTN`.
    by_folded = {o.lower(): o for o in options}
    folded = word.replace("-", "_").lower()
    close = difflib.get_close_matches(folded, list(by_folded), n=1, cutoff=0.6)
    if not close and word.lower() in by_folded:
        close = [word.lower()]
    return f"; did you mean {by_folded[close[0]]!r}?" if close else ""


def is_number(value: object) -> bool:
    """An int or a finite float; bools are not numbers here (YAML `true` must not mean 1)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and math.isfinite(value)


def is_scalar(value: object) -> bool:
    return value is None or isinstance(value, str | bool) or is_number(value)


def same(a: object, b: object) -> bool:
    """Equality that keeps `True` apart from `1` and `"8"` apart from `8`."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if is_number(a) and is_number(b):
        return a == b
    return type(a) is type(b) and a == b


def contains(values: Iterable[object], value: object) -> bool:
    return any(same(v, value) for v in values)


def on_grid(value: float, low: float, step: float) -> bool:
    """Whether `value` is `low + k * step`, computed in decimal as Optuna checks it."""
    try:
        rest = (Decimal(str(value)) - Decimal(str(low))) % Decimal(str(step))
    except (InvalidOperation, ValueError):
        return False
    return bool(rest == 0)


def lookup(context: Mapping[str, Any], key: str) -> Any:
    """`hardware.num_gpus` from a flat key, a nested mapping or an object (HardwareProfile)."""
    if key in context:
        return context[key]
    head, _, tail = key.partition(".")
    section = context.get(head)
    if section is None:
        return MISSING
    if isinstance(section, Mapping):
        return section.get(tail, MISSING)
    return getattr(section, tail, MISSING)
