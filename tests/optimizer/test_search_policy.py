"""The search policy and the daemon loop without Ray or engines: a scripted runner on the inline
executor, a real Optuna storage and a real MLflow store, a study in seconds."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from optimizer.config import load_study
from optimizer.results.trial_record import (
    ATTR_BASELINE,
    ATTR_CONFIRM,
    ATTR_DUPLICATE_OF,
    record_of,
)
from optimizer.run.daemon import Daemon
from optimizer.run.executor import InlineExecutor
from optimizer.search.controller import SearchController
from optimizer.storage.study import count_trials
from optimizer.tracking.study_summary import study_summary
from optimizer.tracking.tracker import Tracker
from runners.base import (
    BenchmarkMetrics,
    EngineConfig,
    Failure,
    FailureReason,
    RunResult,
    StepMetrics,
)
from runners.workload import Workload
from search_spaces import load_space
from tests.builders import benchmark_metrics, categorical_space, search_setup, write_study

# flags -> goodput, or the reason its engine failed (None: OOM at start)
Script = Callable[[Mapping[str, Any]], float | FailureReason | None]


def _metrics(goodput: float, throughput: float) -> BenchmarkMetrics:
    return benchmark_metrics(1.0, completed=16, total_input_tokens=1, total_output_tokens=1,
                             request_throughput=throughput, request_goodput=goodput,
                             output_throughput=100 * goodput, total_token_throughput=1.0)


class ScriptedRunner:
    """A `Runner` whose goodput at each level is `script(flags)` (half of it, with twice the
    throughput, at the first level: a level that missed the SLO); a `FailureReason` fails the
    run with it, None with an OOM at start."""

    def __init__(self, script: Script, launched: list[dict[str, Any]]) -> None:
        self.script = script
        self.launched = launched

    def run(self, config: EngineConfig, workload: Workload, workdir: Path,
            on_step: Callable[[StepMetrics], bool] | None = None) -> RunResult:
        self.launched.append(dict(config.flags))
        value = self.script(config.flags)
        if value is None or isinstance(value, FailureReason):
            reason = value or FailureReason.OOM_AT_START
            return RunResult(status="failed", failure=Failure(reason, f"scripted {reason}"))
        steps = []
        for index, level in enumerate(workload.levels):
            goodput = value * (0.5 if index == 0 else 1.0)
            step = StepMetrics(step=index, level=level, metrics=_metrics(goodput, 2 * value))
            steps.append(step)
            if on_step is not None and on_step(step):
                return RunResult(status="stopped", steps=tuple(steps))
        return RunResult(status="complete", steps=tuple(steps))

    def close(self) -> None:
        return None


def _run_daemon(tmp_path: Path, script: Script, *, trials: int,
                **choices: list[Any]) -> tuple[optuna.Study, list[dict[str, Any]]]:
    space_path = categorical_space(tmp_path, **choices)
    cfg = load_study(write_study(tmp_path, trials=trials, search_space=str(space_path)))
    space = load_space(space_path).resolve({})
    launched: list[dict[str, Any]] = []
    daemon = Daemon(cfg, space=space, executor=InlineExecutor(
        lambda: ScriptedRunner(script, launched), total_gpus=2),
        registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01)
    summary = daemon.run()
    assert summary.total_finished >= 1
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage_url), launched


def test_the_daemon_runs_a_study_on_the_inline_executor_without_ray(tmp_path: Path) -> None:
    seqs = [256, 64, 128, 512]
    study, launched = _run_daemon(tmp_path, lambda flags: float(flags.get("max_num_seqs") or
                                                                256) / 10,
                                  trials=6, max_num_seqs=seqs, kv_cache_dtype=["auto", "fp8"])
    trials = study.get_trials(deepcopy=False)
    first = min(trials, key=lambda t: t.number)
    assert first.user_attrs.get(ATTR_BASELINE), "the defaults run first"
    keys = [tuple(sorted(flags.items())) for flags in launched]
    assert len(keys) == len(set(keys)), "no config is launched twice"
    records = [r for t in trials if (r := record_of(t)) is not None]
    assert all(r.conclusion for r in records), "every finished trial has its conclusion"
    assert sum(1 for t in trials if ATTR_DUPLICATE_OF not in t.user_attrs
               and t.state.is_finished()) == 6, "the budget counts launched trials"


@pytest.mark.parametrize(("reason", "is_one_off"), [
    (FailureReason.CRASH_MID_RUN, True), (FailureReason.HANG, True),
    (FailureReason.STARTUP_TIMEOUT, True), (FailureReason.STARTUP_CRASH, True),
    (FailureReason.OOM_AT_START, False), (FailureReason.CUDA_GRAPH_CAPTURE, False),
])
def test_an_engine_fault_fails_its_trial_and_only_a_one_off_of_the_defaults_is_retried(
        tmp_path: Path, reason: FailureReason, is_one_off: bool) -> None:
    """Every trial's engine fails (a fault in `fixed_flags` does that end to end): each is
    failed with its reason and a conclusion, and the study goes on. A crash, a hang or a failed
    start may be one-off: the defaults (every gain's reference) get one retry; a config
    failure repeats and is not retried."""
    study, launched = _run_daemon(tmp_path, lambda flags: reason, trials=2,
                                  max_num_seqs=[256, 512, 1024])
    records = [record_of(t) for t in study.trials]
    assert len(launched) == len(records) == 2 + is_one_off
    assert all(r is not None and r.state == "failed" and r.failure_reason == reason.value
               and r.conclusion for r in records), records
    assert sum(r is not None and r.is_baseline for r in records) == 1 + is_one_off


def test_a_one_off_crash_of_the_defaults_is_retried_and_the_retry_is_every_gains_reference(
        tmp_path: Path) -> None:
    """The defaults' engine crashes once (as a kill mid-run would leave it): they are queued
    again as the defaults, measured the second time, and the other trials are compared with
    that measurement; the study has its baseline (no "No baseline" in its report)."""
    from optimizer.results.conclusion import baseline_trial
    from optimizer.results.recommendation import no_baseline_reason

    crashes = itertools.count()

    def crash_the_defaults_once(flags: Mapping[str, Any]) -> float | FailureReason:
        if "max_num_seqs" not in flags and next(crashes) == 0:
            return FailureReason.CRASH_MID_RUN
        return float(flags.get("max_num_seqs") or 1024) / 10

    study, launched = _run_daemon(tmp_path, crash_the_defaults_once, trials=2,
                                  max_num_seqs=[1024, 256, 512])
    trials = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    lost = trials[0]
    assert lost.user_attrs[ATTR_BASELINE] is True and lost.state == TrialState.FAIL
    retry = [t for t in trials if t.user_attrs.get("retry_of") == lost.number]
    assert len(retry) == 1 and retry[0].user_attrs.get(ATTR_BASELINE) is True, \
        "the defaults are queued again, as the defaults"
    record = record_of(retry[0])
    assert record is not None and record.state == "complete", "and measured the second time"
    baseline = baseline_trial(study)
    assert baseline is not None and baseline.number == retry[0].number
    assert no_baseline_reason(study) is None, "the study has its baseline"
    others = [r for t in trials if not t.user_attrs.get(ATTR_BASELINE)
              and (r := record_of(t)) is not None and r.state == "complete"]
    assert others and all("vs the vLLM defaults" in r.conclusion for r in others), \
        "the other trials are compared with the retried defaults"
    assert len(launched) == 3, "two trials and one retry"


def test_a_config_failure_teaches_the_sampler_with_the_worst_value_and_a_constraint(
        tmp_path: Path) -> None:
    study, _ = _run_daemon(tmp_path, lambda flags: None if flags.get("kv_cache_dtype") ==
                           "fp8" else 10.0, trials=3, kv_cache_dtype=["auto", "fp8"],
                           max_num_seqs=[256, 512])
    failed = [t for t in study.get_trials(deepcopy=False)
              if (r := record_of(t)) is not None and r.state == "failed"
              and r.failure_reason == "oom_at_start"]
    assert failed, "the scripted OOM ran"
    for trial in failed:
        assert trial.state == TrialState.COMPLETE and trial.values == [0.0], \
            "TPE learns from it: complete, with the worst value"
        assert trial.constraints and max(trial.constraints.values()) > 0, "and infeasible"


def _policy(tmp_path: Path, seed: int = 0, **choices: list[Any]) -> SearchController:
    cfg, space, study = search_setup(tmp_path, choices, trials=20,
                                     sampler={"name": "tpe", "seed": seed})
    policy = SearchController(cfg, space, study, workload=cfg.workload, total_gpus=2)
    policy.prepare()
    return policy


def test_a_trial_measured_before_the_defaults_is_recorded_after_them(tmp_path: Path) -> None:
    # max_num_seqs under 256 sets the CUDA-graph capture sizes, a part of vLLM's compile key:
    # the two trials compile different keys, so neither waits for the other's compile.
    policy = _policy(tmp_path, max_num_seqs=[16, 32, 64])
    defaults = policy.next_launch(lambda num_gpus: True)
    other = policy.next_launch(lambda num_gpus: True)
    assert defaults is not None and defaults.is_baseline and other is not None
    levels = policy.workload.levels
    done = RunResult(status="complete", steps=tuple(
        StepMetrics(step=i, level=level, metrics=_metrics(5.0, 5.0))
        for i, level in enumerate(levels)))
    policy.on_result(other, done)
    assert record_of(policy.study.get_trials(deepcopy=False)[other.trial.number]) is None, \
        "held: the defaults are still running"
    policy.on_result(defaults, done)
    held = record_of(policy.study.get_trials(deepcopy=False)[other.trial.number])
    assert held is not None, "recorded once the defaults were"
    assert "vs the vLLM defaults" in held.conclusion and \
        "no defaults measurement" not in held.conclusion, held.conclusion


def test_a_trial_stopped_in_flight_again_and_again_is_re_queued_each_time(
        tmp_path: Path) -> None:
    policy = _policy(tmp_path, max_num_seqs=[256, 512])  # retries: 1, the default
    numbers = []
    for _ in range(3):  # `stop --now` three nights running, each time during the defaults
        running = policy.next_launch(lambda num_gpus: not policy.running)
        assert running is not None and running.is_baseline, "the defaults, re-queued as such"
        numbers.append(running.trial.number)
        policy.interrupted(running)
    trials = policy.study.get_trials(deepcopy=False)
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    assert [t.user_attrs["retry_of"] for t in waiting] == [numbers[-1]], \
        "re-queued after every stop, as its record says"
    assert waiting[0].user_attrs["retries"] == 0, "a stop spends none of its retries"


def test_a_lost_trials_record_says_whether_it_was_re_queued(tmp_path: Path) -> None:
    policy = _policy(tmp_path, max_num_seqs=[256, 512])  # retries: 1, the default
    lost = RunResult(status="failed", failure=Failure(FailureReason.WORKER_LOST,
                                                      "the Ray worker running this trial died."))
    conclusions = []
    for _ in range(2):  # the defaults' worker dies, and again under its retry
        running = policy.next_launch(lambda num_gpus: not policy.running)
        assert running is not None and running.is_baseline
        policy.on_result(running, lost)
        record = record_of(policy.study.get_trials(deepcopy=False)[running.trial.number])
        assert record is not None
        conclusions.append(record.conclusion)
    assert conclusions[0].endswith("died; re-queued."), conclusions[0]
    assert conclusions[1].endswith("died; not re-queued (retried 1 times already)."), \
        "a trial out of retries is not said to be re-queued"


def test_a_trial_the_stop_left_waiting_for_gpus_is_not_launched_not_rejected(
        tmp_path: Path) -> None:
    policy = _policy(tmp_path, max_num_seqs=[256, 512])
    room = iter([True])  # room to ask for a trial, then none for its GPUs
    assert policy.next_launch(lambda num_gpus: next(room, False)) is None and policy.waiting
    number = policy.waiting[0].trial.number
    policy.release_waiting()  # the daemon stops
    record = record_of(policy.study.get_trials(deepcopy=False)[number])
    assert record is not None and record.conclusion.startswith("not launched (interrupted)"), \
        "only a config refused for what it is is 'rejected before launch'"
    counts = count_trials(policy.study.get_trials(deepcopy=False))
    assert counts.by_state["failed"] == 0 and counts.not_launched == 1 and counts.queued == 1
    assert "1 stopped before launch (re-queued); 1 queued" in counts.describe(), \
        "a trial that never launched is not counted failed after a Ctrl-C"


@pytest.mark.parametrize("seed", range(3))
def test_the_policy_never_hands_out_a_config_twice(tmp_path: Path, seed: int) -> None:
    (tmp_path / str(seed)).mkdir()
    policy = _policy(tmp_path / str(seed), seed, max_num_seqs=[256, 512],
                     kv_cache_dtype=["auto"])
    handed: list[str] = []
    for _ in itertools.repeat(None, 10):
        running = policy.next_launch(lambda num_gpus: not policy.running)
        if running is None:
            break
        handed.append(repr(sorted(running.params.items())))
        policy.on_result(running, RunResult(status="complete", steps=tuple(
            StepMetrics(step=i, level=level, metrics=_metrics(5.0, 5.0))
            for i, level in enumerate(policy.workload.levels))))
    assert len(handed) == len(set(handed)) == 2, "two configs in the space, each once"


def test_a_store_that_refuses_the_study_run_starts_nothing_with_one_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store passed the start-up check and broke before the study's run was opened."""
    from optimizer.errors import TrackingError

    space_path = categorical_space(tmp_path, max_num_seqs=[256, 512])
    cfg = load_study(write_study(tmp_path, trials=2, search_space=str(space_path)))
    tracker = Tracker(cfg.tracking_uri)

    def refuse(*args: Any, **kwargs: Any) -> str:
        raise OSError("disk full")

    monkeypatch.setattr(tracker, "start_study", refuse)
    launched: list[dict[str, Any]] = []
    daemon = Daemon(cfg, space=load_space(space_path).resolve({}), executor=InlineExecutor(
        lambda: ScriptedRunner(lambda flags: 1.0, launched), total_gpus=1),
        registry_dir=tmp_path / "engines", tracker=tracker,
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01)
    with pytest.raises(TrackingError, match="nothing was launched"):
        daemon.run()
    assert not launched, "no engine started"
    from optimizer.storage.lock import read_lock, study_lock_path

    assert read_lock(study_lock_path(cfg)) is None, "the study's lock is free again"


def test_a_confirmation_never_takes_a_seed_still_queued_beyond_the_budget(
        tmp_path: Path) -> None:
    """Seeds beyond `budget.trials` stay queued for a later resume; the confirmation rounds are
    trials of their own with the defaults' and the best's configs (Optuna's `ask` would hand out
    the oldest queued trial first)."""
    space_path = categorical_space(tmp_path, max_num_seqs=[256, 64, 128, 512])
    cfg = load_study(write_study(
        tmp_path, trials=2, search_space=str(space_path), confirm_rounds=1))
    space = load_space(space_path).resolve({})
    launched: list[dict[str, Any]] = []
    daemon = Daemon(cfg, space=space, executor=InlineExecutor(
        lambda: ScriptedRunner(lambda flags: 1000.0 / float(flags.get("max_num_seqs") or 256),
                               launched), total_gpus=2),
        registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01, seed_trials=[
            {**space.defaults(), "max_num_seqs": n} for n in (64, 128, 512)])
    daemon.run()
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    trials = study.get_trials(deepcopy=False)
    confirms = [t for t in trials if ATTR_CONFIRM in t.user_attrs]
    assert sorted(t.user_attrs[ATTR_CONFIRM] for t in confirms) == ["best", "defaults"]
    by_label = {t.user_attrs[ATTR_CONFIRM]: t.params.get("max_num_seqs") for t in confirms}
    assert by_label == {"defaults": 256, "best": 64}, "the defaults and the best, re-measured"
    waiting = [t.params or t.system_attrs.get("fixed_params", {}) for t in trials
               if t.state == TrialState.WAITING]
    assert [w.get("max_num_seqs") for w in waiting] == [128, 512], "later seeds stay queued"
    assert len(launched) == 4, "2 trials of the budget and 2 confirmation runs"


def test_a_fixed_flag_is_no_trials_change_in_its_conclusion(tmp_path: Path) -> None:
    """The baseline runs the study's fixed flags too (the H200 widened study's conclusions named
    its fixed max_model_len=4096 as a change): a trial's conclusion names only what it changes."""
    space_path = categorical_space(tmp_path, max_num_seqs=[256, 64],
                                   max_model_len=[32768, 4096])
    cfg = load_study(write_study(tmp_path, trials=2, search_space=str(space_path),
                                 fixed_flags={"max_model_len": 4096}))
    space, _ = load_space(space_path).resolve({}).with_fixed({"max_model_len": 4096})
    daemon = Daemon(cfg, space=space, executor=InlineExecutor(
        lambda: ScriptedRunner(lambda flags: 1000.0 / float(flags.get("max_num_seqs") or 256),
                               []), total_gpus=2),
        registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01,
        seed_trials=[{**space.defaults(), "max_num_seqs": 64}])
    daemon.run()
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    records = {t.number: record_of(t) for t in study.get_trials(deepcopy=False)}
    seeded = records[1]
    assert seeded is not None and seeded.params["max_model_len"] == 4096
    assert "max_num_seqs=64" in seeded.conclusion
    assert "max_model_len" not in seeded.conclusion
    # ... and names the baseline as it ran: with the fixed flag, never "the vLLM defaults".
    baseline = records[0]
    assert baseline is not None and baseline.conclusion.startswith(
        "vLLM defaults + your fixed flags (max_model_len=4096): "), baseline.conclusion
    assert "vs the baseline (vLLM defaults + your fixed flags)" in seeded.conclusion
    assert "the vLLM defaults" not in seeded.conclusion, seeded.conclusion


class _LostRunner(ScriptedRunner):
    """Its worker dies under every trial, as when the local Ray's raylet is gone."""

    def run(self, config: EngineConfig, workload: Workload, workdir: Path,
            on_step: Callable[[StepMetrics], bool] | None = None) -> RunResult:
        self.launched.append(dict(config.flags))
        return RunResult(status="failed", failure=Failure(FailureReason.WORKER_LOST,
                                                          "scripted ActorDiedError"))


class _NodeGoneExecutor(InlineExecutor):
    """The lost worker's node went with it: Ray places nothing again (as RayExecutor finds a
    dead local raylet: tests/test_faults_ray.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.placing: list[int] = []  # placing_gpus of each call

    def shrink_to_live(self, timeout_s: float = 30.0, *, placing_gpus: int = 0) -> int:
        self.placing.append(placing_gpus)
        self.total_gpus = 0
        return 0


def test_a_lost_worker_whose_gpus_are_gone_stops_the_study_instead_of_waiting_forever(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    space_path = categorical_space(tmp_path, max_num_seqs=[256, 512])
    cfg = load_study(write_study(tmp_path, trials=4, search_space=str(space_path)))
    launched: list[dict[str, Any]] = []
    executor = _NodeGoneExecutor(lambda: _LostRunner(lambda flags: 1.0, launched), total_gpus=1)
    resume = f"nightshift start {cfg.source} --storage 'sqlite:///a b.db'"
    daemon = Daemon(cfg, space=load_space(space_path).resolve({}), executor=executor,
                    registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
                    workload=cfg.workload, study_params={},
                    study_artifacts={}, summarize=study_summary, poll_s=0.01, resume=resume)
    summary = daemon.run()
    assert summary.stopped_early, "stopped, for a resume once Ray is back"
    assert len(launched) == 1, "nothing launched on GPUs Ray no longer has"
    assert executor.placing == [1], "the lost worker's GPUs must be placed again first"
    assert f"resume with `{resume}`" in caplog.text, "the resume command as the CLI gave it"
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    assert [t.user_attrs.get("retry_of") for t in study.get_trials(
        deepcopy=False, states=(TrialState.WAITING,))] == [0], "the lost trial is re-queued"


def test_a_two_gpu_trial_is_told_and_compared_per_gpu(tmp_path: Path) -> None:
    # The quickstart's case: two replicas serve 1.45x the defaults on one GPU, 0.72x per GPU.
    study, launched = _run_daemon(
        tmp_path, lambda flags: 14.5 if flags.get("data_parallel_size") == 2 else 10.0,
        trials=2, data_parallel_size=[1, 2])
    assert any(flags.get("data_parallel_size") == 2 for flags in launched)
    dp2 = next(t for t in study.get_trials(deepcopy=False)
               if t.params.get("data_parallel_size") == 2)
    assert dp2.values == [7.25], "Optuna is told goodput per GPU"
    assert dp2.intermediate_values[1] == 7.25, "the pruner compares per GPU too"
    record = record_of(dp2)
    assert record is not None and record.num_gpus == 2
    assert record.metrics["objective.goodput"] == 14.5, "MLflow keeps the raw figure"
    assert record.metrics["objective.goodput.per_gpu"] == 7.25
    assert "goodput 14.5 req/s on 2 GPUs = 7.25 req/s per GPU, 0.72x the vLLM defaults per " \
        "GPU" in record.conclusion, record.conclusion
    assert study.best_trial.params.get("data_parallel_size") in (None, 1), \
        "two copies of the defaults serve more: the defaults stay the best"
