"""The study files tests build, and readers of what a study left: one small simulated study
(two simulated H200s, a tiny workload, no confirmation round) that each test changes only where
its point needs (`write_study(tmp_path, trials=2, workload={...})`); one level's figures
(`benchmark_metrics`); and a short capacity search on the simulated engine
(`staircase_workload`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import yaml
from mlflow import MlflowClient

from runners.base import BenchmarkMetrics, EngineConfig, RunResult
from runners.capacity.search import CapacitySearch
from runners.workload import SLO, LengthDistribution, Workload

MODEL = {"path": "qwen2.5-7b", "load_format": "dummy", "skip_tokenizer_init": True}
WORKLOAD = {"input_len": 128, "output_len": 16, "levels": [{"concurrency": 4}, {"concurrency": 8}],
            "num_requests": 16, "warmup_requests": 2}


def study_dict(tmp_path: Path, *, name: str = "e2e", trials: int = 12,
               **overrides: Any) -> dict[str, Any]:
    """The study, as the YAML file holds it; its results under tmp_path/results and its MLflow
    store at tmp_path/mlruns/mlflow.db. A key given in `overrides` replaces the default whole."""
    return {
        "name": name,
        "engine": "simulated",
        "model": dict(MODEL),
        "workload": dict(WORKLOAD),
        "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 40},
        "search_space": "hopper",
        "budget": {"trials": trials},
        "simulated": {"hardware": "h200", "num_gpus": 2, "startup_time_scale": 0.002},
        "confirm_rounds": 0,  # the final re-measurement has a test of its own
        "results_dir": str(tmp_path / "results"),
        "tracking_uri": f"sqlite:///{tmp_path}/mlruns/mlflow.db",
        **overrides,
    }


def write_study(tmp_path: Path, *, name: str = "e2e", trials: int = 12,
                file_name: str = "study.yaml", **overrides: Any) -> Path:
    """`study_dict` written to tmp_path/file_name; its path."""
    path = tmp_path / file_name
    path.write_text(yaml.safe_dump(study_dict(tmp_path, name=name, trials=trials, **overrides)))
    return path


def categorical_space(tmp_path: Path, **choices: list[Any]) -> Path:
    """A small search space file: each param categorical over `choices`, vLLM's default first
    (the defaults baseline runs it)."""
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump({"name": "small", "parameters": {
        name: {"type": "categorical", "choices": values, "default": "vllm"}
        for name, values in choices.items()}}))
    return path


def search_setup(tmp_path: Path, choices: dict[str, list[Any]] | None = None,
                 **overrides: Any) -> tuple[Any, Any, optuna.Study]:
    """What a search policy is built from, as the daemon builds it: the study file's config
    (`write_study` with `overrides`), the resolved space over `choices` (`categorical_space`;
    max_num_seqs [256, 64] when none) and a new in-memory study with the file's sampler and
    pruner."""
    from optimizer.config import load_study
    from optimizer.storage.study import make_pruner, make_sampler
    from search_spaces import load_space

    space_path = categorical_space(tmp_path, **(choices or {"max_num_seqs": [256, 64]}))
    cfg = load_study(write_study(tmp_path, search_space=str(space_path), **overrides))
    study = optuna.create_study(directions=cfg.directions, sampler=make_sampler(cfg),
                                pruner=make_pruner(cfg))
    return cfg, load_space(space_path).resolve({}), study


def load(tmp_path: Path, name: str = "e2e") -> optuna.Study:
    """The study `write_study` stored, from its Optuna database."""
    return optuna.load_study(study_name=name,
                             storage=f"sqlite:///{tmp_path}/results/optuna.db")


def trial_runs(tmp_path: Path, name: str = "e2e") -> list[Any]:
    """The run of every Optuna trial: search trials and confirmation runs (kind
    `confirmation`), not the study's own run."""
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    exp = client.get_experiment_by_name(name)
    assert exp is not None, f"no MLflow experiment {name!r}"
    return client.search_runs([exp.experiment_id],
                              filter_string="tags.`nightshift.kind` != 'study'",
                              max_results=1000)


LATENCY_FIELDS = tuple(f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
                       for m in ("ttft", "tpot", "itl", "e2el"))


def benchmark_metrics(latency_ms: float | None = None, **figures: Any) -> BenchmarkMetrics:
    """One level's figures: every latency statistic `latency_ms` (None: no sample), then
    `figures` (any field: `completed=150`, `p99_tpot_ms=14.0`, ...); counts and rates not
    given are 0, the goodput None, one second long."""
    fields: dict[str, Any] = dict.fromkeys(LATENCY_FIELDS, latency_ms)
    fields.update(completed=1, failed=0, duration_s=1.0, total_input_tokens=0,
                  total_output_tokens=0, request_throughput=0.0, request_goodput=None,
                  output_throughput=0.0, total_token_throughput=0.0)
    return BenchmarkMetrics(**{**fields, **figures})


def staircase_workload(workload: dict[str, Any] | None = None, **capacity: Any) -> Workload:
    """A steady staircase sized for the simulated engine: 256 in / 64 out, TPOT p99 <= 12 ms, a
    request rate in [2, 400] to 30% in at most 3 steps of 1-5 s windows; `capacity` and
    `workload` change what a test's point needs (`hold_s=0`, `profile=True`)."""
    search = {"axis": "request_rate", "low": 2, "high": 400, "tolerance": 0.3,
              "max_probes": 3, "min_window_requests": 40, "min_window_s": 1.0,
              "max_window_s": 5.0, **capacity}
    return Workload(input_len=LengthDistribution(mean=256),
                    output_len=LengthDistribution(mean=64), slo=SLO(tpot_p99_ms=12),
                    num_warmup_requests=2, capacity=CapacitySearch(**search),
                    **(workload or {}))


def simulated_run(tmp_path: Path, config: EngineConfig, workload: Workload, *,
                  stall_timeout_s: float = 30.0) -> RunResult:
    """`config` run once on the simulated H200 (start-ups at 0.1% of the modelled time) by a
    runner of its own over tmp_path/engines, the trial's files in tmp_path/trial; the runner
    closed after. Asserts that the trial completed."""
    from runners.engine import EngineRunner
    from runners.simulated.launcher import SimulatedLauncher

    runner = EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.001),
                          tmp_path / "engines", stall_timeout_s=stall_timeout_s)
    try:
        result = runner.run(config, workload, tmp_path / "trial")
    finally:
        runner.close()
    assert result.status == "complete", (config.flags, result.failure)
    return result


@contextlib.contextmanager
def echo_engine(workdir: Path, *, ttft_ms: float, tpot_ms: float) -> Iterator[str]:
    """tests/runners/echo_engine.py (fixed TTFT and TPOT, real SSE), started and healthy: its
    base URL; stopped on exit."""
    import sys

    from runners.process import EngineProcess, free_port, wait_healthy

    port = free_port()
    proc = EngineProcess.start(
        [sys.executable, "-m", "tests.runners.echo_engine", "--port", str(port),
         "--ttft-ms", str(ttft_ms), "--tpot-ms", str(tpot_ms)],
        {"PYTHONPATH": str(Path(__file__).resolve().parents[1])}, workdir / "echo.log",
        workdir / "registry")
    with proc:
        base_url = f"http://127.0.0.1:{port}"
        state = wait_healthy(base_url, proc, timeout_s=30, poll_s=0.1)
        assert state == "ready", (workdir / "echo.log").read_text()
        yield base_url


@contextlib.contextmanager
def simulated_engine(tmp_path: Path, config: EngineConfig | None = None, *,
                     startup_time_scale: float = 0.01) -> Iterator[str]:
    """A simulated H200 serving `config` (default: the Qwen2.5-7B shape, dummy weights,
    token-id prompts), started and healthy: its base URL; terminated on exit."""
    from runners.process import EngineProcess, free_port, wait_healthy
    from runners.simulated.launcher import SimulatedLauncher

    launcher = SimulatedLauncher("h200", startup_time_scale=startup_time_scale, seed=0)
    config = config or EngineConfig(model="qwen2.5-7b", load_format="dummy",
                                    skip_tokenizer_init=True)
    port = free_port()
    argv, env = launcher.command(config, port, tmp_path, None)
    proc = EngineProcess.start(argv, env, tmp_path / "log", tmp_path)
    try:
        url = f"http://127.0.0.1:{port}"
        assert wait_healthy(url, proc, 60.0) == "ready"
        yield url
    finally:
        proc.terminate()
