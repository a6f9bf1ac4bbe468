"""The tuning memory end to end on real components (Optuna SQLite, a real MLflow sqlite store, a
local Ray, the simulated engine): a study's fingerprint and best on its run, a second compatible
study seeded with that best right after its defaults and measuring it anew, an incompatible one
skipped with the reason, and `nightshift history` listing them newest first."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow import MlflowClient

from optimizer.cli import main
from optimizer.results.trial_record import ATTR_SEED_SOURCE
from tests import builders

pytestmark = pytest.mark.slow


def write_study(tmp_path: Path, name: str, **overrides: Any) -> Path:
    """The study `name`, one trial at a time, its results under tmp_path/name; one MLflow store
    for all (the memory reads across studies)."""
    return builders.write_study(
        tmp_path, name=name, trials=2, file_name=f"{name}.yaml", max_parallel_trials=1,
        results_dir=str(tmp_path / name), **{"workload": {
            **builders.WORKLOAD, "levels": [{"concurrency": 8}]}, **overrides})


def trials_of(tmp_path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/{name}/optuna.db")
    return sorted(study.trials, key=lambda t: t.number)


def study_run(client: MlflowClient, name: str) -> Any:
    exp = client.get_experiment_by_name(name)
    return client.search_runs([exp.experiment_id],
                              filter_string="tags.`nightshift.kind` = 'study'")[0]


def test_second_compatible_study_is_seeded_with_the_first_best_and_measures_it_anew(
        tmp_path: Path, ray_cluster: None, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    client = MlflowClient(uri)
    # The first study measures the defaults and one seed fp8 config, which the simulated H200
    # runs faster: its best is a change from the defaults.
    first = write_study(tmp_path, "first",
                        seed_trials=[{"quantization": "fp8", "kv_cache_dtype": "fp8"}])
    assert main(["start", str(first), "--no-progress"]) == 0
    run = study_run(client, "first")
    tags = run.data.tags
    assert len(tags["fingerprint.hash"]) == 12 and tags["fingerprint.gpu_model"] == "NVIDIA H200"
    assert json.loads(tags["fingerprint.json"])["architecture"] == "Qwen2ForCausalLM"
    changes = json.loads(tags["best.changes"])
    assert changes, "precondition: the first study's best is not the defaults"
    first_trials = trials_of(tmp_path, "first")
    stored = optuna.load_study(study_name="first", storage=f"sqlite:///{tmp_path}/first/optuna.db")
    assert stored.user_attrs["fingerprint"]["gpu_count"] == 2, "the fingerprint is in Optuna too"
    assert stored.user_attrs["vllm_defaults"]["max_num_seqs"] == 1024, \
        "vLLM's defaults on the study's host (an H200), for the report's one-knob table"
    best_number = int(tags["best_trial"])
    best_record = first_trials[best_number].user_attrs["record"]
    first_ended = max(t.user_attrs["record"]["engine_ended_unix_s"] for t in first_trials)

    # A compatible second study (warm_start: auto, the default), another simulated seed.
    second = write_study(tmp_path, "second", simulated={
        "hardware": "h200", "num_gpus": 2, "startup_time_scale": 0.002, "seed": 7})
    capsys.readouterr()
    assert main(["start", str(second), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warm start: seeded from first" in err, "the CLI says which study seeded it and why"
    trials = trials_of(tmp_path, "second")
    assert trials[0].user_attrs.get("baseline") is True, "the defaults still run first"
    seeded = trials[1]
    assert seeded.user_attrs.get(ATTR_SEED_SOURCE) == "warm_start:first", \
        "the first's best runs right after the defaults, tagged with its source"
    assert {k: seeded.params[k] for k in changes} == changes, "the first study's best config"
    record = seeded.user_attrs["record"]
    assert record["seed_source"] == "warm_start:first"
    assert record["state"] == "complete" and record["steps"], "it was measured here"
    assert record["engine_started_unix_s"] > first_ended, \
        "its engine ran in this study, after the first study's had ended"
    assert record["values"] != best_record["values"] and \
        record["metrics"] != best_record["metrics"], \
        "the earlier study's figures are never copied into the new study's record"
    second_run = study_run(client, "second")
    assert "seeded from first" in second_run.data.tags["warm_start"]
    child = client.search_runs(
        [second_run.info.experiment_id],
        filter_string="tags.`nightshift.trial` = '1' and tags.`nightshift.kind` = 'trial'")[0]
    assert child.data.tags["seed.source"] == "warm_start:first"
    assert child.data.metrics.get("headline.request_goodput") == \
        record["metrics"]["request_goodput"], "the run logs this study's own measurement"

    # An incompatible study (prompts 16x longer): skipped with the reason, nothing seeded.
    third = write_study(tmp_path, "third", budget={"trials": 1},
                        workload={"input_len": 2048, "output_len": 16,
                                  "levels": [{"concurrency": 8}], "num_requests": 16,
                                  "warmup_requests": 2})
    capsys.readouterr()
    assert main(["start", str(third), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warm start: skipped first: input_len_mean: 128 there, 2048 here" in err, err
    assert all(ATTR_SEED_SOURCE not in t.user_attrs for t in trials_of(tmp_path, "third"))
    assert "skipped second: input_len_mean" in study_run(client, "third").data.tags["warm_start"]

    # history: the three studies, newest first; --trials lists each trial's conclusion.
    capsys.readouterr()
    assert main(["history", "--model", "qwen2.5-7b", "--tracking-uri", uri, "--trials"]) == 0
    out = capsys.readouterr().out
    positions = [out.index(f"\n{name} ") for name in ("third", "second", "first")]
    assert positions == sorted(positions), f"newest first:\n{out}"
    assert "[warm_start:first]" in out, "--trials shows which trial a warm start seeded"
    assert main(["history", "--fingerprint", tags["fingerprint.hash"], "--tracking-uri",
                 uri]) == 0
    out = capsys.readouterr().out
    assert "\nfirst " in out and "\nsecond " in out and "\nthird " not in out, \
        "the two studies of one fingerprint (the simulated seed is not part of it)"
    assert main(["history", "--study", str(second)]) == 0
    out = capsys.readouterr().out
    assert "\nfirst " in out and "\nthird " not in out, "--study lists compatible studies"
    assert "\nsecond (this study) " in out, "and its own study, marked"
