"""One real trial through `EngineRunner` + `VllmLauncher` on a GPU (skipped without GPU/vllm).

Small on purpose: Qwen2.5-0.5B shape with dummy weights, eager mode (no torch.compile), a few
requests. Proves argv, readiness, streaming load, /metrics, log parsing and teardown on vLLM."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from runners.base import EngineConfig
from runners.engine import EngineRunner
from runners.load_level import LoadLevel
from runners.model_info import resolve_model_dir
from runners.vllm.launcher import VllmLauncher
from runners.workload import SLO, LengthDistribution, Workload

pytestmark = pytest.mark.gpu


def test_one_real_vllm_trial_measures_and_tears_down(tmp_path: Path) -> None:
    model_dir = resolve_model_dir("qwen2.5-0.5b")
    assert model_dir is not None
    config = EngineConfig(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True,
                          flags={"enforce_eager": True, "gpu_memory_utilization": 0.3,
                                 "max_model_len": 2048})
    workload = Workload(input_len=LengthDistribution(mean=256),
                        output_len=LengthDistribution(mean=64),
                        levels=(LoadLevel(max_concurrency=4), LoadLevel(max_concurrency=16)),
                        num_requests=32, num_warmup_requests=4, vocab_size=151936,
                        slo=SLO(ttft_p99_ms=2000, tpot_p99_ms=100), startup_timeout_s=400)
    runner = EngineRunner(VllmLauncher(cache_root=tmp_path / "cache"), tmp_path / "engines")
    seen: list[int] = []
    result = runner.run(config, workload, tmp_path / "trial",
                        on_step=lambda step: seen.append(step.step) is not None)
    runner.close()

    assert result.status == "complete", (result.failure, result.server_log[-3000:])
    assert seen == [0, 1], "on_step is called after every load level"
    for step in result.steps:
        m = step.metrics
        assert m.completed == 32 and m.failed == 0
        assert m.output_throughput > 0 and 0 < m.p99_tpot_ms < 1000
        assert m.total_output_tokens == 32 * 64, "token counts come from usage, exactly"
        assert step.server_metrics.get("vllm:generation_tokens_total", 0) >= 32 * 64
    assert result.engine.kv_cache_tokens and result.engine.kv_cache_tokens > 10_000
    assert result.engine.attention_backend, "the chosen backend is read from the log"
    assert result.engine.startup_s and result.engine.startup_s > 1
    assert "--enforce-eager" in result.argv and "127.0.0.1" in result.argv
    assert list((tmp_path / "engines").glob("*.json")) == [], "engine record removed"
    vllm_procs = [p for p in psutil.process_iter(["cmdline"])
                  if str(model_dir) in " ".join(p.info["cmdline"] or [])]
    assert vllm_procs == [], "no vllm serve process outlives its trial"
