"""Text prompts through the model's own tokenizer on real vLLM with real weights (issue 21):
SmolLM2-135M-Instruct in bf16 (scripts/convert_smollm2.py), a ShareGPT-style file
(examples/conversations.json) sent as multi-turn conversations. The client counts every prompt
with the model's tokenizer.json; the server's usage.prompt_tokens must agree token for token.
Skipped without a GPU and vLLM, or without the converted model. Eager, about a minute."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runners.base import EngineConfig
from runners.engine import EngineRunner
from runners.load_level import LoadLevel
from runners.tokenizer import load_tokenizer
from runners.vllm.launcher import VllmLauncher
from runners.workload import SLO, DatasetSource, LengthDistribution, MultiTurn, Workload

pytestmark = pytest.mark.gpu

MODEL_DIR = Path(os.environ.get("NIGHTSHIFT_SMOLLM2_DIR", "/root/smollm2-135m-bf16"))
DATASET = Path(__file__).resolve().parents[2] / "examples" / "conversations.json"


def test_real_tokenizer_counts_match_vllms_usage_on_multi_turn_dataset_prompts(
        tmp_path: Path) -> None:
    if not (MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip(f"no converted SmolLM2 at {MODEL_DIR}: run scripts/convert_smollm2.py "
                    "(or set NIGHTSHIFT_SMOLLM2_DIR)")
    assert load_tokenizer(MODEL_DIR) is not None
    workload = Workload(dataset=DatasetSource(path=DATASET), tokenizer_dir=MODEL_DIR,
                        multi_turn=MultiTurn(max_turns=3), output_len=LengthDistribution(mean=32),
                        levels=(LoadLevel(max_concurrency=4),), num_requests=16,
                        num_warmup_requests=2, slo=SLO(tpot_p99_ms=1000),
                        startup_timeout_s=400)
    flags = {"enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 2048}
    runner = EngineRunner(VllmLauncher(cache_root=tmp_path / "cache"), tmp_path / "engines")
    try:
        result = runner.run(EngineConfig(model=str(MODEL_DIR), flags=flags), workload,
                            tmp_path / "trial")
    finally:
        runner.close()
    assert result.status == "complete", (result.failure, result.server_log[-2000:])
    (step,) = result.steps
    server = step.server_metrics
    assert step.metrics.completed >= 16 and step.metrics.failed == 0
    assert server["prompt_len_is_estimated"] == 0.0
    # Counted by the client with tokenizer.json, by vLLM with its own tokenizer: equal.
    assert server["prompt_tokens_server_minus_client_max_abs"] == 0.0, server
    assert server["multi_turn.num_turns"] == step.metrics.completed
    assert "multi_turn.later_turns_mean_ttft_ms" in server
