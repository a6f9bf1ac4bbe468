"""`EngineRunner` over the simulated engine: the shared Runner contract, then each injected fault
driven through the whole runner (launch, readiness, load, classification, teardown). CPU only."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from runners.base import (
    EngineConfig,
    Failure,
    FailureReason,
    FlagValue,
    Phase,
    Runner,
    RunResult,
)
from runners.engine import EngineRunner
from runners.simulated.launcher import SimulatedLauncher
from runners.vllm.logs import classify_failure as vllm_classify_failure
from runners.workload import Workload
from tests.runners.contract import EngineWatcher, RunnerContract, small_workload

STARTUP_TIME_SCALE = 0.001  # a modelled ~200 s start sleeps ~0.2 s
MODEL = "qwen2.5-7b"
STALL_TIMEOUT_S = 2.0  # a hang is declared after this long without a token
# Requests the runner sends before the first level: one readiness probe, then the warm-up.
NUM_PRE_LEVEL_REQUESTS = 1 + small_workload().num_warmup_requests


def _runner(registry_dir: Path) -> EngineRunner:
    return EngineRunner(SimulatedLauncher("h200", startup_time_scale=STARTUP_TIME_SCALE),
                        registry_dir, stall_timeout_s=STALL_TIMEOUT_S)


class TestSimulatedRunner(RunnerContract):
    @pytest.fixture
    def runner(self, registry_dir: Path) -> Iterator[Runner]:
        runner = _runner(registry_dir)
        yield runner
        runner.close()

    @pytest.fixture
    def model_name(self) -> str:
        return MODEL

    @pytest.fixture
    def bad_config(self, config: EngineConfig) -> EngineConfig:
        # Two-way tensor parallelism on the one-GPU H200 preset: refused before loading.
        return replace(config, flags={**config.flags, "tensor_parallel_size": 2})

    def test_argv_names_loopback_host(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        super().test_argv_names_loopback_host(runner, config, workload, tmp_path, registry_dir)


# -- faults through the whole runner ----------------------------------------------------------

@pytest.fixture
def registry_dir(tmp_path: Path) -> Path:
    return tmp_path / "engines"


@pytest.fixture
def runner(registry_dir: Path) -> Iterator[EngineRunner]:
    runner = _runner(registry_dir)
    yield runner
    runner.close()


@pytest.fixture
def workload() -> Workload:
    return small_workload()


def _run_with_faults(runner: EngineRunner, registry_dir: Path, tmp_path: Path,
                     workload: Workload, faults: Mapping[str, FlagValue]) -> RunResult:
    config = EngineConfig(model=MODEL, load_format="dummy",
                          flags={"max_model_len": 2048, "max_num_seqs": 16, **faults})
    with EngineWatcher(registry_dir) as watcher:
        result = runner.run(config, workload, tmp_path / "trial")
    watcher.assert_none_survive(result)
    return result


def _assert_failed(result: RunResult, reason: FailureReason) -> None:
    assert result.status == "failed", f"an injected fault fails the run, got {result.status}"
    assert result.failure is not None, "a failed run says why"
    assert result.failure.reason == reason, (
        f"the fault is classified as {reason}, got {result.failure.reason}: "
        f"{result.failure.message}")
    assert result.failure.message, "the failure has a message for humans"


def test_engine_crash_mid_level_is_crash_mid_run(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    result = _run_with_faults(runner, registry_dir, tmp_path, workload,
                              {"sim_crash_after_requests": NUM_PRE_LEVEL_REQUESTS + 3})
    _assert_failed(result, FailureReason.CRASH_MID_RUN)
    assert result.steps == (), "the crash came in level 0: no level was measured"


def test_engine_crash_in_second_level_keeps_the_first_step(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    assert workload.num_requests is not None
    crash_after = NUM_PRE_LEVEL_REQUESTS + workload.num_requests + 2
    result = _run_with_faults(runner, registry_dir, tmp_path, workload,
                              {"sim_crash_after_requests": crash_after})
    _assert_failed(result, FailureReason.CRASH_MID_RUN)
    assert len(result.steps) == 1, "the level measured before the crash is kept in the result"


def test_engine_hang_under_load_is_hang(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    result = _run_with_faults(runner, registry_dir, tmp_path, workload,
                              {"sim_hang_after_requests": NUM_PRE_LEVEL_REQUESTS + 3})
    _assert_failed(result, FailureReason.HANG)
    assert result.wall_s < STALL_TIMEOUT_S + 15, (
        f"a hang is declared after stall_timeout_s, not request_timeout_s; took {result.wall_s}")


def test_kv_cache_oom_at_start_is_oom_at_start(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    result = _run_with_faults(runner, registry_dir, tmp_path, workload,
                              {"sim_oom_at_start": True})
    _assert_failed(result, FailureReason.OOM_AT_START)
    assert result.steps == (), "an engine that never started measured nothing"


def test_graph_capture_failure_is_cuda_graph_capture_not_oom(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    result = _run_with_faults(runner, registry_dir, tmp_path, workload,
                              {"sim_graph_capture_fail": True})
    _assert_failed(result, FailureReason.CUDA_GRAPH_CAPTURE)


def test_start_slower_than_startup_timeout_is_startup_timeout(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    quick = replace(workload, startup_timeout_s=1.0)
    result = _run_with_faults(runner, registry_dir, tmp_path, quick, {"sim_slow_start_s": 30.0})
    _assert_failed(result, FailureReason.STARTUP_TIMEOUT)
    assert result.wall_s < 15, f"the runner gives up at startup_timeout_s, took {result.wall_s}"


def test_error_rate_above_max_failed_fraction_is_too_many_errors(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    # The engine's error draws are seeded: at 10 % the readiness probe and the warm-up
    # succeed and level 0 loses 2 of 8 requests, above the 5 % allowed.
    result = _run_with_faults(runner, registry_dir, tmp_path, workload, {"sim_error_rate": 0.1})
    _assert_failed(result, FailureReason.TOO_MANY_ERRORS)
    assert workload.max_failed_fraction == 0.05, "the test's arithmetic assumes 5 % allowed"


def test_high_error_rate_on_a_live_engine_is_too_many_errors_not_startup_crash(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    # At 50 % the seeded first draw (0.134) fails the readiness probe itself.
    result = _run_with_faults(runner, registry_dir, tmp_path, workload, {"sim_error_rate": 0.5})
    _assert_failed(result, FailureReason.TOO_MANY_ERRORS)


# An engine that prints its secrets (as a library may echo a token in an error) and dies at
# start; the key it was given goes to a side file, for the test alone to know it.
_ECHO = """
import os, pathlib, sys
pathlib.Path(sys.argv[1]).write_text(os.environ["VLLM_API_KEY"])
print("logging in with", os.environ["HF_TOKEN"], "key", os.environ["VLLM_API_KEY"], flush=True)
raise RuntimeError("login refused for token " + os.environ["HF_TOKEN"])
"""


class _EchoingLauncher(SimulatedLauncher):
    """The simulated launcher's record, an engine that echoes its secrets, vLLM's classifier
    (whose failure message quotes the error line)."""

    def __init__(self, key_file: Path) -> None:
        super().__init__("h200", startup_time_scale=STARTUP_TIME_SCALE)
        self.key_file = key_file

    def command(self, config: EngineConfig, port: int, workdir: Path,
                profile_dir: Path | None) -> tuple[list[str], dict[str, str]]:
        _, env = super().command(config, port, workdir, profile_dir)
        return [sys.executable, "-c", _ECHO, str(self.key_file)], env

    def classify_failure(self, log_text: str, returncode: int | None,
                         phase: Phase) -> Failure:
        return vllm_classify_failure(log_text, returncode, phase)


def test_secrets_an_engine_prints_are_scrubbed_from_its_log_failure_and_result(
        registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    # Issue 35, item 8: the token of the study's env and the engine's own API key.
    token = "hf_" + "s" * 32
    runner = EngineRunner(_EchoingLauncher(tmp_path / "key"), registry_dir)
    config = EngineConfig(model=MODEL, load_format="dummy", env={"HF_TOKEN": token})
    with EngineWatcher(registry_dir) as watcher:
        result = runner.run(config, workload, tmp_path / "trial")
    watcher.assert_none_survive(result)
    key = (tmp_path / "key").read_text()
    assert result.failure is not None and result.failure.reason == FailureReason.STARTUP_CRASH
    assert "RuntimeError: login refused for token <redacted>" in result.failure.message, \
        result.failure.message
    log = (tmp_path / "trial" / "server.log").read_text()
    assert "logging in with <redacted> key <redacted>" in log, log
    for where, text in (("the failure", repr(result.failure)), ("the log kept", log),
                        ("the log's tail for MLflow", result.server_log)):
        assert token not in text and key not in text, f"no secret value in {where}"


def test_a_run_keeps_secrets_out_of_its_result_and_its_engine_answers_only_the_runner(
        runner: EngineRunner, registry_dir: Path, tmp_path: Path, workload: Workload) -> None:
    token = "hf_" + "t" * 32
    config = EngineConfig(model=MODEL, load_format="dummy",
                          flags={"max_model_len": 2048, "max_num_seqs": 16},
                          env={"HF_TOKEN": token, "TOKENIZERS_PARALLELISM": "false"})
    outsider: list[int] = []
    live_argv: list[str] = []

    def probe(_: object) -> bool:
        # Another local user, knowing the port but not the key, while the level runs.
        assert runner._proc is not None
        argv = psutil.Process(runner._proc.pid).cmdline()
        live_argv.append(" ".join(argv))  # what another user reads with `ps -eww`
        port = argv[argv.index("--port") + 1]
        outsider.append(httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code)
        outsider.append(httpx.post(f"http://127.0.0.1:{port}/reset_prefix_cache").status_code)
        return False

    with EngineWatcher(registry_dir) as watcher:
        result = runner.run(config, workload, tmp_path / "trial", on_step=probe)
    watcher.assert_none_survive(result)
    assert result.status == "complete", result.failure
    assert outsider and set(outsider) == {401}, "the engine answers only the key's holder"
    assert live_argv and token not in live_argv[0], "the engine's argv never holds a secret"
    written = repr((result.argv, dict(result.env)))
    assert token not in written, "the record names the secret, never its value"
    assert result.env["HF_TOKEN"] == "${HF_TOKEN}"
    assert result.env["TOKENIZERS_PARALLELISM"] == "false"
    assert "VLLM_API_KEY" not in result.env, "the engine's key stays with the runner"
