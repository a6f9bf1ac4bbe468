"""Measured facts as data: a knob value known to be pathological on a hardware class with a
vLLM version, with its evidence and its effect (`exclude`: the rules remove the value). The
bundled table is `facts/known_facts.yaml`; the tuning memory writes the facts a study measured
to the user's file (`facts_file()`), read beside it. A study file's `known_facts.ignore` lists
the ids it overrides. Only stdlib and yaml here: search_spaces imports nothing of nightshift's."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from search_spaces.bounded_yaml import load_yaml, yaml_message
from search_spaces.values import lookup, show

BUNDLED_FACTS = Path(__file__).resolve().parent / "facts" / "known_facts.yaml"
# The user's own facts (written by the tuning memory); NIGHTSHIFT_KNOWN_FACTS moves it.
FACTS_ENV = "NIGHTSHIFT_KNOWN_FACTS"
# exclude: the rules remove the value; keep: nothing (a user's entry with a bundled fact's id
# and `effect: keep` overrides that fact everywhere).
Effect = Literal["exclude", "keep"]
EFFECTS: tuple[Effect, ...] = ("exclude", "keep")
_KEYS = ("id", "hardware_class", "vllm_version", "param", "value", "effect", "evidence")


class FactError(ValueError):
    """A malformed facts file: one line naming the file, the entry and the fix."""


@dataclass(frozen=True)
class KnownFact:
    """`param: value` measured pathological on `hardware_class` with vLLM `vllm_version` (a
    release prefix: "0.26" matches 0.26.0 and 0.26.1)."""

    id: str
    hardware_class: str
    vllm_version: str
    param: str
    value: Any
    effect: Effect
    evidence: Mapping[str, str] = field(default_factory=dict)
    source: str = "bundled"  # the file it came from: "bundled" or the user's file's path

    def applies(self, hardware_class: object, vllm_version: object) -> bool:
        version = release_of(vllm_version)
        return hardware_class == self.hardware_class and version is not None and (
            version == self.vllm_version or version.startswith(self.vllm_version + "."))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "hardware_class": self.hardware_class,
                "vllm_version": self.vllm_version, "param": self.param, "value": self.value,
                "effect": self.effect, "evidence": dict(self.evidence)}

    def describe(self) -> str:
        figures = self.evidence.get("figures", "")
        return (f"{self.param}={self.value} on {self.hardware_class} with vLLM "
                f"{self.vllm_version}: {self.effect} ({self.evidence.get('study', 'measured')}"
                f"{': ' + figures if figures else ''})")


def release_of(engine_version: object) -> str | None:
    """vLLM's release from an engine version as nightshift reports it ("0.26.0", "simulated
    0.26.0", "0.26.0+cu129"); None where unknown."""
    if not isinstance(engine_version, str) or not engine_version.strip():
        return None
    return engine_version.split()[-1].split("+")[0]


def facts_file() -> Path:
    """The user's facts file: $NIGHTSHIFT_KNOWN_FACTS, else
    ~/.cache/nightshift/known_facts.yaml."""
    env = os.environ.get(FACTS_ENV)
    return Path(env) if env else Path.home() / ".cache" / "nightshift" / "known_facts.yaml"


def parse_facts(data: object, source: str) -> tuple[KnownFact, ...]:
    if data is None:
        return ()
    entries = data.get("facts") if isinstance(data, Mapping) else None
    if not isinstance(entries, list):
        raise FactError(f"{source}: expected a mapping with a `facts:` list; fix the file or "
                        "delete it.")
    facts = []
    for index, raw in enumerate(entries):
        where = f"{source}: facts[{index}]"
        if not isinstance(raw, Mapping):
            raise FactError(f"{where}: expected a mapping with {', '.join(_KEYS)}.")
        unknown = sorted(set(map(str, raw)) - set(_KEYS))
        if unknown:
            raise FactError(f"{where}.{unknown[0]}: not a key of a fact; use {', '.join(_KEYS)}.")
        for key in ("id", "hardware_class", "vllm_version", "param"):
            if not isinstance(raw.get(key), str) or not raw[key]:
                raise FactError(f"{where}.{key}: expected a non-empty string (quote a version: "
                                "\"0.26\").")
        if "value" not in raw:
            raise FactError(f"{where}.value: missing; give the knob's value the fact is about.")
        if raw.get("effect") not in EFFECTS:
            raise FactError(f"{where}.effect: expected one of {', '.join(EFFECTS)} but got "
                            f"{show(raw.get('effect'))}.")
        evidence = raw.get("evidence") or {}
        if not isinstance(evidence, Mapping):
            raise FactError(f"{where}.evidence: expected a mapping (study, trial, figures).")
        facts.append(KnownFact(raw["id"], raw["hardware_class"], raw["vllm_version"],
                               raw["param"], raw["value"], raw["effect"],
                               {str(k): str(v) for k, v in evidence.items()}, source))
    ids = [f.id for f in facts]
    duplicate = next((i for i in ids if ids.count(i) > 1), None)
    if duplicate is not None:
        raise FactError(f"{source}: the id {duplicate!r} is given twice; give each fact its own.")
    return tuple(facts)


def read_facts_file(path: Path, source: str | None = None) -> tuple[KnownFact, ...]:
    """The facts of one file; none where the file does not exist."""
    if not path.is_file():
        return ()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise FactError(f"{path}: cannot read the facts file ({type(exc).__name__}); fix it "
                        "or delete it.") from exc
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise FactError(yaml_message(exc, str(path), text)) from exc
    return parse_facts(data, source or str(path))


def load_facts(user_file: Path | None = None) -> tuple[KnownFact, ...]:
    """The bundled facts, then the user's (`user_file`, else `facts_file()`); a user fact with
    a bundled fact's id replaces it."""
    bundled = read_facts_file(BUNDLED_FACTS, "bundled")
    user = read_facts_file(user_file or facts_file())
    ids = {f.id for f in user}
    return (*[f for f in bundled if f.id not in ids], *user)


def bundled_facts() -> tuple[KnownFact, ...]:
    return read_facts_file(BUNDLED_FACTS, "bundled")


def applicable(facts: Iterable[KnownFact], context: Mapping[str, Any],
               ignore: Sequence[str] = ()) -> list[KnownFact]:
    """The facts that hold for the context's hardware class and vLLM version, less those the
    study file overrides (`ignore`)."""
    hardware_class = lookup(context, "hardware.hardware_class")
    version = lookup(context, "engine.vllm_version")
    return [f for f in facts if f.id not in ignore and f.applies(hardware_class, version)]
