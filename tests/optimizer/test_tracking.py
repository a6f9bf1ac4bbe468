"""MLflow tracking on a real sqlite store: parent/child runs, states, the catch-up on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient

from optimizer.errors import TrackingError
from optimizer.tracking.payload import TrialLog
from optimizer.tracking.store import artifact_root_for
from optimizer.tracking.tracker import CatchUp, Tracker


def test_parent_and_child_runs_nest_with_states(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("s1", key="k", params={"engine": "simulated"},
                                 artifacts={"study.json": {"name": "s1"}})
    assert tracker.start_study("s1", key="k", params={}, artifacts={}) == parent, \
        "a resumed study reuses its parent run"
    child = tracker.start_trial(parent, "s1", 0, {"max_num_seqs": 256})
    log = tmp_path / "server.log"
    log.write_text("hello")
    tracker.finish_trial(child, state="complete", metrics={"request_goodput": 3.5,
                                                           "bad": float("nan")},
                         step_metrics=[(0, {"p99_tpot_ms": 7.0}), (1, {"p99_tpot_ms": 9.0})],
                         tags={"conclusion": "new best."}, texts={"server.log": "tail"},
                         dicts={"launch.json": {"argv": ["vllm", "serve"]}}, files=[log])
    client = MlflowClient(uri)
    run = client.get_run(child)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.tags["state"] == "complete"
    assert run.data.tags["conclusion"] == "new best."
    assert run.data.params["max_num_seqs"] == "256"
    assert "bad" not in run.data.metrics, "non-finite metrics are not logged"
    history = client.get_metric_history(child, "p99_tpot_ms")
    assert sorted((m.step, m.value) for m in history) == [(0, 7.0), (1, 9.0)]
    names = {a.path for a in client.list_artifacts(child)}
    assert {"server.log", "launch.json"} <= names
    root = artifact_root_for(uri)
    assert root is not None and (root / "s1").is_dir(), "artifacts live beside the database"


def test_a_study_begun_anew_under_its_name_gets_a_parent_run_of_its_own(tmp_path: Path) -> None:
    """Its Optuna storage deleted and the study started again: the new trials 0, 1, ... must
    not land under the earlier parent run beside the earlier trials of those numbers."""
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db")
    first = tracker.start_study("s6", key="a", params={"budget": 3}, artifacts={})
    old_trial = tracker.start_trial(first, "s6", 0, {})
    second = tracker.start_study("s6", key="b", params={"budget": 5}, artifacts={})
    assert second != first, "a new Optuna study, a new parent run"
    assert tracker.start_study("s6", key="a", params={}, artifacts={}) == first, \
        "resuming the first study finds its own parent"
    assert tracker.find_trial_run("s6", second, 0) is None, "trial 0 of the first is not ours"
    assert tracker.find_trial_run("s6", first, 0) == old_trial
    assert tracker.catch_up("s6", second, []) == CatchUp(0, 0), \
        "the first study's run left RUNNING is not the second's to close"
    assert MlflowClient(tracker.tracking_uri).get_run(old_trial).info.status == "RUNNING"
    assert tracker.find_study_run("s6", "a") == first and tracker.find_study_run("s6") == second


def test_a_study_begun_before_keys_adopts_its_unkeyed_parent_run(tmp_path: Path) -> None:
    tracker = Tracker(f"sqlite:///{tmp_path}/mlflow.db")
    legacy = tracker.client.create_run(tracker.experiment_id("s7"), run_name="s7",
                                       tags={"nightshift.study": "s7",
                                             "nightshift.kind": "study"}).info.run_id
    assert tracker.start_study("s7", key="new", params={}, artifacts={},
                               adopt_unkeyed=True) == legacy
    assert tracker.find_study_run("s7", "new") == legacy, "the key is written on it"
    assert tracker.find_study_run("s7", "other") is None, "no parent of another study's key"


def test_catch_up_closes_runs_left_running_and_counts_only_those(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("s2", key="k", params={}, artifacts={})
    finished_in_optuna = tracker.start_trial(parent, "s2", 0, {})
    lost = tracker.start_trial(parent, "s2", 1, {})
    workdir = tmp_path / "trials" / "0002"
    workdir.mkdir(parents=True)
    (workdir / "server.log").write_text("engine log")
    done = tracker.catch_up("s2", parent, [
        TrialLog(0, finished_in_optuna, {}, {"state": "pruned", "metrics": {"x": 1.0},
                                             "tags": {"conclusion": "pruned."}}),
        TrialLog(2, None, {"max_num_seqs": 64}, {"state": "complete", "metrics": {"x": 2.0}},
                 workdir)])
    assert done == CatchUp(left_running=2, created=1), "the run it created is not counted"
    client = MlflowClient(uri)
    assert client.get_run(finished_in_optuna).info.status == "KILLED"
    lost_run = client.get_run(lost)
    assert lost_run.info.status == "FAILED"
    assert lost_run.data.tags["failure_reason"] == "daemon_lost"
    created = tracker.find_trial_run("s2", parent, 2)
    assert created is not None and client.get_run(created).info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(created)} == {"server.log"}, \
        "a run the catch-up creates gets the server log from the trial's workdir"
    assert tracker.catch_up("s2", parent, []) == CatchUp(0, 0), "nothing left RUNNING"


def test_finish_trial_replayed_logs_nothing_twice(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("s3", key="k", params={}, artifacts={})
    child = tracker.start_trial(parent, "s3", 0, {})
    payload: dict[str, Any] = {"state": "complete",
                               "metrics": {"goodput": 3.0, "tpot": 9.0},
                               "step_metrics": [(0, {"goodput": 2.0}), (1, {"goodput": 3.0})],
                               "texts": {"server.log": "tail"},
                               "dicts": {"record.json": {"a": 1}}}
    tracker.finish_trial(child, **payload)
    tracker.finish_trial(child, **payload)  # a replay of a call that died halfway
    client = MlflowClient(uri)
    history = client.get_metric_history(child, "goodput")
    assert sorted((m.step, m.value) for m in history) == [(0, 2.0), (0, 3.0), (1, 3.0)]
    assert len(client.get_metric_history(child, "tpot")) == 1


def test_unusable_store_is_a_tracking_error(tmp_path: Path) -> None:
    # A file where the store's directory should be: fails for root too (unlike chmod).
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(TrackingError, match="pass a writable --tracking-uri"):
        Tracker(f"sqlite:///{blocker}/sub/mlflow.db")


def _record(**kw: Any) -> Any:
    from optimizer.results.trial_record import TrialRecord

    base: dict[str, Any] = {
        "state": "complete", "params": {}, "conclusion": "fp8 weights: 1.32x the defaults.",
        "flags": {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": 4096},
        "values": (34.38,),
        "metrics": {"request_goodput": 34.38, "objective.goodput": 34.38,
                    "engine.startup_s": 90.0},
        "steps": ({"step": 0, "metrics": {"request_goodput": 10.58}},
                  {"step": 1, "metrics": {"request_goodput": 34.38}})}
    return TrialRecord(**{**base, **kw})


def test_runs_are_named_described_and_headline_figures_never_sit_on_a_level(
        tmp_path: Path) -> None:
    from optimizer.tracking.payload import tracking_payload

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("s4", key="k", params={}, artifacts={})
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("s4")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development", \
        "the UI opens the study on its runs, not on a GenAI overview"
    run = tracker.start_trial(parent, "s4", 3, {})
    tracker.finish_trial(run, **tracking_payload(
        _record(), None, number=3, fixed_flags={"max_model_len": 4096}))
    logged = client.get_run(run)
    assert logged.info.run_name == "t003 fp8+kv-fp8", "the changes, not the fixed flag"
    assert logged.data.tags["mlflow.note.content"] == "fp8 weights: 1.32x the defaults."
    levels = client.get_metric_history(run, "request_goodput")
    assert sorted((m.step, m.value) for m in levels) == [(0, 10.58), (1, 34.38)], \
        "the per-level series holds each level once"
    assert logged.data.metrics["headline.request_goodput"] == 34.38
    assert logged.data.metrics["objective.goodput"] == 34.38
    assert logged.data.metrics["engine.startup_s"] == 90.0, "a figure of no level keeps its name"


def test_confirmation_and_failed_runs_say_what_they_are(tmp_path: Path) -> None:
    from optimizer.tracking.payload import tracking_payload

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("s5", key="k", params={}, artifacts={})
    client = MlflowClient(uri)
    confirm = tracker.start_trial(parent, "s5", 14, {}, confirm="best")
    tracker.finish_trial(confirm, **tracking_payload(_record(), None, number=14,
                                                     confirm="best"))
    run = client.get_run(confirm)
    assert (run.data.tags["nightshift.kind"], run.data.tags["nightshift.confirm"]) == \
        ("confirmation", "best")
    assert run.info.run_name == "c014 confirm best"
    failed = tracker.start_trial(parent, "s5", 6, {})
    tracker.finish_trial(failed, **tracking_payload(
        _record(state="failed", values=None, failure_reason="interrupted"), None, number=6))
    metrics = client.get_run(failed).data.metrics
    assert "objective.goodput" not in metrics, "a failed trial has no objective value"
    assert metrics["headline.request_goodput"] == 34.38, "what its levels measured stays"
    # The catch-up finds a confirmation run by its trial number and replays the same payload.
    client.update_run(confirm, status="RUNNING")
    done = tracker.catch_up("s5", parent, [TrialLog(14, None, {}, tracking_payload(
        _record(), None, number=14, confirm="best"))])
    assert done == CatchUp(left_running=1, created=0)
    assert client.get_run(confirm).info.status == "FINISHED"
    assert len(client.get_metric_history(confirm, "request_goodput")) == 2, "nothing twice"
    assert tracker.find_trial_run("s5", parent, 14) == confirm


def test_a_store_written_before_the_mark_opens_on_runs_after_a_restart(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    client.create_experiment("old")
    Tracker(uri).start_study("old", key="k", params={}, artifacts={})
    assert client.get_experiment_by_name("old").tags["mlflow.experimentKind"] == \
        "custom_model_development"


def test_the_recommended_trial_is_marked_by_tag_and_name_and_the_mark_moves(
        tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("s", key="k", params={}, artifacts={})
    runs = {n: tracker.start_trial(parent, "s", n, {}) for n in (0, 1, 2)}
    figures = {1: {"goodput in req per s per GPU": 38.6, "gain vs defaults x": 1.32}}
    tracker.mark_trials(parent, 1, figures)
    client = MlflowClient(uri)
    marked = client.get_run(runs[1])
    assert marked.data.tags["nightshift.recommended"] == "true"
    assert marked.info.run_name == "★ recommended: t001"
    assert marked.data.metrics == figures[1]
    tracker.mark_trials(parent, 2, figures)
    assert "nightshift.recommended" not in client.get_run(runs[1]).data.tags
    assert client.get_run(runs[1]).info.run_name == "t001", "the mark moved"
    assert client.get_run(runs[2]).info.run_name == "★ recommended: t002"


def test_the_runs_view_opens_on_the_objective_the_gain_and_the_bottleneck() -> None:
    from optimizer.tracking.view import runs_view, three_digits, view_key

    columns = runs_view({"goodput": "maximize"})["selectedColumns"]
    assert columns[:3] == ["metrics.`goodput in req per s per GPU`",
                           "metrics.`gain vs defaults x`",
                           "tags.`bottleneck`"]
    assert view_key("tpot") == "tpot in ms TPOT p99" and three_digits(38.61234) == 38.6


def test_a_runs_description_starts_with_its_figure_and_simulated_timing_is_explained() -> None:
    from optimizer.tracking.payload import SIMULATED_TIMING, tracking_payload

    conclusion = ("quantization=fp8, kv_cache_dtype=fp8 vs the vLLM defaults: goodput 38.6 "
                  "req/s, 1.32x the vLLM defaults (one measurement each: no interval). "
                  "memory-bound.")
    simulated = ("/usr/bin/python3", "-m", "runners.simulated", "--port", "8000")
    tags = tracking_payload(_record(conclusion=conclusion, argv=simulated,
                                    engine={"engine_version": "0.26.0"}), None, number=1)["tags"]
    assert tags["mlflow.note.content"].startswith(
        "SIMULATED: goodput 38.6 req/s, 1.32x the vLLM defaults")
    assert tags["mlflow.note.content"].endswith(
        "Changes from the vLLM defaults: quantization=fp8, kv_cache_dtype=fp8.")
    assert tags["conclusion"] == conclusion, "the conclusion tag as the trial concluded"
    assert tags["timing"] == SIMULATED_TIMING
    real = tracking_payload(_record(argv=("vllm", "serve", "m"), engine={
        "engine_version": "0.26.0"}), None, number=1)
    assert "timing" not in real["tags"], "a real engine's start-up is its wall time"


def test_a_simulated_engines_run_says_simulated_in_its_name_description_and_tags(
        tmp_path: Path) -> None:
    """Defect 7 (session 13): a simulated trial's run read `★ recommended: t005 fp8+...`,
    "goodput 42.5 req/s, 1.29x the vLLM defaults ..." and `engine.engine_version: 0.26.0`,
    as a vLLM's measurement would; a run of vLLM is left as it was."""
    from optimizer.tracking.payload import tracking_payload

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri)
    parent = tracker.start_study("sim", key="k", params={}, artifacts={})
    client = MlflowClient(uri)
    simulated = ("/usr/bin/python3", "-m", "runners.simulated", "--port", "8000")
    engine = {"engine_version": "0.26.0"}
    runs = {}
    for number, argv, confirm in ((5, simulated, None), (7, simulated, "best"),
                                  (6, ("vllm", "serve", "m"), None)):
        run = tracker.start_trial(parent, "sim", number, {}, confirm=confirm)
        tracker.finish_trial(run, **tracking_payload(
            _record(argv=argv, engine=engine), None, number=number, confirm=confirm))
        runs[number] = run
    tracker.mark_trials(parent, 5)
    marked = client.get_run(runs[5])
    assert marked.info.run_name == "★ recommended: t005 sim fp8+kv-fp8+len4k"
    assert client.get_run(runs[7]).info.run_name == "c007 sim confirm best"
    for number in (5, 7):
        tags = client.get_run(runs[number]).data.tags
        assert tags["nightshift.engine"] == "simulated"
        assert tags["mlflow.note.content"].startswith("SIMULATED: "), tags
        assert tags["engine.engine_version"] == "simulated 0.26.0", \
            "the vLLM version modelled, never read as a vLLM that ran"
        assert tags["conclusion"] == "fp8 weights: 1.32x the defaults.", \
            "the conclusion the tuning memory reads stays the trial's own"
    real = client.get_run(runs[6])
    assert real.info.run_name == "t006 fp8+kv-fp8+len4k"
    assert "nightshift.engine" not in real.data.tags
    assert real.data.tags["mlflow.note.content"] == "fp8 weights: 1.32x the defaults."
    assert real.data.tags["engine.engine_version"] == "0.26.0"


def test_a_simulated_studys_run_is_tagged_simulated_and_never_confirmed(
        tmp_path: Path) -> None:
    """The study's run: its description starts "SIMULATED:", `nightshift.engine` says so and
    its `confirmed` tag is "false" for simulated repeats however tight their interval."""
    import optuna

    from optimizer.config import parse_study
    from optimizer.results.confirmation import confirm_summary
    from optimizer.tracking.study_summary import study_summary

    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}
    for argv, is_simulated in ((["python3", "-m", "runners.simulated"], True),
                               (["vllm", "serve", "m"], False)):
        cfg = parse_study({"name": "s", "model": {"path": "qwen2.5-7b"},
                           "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 10}})
        study = optuna.create_study(direction="maximize")
        for attrs, flags, value in (({"baseline": True}, {}, 32.90),
                                    ({}, {"quantization": "fp8"}, 42.48)):
            study.add_trial(optuna.trial.create_trial(
                params={"quantization": flags.get("quantization", "none")},
                distributions=dist, value=value, user_attrs={**attrs, "record": {
                    "state": "complete", "params": flags, "flags": flags,
                    "values": [value], "metrics": {}, "argv": argv,
                    "conclusion": "x", "is_baseline": bool(attrs)}}))
        study.set_user_attr("confirm", confirm_summary(
            "goodput", 1, 0, [{"defaults": 32.90, "best": 42.48}] * 2,
            is_simulated=is_simulated))
        _, tags = study_summary(study, cfg)
        assert tags["mlflow.note.content"].startswith("SIMULATED: ") == is_simulated
        assert ("nightshift.engine" in tags) == is_simulated
        assert tags["confirmed"] == ("false" if is_simulated else "true")


def test_a_baseline_that_ran_fixed_flags_is_named_and_described_as_the_baseline() -> None:
    """The run name and description may say what the baseline ran; tag names stay."""
    from optimizer.results.baseline_words import baseline_words
    from optimizer.tracking.payload import description_of, run_name

    fixed = {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_model_len": 4096}
    baseline = _record(is_baseline=True)
    assert run_name(0, baseline, fixed) == "t000 baseline"
    assert run_name(0, _record(is_baseline=True, flags={})) == "t000 defaults"
    words = baseline_words(fixed)
    conclusion = ("max_num_seqs=512 vs the baseline (vLLM defaults + your fixed flags): "
                  "goodput 12 req/s, 1.20x the baseline (vLLM defaults + your fixed flags) "
                  "(one measurement each: no interval).")
    assert description_of(conclusion, words=words) == (
        "goodput 12 req/s, 1.20x the baseline (vLLM defaults + your fixed flags) (one "
        "measurement each: no interval). Changes from the baseline (vLLM defaults + your "
        "fixed flags): max_num_seqs=512."), "the figure first, as without fixed flags"
    assert description_of("max_num_seqs=512 vs the vLLM defaults: goodput 12 req/s.") == \
        "goodput 12 req/s. Changes from the vLLM defaults: max_num_seqs=512."
