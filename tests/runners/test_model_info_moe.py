"""Mixture-of-experts shapes: the parameters held, passed per token and read per step, checked
against the published counts; what the simulated engine sizes from them; and the refusal of an
expert form that is not modelled, from config.json to `nightshift start`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from optimizer.cli import main
from runners.base import EngineConfig
from runners.hardware import load_preset
from runners.model_info import ModelInfo, UnmodelledMoeError, load_model_info
from runners.simulated.calibration import GIB
from runners.simulated.performance import PerformanceModel

# mistralai/Mixtral-8x7B-v0.1's config.json (the shape keys), as published.
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 32768, "vocab_size": 32000, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "sliding_window": None}
# Qwen/Qwen3-30B-A3B's config.json (the shape keys), as published.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_hidden_layers": 48, "max_position_embeddings": 40960, "vocab_size": 151936,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# Qwen/Qwen1.5-MoE-A2.7B's config.json (the shape keys): a shared expert besides 60 routed.
QWEN15_MOE_A27B: dict[str, Any] = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
    "decoder_sparse_step": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_hidden_layers": 24, "max_position_embeddings": 8192, "vocab_size": 151936,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# deepseek-ai/DeepSeek-V3's shape keys: MLA attention, a dense first layers, a shared expert.
DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "num_attention_heads": 128,
    "num_key_value_heads": 128, "num_hidden_layers": 61, "vocab_size": 129280,
    "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}


def billions(n: float) -> float:
    return round(n / 1e9, 1)


@pytest.mark.parametrize(("config", "total_b", "active_b"), [
    (MIXTRAL_8X7B, 46.7, 12.9),  # Mistral's announcement: 46.7B total, 12.9B per token
    (QWEN3_30B_A3B, 30.5, 3.3),  # the model card: 30.5B total, 3.3B activated
    (QWEN15_MOE_A27B, 14.3, 2.7),  # the model card: 14.3B total, 2.7B activated
], ids=["mixtral-8x7b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])
def test_an_moe_shape_counts_every_expert_held_and_the_top_k_a_token_passes(
        config: dict[str, Any], total_b: float, active_b: float) -> None:
    model = ModelInfo.from_config(config)
    assert model.is_moe
    assert billions(model.num_params) == total_b
    # The published active figures are rounded down to 2-3 digits; Qwen3's 3.35B reads 3.3B.
    assert model.num_active_params == pytest.approx(active_b * 1e9, rel=0.02)
    # Weights in memory are every expert's: Mixtral in bf16 is ~87 GiB, not a 7B's 13.5.
    if config is MIXTRAL_8X7B:
        assert model.weight_bytes(2.0) / GIB == pytest.approx(87.0, abs=0.1)


def test_a_dense_model_holds_passes_and_reads_the_same_weights() -> None:
    model = load_model_info("qwen2.5-7b")
    assert model is not None and not model.is_moe
    assert model.num_active_params == model.num_params == 7_615_483_904
    assert model.linear_params_read(1) == model.linear_params_read(256) == model.linear_params


def test_a_step_reads_the_experts_its_tokens_touch_from_top_k_up_to_all_of_them() -> None:
    model = ModelInfo.from_config(MIXTRAL_8X7B)
    assert model.experts_read(1) == pytest.approx(2.0)  # one token: its top-2
    # Uniform routing: 8 x (1 - (6/8)^2) = 3.5 for two tokens, under min(8, 2 x 2).
    assert model.experts_read(2) == pytest.approx(3.5)
    assert 7.9 < model.experts_read(16) <= 8.0
    one, batch = model.weight_bytes_read(2.0, 1), model.weight_bytes_read(2.0, 256)
    assert one == pytest.approx((model.active_linear_params + model.lm_head_params) * 2.0)
    assert batch == pytest.approx((model.linear_params + model.lm_head_params) * 2.0)


def test_the_simulated_engine_holds_every_expert_and_leaves_the_kv_cache_the_rest() -> None:
    """The s13 check: Mixtral-8x7B on an H200 was sized as a dense 7.2B (13.49 GiB of weights,
    113 GiB of KV cache)."""
    h200 = load_preset("h200")
    sized = PerformanceModel.from_config(
        EngineConfig("mixtral", {}), h200, ModelInfo.from_config(MIXTRAL_8X7B))
    assert sized.weight_bytes_per_gpu / GIB == pytest.approx(87.0, abs=0.1)
    budget = h200.gpu_memory_gib * GIB * sized.gpu_memory_utilization
    assert sized.kv_cache_bytes_per_gpu < budget - 87.0 * GIB
    fp8 = PerformanceModel.from_config(
        EngineConfig("mixtral", {"quantization": "fp8"}), h200,
        ModelInfo.from_config(MIXTRAL_8X7B))
    assert fp8.weight_bytes_per_gpu / GIB == pytest.approx(43.7, abs=0.1)  # bf16 embeddings


def test_a_simulated_decode_step_reads_more_experts_as_its_batch_grows() -> None:
    h200 = load_preset("h200")
    moe = PerformanceModel.from_config(EngineConfig("qwen3-30b-a3b", {}), h200,
                                       ModelInfo.from_config(QWEN3_30B_A3B))
    one, many = moe.step_time(1, 512), moe.step_time(64, 64 * 512)
    # One sequence reads 8 of 128 experts a layer (~6.8 GB); 64 read nearly all (~61 GB).
    assert many.gemm_s > 5 * one.gemm_s


@pytest.mark.parametrize("config", [
    DEEPSEEK_V3,
    {"model_type": "dbrx", "d_model": 6144, "hidden_size": 6144, "num_attention_heads": 48,
     "num_hidden_layers": 40, "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}},
    {**MIXTRAL_8X7B, "model_type": "phimoe", "architectures": ["PhiMoEForCausalLM"]},
], ids=["deepseek-v3", "dbrx", "phimoe"])
def test_an_expert_form_not_modelled_is_refused_naming_it(config: dict[str, Any]) -> None:
    with pytest.raises(UnmodelledMoeError, match=r"mixture of experts.*a form not modelled"):
        ModelInfo.from_config(config)


def test_start_refuses_an_unmodelled_moe_folder_in_one_line_naming_model_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "deepseek"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    study = tmp_path / "study.yaml"
    study.write_text(
        "name: x-deepseek\nengine: simulated\n"
        "model: {path: deepseek, load_format: dummy, skip_tokenizer_init: true}\n"
        "workload: {input_len: 512, output_len: 128, levels: [{concurrency: 16}], "
        "num_requests: 48}\n"
        "slo: {ttft_p99_ms: 2000, tpot_p99_ms: 40}\nbudget: {trials: 3}\n"
        "simulated: {hardware: h200, num_gpus: 8}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code = main(["start", str(study), "--dry-run", "--no-progress"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(err) == 1, err
    assert "model.path" in err[0] and "config.json" in err[0]
    assert "n_routed_experts 256" in err[0] and "'deepseek_v3'" in err[0]
    assert err[0].endswith("on a real engine set model.path to its hub id."), err[0]
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists()


def test_a_loaded_folder_of_an_unmodelled_moe_names_its_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    with pytest.raises(ValueError, match=r"config\.json: mixture of experts \(n_routed_"):
        load_model_info(str(tmp_path))


def test_the_bottleneck_reads_the_same_facts_every_expert_held_the_touched_ones_read() -> None:
    """The memory check before launch holds every expert; the roofline of a measured decode
    level reads, per engine step, the experts its tokens were routed to."""
    from optimizer.bottleneck import step_roofline
    from optimizer.bottleneck.memory_fit import memory_problem
    from runners.base import BenchmarkMetrics, StepMetrics
    from runners.load_level import LoadLevel

    model = ModelInfo.from_config(MIXTRAL_8X7B)
    problem = memory_problem(EngineConfig("mixtral"), load_preset("a100-80gb"), model)
    assert problem is not None and "the weights need 87.0 GiB per GPU" in problem
    zero = {f"{s}_{m}_ms": 0.0 for s in ("mean", "median", "std", "p90", "p99")
            for m in ("ttft", "tpot", "itl", "e2el")}
    metrics = BenchmarkMetrics(
        completed=100, failed=0, duration_s=10.0, total_input_tokens=200_000,
        total_output_tokens=12_800, request_throughput=10.0, request_goodput=None,
        output_throughput=1280.0, total_token_throughput=21_280.0, **zero)
    # Every prompt served from the prefix cache: pure decode, 12,800 tokens in 2,000 steps.
    step = StepMetrics(step=0, level=LoadLevel(request_rate_rps=10.0), metrics=metrics,
                       server_metrics={"vllm:prompt_tokens_total": 200_000.0,
                                       "vllm:prompt_tokens_cached_total": 200_000.0,
                                       "vllm:generation_tokens_total": 12_800.0,
                                       "vllm:iteration_tokens_total_count": 2000.0})
    h200 = load_preset("h200")
    terms = step_roofline(step, EngineConfig("mixtral"), h200, model)
    assert terms is not None
    kv, decode_tps = model.kv_bytes_per_token(2.0), 1280.0
    weights = model.weight_bytes_read(2.0, 6.4)  # 6.4 tokens a step: ~6.7 of 8 experts a layer
    assert 2.0 * (model.active_linear_params + model.lm_head_params) < weights < \
        2.0 * (model.linear_params + model.lm_head_params)
    expected = weights * 200.0 + decode_tps * (2000 + 64) * kv + decode_tps * kv
    assert terms.bytes_per_s == pytest.approx(expected)


def test_the_simulated_mfu_counters_count_experts_as_vllm_0_26_does() -> None:
    """vLLM 0.26's estimator (v1/metrics/perf.py `FfnMetrics`): top-k rows per token through
    experts of `moe_intermediate_size` (Mixtral: `intermediate_size`), and min(rows, experts)
    experts' weights read a layer."""
    import dataclasses

    from runners.simulated.mfu import vllm_mfu_estimate

    h200 = load_preset("h200")
    model = ModelInfo.from_config(MIXTRAL_8X7B)
    moe = PerformanceModel.from_config(EngineConfig("mixtral"), h200, model)
    dense = PerformanceModel.from_config(EngineConfig("mixtral"), h200, dataclasses.replace(
        model, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, num_moe_layers=0))
    h, inter, layers = model.hidden_size, model.intermediate_size, model.num_hidden_layers

    def read(n: int) -> float:
        return vllm_mfu_estimate(moe, [(1, 100, False)] * n).read_bytes

    # Two rows a token: 2 experts' weights for one token, 4 for two, all 8 from four on.
    expert_bytes = 3 * h * inter * 2.0 * layers
    assert (read(2) - read(1)) - (read(8) - read(4)) / 4 == pytest.approx(2 * expert_bytes)
    one = vllm_mfu_estimate(moe, [(1, 100, False)])
    assert one.flops - vllm_mfu_estimate(dense, [(1, 100, False)]).flops == \
        pytest.approx(6 * h * inter * layers)  # the second expert's row
