"""The contract every `Runner` passes, as every Optuna storage passes `StorageTestCase`.

Subclass `RunnerContract` in a `Test*` class and provide the `runner`, `model_name` and
`bad_config` fixtures; every test here then runs against that runner. The suite holds a runner to
what `runners.base.Runner` promises: one `StepMetrics` per level with self-consistent figures,
early stop through `on_step`, trial-level failures returned (never raised) with a classified
reason, no engine process left alive after any run, and an idempotent `close`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import psutil
import pytest

from runners.base import EngineConfig, FailureReason, Runner, RunResult, StepMetrics
from runners.load_level import LoadLevel
from runners.workload import SLO, LengthDistribution, Workload

NUM_REQUESTS = 8  # per level: enough for percentiles, few enough to finish in well under a second
INPUT_LEN = 32  # tokens
OUTPUT_LEN = 16  # tokens
_POLL_S = 0.005  # the watcher's registry poll: a failed start lives far longer than this


class EngineWatcher:
    """Records every engine a run starts, while it runs: the pids the runner writes to its
    registry directory and the processes that appear below this test process.

    Used as a context manager around `runner.run`; `assert_none_survive` then checks each of them
    is gone. A runner that writes no registry records is still held to the process-tree check.
    """

    def __init__(self, registry_dir: Path) -> None:
        self.registry_dir = registry_dir
        self.registry_pids: set[int] = set()
        self.new_processes: dict[int, psutil.Process] = {}
        self._before = {p.pid for p in _descendants()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="engine-watcher", daemon=True)

    def __enter__(self) -> EngineWatcher:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(_POLL_S)
        self._sample()

    def _sample(self) -> None:
        for path in self.registry_dir.glob("*.json") if self.registry_dir.is_dir() else ():
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # removed or being replaced between glob and read
            if isinstance(record, dict) and isinstance(record.get("pid"), int):
                self.registry_pids.add(record["pid"])
        for proc in _descendants():
            if proc.pid not in self._before:
                self.new_processes.setdefault(proc.pid, proc)

    def assert_none_survive(self, result: RunResult | None = None) -> None:
        """No engine this run started is alive, its registry record is gone, and no live
        process runs the argv the result reports."""
        assert self._stop.is_set(), "assert_none_survive is called after the run, outside `with`"
        alive = [pid for pid in sorted(self.registry_pids) if _is_alive(pid)]
        assert not alive, f"engine pids {alive} from the registry are alive after run returned"
        strays = [p.pid for p in self.new_processes.values() if _is_alive_process(p)]
        assert not strays, f"processes {strays} started during the run are alive after it"
        records = sorted(p.name for p in self.registry_dir.glob("*.json"))  # [] when absent
        assert not records, f"a finished run leaves no registry record, found {records}"
        if result is not None and result.argv:
            running = [p.pid for p in psutil.process_iter(["cmdline"])
                       if tuple(p.info["cmdline"] or ()) == result.argv
                       and _is_alive_process(p)]
            assert not running, f"processes {running} still run the result's argv"


def _descendants() -> list[psutil.Process]:
    try:
        children: list[psutil.Process] = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
    return children


def _is_alive(pid: int) -> bool:
    try:
        return _is_alive_process(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def _is_alive_process(proc: psutil.Process) -> bool:
    """Running and not a zombie; `is_running` also guards against a reused pid."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def assert_consistent(step: StepMetrics, workload: Workload) -> None:
    """The figures of one healthy level agree with the workload and with each other."""
    m = step.metrics
    assert workload.num_requests is not None
    label = f"level {step.step} ({step.level.label})"
    assert m.failed == 0, f"{label}: a healthy engine fails no request, got {m.failed}"
    assert m.completed == workload.num_requests, (
        f"{label}: every request completes, got {m.completed} of {workload.num_requests}")
    assert m.total_output_tokens == workload.num_requests * workload.output_len.mean, (
        f"{label}: each request yields exactly its fixed output length, got "
        f"{m.total_output_tokens} tokens")
    assert m.total_input_tokens == workload.num_requests * workload.input_len.mean, (
        f"{label}: each prompt has its fixed input length, got {m.total_input_tokens} tokens")
    assert m.duration_s > 0 and m.request_throughput > 0, f"{label}: throughput is positive"
    for name in ("ttft", "tpot", "itl", "e2el"):
        median = getattr(m, f"median_{name}_ms")
        p99 = getattr(m, f"p99_{name}_ms")
        assert 0 < median <= p99, f"{label}: 0 < median <= p99 for {name}, got {median}, {p99}"
    assert m.median_ttft_ms <= m.p99_e2el_ms, f"{label}: a first token precedes the last"
    assert m.request_goodput is not None, f"{label}: an SLO is set, so goodput is reported"
    assert 0 <= m.request_goodput <= m.request_throughput, (
        f"{label}: goodput <= throughput, got {m.request_goodput} > {m.request_throughput}")


def small_workload() -> Workload:
    """Two load levels of a few short requests each, with an SLO no healthy engine misses (so
    goodput is reported and checkable)."""
    return Workload(input_len=LengthDistribution(mean=INPUT_LEN),
                    output_len=LengthDistribution(mean=OUTPUT_LEN),
                    levels=(LoadLevel(max_concurrency=2),
                            LoadLevel(request_rate_rps=100.0, max_concurrency=8)),
                    num_requests=NUM_REQUESTS, num_warmup_requests=2, seed=0,
                    slo=SLO(ttft_p99_ms=60_000, tpot_p99_ms=60_000),
                    request_timeout_s=30.0, startup_timeout_s=60.0)


class RunnerContract:
    """What every `Runner` does. Subclasses provide `runner` (closed by the fixture itself),
    `model_name` (a model the runner serves) and `bad_config` (one that cannot start)."""

    # -- fixtures a subclass provides --------------------------------------------------------

    @pytest.fixture
    def runner(self, registry_dir: Path) -> Iterator[Runner]:
        raise NotImplementedError("a RunnerContract subclass must provide a `runner` fixture "
                                  "that records its engines under `registry_dir`")

    @pytest.fixture
    def model_name(self) -> str:
        raise NotImplementedError("a RunnerContract subclass must provide `model_name`")

    @pytest.fixture
    def bad_config(self) -> EngineConfig:
        raise NotImplementedError("a RunnerContract subclass must provide `bad_config`, an "
                                  "EngineConfig the engine refuses at start")

    # -- shared fixtures ---------------------------------------------------------------------

    @pytest.fixture
    def registry_dir(self, tmp_path: Path) -> Path:
        return tmp_path / "engines"

    @pytest.fixture
    def config(self, model_name: str) -> EngineConfig:
        """Small and healthy: dummy weights, a short context, a small batch."""
        return EngineConfig(model=model_name, load_format="dummy",
                            flags={"max_model_len": 2048, "max_num_seqs": 16,
                                   "gpu_memory_utilization": 0.5})

    @pytest.fixture
    def workload(self) -> Workload:
        return small_workload()

    # -- the contract ------------------------------------------------------------------------

    def test_healthy_run_completes_with_one_consistent_step_per_level(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        seen: list[int] = []

        def on_step(step: StepMetrics) -> bool:
            seen.append(step.step)
            return False

        with EngineWatcher(registry_dir) as watcher:
            result = runner.run(config, workload, tmp_path / "trial", on_step=on_step)
        watcher.assert_none_survive(result)

        assert result.status == "complete", (
            f"a healthy config completes, got {result.status}: {result.failure}")
        assert result.failure is None, "a complete run carries no failure"
        assert len(result.steps) == len(workload.levels), "one StepMetrics per load level"
        assert seen == list(range(len(workload.levels))), "on_step is called after each level"
        for index, (step, level) in enumerate(zip(result.steps, workload.levels, strict=True)):
            assert step.step == index and step.level == level, "steps follow the levels' order"
            assert_consistent(step, workload)
        assert result.wall_s > 0, "wall_s covers launch to teardown"
        assert watcher.registry_pids, "the engine's pid was recorded in the registry while up"

    def test_on_step_returning_true_stops_after_that_level(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        calls: list[int] = []

        def stop_at_once(step: StepMetrics) -> bool:
            calls.append(step.step)
            return True

        with EngineWatcher(registry_dir) as watcher:
            result = runner.run(config, workload, tmp_path / "trial", on_step=stop_at_once)
        watcher.assert_none_survive(result)

        assert result.status == "stopped", f"on_step -> True stops the run, got {result.status}"
        assert result.failure is None, "an early stop is not a failure"
        assert calls == [0], "on_step is not called again once it asked to stop"
        assert len(result.steps) == 1, "a run stopped after level 0 reports exactly one step"
        assert_consistent(result.steps[0], workload)

    def test_on_step_raising_propagates_and_still_tears_the_engine_down(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        class CallerBug(Exception):
            pass

        def broken(step: StepMetrics) -> bool:
            raise CallerBug("the caller's callback failed")

        with EngineWatcher(registry_dir) as watcher, pytest.raises(CallerBug):
            runner.run(config, workload, tmp_path / "trial", on_step=broken)
        watcher.assert_none_survive()

    def test_config_that_cannot_start_fails_with_classified_reason(
            self, runner: Runner, bad_config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        with EngineWatcher(registry_dir) as watcher:
            result = runner.run(bad_config, workload, tmp_path / "trial")
        watcher.assert_none_survive(result)

        assert result.status == "failed", f"a config that cannot start fails, got {result}"
        assert result.failure is not None, "a failed run says why"
        assert result.failure.reason != FailureReason.INTERNAL, (
            f"a refused config is classified, not INTERNAL: {result.failure.message}")
        assert not result.failure.is_retryable, (
            f"a refused config is the config's fault, not retryable: {result.failure.reason}")
        assert result.failure.message, "the failure has a message for humans"
        assert result.steps == (), "an engine that never started measured nothing"
        assert result.server_log, "a failed start keeps the engine's log tail"

    def test_runner_measures_again_after_a_failed_run(
            self, runner: Runner, config: EngineConfig, bad_config: EngineConfig,
            workload: Workload, tmp_path: Path, registry_dir: Path) -> None:
        with EngineWatcher(registry_dir) as watcher:
            failed = runner.run(bad_config, workload, tmp_path / "first")
            result = runner.run(config, workload, tmp_path / "second")
        watcher.assert_none_survive(result)

        assert failed.status == "failed", "the first config cannot start"
        assert result.status == "complete", (
            f"a failed trial leaves the runner usable for the next, got {result.failure}")
        assert len(result.steps) == len(workload.levels), "one StepMetrics per load level"

    def test_close_is_idempotent_and_leaves_no_engine(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        with EngineWatcher(registry_dir) as watcher:
            result = runner.run(config, workload, tmp_path / "trial")
            runner.close()
            runner.close()
        watcher.assert_none_survive(result)
        assert result.status == "complete", f"a healthy config completes: {result.failure}"

    def test_close_before_any_run_is_a_no_op(self, runner: Runner) -> None:
        runner.close()
        runner.close()

    def test_result_carries_argv_and_server_log_tail(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        with EngineWatcher(registry_dir) as watcher:
            result = runner.run(config, workload, tmp_path / "trial")
        watcher.assert_none_survive(result)

        assert isinstance(result.argv, tuple) and result.argv, "argv is a non-empty tuple"
        assert all(isinstance(arg, str) for arg in result.argv), "argv holds only str"
        assert isinstance(result.server_log, str) and result.server_log.strip(), (
            "the result keeps a tail of the engine's log")
        assert result.workdir == tmp_path / "trial", "the result names the run's workdir"

    def test_argv_names_loopback_host(
            self, runner: Runner, config: EngineConfig, workload: Workload, tmp_path: Path,
            registry_dir: Path) -> None:
        with EngineWatcher(registry_dir) as watcher:
            result = runner.run(config, workload, tmp_path / "trial")
        watcher.assert_none_survive(result)
        assert "127.0.0.1" in result.argv, (
            f"the recorded launch command binds the engine to loopback only, got {result.argv}")
