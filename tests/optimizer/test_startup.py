"""The start-up plan of the search policy (optimizer/search/startup.py): warm compile keys first,
one compile of a key at a time, the warm-cache check's variable, what a record keeps of a start-up,
and the study file's `startup` section (savers, refusals)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from optimizer.config import load_study
from optimizer.errors import ConfigError
from optimizer.export import trial_env as export_env
from optimizer.search.controller import SearchController
from optimizer.search.startup import CompileCaches, launch_order, startup_record
from optimizer.storage.study import engine_config, make_sampler, startup_saver_env
from runners.base import EngineConfig, EngineInfo, RunResult, StepMetrics
from runners.vllm.compile_cache import compile_key
from search_spaces import load_space
from tests.builders import categorical_space, search_setup, write_study
from tests.optimizer.test_search_policy import _metrics


def _key(flags: dict[str, Any]) -> Any:
    return compile_key(EngineConfig("/m", flags))


def test_warm_keys_start_first_and_a_key_being_compiled_waits() -> None:
    caches = CompileCaches()
    cold, warm, eager = _key({"block_size": 32}), _key({}), None
    caches.warm.add(warm.digest)
    items = [cold, warm, eager]
    order = launch_order(items, lambda k: k, caches, is_reserved=lambda k: False)
    assert order == [1, 2, 0], "warm, then no compile at all, then the cold one"
    caches.launched(7, cold, caches.predict(cold))
    assert launch_order(items, lambda k: k, caches, is_reserved=lambda k: False) == [1, 2], \
        "trial 7 compiles that key: the other trial of it waits"
    caches.started(7, cold)
    assert caches.predict(cold) == "warm" and not caches.is_compiling(cold)
    assert launch_order(items, lambda k: k, caches, is_reserved=lambda k: k is cold)[0] == 0, \
        "one holding the next free GPUs goes first whatever its key"


def _policy(tmp_path: Path, **startup: Any) -> SearchController:
    cfg, space, study = search_setup(tmp_path, {"gpu_memory_utilization": [0.9, 0.8, 0.7]},
                                     trials=10, sampler={"name": "tpe", "seed": 0},
                                     startup=startup)
    policy = SearchController(cfg, space, study, workload=cfg.workload, total_gpus=2)
    policy.prepare()
    return policy


def _step(policy: SearchController) -> StepMetrics:
    return StepMetrics(step=0, level=policy.workload.levels[0], metrics=_metrics(5.0, 5.0))


def test_the_policy_never_compiles_one_key_twice_at_once(tmp_path: Path) -> None:
    policy = _policy(tmp_path, verify_warm=True)
    first = policy.next_launch(lambda n: True)
    assert first is not None and first.prediction == "cold"
    assert "VLLM_FORCE_AOT_LOAD" not in first.config.env, "a cold start is not checked"
    assert policy.next_launch(lambda n: True) is None, \
        "gpu_memory_utilization is outside vLLM's key: the next trial waits for the compile"
    assert policy.waiting, "it is asked and waits"
    policy.on_step(first, _step(policy))  # the engine served: its compile is on disk
    second = policy.next_launch(lambda n: True)
    assert second is not None and second.prediction == "warm"
    assert second.config.env.get("VLLM_FORCE_AOT_LOAD") == "1", "startup.verify_warm"
    assert compile_key(second.config) == first.compile_key, "the check is outside the key"


def test_without_ordering_trials_of_one_key_start_side_by_side(tmp_path: Path) -> None:
    policy = _policy(tmp_path, order_by_compile_key=False)
    assert policy.next_launch(lambda n: True) is not None
    assert policy.next_launch(lambda n: True) is not None


def test_a_record_says_whether_the_prediction_held(tmp_path: Path) -> None:
    key = _key({})
    warm = RunResult(status="complete", argv=("vllm",), engine=EngineInfo(
        startup_s=70.0, model_load_s=3.0, compile_s=2.9, graph_capture_s=5.0,
        compile_cache="warm", compile_cache_dir="6cc5f9a5ca6ab7ed"))
    right = startup_record(key, "warm", warm)
    assert right["is_prediction_right"] is True and right["compile_s"] == 2.9
    wrong = startup_record(key, "cold", warm)
    assert wrong["is_prediction_right"] is False, "a wrong estimate shows"
    unknown = startup_record(key, "cold", RunResult(status="failed"))
    assert unknown["is_prediction_right"] is None and unknown["compile_cache"] is None


def test_a_policy_learns_warm_keys_from_the_records_of_an_earlier_run(tmp_path: Path) -> None:
    caches = CompileCaches()
    key = _key({})
    caches.learn({"compile_key": key.digest, "compile_cache": "cold"})
    caches.learn({"compile_key": _key({"block_size": 32}).digest, "compile_cache": None})
    assert caches.predict(key) == "warm"
    assert caches.predict(_key({"block_size": 32})) == "cold", "it never reached the compile"


def test_the_sampler_saver_reaches_every_trial_and_never_the_export(tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, startup={"savers": ["flashinfer_sampler_off"]}))
    config = engine_config(cfg, {})
    assert config.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    record = {"env": {**config.env, "VLLM_FORCE_AOT_LOAD": "1", "VLLM_CACHE_ROOT": "/c",
                      "VLLM_USE_DEEP_GEMM": "0"}}
    exported = export_env(record["env"], startup_saver_env(cfg.spec.startup.savers))
    assert exported == {"VLLM_USE_DEEP_GEMM": "0"}, "savers and the warm check stay behind"


@pytest.mark.parametrize(("override", "words"), [
    ({"env": {"VLLM_ENABLE_STARTUP_PLAN": "1"}}, "gpu_memory_utilization"),
    ({"env": {"VLLM_FORCE_AOT_LOAD": "1"}}, "fail every trial"),
    ({"startup": {"verify_warm": True, "compile_cache": "per_trial"}}, "never warm"),
    ({"startup": {"verify_warm": True}, "env": {"VLLM_USE_AOT_COMPILE": "0"}}, "turns off"),
    ({"startup": {"savers": ["startup_plan"]}}, "flashinfer_sampler_off"),
    ({"startup": {"savers": ["flashinfer_sampler_off"]},
      "env": {"VLLM_USE_FLASHINFER_SAMPLER": "1"}}, "one place"),
])
def test_startup_settings_that_would_change_the_measurement_are_refused(
        tmp_path: Path, override: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_study(write_study(tmp_path, **override))


def test_mlflow_gets_the_start_up_as_tags_and_metrics() -> None:
    from optimizer.results.trial_record import TrialRecord
    from optimizer.search.startup import startup_metrics
    from optimizer.tracking.payload import tracking_payload

    cold = RunResult(status="complete", argv=("vllm",), engine=EngineInfo(
        startup_s=127.0, model_load_s=3.5, compile_s=30.7, graph_capture_s=4.0,
        compile_cache="cold", compile_cache_dir="6cc5f9a5ca6ab7ed"))
    startup = startup_record(_key({}), "warm", cold)
    record = TrialRecord(state="complete", params={}, conclusion="c", startup=startup,
                         metrics=startup_metrics(startup))
    payload = tracking_payload(record, None, number=3)
    assert payload["tags"]["startup.compile_cache"] == "cold"
    assert payload["tags"]["startup.compile_cache_predicted"] == "warm"
    assert payload["tags"]["startup.vllm_key"] == "6cc5f9a5ca6ab7ed"
    assert payload["metrics"]["startup.compile_s"] == 30.7
    assert payload["metrics"]["startup.is_cold_compile"] == 1.0
    assert payload["metrics"]["startup.is_prediction_right"] == 0.0, "the miss is visible"
    again = TrialRecord.from_user_attr(record.to_user_attr())
    assert again.startup == record.startup, "kept in Optuna, replayed by the catch-up"


def _ledger_policy(tmp_path: Path, name: str, cache: Path, version: str | None = None,
                   **startup: Any) -> SearchController:
    """A study on the simulated engine whose trials use `cache` as their VLLM_CACHE_ROOT and
    whose policy reads that root's compile ledger (as `nightshift start` wires it)."""
    from optimizer.run.engine_choice import compile_ledger_of
    from runners.vllm.compile_ledger import CompileLedger

    folder = tmp_path / name
    folder.mkdir()
    cfg, space, study = search_setup(folder, {"gpu_memory_utilization": [0.9, 0.8, 0.7]},
                                     name=name, trials=10, sampler={"name": "tpe", "seed": 0},
                                     startup=startup, env={"VLLM_CACHE_ROOT": str(cache)})
    ledger = compile_ledger_of(cfg, "simulated") if version is None else \
        CompileLedger(cache, vllm_version=version, engine="simulated")
    policy = SearchController(cfg, space, study, workload=cfg.workload, total_gpus=1,
                              compiled_elsewhere=ledger.compiled_keys if ledger else None)
    policy.prepare()
    return policy


def _run_simulated(tmp_path: Path, config: EngineConfig, name: str, *,
                   ledger_writer: str | None) -> RunResult:
    from runners.engine import EngineRunner
    from runners.load_level import LoadLevel
    from runners.simulated.launcher import SimulatedLauncher
    from runners.workload import LengthDistribution, Workload

    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", ledger_writer=ledger_writer)
    workload = Workload(input_len=LengthDistribution(mean=16),
                        output_len=LengthDistribution(mean=4), num_requests=4,
                        num_warmup_requests=0, levels=(LoadLevel(max_concurrency=2),),
                        vocab_size=1000, startup_timeout_s=60)
    try:
        return runner.run(config, workload, tmp_path / name)
    finally:
        runner.close()


def test_a_key_another_process_compiled_on_the_cache_root_is_predicted_warm(
        tmp_path: Path) -> None:
    """A `regress` run compiles a config on the shared root; a study started afterwards on the
    same root predicts that key warm from the ledger, and the simulated engine starts warm."""
    from runners.vllm.compile_ledger import ledger_path

    cache = tmp_path / "cache"
    first = _ledger_policy(tmp_path, "first", cache).next_launch(lambda n: True)
    assert first is not None and first.prediction == "cold", "an empty root"
    regress = _run_simulated(tmp_path, first.config, "regress", ledger_writer="regress:case")
    assert regress.status == "complete" and regress.engine.compile_cache == "cold"
    (line,) = ledger_path(cache).read_text().splitlines()
    assert '"writer": "regress:case"' in line and '"vllm_version": "0.26.0"' in line

    second = _ledger_policy(tmp_path, "second", cache).next_launch(lambda n: True)
    assert second is not None and second.compile_key == first.compile_key
    assert second.prediction == "warm", "the ledger says another process compiled it"
    trial = _run_simulated(tmp_path, second.config, "trial", ledger_writer="study:second")
    assert startup_record(second.compile_key, second.prediction, trial)["is_prediction_right"]
    assert len(ledger_path(cache).read_text().splitlines()) == 2, "the warm start is kept too"


def test_a_ledger_entry_of_another_vllm_version_or_a_per_trial_study_predicts_cold(
        tmp_path: Path) -> None:
    from runners.vllm.compile_ledger import CompileLedger

    cache = tmp_path / "cache"
    config = _ledger_policy(tmp_path, "first", cache).next_launch(lambda n: True)
    assert config is not None
    _run_simulated(tmp_path, config.config, "regress", ledger_writer="regress:case")
    assert CompileLedger(cache, vllm_version="0.26.0", engine="simulated").compiled_keys()

    older = _ledger_policy(tmp_path, "older", cache, version="0.25.1").next_launch(
        lambda n: True)
    assert older is not None and older.prediction == "cold", "a key holds under one version"
    isolated = _ledger_policy(tmp_path, "isolated", cache, version="0.26.0",
                              compile_cache="per_trial").next_launch(lambda n: True)
    assert isolated is not None and isolated.prediction == "cold", \
        "per_trial never reads the shared ledger"
    wired = _ledger_policy(tmp_path, "wired", cache, compile_cache="per_trial")
    assert wired.placement.compiled_elsewhere is None, \
        "nightshift start hands a per_trial study none"


def test_a_per_trial_cache_never_writes_the_shared_ledger(tmp_path: Path) -> None:
    from optimizer.run.engines import RunnerSpec, build_runner
    from runners.vllm.compile_ledger import ledger_path

    spec = RunnerSpec(kind="simulated", registry_dir=tmp_path / "engines",
                      is_cache_per_trial=True, ledger_writer="study:isolated")
    assert build_runner(spec).ledger_writer is None
    shared = RunnerSpec(kind="vllm", registry_dir=tmp_path / "engines",
                        cache_root=tmp_path / "cache", ledger_writer="study:shared")
    assert build_runner(shared).ledger_writer == "study:shared"
    assert not ledger_path(tmp_path / "cache").exists()


def test_a_resumed_study_trusts_the_ledger_not_its_records_for_what_is_warm(
        tmp_path: Path) -> None:
    """A study resumed on a machine whose cache root is new (or cleared) holds records of keys
    compiled elsewhere: with a ledger read on that root, they are cold (a warm prediction would
    launch a must-compile start under VLLM_FORCE_AOT_LOAD); with no ledger, the records say."""
    from optimizer.results.trial_record import ATTR_RECORD, TrialRecord

    cache = tmp_path / "cache"
    first = _ledger_policy(tmp_path, "first", cache).next_launch(lambda n: True)
    assert first is not None and first.compile_key is not None
    record = TrialRecord(state="complete", params=dict(first.params), conclusion="measured",
                         values=(1.0,), startup={"compile_key": first.compile_key.digest,
                                                 "compile_cache": "cold"})
    folder = tmp_path / "resumed"
    folder.mkdir()
    space_path = categorical_space(folder, gpu_memory_utilization=[0.9, 0.8, 0.7])
    cfg = load_study(write_study(folder, name="resumed", trials=10, search_space=str(space_path),
                                 env={"VLLM_CACHE_ROOT": str(cache)}))
    space = load_space(space_path).resolve({})
    dists = {k: d for k, d in space.distributions().items() if k in first.params}

    def resumed(compiled_elsewhere: Any) -> str:
        study = optuna.create_study(directions=cfg.directions, sampler=make_sampler(cfg))
        study.add_trial(optuna.trial.create_trial(
            params=dict(first.params), distributions=dists,
            values=[1.0], user_attrs={ATTR_RECORD: record.to_user_attr()}))
        study.enqueue_trial(dict(first.params))  # the same key, asked again
        policy = SearchController(cfg, space, study, workload=cfg.workload,
                                  total_gpus=1, compiled_elsewhere=compiled_elsewhere)
        policy.prepare()
        launch = policy.next_launch(lambda n: True)
        assert launch is not None and launch.compile_key == first.compile_key
        return launch.prediction

    assert resumed(lambda: frozenset()) == "cold", "the ledger on this root never saw the key"
    assert resumed(None) == "warm", "without a ledger the earlier records are all there is"
