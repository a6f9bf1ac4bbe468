"""The tuning memory's writer of measured facts (optimizer/tuning_memory/learned_facts.py
`measured_facts`, `write_facts`): a knob value held by every pathological trial of a study and by
no healthy one becomes a fact for the study's hardware class and vLLM release; one trial changing
many knobs names none; the user's file keeps what the user wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from optimizer.results.trial_record import TrialRecord
from optimizer.tuning_memory.learned_facts import measured_facts, write_facts
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


def test_a_study_whose_two_oom_configs_share_a_value_writes_it_at_its_end(
        tmp_path: Path) -> None:
    """The daemon calls the writer at the study's end: a real Optuna SQLite study and MLflow
    store, a scripted runner (max_num_seqs 1024 OOMs at start), every config of the space."""
    from functools import partial
    from itertools import product

    from optimizer.config import load_study
    from optimizer.run.daemon import Daemon
    from optimizer.run.executor import InlineExecutor
    from optimizer.tracking.study_summary import study_summary
    from optimizer.tracking.tracker import Tracker
    from optimizer.tuning_memory.learned_facts import learn_facts
    from search_spaces import load_space
    from tests.builders import categorical_space, write_study
    from tests.optimizer.test_search_policy import ScriptedRunner

    space_path = categorical_space(tmp_path, max_num_seqs=[256, 512, 1024],
                                   quantization=["none", "fp8"])
    cfg = load_study(write_study(tmp_path, trials=6, max_parallel_trials=1,
                                 search_space=str(space_path), warm_start="off"))
    space = load_space(space_path).resolve({})
    seeds = [{**space.defaults(), "max_num_seqs": s, "quantization": q}
             for s, q in product([256, 512, 1024], ["none", "fp8"])]
    seeds = [s for s in seeds if s != space.defaults()]
    path = tmp_path / "facts.yaml"
    launched: list[dict[str, Any]] = []
    daemon = Daemon(cfg, space=space, executor=InlineExecutor(lambda: ScriptedRunner(
        lambda flags: None if flags.get("max_num_seqs") == 1024 else 10.0, launched),
        total_gpus=1), registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01, seed_trials=seeds,
        learn_facts=partial(learn_facts, study_name=cfg.name, hardware_class="hopper",
                            vllm_version="0.26.0", path=path))
    daemon.run()
    assert len(launched) == 6
    facts = read_facts_file(path)
    assert [(f.param, f.value, f.vllm_version) for f in facts] == [("max_num_seqs", 1024, "0.26")]
    assert facts[0].evidence["study"] == cfg.name
