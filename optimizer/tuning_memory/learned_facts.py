"""The tuning memory's writer of measured facts: config classes a finished study measured as
pathological (every trial holding a value far slower to start, far slower per token, or failing
for a config reason; none other), appended to the user's known-facts file for later studies'
spaces (docs/tuning-memory.md, search_spaces/known_facts.py)."""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from optimizer.results.trial_record import TrialRecord, record_of
from optimizer.storage.study import CONFIG_FAILURES
from search_spaces.known_facts import KnownFact, read_facts_file, release_of

logger = logging.getLogger(__name__)


def _value_key(value: Any) -> str:
    """A param's value as comparable text (as its trial's params hold it in JSON)."""
    return json.dumps(value, sort_keys=True, default=str)

# A config class is pathological when every trial holding its value is and no other is: its
# start-up this many times the others' median and STARTUP_EXTRA_S longer, its TPOT p99 this
# many times theirs, or it failed for one config reason each time. At least MIN_PATHOLOGICAL
# trials must hold the value (one trial changing ten knobs names no single one of them) and
# MIN_HEALTHY trials must not.
STARTUP_FACTOR = 1.8
STARTUP_EXTRA_S = 120.0
TPOT_FACTOR = 5.0
MIN_PATHOLOGICAL = 2
MIN_HEALTHY = 3


# A config told infeasible never ran: no measurement of it.
CONFIG_FAILURE_VALUES = frozenset(str(getattr(r, "value", r)) for r in CONFIG_FAILURES
                                  if str(getattr(r, "value", r)) != "infeasible")


def _tpot_p99(record: TrialRecord) -> float | None:
    figures = [float(t) for s in record.steps
               if (t := (s.get("metrics") or {}).get("p99_tpot_ms"))]
    return max(figures) if figures else None


def _why_pathological(record: TrialRecord, startup_median: float | None,
                      tpot_median: float | None) -> str | None:
    if record.state == "failed":
        return f"failed: {record.failure_reason}" if record.failure_reason in \
            CONFIG_FAILURE_VALUES else None
    startup = record.metrics.get("engine.startup_s")
    if startup is not None and startup_median is not None and \
            startup >= STARTUP_FACTOR * startup_median and \
            startup - startup_median >= STARTUP_EXTRA_S:
        return f"start-up {startup:.0f} s (others' median {startup_median:.0f} s)"
    tpot = _tpot_p99(record)
    if tpot is not None and tpot_median is not None and tpot >= TPOT_FACTOR * tpot_median:
        return f"TPOT p99 {tpot:.0f} ms (others' median {tpot_median:.0f} ms)"
    return None


def measured_facts(records: Mapping[int, TrialRecord], *, study: str, hardware_class: str,
                   vllm_version: str | None) -> list[KnownFact]:
    """The config classes a study measured as pathological (start-up or TPOT far outside the
    others, a config failure that repeats), as facts for its hardware class and vLLM release:
    a knob value held by every pathological trial of one kind, by at least MIN_PATHOLOGICAL of
    them, and by none of at least MIN_HEALTHY healthy trials. None without a known version."""
    version = release_of(vllm_version)
    if version is None:
        return []
    release = ".".join(version.split(".")[:2])
    measured = {n: r for n, r in records.items()
                if r.params and r.state in ("complete", "failed") and not r.is_unstable}
    startups = [float(s) for r in measured.values() if r.state == "complete"
                and (s := r.metrics.get("engine.startup_s")) is not None]
    tpots = [t for r in measured.values() if r.state == "complete"
             and (t := _tpot_p99(r)) is not None]
    why = {n: w for n, r in measured.items() if (w := _why_pathological(
        r, statistics.median(startups) if startups else None,
        statistics.median(tpots) if tpots else None)) is not None}
    healthy = [r for n, r in measured.items() if n not in why and r.state == "complete"]
    if len(healthy) < MIN_HEALTHY:
        return []
    facts = []
    for kind in sorted({w.split(" ")[0] for w in why.values()}):
        bad = {n: measured[n] for n, w in why.items() if w.split(" ")[0] == kind}
        if len(bad) < MIN_PATHOLOGICAL:
            continue
        first = next(iter(bad.values()))
        for param, value in first.params.items():
            if any(_value_key(r.params.get(param)) != _value_key(value) for r in bad.values()) \
                    or any(_value_key(r.params.get(param)) == _value_key(value)
                           for r in healthy):
                continue
            figures = "; ".join(f"trial {n}: {why[n]}" for n in sorted(bad))
            facts.append(KnownFact(
                id=f"{hardware_class}-vllm{release}-{param}-{value}",
                hardware_class=hardware_class, vllm_version=release, param=param, value=value,
                effect="exclude",
                evidence={"study": study, "trial": ", ".join(str(n) for n in sorted(bad)),
                          "figures": figures,
                          "where": f"the study's records ({len(healthy)} healthy trials)"}))
    return facts


def write_facts(path: Path, facts: Sequence[KnownFact]) -> list[str]:
    """Add `facts` to the user's facts file (`search_spaces.known_facts.facts_file()`), by id:
    a fact there already keeps its entry (the user may have edited it). Returns the ids added."""
    existing = read_facts_file(path)
    have = {f.id for f in existing}
    new = [f for f in facts if f.id not in have]
    if not new:
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"facts": [f.to_dict() for f in (*existing, *new)]}
    text = ("# Measured facts nightshift's tuning memory wrote (search_spaces/known_facts.py);\n"
            "# edit or delete an entry to override it, or list its id under a study file's\n"
            "# known_facts.ignore.\n" + yaml.safe_dump(data, sort_keys=False))
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return [f.id for f in new]


def learn_facts(optuna_study: Any, *, study_name: str, hardware_class: str,
                vllm_version: str | None, path: Path) -> list[str]:
    """At a study's end: the facts its records show (`measured_facts`), added to the user's
    facts file (`path`); the ids added."""
    records = {t.number: r for t in optuna_study.get_trials(deepcopy=False)
               if (r := record_of(t)) is not None}
    return write_facts(path, measured_facts(records, study=study_name,
                                            hardware_class=hardware_class,
                                            vllm_version=vllm_version))
