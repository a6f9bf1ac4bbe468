"""The simulated engine as a real process: vLLM's HTTP surface, SSE format, /metrics, the
profiler trace, start-up log lines and each injected fault. CPU only; each test a few seconds."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runners.base import EngineConfig, FailureReason
from runners.hardware import load_preset
from runners.loadgen.level import run_level_sync
from runners.loadgen.requests import build_requests
from runners.process import free_port
from runners.simulated.launcher import SimulatedLauncher
from runners.simulated.performance import PerformanceModel

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIME_SCALE = 0.001  # ~0.2 s of sleeping for a modelled 200 s start
MODEL = "qwen2.5-0.5b"  # small shape: short step times keep the tests fast


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    launcher: SimulatedLauncher

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()


def _wait_healthy(engine: Engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise AssertionError(f"engine exited ({engine.proc.returncode}):\n{engine.log()}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=0.5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"engine not healthy within {timeout_s} s:\n{engine.log()}")


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    """Start engines through `SimulatedLauncher.command`, each in its own session; kill every
    process group in teardown, whatever the test did."""
    procs: list[subprocess.Popen[bytes]] = []

    def _launch(flags: dict[str, object] | None = None, *, profile: bool = False,
                model: str = MODEL, env_vars: dict[str, str] | None = None) -> Engine:
        launcher = SimulatedLauncher("h200", startup_time_scale=STARTUP_TIME_SCALE, seed=0)
        port = free_port()
        profile_dir = tmp_path / "profile" if profile else None
        argv, env = launcher.command(EngineConfig(model, flags or {}, env=env_vars or {},
                                                  served_model_name="sim"),
                                     port, tmp_path, profile_dir)
        log_path = tmp_path / f"server-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
                                    start_new_session=True)
        procs.append(proc)
        return Engine(proc, port, log_path, launcher)

    try:
        yield _launch
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _stream(engine: Engine, max_tokens: int, timeout_s: float = 10.0) -> list[dict]:
    body = {"model": "sim", "prompt": list(range(100)), "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[dict] = []
    with httpx.stream("POST", f"{engine.url}/v1/completions", json=body,
                      timeout=timeout_s) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), "every SSE line is a data line"
    assert lines[-1] == "data: [DONE]", "the stream ends with [DONE]"
    for line in lines[:-1]:
        chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def test_engine_serves_health_models_metrics_and_streams_completions(launch):
    engine = launch()
    _wait_healthy(engine)
    models = httpx.get(f"{engine.url}/v1/models").json()
    assert models["data"][0]["id"] == "sim"

    chunks = _stream(engine, max_tokens=12)
    token_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(token_chunks) == 12 and all(c["choices"][0]["text"] for c in token_chunks)
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 100, "completion_tokens": 12,
                                    "total_tokens": 112, "prompt_tokens_details": None}

    plain = httpx.post(f"{engine.url}/v1/completions", timeout=10,
                       json={"prompt": "a few words here", "max_tokens": 3}).json()
    assert plain["usage"]["completion_tokens"] == 3 and plain["choices"][0]["text"]

    text = httpx.get(f"{engine.url}/metrics").text
    samples = {(s.name, s.labels.get("le")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("vllm:generation_tokens_total", None)] == 15
    assert samples[("vllm:prompt_tokens_total", None)] == 104
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == 2
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == 11 + 2
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count"):
        assert (name, None) in samples, f"{name} must be exported under vLLM's name"
    assert not any(name.endswith("_created") for name, _ in samples), "vLLM has no _created"


def test_with_an_api_key_every_route_but_health_answers_401_without_it(launch):
    key = "k-" + "x" * 30
    engine = launch(env_vars={"VLLM_API_KEY": key})
    _wait_healthy(engine)
    assert httpx.get(f"{engine.url}/v1/models").status_code == 401
    assert httpx.post(f"{engine.url}/reset_prefix_cache").status_code == 401
    assert httpx.get(f"{engine.url}/metrics").status_code == 401
    wrong = {"Authorization": "Bearer not-the-key"}
    assert httpx.get(f"{engine.url}/v1/models", headers=wrong).status_code == 401
    right = {"Authorization": f"Bearer {key}"}
    assert httpx.get(f"{engine.url}/v1/models", headers=right).status_code == 200
    assert httpx.post(f"{engine.url}/reset_prefix_cache", headers=right).status_code == 200
    body = {"model": "sim", "prompt": list(range(10)), "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, headers=right,
                      timeout=10) as response:
        assert response.status_code == 200
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"


def test_the_launch_names_its_variables_in_argv_and_passes_their_values_in_the_environment(
        launch):
    token = "hf_" + "s" * 30
    engine = launch(env_vars={"HF_TOKEN": token})
    _wait_healthy(engine)
    argv = psutil_cmdline(engine.proc.pid)
    assert token not in " ".join(argv), "a secret must never be readable in the argv (ps -eww)"
    assert any('"env_names": ["HF_TOKEN"]' in a for a in argv)


def psutil_cmdline(pid: int) -> list[str]:
    import psutil

    return list(psutil.Process(pid).cmdline())


def test_startup_log_carries_vllms_lines_and_parses_into_engine_info(launch):
    engine = launch()
    _wait_healthy(engine)
    info = engine.launcher.parse_log(engine.log())
    assert info.attention_backend == "FLASH_ATTN"
    assert info.kv_cache_tokens and info.kv_cache_tokens > 1_000_000
    assert info.max_model_len == 32768 and info.max_concurrency_at_max_len
    assert info.compile_s and info.graph_capture_s and info.model_memory_gib
    assert info.startup_s and info.startup_s > 60, "the modelled (unscaled) start-up"
    assert "GPU KV cache size: " in engine.log() and "," in engine.log().split(
        "GPU KV cache size: ")[1].split(" ")[0], "token count printed with commas"


def test_eager_start_logs_no_graph_capture(launch):
    engine = launch({"enforce_eager": True})
    _wait_healthy(engine)
    assert "Graph capturing finished" not in engine.log()
    assert "(compilation: 0.00 s)" in engine.log()


def test_profile_endpoints_write_a_gzipped_chrome_trace_of_kernels(launch, tmp_path):
    engine = launch({"sim_error_rate": 0.0}, profile=True)
    _wait_healthy(engine)
    assert httpx.post(f"{engine.url}/start_profile").status_code == 200
    _stream(engine, max_tokens=8)
    assert httpx.post(f"{engine.url}/stop_profile", timeout=10).status_code == 200
    traces = list((tmp_path / "profile").glob("rank0.*.pt.trace.json.gz"))
    assert len(traces) == 1
    with gzip.open(traces[0], "rt") as handle:
        events = json.load(handle)["traceEvents"]
    assert 0 < len(events) <= 5000
    assert all(e["ph"] == "X" and isinstance(e["pid"], int) and isinstance(e["tid"], int)
               for e in events)
    kernels = [e["name"] for e in events if e["cat"] == "kernel"]
    assert any(name.startswith("nvjet_sm90_tst_") for name in kernels), "Hopper GEMMs"
    assert any("FlashAttnFwdSm90" in name for name in kernels)
    assert any("reshape_and_cache_flash_kernel" in name for name in kernels)
    assert any(name.startswith("triton_poi_fused_") for name in kernels)
    assert any(e["cat"] == "gpu_memcpy" for e in events)


def test_profile_endpoints_are_404_without_a_profile_dir(launch):
    engine = launch()
    _wait_healthy(engine)
    assert httpx.post(f"{engine.url}/start_profile").status_code == 404


def test_crash_fault_exits_abruptly_after_n_requests(launch):
    engine = launch({"sim_crash_after_requests": 1})
    _wait_healthy(engine)
    _stream(engine, max_tokens=2)
    with pytest.raises(httpx.HTTPError):
        _stream(engine, max_tokens=2)
    assert engine.proc.wait(timeout=5) == 1
    failure = engine.launcher.classify_failure(engine.log(), 1, "run")
    assert failure.reason == FailureReason.CRASH_MID_RUN


def test_hang_fault_stops_tokens_and_health_but_stays_alive(launch):
    engine = launch({"sim_hang_after_requests": 0})
    _wait_healthy(engine)
    with pytest.raises(httpx.TimeoutException):
        _stream(engine, max_tokens=4, timeout_s=1.0)
    with pytest.raises(httpx.TimeoutException):
        httpx.get(f"{engine.url}/health", timeout=0.5)
    assert engine.proc.poll() is None, "a hung engine is alive"
    assert engine.launcher.classify_failure(engine.log(), None, "run").reason == (
        FailureReason.HANG)


def test_hang_at_start_never_becomes_healthy(launch):
    engine = launch({"sim_hang_at_start": True})
    # Listening can take seconds on a loaded host (the server's imports); once it answers, it
    # must keep answering 503, never 200.
    deadline = time.monotonic() + 30
    codes = []
    while time.monotonic() < deadline and len(codes) < 3:
        with contextlib.suppress(httpx.TransportError):
            codes.append(httpx.get(f"{engine.url}/health", timeout=1).status_code)
        time.sleep(0.5)
    assert codes == [503, 503, 503]
    assert engine.launcher.classify_failure(engine.log(), None, "startup").reason == (
        FailureReason.STARTUP_TIMEOUT)


@pytest.mark.parametrize(("flags", "reason", "words"), [
    ({"sim_oom_at_start": True}, FailureReason.OOM_AT_START,
     "No available memory for the cache blocks"),
    ({"sim_graph_capture_fail": True}, FailureReason.CUDA_GRAPH_CAPTURE, "CUDA out of memory"),
    ({"gpu_memory_utilization": 0.5, "max_model_len": 10_000_000},
     FailureReason.KV_CACHE_TOO_SMALL, "To serve at least one request"),
    ({"tensor_parallel_size": 2}, FailureReason.UNSUPPORTED_CONFIG, "max local gpu count"),
], ids=["oom", "graph-capture", "kv-too-small", "tp-gt-gpus"])
def test_start_failures_exit_1_with_vllms_message(launch, flags, reason, words):
    engine = launch(flags)
    assert engine.proc.wait(timeout=10) == 1
    assert words in engine.log()
    assert engine.launcher.classify_failure(engine.log(), 1, "startup").reason == reason


def test_error_rate_fault_answers_http_500(launch):
    engine = launch({"sim_error_rate": 1.0})
    _wait_healthy(engine)
    response = httpx.post(f"{engine.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert response.status_code == 500 and response.json()["object"] == "error"


def test_slow_start_fault_delays_health(launch):
    engine = launch({"sim_slow_start_s": 1.0})
    started = time.monotonic()
    _wait_healthy(engine)
    assert time.monotonic() - started >= 1.0


def _paced(flags: dict[str, object], prompt_len: int, max_tokens: int, num_requests: int
           ) -> tuple[list[float], float, float]:
    """In-process, in virtual time: `num_requests` streams at once on the small model; the
    loop's time at each token, the modelled span of the level (first arrival to last token) and
    the time the engine slept in all (the loop's clock: what a real loop would have waited)."""
    import asyncio

    from runners.hardware import load_preset
    from runners.simulated.engine import SimulatedEngine
    from runners.simulated.settings import ServerSettings
    from tests.virtual_time import run_in_virtual_time

    async def main() -> tuple[list[float], float, float]:
        engine = SimulatedEngine(ServerSettings(
            EngineConfig(MODEL, flags), load_preset("h200"), port=0,
            startup_time_scale=STARTUP_TIME_SCALE, noise_sigma=0.0))
        assert await engine.start() is None
        loop = asyncio.get_running_loop()
        started = loop.time()
        token_times: list[float] = []
        spans: list[tuple[float, float]] = []

        async def one(first: int) -> None:
            async for event in engine.generate(list(range(first, first + prompt_len)),
                                               max_tokens):
                token_times.append(loop.time())
                if event.is_finished:
                    spans.append((event.request.arrival_s, event.time_s))

        await asyncio.gather(*(one(100 * i) for i in range(num_requests)))
        modelled_s = max(end for _, end in spans) - min(start for start, _ in spans)
        return token_times, modelled_s, loop.time() - started

    return run_in_virtual_time(main())


def test_decode_tokens_are_paced_at_the_models_step_time():
    # ~10 ms eager steps; on a virtual clock the pacing is exact, whatever the host.
    token_times, _, _ = _paced({"enforce_eager": True}, prompt_len=100, max_tokens=40,
                               num_requests=1)
    config = EngineConfig(MODEL, {"enforce_eager": True})
    step_s = PerformanceModel.from_config(config, load_preset("h200")).step_time(
        1, 140).total_s
    assert len(token_times) == 40
    assert token_times[-1] - token_times[0] == pytest.approx(39 * step_s, rel=0.01), \
        "one decode step's time between tokens"


def test_a_jit_stall_is_modelled_in_full_but_slept_time_scaled():
    """fp8_per_block's JIT stall (TPOT p99 475 ms on the H200) is on the modelled clock, which
    the figures read; the engine sleeps it scaled by startup_time_scale, as start-up."""
    _, modelled_s, slept_s = _paced({"quantization": "fp8_per_block"}, prompt_len=64,
                                    max_tokens=8, num_requests=4)
    assert modelled_s > 1.0, f"the stall is modelled: {modelled_s:.2f} s"
    assert slept_s < 0.1 * modelled_s, f"slept {slept_s:.2f} s of {modelled_s:.2f} s modelled"


def _serve_concurrently(flags: dict[str, object], num_requests: int,
                        max_tokens: int) -> tuple[float, list[int]]:
    """In-process, in virtual time: `num_requests` streams at once on a 7B-shape engine; the time
    they took on the engine's modelled clock (first arrival to last token: what the load
    generator reads) and how many requests each replica was handed. The loop's clock is
    virtual, so a busy host changes neither figure and nothing sleeps."""
    import asyncio

    from runners.hardware import load_preset
    from runners.simulated.engine import SimulatedEngine
    from runners.simulated.settings import ServerSettings
    from tests.virtual_time import run_in_virtual_time

    async def main() -> tuple[float, list[int]]:
        engine = SimulatedEngine(ServerSettings(
            EngineConfig("qwen2.5-7b", flags), load_preset("h200"), port=0,
            startup_time_scale=1e-5, noise_sigma=0.0))
        assert await engine.start() is None

        spans: list[tuple[float, float]] = []

        async def one(index: int) -> None:
            async for event in engine.generate(list(range(index, index + 16)), max_tokens):
                if event.is_finished:
                    spans.append((event.request.arrival_s, event.time_s))

        tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
        await asyncio.sleep(0)  # every generator has handed its request to a replica
        handed = [len(r.scheduler.waiting) + len(r.scheduler.running) for r in engine.replicas]
        await asyncio.gather(*tasks)
        return max(end for _, end in spans) - min(start for start, _ in spans), handed

    return run_in_virtual_time(main())


def test_data_parallel_replicas_split_the_load_and_multiply_decode_throughput():
    one_s, one_handed = _serve_concurrently({}, num_requests=512, max_tokens=32)
    two_s, two_handed = _serve_concurrently({"data_parallel_size": 2}, num_requests=512,
                                            max_tokens=32)
    assert one_handed == [512]
    assert two_handed == [256, 256], "the least-loaded replica takes each new request"
    # At a decode batch of 512 a 7B model's GEMMs are compute-bound on an H200: two replicas,
    # each on its own GPU with half the batch, take about half the time. (At a small batch
    # they would not: per-token latency stays, only capacity doubles.)
    assert one_s / two_s > 1.6, f"DP=2 took {two_s:.2f} s vs {one_s:.2f} s at DP=1"


_HOG = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


def _level_figures(engine: Engine) -> dict[str, float]:
    from runners.load_level import LoadLevel
    from runners.workload import SLO, LengthDistribution, Workload

    workload = Workload(input_len=LengthDistribution(mean=256),
                        output_len=LengthDistribution(mean=64), vocab_size=1000)
    requests = build_requests(workload, 96, seed=0)
    slo = SLO(ttft_p99_ms=200, tpot_p99_ms=10)
    # As the runner does: one readiness completion first (the load generator learns there
    # that the server runs a modelled clock), then the measured level.
    run_level_sync(engine.url, "sim", requests[:1], LoadLevel(max_concurrency=1), slo,
                   timeout_s=60, seed=0)
    result = run_level_sync(
        engine.url, "sim", requests, LoadLevel(max_concurrency=32), slo, timeout_s=120, seed=0)
    assert result.is_modelled_clock and result.metrics.completed == 96
    m = result.metrics
    return {"output_throughput": m.output_throughput, "request_goodput": m.request_goodput or 0,
            "median_tpot_ms": m.median_tpot_ms, "p99_tpot_ms": m.p99_tpot_ms,
            "median_ttft_ms": m.median_ttft_ms, "mean_e2el_ms": m.mean_e2el_ms}


def test_one_config_measures_the_same_twice_while_the_cpu_is_busy(launch):
    """Two servers of one config, each driven by the load generator over HTTP while two
    processes spin both of a small machine's cores: the figures agree within 2% (they come from
    the server's modelled clock, which a late-waking event loop does not stretch)."""
    hogs = [subprocess.Popen([os.sys.executable, "-c", _HOG]) for _ in range(2)]
    try:
        runs = []
        for _ in range(2):
            engine = launch({"max_model_len": 4096})
            _wait_healthy(engine, timeout_s=30.0)
            runs.append(_level_figures(engine))
            engine.proc.send_signal(signal.SIGTERM)
            engine.proc.wait(timeout=10)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    first, second = runs
    spread = {k: abs(second[k] - first[k]) / first[k] for k in first}
    assert all(v <= 0.02 for v in spread.values()), f"{spread}: {first} vs {second}"


def test_a_kernel_path_that_jit_compiles_while_serving_reports_the_measured_stall(launch):
    """`quantization: fp8_per_block` served TPOT p99 475 ms on the H200 (kernels JIT-compiled
    while serving): the figures say so, on the modelled clock, without the test sleeping it."""
    from runners.load_level import LoadLevel
    from runners.workload import SLO, LengthDistribution, Workload

    engine = launch({"quantization": "fp8_per_block"})
    _wait_healthy(engine, timeout_s=30.0)
    workload = Workload(input_len=LengthDistribution(mean=64),
                        output_len=LengthDistribution(mean=8), vocab_size=1000)
    requests = build_requests(workload, 4, seed=0)
    # Slept time-scaled (test_a_jit_stall_is_modelled_in_full_but_slept_time_scaled).
    result = run_level_sync(engine.url, "sim", requests, LoadLevel(max_concurrency=2),
                                    SLO(tpot_p99_ms=10), timeout_s=60, seed=0)
    assert result.is_modelled_clock and result.metrics.completed == 4
    assert result.metrics.median_tpot_ms > 400 and result.metrics.request_goodput == 0


def test_failed_requests_stay_inside_the_level_duration_on_the_modelled_clock(
        launch: Callable[..., Engine]) -> None:
    from runners.load_level import LoadLevel
    from runners.loadgen.requests import RequestSpec
    from runners.workload import SLO

    engine = launch({"sim_error_rate": 0.6})
    _wait_healthy(engine)
    specs = [RequestSpec(list(range(10, 26)), 16, 4) for _ in range(10)]
    result = run_level_sync(engine.url, "sim", specs,
                            LoadLevel(request_rate_rps=10.0, burstiness=1e6), SLO(),
                            timeout_s=30, seed=0)
    m = result.metrics
    assert result.is_modelled_clock and m.failed > 0 and m.completed > 0
    refused = [o.modelled_span_s for o in result.outputs if not o.success]
    assert all(span is not None for span in refused), "an error answer carries its modelled time"
    # The level's duration spans every request, refused ones included (spanning the
    # successes alone, from the first arrival, read 0.5-0.8 s here: shorter than the load
    # offered, a rate above it where the first or last failed). Checked against the
    # requests' own modelled times, which a busy host's lag moves with the duration.
    spans = [o.modelled_span_s for o in result.outputs]
    assert all(s is not None for s in spans)
    first = min(s[0] for s in spans if s is not None)
    last = max(s[1] for s in spans if s is not None)
    assert m.duration_s >= last - first - 1e-6, (m.duration_s, spans)
