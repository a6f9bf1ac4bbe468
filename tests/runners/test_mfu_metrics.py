"""vLLM's own FLOP/byte accounting and the runtime JIT count: `--enable-mfu-metrics` on the
launch command of vLLM >= 0.26, its counters read per level, the JIT monitor's lines counted
from the log, and the simulated engine exposing the same counters as a real HTTP server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from runners import prometheus
from runners.base import EngineConfig
from runners.vllm.launcher import VllmLauncher
from runners.vllm.logs import parse_log
from tests.runners.test_simulated_server import _stream, _wait_healthy, launch  # noqa: F401

LOGS = Path(__file__).parents[1] / "fixtures" / "vllm_logs"


def _argv(flags: dict[str, object], version: str) -> list[str]:
    launcher = VllmLauncher(vllm_version=version, python="/usr/bin/python3")
    argv, _ = launcher.command(EngineConfig("/models/m", flags), 8011, Path("/tmp/w"), None)
    return argv


def test_mfu_metrics_are_switched_on_from_vllm_0_26_only() -> None:
    assert _argv({}, "0.26.0").count("--enable-mfu-metrics") == 1
    assert "--enable-mfu-metrics" not in _argv({}, "0.25.1"), \
        "an unknown flag makes vLLM's parser exit 2; earlier versions were not checked"


def test_an_explicit_mfu_flag_is_not_doubled_or_overridden() -> None:
    assert _argv({"enable_mfu_metrics": True}, "0.26.0").count("--enable-mfu-metrics") == 1
    assert "--enable-mfu-metrics" not in _argv({"enable_mfu_metrics": False}, "0.26.0")


def test_a_healthy_h200_log_has_no_runtime_jit_compiles() -> None:
    """trial0.log (recorded, vLLM 0.26 on the H200) activates the JIT monitor and compiles
    nothing afterwards."""
    info = parse_log((LOGS / "h200" / "trial0.log").read_text())
    assert info.num_runtime_jit_compiles == 0


def test_runtime_jit_compiles_are_counted_once_per_kernel() -> None:
    """Lines composed from vLLM 0.26's format string (vllm/utils/jit_monitor.py, not a
    recording): each kernel is warned once per process, once per tensor-parallel rank."""
    line = ("({who} pid={pid}) WARNING 12-04 10:01:02 [jit_monitor.py:135] Triton kernel JIT "
            "compilation during inference: {name}. This causes a latency spike; consider "
            "extending warmup to cover this shape/config.")
    text = (LOGS / "h200" / "trial0.log").read_text() + "\n".join([
        line.format(who="Worker_TP0", pid=11, name="_w8a8_block_fp8_matmul"),
        line.format(who="Worker_TP1", pid=12, name="_w8a8_block_fp8_matmul"),
        line.format(who="Worker_TP0", pid=11, name="_per_token_group_quant_fp8"),
    ])
    assert parse_log(text).num_runtime_jit_compiles == 2
    before_warmup = line.format(who="EngineCore", pid=9, name="warm_kernel")
    assert parse_log(before_warmup).num_runtime_jit_compiles is None, \
        "no monitor line: the log says nothing about compiles while serving"


def test_level_counters_read_mfu_and_cached_prompt_tokens() -> None:
    growth = {"vllm:prompt_tokens_total": 1000.0, "vllm:prompt_tokens_cached_total": 400.0,
              "vllm:prefix_cache_hits_total": 380.0, "vllm:generation_tokens_total": 64.0,
              "vllm:iteration_tokens_total_count": 70.0,
              "vllm:estimated_flops_per_gpu_total": 5e13,
              "vllm:estimated_read_bytes_per_gpu_total": 2e11,
              "vllm:estimated_write_bytes_per_gpu_total": 1e10}
    counters = prometheus.level_counters(growth)
    assert counters.computed_prompt_tokens == 600.0, "vLLM's cached counter wins over hits"
    assert counters.num_steps == 70.0 and counters.has_mfu
    del growth["vllm:prompt_tokens_cached_total"]
    assert prometheus.level_counters(growth).computed_prompt_tokens == 620.0
    assert not prometheus.level_counters({}).has_mfu


@pytest.mark.parametrize("flags", [{}, {"quantization": "fp8", "kv_cache_dtype": "fp8"}])
def test_simulated_engine_exposes_vllms_mfu_counters(launch, flags) -> None:  # noqa: F811
    engine = launch(flags)
    _wait_healthy(engine)
    before = prometheus.scrape(engine.url)
    _stream(engine, max_tokens=8)
    growth = prometheus.delta(before, prometheus.scrape(engine.url))
    counters = prometheus.level_counters(growth)
    assert counters.has_mfu, "the launcher turns the counters on, as it does for vLLM"
    assert counters.num_steps and counters.num_steps >= 8
    assert counters.prompt_tokens == 100 and counters.cached_prompt_tokens == 0
    flops = counters.estimated_flops_per_gpu or 0.0
    # qwen2.5-0.5b: ~0.5 G linear parameters; 107 tokens through them, at 2 FLOPs each.
    assert 2 * 0.36e9 * 107 < flops < 2 * 0.7e9 * 108 + 1e11


def test_simulated_engine_without_the_flag_has_no_mfu_counters(launch) -> None:  # noqa: F811
    engine = launch({"enable_mfu_metrics": False})
    _wait_healthy(engine)
    text = httpx.get(f"{engine.url}/metrics").text
    assert "vllm:estimated_flops_per_gpu" not in text
    assert "vllm:prompt_tokens_cached_total" in text


def test_nvml_utilisation_is_kept_per_load_level() -> None:
    """Recorded 8x H100 answers: device 6 reads 77% first, then 90%. A level that started after
    the first sample sees only its own samples; the run's mean mixes both."""
    import time

    from runners.telemetry import TelemetrySampler
    from tests.runners.test_hardware import ReplayNvml

    nvml = ReplayNvml("8xh100_nvlink")
    uuids = [d["nvmlDeviceGetUUID"] for d in nvml.data["devices"]]
    sampler = TelemetrySampler([0], interval_s=60, nvml=nvml, visible_devices=uuids[6])
    sampler.start()  # the thread's first sample: 77%
    deadline = time.monotonic() + 30.0
    while sampler.summary().get("num_samples", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.01)  # monotonic time moves on past that sample
    level_start = time.monotonic()
    assert sampler.gpu_util_mean_pct_since(level_start) is None, "no sample of the level yet"
    sampler.sample_once()
    assert sampler.gpu_util_mean_pct_since(level_start) == 90.0
    assert sampler.stop()["gpu_util_mean_pct"] == pytest.approx((77 + 90) / 2)
