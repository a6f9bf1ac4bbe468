"""Trials run side by side where their GPUs allow, judged by the engine processes' own lives
(launch to teardown), not by when Optuna asked for the trials."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from optimizer.cli import main
from tests.builders import categorical_space, load, trial_runs, write_study


def engine_intervals(tmp_path: Path) -> dict[int, tuple[float, float]]:
    """Trial number -> (engine launched, engine ended), Unix seconds, of every launched trial."""
    out = {}
    for trial in load(tmp_path).trials:
        record = trial.user_attrs.get("record") or {}
        start, end = record.get("engine_started_unix_s"), record.get("engine_ended_unix_s")
        if start is not None and end is not None:
            out[trial.number] = (float(start), float(end))
    return out


def overlapping(intervals: dict[int, tuple[float, float]]) -> set[frozenset[int]]:
    return {frozenset((a, b)) for (a, (s1, e1)), (b, (s2, e2))
            in itertools.combinations(intervals.items(), 2) if s1 < e2 and s2 < e1}


@pytest.mark.slow
def test_a_trial_waiting_for_two_gpus_does_not_hold_back_one_that_fits(
        tmp_path: Path, ray_cluster: None) -> None:
    # Two GPUs. The defaults take one; the next config asked (TP 2) needs both and must wait;
    # the one after it (TP 1) fits beside the defaults and must not wait behind it.
    space = categorical_space(tmp_path, tensor_parallel_size=[1, 2],
                              kv_cache_dtype=["auto", "fp8"])
    path = write_study(tmp_path, trials=3, search_space=str(space),
                       seed_trials=[{"tensor_parallel_size": 2}, {"kv_cache_dtype": "fp8"}],
                       workload={"input_len": 128, "output_len": 160,
                                 "levels": [{"concurrency": 4}], "num_requests": 24,
                                 "warmup_requests": 1})
    assert main(["start", str(path), "--no-progress"]) == 0

    intervals = engine_intervals(tmp_path)
    assert sorted(intervals) == [0, 1, 2], "the defaults and both seeds ran an engine"
    trials = {t.number: t for t in load(tmp_path).trials}
    assert trials[1].params["tensor_parallel_size"] == 2
    pairs = overlapping(intervals)
    assert frozenset((0, 2)) in pairs, \
        f"the 1-GPU trial ran beside the defaults, not behind the 2-GPU one: {intervals}"
    assert not [p for p in pairs if 1 in p], \
        f"the 2-GPU trial ran alone: two GPUs hold no third engine: {intervals}"
    record = trials[2].user_attrs["record"]
    assert record["engine_started_unix_s"] < record["engine_ended_unix_s"]
    # A trial beside the defaults may end first: its conclusion still compares it with them
    # (it is recorded once they are measured), in Optuna and so in MLflow and the report.
    for number in (1, 2):
        conclusion = trials[number].user_attrs["record"]["conclusion"]
        assert "x the vLLM defaults" in conclusion and "no defaults measurement" not in \
            conclusion, f"trial {number} is compared with the defaults: {conclusion}"


@pytest.mark.slow
def test_a_trial_that_ends_before_the_defaults_is_still_compared_with_them(
        tmp_path: Path, ray_cluster: None) -> None:
    # Two GPUs, two 1-GPU trials side by side: the defaults and fp8 weights, which the
    # simulated engine serves faster, so it usually ends first. Its conclusion (Optuna, MLflow)
    # compares it with the defaults all the same: it is recorded once they are measured.
    space = categorical_space(tmp_path, quantization=["none", "fp8"])
    path = write_study(tmp_path, trials=2, search_space=str(space),
                       seed_trials=[{"quantization": "fp8"}],
                       workload={"input_len": 128, "output_len": 256,
                                 "levels": [{"concurrency": 4}], "num_requests": 24,
                                 "warmup_requests": 1})
    assert main(["start", str(path), "--no-progress"]) == 0

    intervals = engine_intervals(tmp_path)
    assert frozenset((0, 1)) in overlapping(intervals), f"side by side: {intervals}"
    fp8 = load(tmp_path).trials[1]
    conclusion = fp8.user_attrs["record"]["conclusion"]
    assert "x the vLLM defaults" in conclusion and "no defaults measurement" not in conclusion, \
        f"compared with the defaults whichever ended first ({intervals}): {conclusion}"
    run = next(r for r in trial_runs(tmp_path) if r.data.tags["nightshift.trial"] == "1")
    assert run.data.tags["conclusion"] == conclusion, "MLflow holds the same conclusion"


def test_a_placement_no_node_of_the_cluster_offers_is_named_with_the_fix() -> None:
    # Issue 35: a ray.resources or ray.accelerator_type the cluster lacks left the trials
    # "running" for as long as one waited. As `ray.nodes()` reports a one-node local cluster:
    from optimizer.run.ray_cluster import placement_problem

    nodes = [{"Alive": True, "Resources": {"CPU": 4.0, "GPU": 2.0, "memory": 1e9,
                                           "node:127.0.0.1": 1.0,
                                           "accelerator_type:H100": 1.0}},
             {"Alive": False, "Resources": {"GPU": 8.0, "tuning_pool": 1.0}}]
    assert placement_problem(nodes, None, {}) is None
    assert placement_problem(nodes, "H100", {}) is None
    problem = placement_problem(nodes, "A100", {})
    assert problem is not None and problem.startswith("ray.accelerator_type:") \
        and "H100" in problem, problem
    problem = placement_problem(nodes, None, {"tuning_pool": 1.0})
    assert problem is not None and problem.startswith("ray.resources:") \
        and "ray start --resources" in problem, "a dead node's resources do not count"


def test_a_worker_ray_cannot_place_is_seen_unplaced_and_cut_at_once(
        tmp_path: Path, ray_cluster: None) -> None:
    # A placement that a node offered at the start may go with the node: the actor then waits
    # unmade. Polling it must not wait on it, and cutting it must not wait for it to answer.
    from types import SimpleNamespace

    from optimizer.run.ray_executor import RayExecutor

    executor = RayExecutor(None, total_gpus=2, resources={"nowhere": 1.0})  # type: ignore[arg-type]
    handle = executor.submit(SimpleNamespace(num_gpus=1), None, tmp_path)  # type: ignore[arg-type]
    assert not handle.is_placed(), "no node has the resource: the worker is never made"
    assert handle.poll() == [], "nothing measured, answered without waiting on the worker"
    handle.cancel()
    executor.release(handle, healthy=False)
    assert executor.gpus_busy == 0 and not executor.can_start(3)


def _unplaceable_daemon(tmp_path: Path, stop_at_start: bool) -> Any:
    """A daemon on the session's Ray whose trials need a resource no node has (as when the
    node that had it is gone): Ray holds their workers unplaced."""
    from optimizer.config import load_study
    from optimizer.run.daemon import Daemon
    from optimizer.run.events import TrialEvent
    from optimizer.run.ray_executor import RayExecutor
    from optimizer.tracking.study_summary import study_summary
    from optimizer.tracking.tracker import Tracker
    from search_spaces import load_space

    space_path = categorical_space(tmp_path, max_num_seqs=[256, 512])
    cfg = load_study(write_study(tmp_path, trials=2, search_space=str(space_path)))
    holder: list[Daemon] = []

    def on_event(event: TrialEvent) -> None:
        if stop_at_start and event.kind == "started":
            holder[0].request_stop()  # the stop SIGTERM makes

    daemon = Daemon(cfg, space=load_space(space_path).resolve({}),
                    executor=RayExecutor(None, total_gpus=2,  # type: ignore[arg-type]
                                         resources={"nowhere": 1.0}),
                    registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
                    workload=cfg.workload, study_params={},
                    study_artifacts={}, summarize=study_summary, on_event=on_event,
                    poll_s=0.05)
    holder.append(daemon)
    return daemon


def _assert_interrupted_and_closed(tmp_path: Path) -> None:
    trial = load(tmp_path).trials[0]
    assert trial.user_attrs["record"]["failure_reason"] == "interrupted", trial.user_attrs
    assert [t for t in load(tmp_path).trials if t.user_attrs.get("retry_of") == 0], \
        "re-queued for the resume"
    assert not [r for r in trial_runs(tmp_path) if r.info.status == "RUNNING"]


def test_a_stop_ends_a_trial_whose_worker_ray_never_placed(
        tmp_path: Path, ray_cluster: None) -> None:
    # Issue 35, item 5: SIGTERM did not end a study whose trials Ray held unplaced (the stop
    # waited for them to finish).
    import threading

    daemon = _unplaceable_daemon(tmp_path, stop_at_start=True)
    ended: list[Any] = []
    thread = threading.Thread(target=lambda: ended.append(daemon.run()), daemon=True)
    thread.start()
    thread.join(120)
    assert ended, "the stop ended the study (it waited for a trial Ray never placed)"
    assert ended[0].stopped_early
    _assert_interrupted_and_closed(tmp_path)


def test_a_placement_no_live_node_offers_any_more_fails_the_study_naming_the_field(
        tmp_path: Path, ray_cluster: None) -> None:
    # Issue 35, item 5, once the study runs: trials sat "running" with no message for as long
    # as one waited. Now the study fails in one line naming the field and the fix.
    from optimizer.errors import NightshiftError

    with pytest.raises(NightshiftError) as caught:
        _unplaceable_daemon(tmp_path, stop_at_start=False).run()
    message = str(caught.value)
    assert message.startswith("ray.resources: no node of the Ray cluster has") and \
        "ray start --resources" in message and "re-queued" in message, message
    _assert_interrupted_and_closed(tmp_path)
