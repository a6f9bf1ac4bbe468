"""The tuning memory's writer of measured facts (optimizer/memory.py `measured_facts`,
`write_facts`): a knob value held by every pathological trial of a study and by no healthy one
becomes a fact for the study's hardware class and vLLM release; one trial changing many knobs
names none; the user's file keeps what the user wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from optimizer.memory import measured_facts, write_facts
from optimizer.records import TrialRecord
from search_spaces.known_facts import read_facts_file


def _trial(quant: str, seqs: int, startup_s: float = 90.0, tpot_ms: float = 10.0,
           failure: str | None = None) -> TrialRecord:
    params: dict[str, Any] = {"quantization": quant, "max_num_seqs": seqs}
    if failure is not None:
        return TrialRecord(state="failed", params=params, conclusion="", failure_reason=failure)
    return TrialRecord(state="complete", params=params, conclusion="",
                       metrics={"engine.startup_s": startup_s},
                       steps=({"step": 0, "metrics": {"p99_tpot_ms": tpot_ms}},))


HEALTHY = [_trial("none", 256), _trial("fp8", 256), _trial("none", 512), _trial("fp8", 128)]


def _facts(*bad: TrialRecord, version: str | None = "0.26.0") -> list[Any]:
    records = dict(enumerate([*HEALTHY, *bad]))
    return measured_facts(records, study="s1", hardware_class="hopper", vllm_version=version)


def test_a_value_every_slow_start_holds_and_no_healthy_trial_holds_becomes_a_fact() -> None:
    facts = _facts(_trial("fp8_per_block", 256, startup_s=306.0, tpot_ms=475.0),
                   _trial("fp8_per_block", 512, startup_s=310.0, tpot_ms=455.0))
    assert [(f.id, f.param, f.value, f.vllm_version, f.effect) for f in facts] == [
        ("hopper-vllm0.26-quantization-fp8_per_block", "quantization", "fp8_per_block",
         "0.26", "exclude")]
    evidence = facts[0].evidence
    assert evidence["trial"] == "4, 5" and "start-up 306 s" in evidence["figures"]


def test_one_pathological_trial_names_no_knob() -> None:
    assert _facts(_trial("fp8_per_block", 1024, startup_s=306.0)) == []


def test_a_config_failure_that_repeats_is_a_fact_and_an_infeasible_one_is_not() -> None:
    facts = _facts(_trial("none", 1024, failure="oom_at_start"),
                   _trial("fp8", 1024, failure="oom_at_start"))
    assert [(f.param, f.value) for f in facts] == [("max_num_seqs", 1024)]
    assert _facts(_trial("none", 1024, failure="infeasible"),
                  _trial("fp8", 1024, failure="infeasible")) == []


def test_no_fact_without_a_known_vllm_version() -> None:
    assert _facts(_trial("fp8_per_block", 256, startup_s=306.0),
                  _trial("fp8_per_block", 512, startup_s=310.0), version=None) == []


def test_the_users_file_keeps_an_entry_it_holds_and_gains_the_new_ones(tmp_path: Path) -> None:
    path = tmp_path / "nightshift" / "known_facts.yaml"
    facts = _facts(_trial("fp8_per_block", 256, startup_s=306.0),
                   _trial("fp8_per_block", 512, startup_s=310.0))
    assert write_facts(path, facts) == [facts[0].id]
    edited = yaml.safe_load(path.read_text())
    edited["facts"][0]["evidence"]["figures"] = "the user's words"
    path.write_text(yaml.safe_dump(edited))
    assert write_facts(path, facts) == [], "a fact already there is not written again"
    assert read_facts_file(path)[0].evidence["figures"] == "the user's words"
