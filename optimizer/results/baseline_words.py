"""What the baseline trial ran, in words: the vLLM defaults, or the vLLM defaults plus the
study's fixed flags (which every trial runs too). Every user-facing phrase that names the
baseline (conclusions, status table, report, export, gains) takes it from `baseline_words`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from optimizer.results.trial_record import HasUserAttrs, stored_fingerprint

_SHOWN_FLAGS: Final = 6  # fixed flags named in full; the rest counted


@dataclass(frozen=True)
class BaselineWords:
    """The baseline named at each length; with no fixed flags, the vLLM defaults."""

    name: str  # its full name, flags listed: "vLLM defaults + your fixed flags (quantization=fp8)"
    the: str  # in a sentence: "the vLLM defaults", "the baseline (vLLM defaults + your ...)"
    short: str  # in a table cell: "defaults", "baseline"
    has_fixed_flags: bool

    @property
    def cell(self) -> str:
        """The baseline's own row in a table's change column: `(vLLM defaults)`, `(baseline)`."""
        return "(vLLM defaults)" if not self.has_fixed_flags else f"({self.short})"

    @property
    def in_parens(self) -> str:
        """Inside a sentence's parentheses (the report's headline, whose first line lists the
        flags): "the vLLM defaults", "the baseline: vLLM defaults + your fixed flags"."""
        return self.the if not self.has_fixed_flags else \
            "the baseline: vLLM defaults + your fixed flags"

    @property
    def the_full(self) -> str:
        """A first mention in a sentence, with the flags: "the vLLM defaults", "the baseline
        (vLLM defaults + your fixed flags (quantization=fp8, kv_cache_dtype=fp8))"."""
        return self.the if not self.has_fixed_flags else f"the baseline ({self.name})"


def baseline_name(fixed_flags: Mapping[str, Any] | None) -> str:
    """What the baseline trial runs: vLLM's defaults, plus the study's fixed flags (which every
    trial gets) when it has any."""
    if not fixed_flags:
        return "vLLM defaults"
    shown = ", ".join(f"{k}={v}" for k, v in list(fixed_flags.items())[:_SHOWN_FLAGS])
    more = f" (+{len(fixed_flags) - _SHOWN_FLAGS} more)" if len(fixed_flags) > _SHOWN_FLAGS \
        else ""
    return f"vLLM defaults + your fixed flags ({shown}{more})"


def baseline_words(fixed_flags: Mapping[str, Any] | None) -> BaselineWords:
    """The words for a study with these fixed flags (None or {}: the vLLM defaults)."""
    if not fixed_flags:
        return DEFAULTS
    return BaselineWords(name=baseline_name(fixed_flags),
                         the="the baseline (vLLM defaults + your fixed flags)",
                         short="baseline", has_fixed_flags=True)


DEFAULTS: Final = BaselineWords(name="vLLM defaults", the="the vLLM defaults", short="defaults",
                                has_fixed_flags=False)


def baseline_words_of(study: HasUserAttrs) -> BaselineWords:
    """The words for a stored study, from the fixed flags its last start's fingerprint holds;
    the vLLM defaults for a study from before fingerprints (which may have had fixed flags:
    nothing stored says)."""
    fingerprint = stored_fingerprint(study)
    flags = fingerprint.fixed_flags if fingerprint is not None else None
    return baseline_words(flags if isinstance(flags, Mapping) else None)
