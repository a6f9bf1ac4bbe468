"""Value objects and the `Runner` protocol: the engine config one measurement takes and all it
gives back (the workload it is asked to drive is runners/workload.py).

Runners know nothing of Optuna or MLflow; everything here is plain data that pickles through Ray.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from runners.capacity.bracket import Bracket
from runners.load_level import LoadLevel
from runners.workload import Workload

if TYPE_CHECKING:
    from runners.quality_eval import QualityRun

FlagValue = str | int | float | bool | None


@dataclass(frozen=True)
class EngineConfig:
    """One engine configuration: model, vLLM flags (snake_case, as vLLM's `EngineArgs` spells
    them) and environment. Flags become `--kebab-case` only at the process boundary."""

    model: str  # local path or hub id
    flags: Mapping[str, FlagValue] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    load_format: str = "auto"  # "auto" (real weights) or "dummy" (random weights, same speed)
    served_model_name: str = "model"
    skip_tokenizer_init: bool = False  # prompts and outputs as token ids
    extra_args: tuple[str, ...] = ()  # passed verbatim after the flags

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.flags.get("tensor_parallel_size") or 1)

    @property
    def pipeline_parallel_size(self) -> int:
        return int(self.flags.get("pipeline_parallel_size") or 1)

    @property
    def data_parallel_size(self) -> int:
        """Engine replicas behind the one API server, each on its own TP x PP GPUs."""
        return int(self.flags.get("data_parallel_size") or 1)

    @property
    def num_gpus(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size


@dataclass(frozen=True)
class BenchmarkMetrics:
    """One load level's figures, named and computed as `vllm bench serve` reports them."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    request_goodput: float | None  # requests/s meeting the SLO; None without an SLO
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    # Latency statistics in ms (mean, median, std, p90, p99 over the level's successful
    # requests, numpy's linear percentiles as vLLM's). None where the level has no sample:
    # TTFT and E2EL with no success, TPOT where every success produced one token, ITL where
    # none produced a second chunk. vLLM writes 0 there (`values or 0`); a 0 ms p99 reads as
    # a measurement, so it is left out of the record, MLflow and the report instead.
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    std_ttft_ms: float | None
    p90_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    std_tpot_ms: float | None
    p90_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    std_itl_ms: float | None
    p90_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    std_e2el_ms: float | None
    p90_e2el_ms: float | None
    p99_e2el_ms: float | None
    max_concurrency_seen: int = 0  # most requests in flight at once on the client
    # The samples the TPOT and ITL statistics are over (TTFT's and E2EL's: `completed`): a
    # p99 of a few is near their maximum, and one-token requests have no TPOT.
    num_tpot_samples: int = 0  # successful requests with more than one output token
    num_itl_samples: int = 0  # gaps between consecutive chunks, over successful requests

    def as_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class StepMetrics:
    """What `on_step` sees after each load level: enough for a pruner to decide."""

    step: int  # 0-based index of the load level
    level: LoadLevel
    metrics: BenchmarkMetrics
    server_metrics: Mapping[str, float] = field(default_factory=dict)  # /metrics, vLLM names
    elapsed_s: float = 0.0  # since the engine process started
    meets_slo: bool | None = None  # set by a capacity search: p99s within the SLO
    # Every measurement of this level when it was repeated; `metrics` is their median (by
    # output throughput), one real run, so its figures belong together.
    repeats: tuple[BenchmarkMetrics, ...] = ()
    # Why a capacity step missed the SLO (one line; None when it met or was not judged).
    miss_reason: str | None = None
    # A steady-state step's measured window (runners/capacity/): the rate its measured
    # requests were sent at, and the rate requests ended at over the same window, requests/s.
    offered_rate_rps: float | None = None
    completed_rate_rps: float | None = None

    @property
    def is_hold(self) -> bool:
        """A capacity search's hold (runners/capacity/staircase.py): its load measured again
        over a long window at that load (Poisson swings within a life, not a drift over the
        window: runners/capacity/stream_source.py), to certify the claim."""
        return self.server_metrics.get("steady.is_hold", 0.0) > 0

    @property
    def is_saturated(self) -> bool:
        """The load generator stopped this level as its waiting queue kept growing
        (runners/levels.py): a miss at its load, its unfinished requests cancelled."""
        return self.server_metrics.get("is_saturated", 0.0) > 0

    @property
    def is_load_unapplied(self) -> bool:
        """The client or the server did not carry the load this level is labelled with (a
        closed loop that held fewer than its concurrency, an open loop that sent late:
        runners/capacity/judge.py, runners/applied_load.py): its figures are of a lighter
        load, never a measurement at its label; `miss_reason` says why."""
        return self.server_metrics.get("steady.is_load_unapplied", 0.0) > 0


class FailureReason(enum.StrEnum):
    """Closed set of why a trial produced no measurement. Names are stable: they become tags."""

    OOM_AT_START = "oom_at_start"  # weights or KV cache do not fit
    KV_CACHE_TOO_SMALL = "kv_cache_too_small"  # max_model_len does not fit the KV cache
    CUDA_GRAPH_CAPTURE = "cuda_graph_capture"
    UNSUPPORTED_CONFIG = "unsupported_config"  # backend/dtype/quantization not on this hardware
    INVALID_ARGUMENT = "invalid_argument"  # vLLM's argument parser refused the argv
    STARTUP_TIMEOUT = "startup_timeout"
    STARTUP_CRASH = "startup_crash"  # exited during start for a reason we could not classify
    CRASH_MID_RUN = "crash_mid_run"
    HANG = "hang"  # alive but not answering during the load
    TOO_MANY_ERRORS = "too_many_errors"  # requests failed above the workload's threshold
    # A latency objective would be read at (or over) a fixed level stopped as saturated (its
    # queue kept growing: `StepMetrics.is_saturated`), so it has no value: unbounded at that
    # load, a miss (as goodput's 0 is), not failed requests. Set by the study, never a runner.
    SATURATED = "saturated"
    # A capacity search in which no probed load met the SLO, with a latency objective: it has
    # no value there (a rate's is 0), a miss, not failed requests. Set by the study.
    SLO_UNMET = "slo_unmet"
    PORT_IN_USE = "port_in_use"
    WORKER_LOST = "worker_lost"  # the Ray worker died
    NODE_LOST = "node_lost"  # the cluster node running the trial died
    DAEMON_LOST = "daemon_lost"  # the daemon died with the trial in flight
    INTERRUPTED = "interrupted"  # the daemon was stopped with the trial in flight
    INFEASIBLE = "infeasible"  # rejected before launch
    INTERNAL = "internal"  # a bug of ours; the message has the traceback's last line
    # The host refused the trial's files or processes (an OSError: disk full, permissions, a
    # path taken; `optimizer.run.executor.is_host_refusal` has the list): the machine's fault,
    # neither the config's nor a bug of ours.
    HOST_ERROR = "host_error"
    # VLLM_FORCE_AOT_LOAD=1 and no loadable compiled artefact: the start-up check of a cache
    # predicted warm failed. The runner relaunches without the check; never a trial's outcome.
    COMPILE_CACHE_MISS = "compile_cache_miss"


@dataclass(frozen=True)
class Failure:
    reason: FailureReason
    message: str  # one sentence for humans
    log_excerpt: str = ""  # the server log lines that decided the reason

    @property
    def is_retryable(self) -> bool:
        """Lost to infrastructure, not to the config: worth one more try."""
        return self.reason in {FailureReason.PORT_IN_USE, FailureReason.WORKER_LOST,
                               FailureReason.NODE_LOST, FailureReason.DAEMON_LOST,
                               FailureReason.INTERRUPTED, FailureReason.HOST_ERROR}


@dataclass(frozen=True)
class EngineInfo:
    """What the engine tells about itself at start (parsed from its log, or reported by the
    simulated engine). Every field is optional: old versions print less."""

    startup_s: float | None = None  # process start to healthy
    kv_cache_tokens: int | None = None
    kv_cache_gib: float | None = None
    max_concurrency_at_max_len: float | None = None  # requests of max_model_len that fit at once
    model_memory_gib: float | None = None
    model_load_s: float | None = None
    compile_s: float | None = None
    graph_capture_s: float | None = None
    graph_memory_gib: float | None = None
    init_engine_s: float | None = None
    attention_backend: str | None = None  # the one actually chosen
    engine_version: str | None = None
    max_model_len: int | None = None
    # Kernels vLLM's JIT monitor saw compiled (or autotuned) after warm-up, i.e. while serving:
    # each one stalls the steps that wait for it. None where the log was not read after the load.
    num_runtime_jit_compiles: int | None = None
    # What the start-up did with vLLM's torch.compile cache: "warm" (loaded, compiled nothing),
    # "cold" (compiled), "none" (no torch.compile: eager); None where the log does not say.
    compile_cache: str | None = None
    compile_cache_dir: str | None = None  # vLLM's own key: the hash directory it used
    # startup.verify_warm's VLLM_FORCE_AOT_LOAD=1 launch failed (no loadable artefact) and the
    # engine was started again without it: the start-up figures are the second launch's.
    is_warm_check_refused: bool = False
    # What vLLM decided for async scheduling at start-up ("Asynchronous scheduling is enabled /
    # disabled", config/vllm.py:1109 in 0.26): it turns it off by itself for some configs
    # (CPU ngram speculation, pooling models), which then measure that change too.
    async_scheduling: bool | None = None
    # Which model runner the engine used: "V2" ("Using V2 Model Runner", v1/worker/gpu_worker.py
    # :378) or "V1" where vLLM fell back from V2 ("... using the V1 model runner instead",
    # config/vllm.py:576-588: ngram speculation, no Triton); None where the log says neither.
    model_runner: str | None = None

    def as_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()
                if isinstance(v, int | float) and not isinstance(v, bool) and v is not None}


RunStatus = Literal["complete", "stopped", "failed"]


@dataclass(frozen=True)
class RunResult:
    """Everything one run produced. `status` is "stopped" when `on_step` asked to stop early."""

    status: RunStatus
    steps: tuple[StepMetrics, ...] = ()
    failure: Failure | None = None
    engine: EngineInfo = field(default_factory=EngineInfo)
    argv: tuple[str, ...] = ()  # the exact launch command
    env: Mapping[str, str] = field(default_factory=dict)  # the variables we set (not inherited)
    server_log: str = ""  # the log's tail, for the tracker (the full log is in workdir)
    workdir: Path | None = None
    trace_summary: Mapping[str, Any] | None = None  # kernel-time shares, when profiled
    trace_path: Path | None = None
    telemetry: Mapping[str, float] = field(default_factory=dict)  # NVML summary over the load
    wall_s: float = 0.0  # whole run, launch to teardown
    # The engine process's life, wall-clock (Unix seconds): launched, and ended (torn down or
    # found dead). None when no engine was launched. What shows trials really ran side by side.
    engine_started_unix_s: float | None = None
    engine_ended_unix_s: float | None = None
    host: str = ""  # where it ran (set by the worker: host name and cluster node)
    # The trimmed trace's bytes, for a driver on another machine than the worker (trace_path
    # names a file on the worker's disk).
    trace_data: bytes | None = field(default=None, repr=False)
    # After a capacity search: where the capacity lies (the highest load that met the SLO,
    # the lowest that missed it) and whether that is within the tolerance.
    capacity: Bracket | None = None
    # With `workload.quality`: the output-quality sample(s) taken after the levels (~100 KB
    # JSON for 32 prompts; each sample also in workdir/quality.json), or why none was taken.
    quality: QualityRun | None = field(default=None, repr=False)


OnStep = Callable[[StepMetrics], bool]


class Runner(Protocol):
    """Measures engine configurations, one at a time.

    Called by a worker (a Ray actor in the daemon, or directly in tests and `bench/`). `run`
    owns the engine's whole life: launch, readiness, warm-up, each load level, optional profile
    window, teardown. It never raises for a trial-level problem: those come back as
    `RunResult(status="failed", failure=...)`. `on_step` is called after every load level and
    returns True to stop early (the result is then "stopped"). `close` releases anything the
    runner keeps between runs (caches stay on disk) and kills any engine still alive.
    """

    def run(self, config: EngineConfig, workload: Workload, workdir: Path,
            on_step: OnStep | None = None) -> RunResult: ...

    def close(self) -> None: ...


Phase = Literal["startup", "run"]


class EngineLauncher(Protocol):
    """How one kind of engine is launched and read. `EngineRunner` (runners/engine.py) owns the
    shared life cycle (process group, readiness, load, teardown) and asks the launcher only for
    what differs between engines. Implementations are pure: no processes, no I/O but reading."""

    name: str  # "vllm" or "simulated"

    def command(self, config: EngineConfig, port: int, workdir: Path,
                profile_dir: Path | None) -> tuple[list[str], dict[str, str]]:
        """argv (no shell) and the environment variables to add for one launch on 127.0.0.1."""
        ...

    def parse_log(self, log_text: str) -> EngineInfo:
        """What the engine told about itself at start (KV capacity, backend, timings)."""
        ...

    def classify_failure(self, log_text: str, returncode: int | None, phase: Phase) -> Failure:
        """Why the engine died (or never became ready), from its exit code and log."""
        ...
