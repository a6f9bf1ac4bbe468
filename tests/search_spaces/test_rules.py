"""Static and conditional rules: built-in vLLM constraints, YAML rules, and what gets logged."""

from __future__ import annotations

from typing import Any

import optuna
import pytest

from runners.hardware import load_preset
from runners.model_info import load_model_info
from search_spaces import SpaceError, load_space, parse_space
from search_spaces.rules import Condition
from search_spaces.values import MISSING
from tests.search_spaces.test_space import CONTEXTS, QWEN_7B, SPACES


def _choices(resolved: Any, name: str) -> tuple[Any, ...]:
    spec = {p.name: p for p in resolved.params}[name]
    return tuple(spec.choices)


def _host(**hardware: Any) -> dict[str, Any]:
    base = {"num_gpus": 8, "compute_capability": 9.0, "gpu_memory_gib": 79.6,
            "interconnect": "nvlink", "hardware_class": "hopper", "gpu_name": "NVIDIA H100"}
    return {"hardware": {**base, **hardware}, "model": dict(QWEN_7B)}


FULL_ATTENTION_SPACE = {"parameters": {
    "attention_backend": {
        "type": "categorical",
        "choices": ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"],
    },
    "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8", "fp8_e5m2"]},
}}


@pytest.mark.parametrize("name", SPACES)
def test_fp8_is_removed_below_sm89(name: str) -> None:
    resolved = load_space(name).resolve(CONTEXTS["a100"])
    by_name = {p.name: p for p in resolved.params}
    for param in ("kv_cache_dtype", "quantization"):
        if param in by_name:
            assert not any(isinstance(c, str) and c.startswith("fp8")
                           for c in by_name[param].choices), f"{name}: no fp8 {param} on SM80"


def test_fp8_stays_on_hopper_and_is_logged_when_removed() -> None:
    hopper = load_space("hopper").resolve(CONTEXTS["h200"])
    assert "fp8" in _choices(hopper, "kv_cache_dtype")
    assert "fp8" in _choices(hopper, "quantization")
    ampere_host = load_space("hopper").resolve(_host(compute_capability=8.0))
    applied = {r.name: r for r in ampere_host.applied_rules}
    assert "fp8-needs-sm89" in applied
    assert "kv_cache_dtype: fixed to auto" in applied["fp8-needs-sm89"].effect


def test_tp_is_capped_at_two_over_pcie() -> None:
    resolved = load_space("default").resolve(_host(interconnect="pcie"))
    assert _choices(resolved, "tensor_parallel_size") == (1, 2)
    assert "pcie-tp-cap" in {r.name for r in resolved.applied_rules}


def test_tp_must_divide_the_attention_heads() -> None:
    resolved = load_space("default").resolve(_host())  # Qwen2.5-7B: 28 heads on 8 GPUs
    assert _choices(resolved, "tensor_parallel_size") == (1, 2, 4), "28 % 8 != 0"
    applied = {r.name: r.effect for r in resolved.applied_rules}
    assert applied["tp-divides-attention-heads"] == "tensor_parallel_size: removed 8"


def test_tp_never_exceeds_the_gpu_count() -> None:
    resolved = load_space("default").resolve(_host(num_gpus=2))
    assert _choices(resolved, "tensor_parallel_size") == (1, 2)
    single = load_space("default").resolve(_host(num_gpus=1))
    assert "tensor_parallel_size" in single.fixed(), "one value left: fixed, not sampled"
    assert "tensor_parallel_size" not in single.distributions()


def test_awq_choices_need_an_awq_checkpoint() -> None:
    bf16 = load_space("ampere").resolve(CONTEXTS["h200"])
    assert _choices(bf16, "quantization") == ("none",)
    awq = load_space("ampere").resolve(CONTEXTS["a100"])
    assert _choices(awq, "quantization") == ("none", "awq_marlin", "awq")


def test_prequantized_checkpoint_loses_on_the_fly_fp8() -> None:
    context = _host()
    context["model"]["quant_method"] = "gptq"
    resolved = load_space("consumer_24gb").resolve(context)
    assert _choices(resolved, "quantization") == ("none", "gptq_marlin")


def test_max_model_len_is_capped_by_the_model() -> None:
    resolved = load_space("default").resolve(CONTEXTS["h200"])  # 32768 positions
    assert _choices(resolved, "max_model_len") == (4096, 8192, 16384, 32768)
    small = _host()
    small["model"]["max_position_embeddings"] = 8192
    assert _choices(load_space("default").resolve(small), "max_model_len") == (4096, 8192)


def test_flex_attention_fixes_the_kv_dtype_to_auto() -> None:
    resolved = parse_space(FULL_ATTENTION_SPACE).resolve(CONTEXTS["h200"])
    trial = optuna.trial.FixedTrial({"attention_backend": "FLEX_ATTENTION",
                                     "kv_cache_dtype": "fp8"})
    params = resolved.sample(trial)
    assert params["kv_cache_dtype"] == "auto", "FLEX_ATTENTION takes no fp8 KV"
    assert resolved.check({"attention_backend": "FLEX_ATTENTION", "kv_cache_dtype": "fp8"}) == [
        "kv_cache_dtype='fp8' breaks rule flex-attention-no-fp8-kv: it must be auto when "
        "params.attention_backend == FLEX_ATTENTION (FLEX_ATTENTION takes no fp8 KV cache)"]


def test_flash_attn_takes_fp8_kv_on_sm90_only() -> None:
    trial = optuna.trial.FixedTrial({"attention_backend": "FLASH_ATTN", "kv_cache_dtype": "fp8"})
    on_hopper = parse_space(FULL_ATTENTION_SPACE).resolve(CONTEXTS["h200"])
    assert on_hopper.sample(trial)["kv_cache_dtype"] == "fp8", "FA3 takes fp8 KV on SM90"
    on_ada = parse_space(FULL_ATTENTION_SPACE).resolve(CONTEXTS["2x4090_pcie"])
    assert on_ada.sample(trial)["kv_cache_dtype"] == "auto", "FA2 takes no fp8 KV"
    assert "flash-attn-fp8-kv-needs-sm90" in {r.name for r in on_ada.applied_rules}


def test_fp8_e5m2_is_dropped_with_flash_attn_on_sm90() -> None:
    resolved = parse_space(FULL_ATTENTION_SPACE).resolve(CONTEXTS["h200"])
    assert "fp8_e5m2" not in _choices(resolved, "kv_cache_dtype")
    no_fa = {"parameters": {
        "attention_backend": {"type": "categorical", "choices": ["FLASHINFER", "TRITON_ATTN"]},
        "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8_e5m2"]}}}
    assert "fp8_e5m2" in _choices(parse_space(no_fa).resolve(CONTEXTS["h200"]), "kv_cache_dtype")


def test_sampled_conditional_configs_satisfy_check_on_ada() -> None:
    resolved = parse_space(FULL_ATTENTION_SPACE).resolve(CONTEXTS["2x4090_pcie"])
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=3, n_startup_trials=5))
    for _ in range(40):
        trial = study.ask()
        params = resolved.sample(trial)
        assert resolved.check(params) == []
        if params["attention_backend"] in ("FLASH_ATTN", "FLEX_ATTENTION"):
            assert params["kv_cache_dtype"] == "auto"
            assert "kv_cache_dtype" not in trial.params, "a fixed param is not suggested"
        study.tell(trial, 1.0)


def test_rule_that_empties_a_param_names_the_rule() -> None:
    space = parse_space({
        "parameters": {"quantization": {"type": "categorical", "choices": ["awq"],
                                        "default": "awq"}},
        "rules": [{"name": "only-awq", "reason": "why", "keep": {"quantization": ["gptq"]}}],
    }, source="mine.yaml")
    with pytest.raises(SpaceError, match=r"^mine\.yaml: rule 'only-awq' leaves quantization "
                                         r"with no value"):
        space.resolve({})


def test_yaml_rules_keep_min_and_fix_on_hardware_class() -> None:
    space = parse_space({
        "parameters": {
            "max_num_seqs": {"type": "int", "low": 32, "high": 512, "step": 32, "default": 256},
            "attention_backend": {"type": "categorical",
                                  "choices": ["FLASH_ATTN", "FLASHINFER", "TRITON_ATTN"]},
            "enforce_eager": {"type": "categorical", "choices": [False, True]},
        },
        "rules": [
            {"name": "big-batches", "reason": "r", "when": {"hardware.hardware_class": "hopper"},
             "min": {"max_num_seqs": 100}},
            {"name": "no-triton", "reason": "r",
             "when": {"hardware.gpu_memory_gib": {"ge": 70}},
             "keep": {"attention_backend": ["FLASH_ATTN", "FLASHINFER", "auto"]}},
            {"name": "graphs", "reason": "r", "when": {"hardware.num_gpus": {"in": [1, 8]}},
             "fix": {"enforce_eager": False}},
            {"name": "never", "reason": "r", "when": {"hardware.interconnect": "pcie"},
             "fix": {"enforce_eager": True}},
        ],
    })
    resolved = space.resolve(_host())
    seqs = {p.name: p for p in resolved.params}["max_num_seqs"]
    assert (seqs.low, seqs.high, seqs.step) == (128, 512, 32), "min snaps up onto the step grid"
    assert _choices(resolved, "attention_backend") == ("FLASH_ATTN", "FLASHINFER", "auto")
    assert resolved.fixed() == {"enforce_eager": False}
    assert [r.name for r in resolved.applied_rules] == ["big-batches", "no-triton", "graphs"]


def test_rule_removing_the_default_moves_the_baseline_and_logs_it() -> None:
    space = parse_space({
        "parameters": {"max_model_len": {"type": "categorical", "choices": [4096, 16384]}},
        "rules": [{"name": "short", "reason": "r", "max": {"max_model_len": 16384}}],
    })
    resolved = space.resolve(CONTEXTS["8xh100_nvlink"])  # 131072 positions
    assert resolved.defaults() == {"max_model_len": 16384}
    effects = {r.name: r.effect for r in resolved.applied_rules}
    assert effects["default-outside-space"] == "max_model_len: 131072 -> 16384"


def test_user_conditional_rule_fixes_a_later_param() -> None:
    space = parse_space({
        "parameters": {
            "enforce_eager": {"type": "categorical", "choices": [False, True]},
            "max_num_seqs": {"type": "categorical", "choices": [64, 256]},
        },
        "rules": [{"name": "eager-small", "reason": "r",
                   "when": {"params.enforce_eager": True, "hardware.num_gpus": {"ge": 1}},
                   "fix": {"max_num_seqs": 64}}],
    })
    resolved = space.resolve(CONTEXTS["h200"])
    trial = optuna.trial.FixedTrial({"enforce_eager": True, "max_num_seqs": 256})
    assert resolved.sample(trial) == {"enforce_eager": True, "max_num_seqs": 64}
    dropped = space.resolve(CONTEXTS["no_gpu"])
    assert dropped.conditional_rules == (), "its hardware part fails without a GPU"


def test_token_budget_below_max_num_seqs_is_rejected() -> None:
    space = parse_space({"parameters": {
        "max_num_batched_tokens": {"type": "categorical", "choices": [512, 4096]},
        "max_num_seqs": {"type": "categorical", "choices": [64, 1024]}}}, source="s.yaml")
    with pytest.raises(SpaceError, match="max_num_batched_tokens >= max_num_seqs"):
        space.resolve(CONTEXTS["h200"])


def test_token_budget_counts_the_values_a_conditional_rule_fixes() -> None:
    # Found by test_fuzz: a rule fixing max_num_seqs above vLLM's default token budget made a
    # space whose own defaults broke it.
    space = parse_space({"parameters": {
        "dtype": {"type": "categorical", "choices": ["auto"]},
        "max_num_seqs": {"type": "categorical", "choices": [1]}},
        "rules": [{"name": "x", "reason": "r", "when": {"params.dtype": "auto"},
                   "fix": {"max_num_seqs": 16384}}]}, source="s.yaml")
    with pytest.raises(SpaceError, match=r"needs max_num_batched_tokens >= max_num_seqs.*rule"):
        space.resolve(CONTEXTS["h200"])


def test_eager_fixes_cudagraph_mode() -> None:
    space = parse_space({"parameters": {
        "enforce_eager": {"type": "categorical", "choices": [False, True]},
        "cudagraph_mode": {"type": "categorical", "choices": ["PIECEWISE", "FULL"]}}})
    resolved = space.resolve({})
    trial = optuna.trial.FixedTrial({"enforce_eager": True, "cudagraph_mode": "FULL"})
    assert resolved.sample(trial)["cudagraph_mode"] == "NONE"


def test_context_accepts_hardware_profile_and_model_info_objects() -> None:
    context = {"hardware": load_preset("h200"), "model": load_model_info("qwen2.5-7b")}
    resolved = load_space("hopper").resolve(context)
    defaults = resolved.defaults()
    assert defaults["max_num_seqs"] == 1024 and defaults["max_model_len"] == 32768
    assert resolved.fixed()["tensor_parallel_size"] == 1


def test_flat_dotted_context_keys_work() -> None:
    resolved = load_space("default").resolve({"hardware.num_gpus": 2,
                                              "hardware.interconnect": "pcie"})
    assert _choices(resolved, "tensor_parallel_size") == (1, 2)


@pytest.mark.parametrize(("op", "value", "actual", "expected"), [
    ("eq", "pcie", "pcie", True), ("eq", 1, True, False), ("ne", "awq", None, True),
    ("in", (1, 2), 2, True), ("not_in", (1, 2), 2, False), ("lt", 8.9, 8.0, True),
    ("le", 8.9, 8.9, True), ("gt", 70, 70, False), ("ge", 70, 79.6, True),
    ("lt", 8.9, None, False), ("eq", "pcie", MISSING, False), ("ne", "pcie", MISSING, False),
])
def test_condition_operators(op: str, value: Any, actual: Any, expected: bool) -> None:
    condition = Condition("hardware.x", op, value)  # type: ignore[arg-type]
    assert condition.holds(actual) is expected


def test_applied_rules_carry_name_reason_and_effect_for_logging() -> None:
    resolved = load_space("default").resolve(CONTEXTS["2x4090_pcie"])
    logged = [r.to_dict() for r in resolved.applied_rules]
    assert all(set(r) == {"name", "reason", "effect", "kind"} for r in logged)
    assert all(r["reason"] and r["effect"] and "\n" not in r["effect"] for r in logged)
    kinds = {r["name"]: r["kind"] for r in logged}
    assert kinds["flex-attention-no-fp8-kv"] == "conditional"
    assert kinds["parallel-sizes-fit-gpus"] == "static", "2 GPUs: TP 4 and 8 dropped"
    assert kinds["flash-attn-fp8-kv-needs-sm90"] == "conditional", "SM 8.9 runs FA2"


def test_pcie_box_searches_replicas_and_never_samples_more_gpus_than_it_has() -> None:
    # 2x RTX 4090 over PCIe: TP capped at 2, and the second GPU can serve as a replica instead.
    resolved = load_space("consumer_24gb").resolve(CONTEXTS["2x4090_pcie"])
    assert _choices(resolved, "tensor_parallel_size") == (1, 2)
    assert _choices(resolved, "data_parallel_size") == (1, 2)
    applied = {r.name: r for r in resolved.applied_rules}
    assert "replicas-fit-gpus" in applied and "this host has 2" in applied[
        "replicas-fit-gpus"].reason
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(40):
        trial = study.ask()
        params = resolved.sample(trial)
        assert resolved.check(params) == []
        tp, dp = params["tensor_parallel_size"], params["data_parallel_size"]
        assert tp * dp <= 2, f"TP {tp} x DP {dp} needs more GPUs than the host has"
        seen.add((tp, dp))
        study.tell(trial, 1.0)
    assert seen == {(1, 1), (1, 2), (2, 1)}, "every layout of two GPUs is searched"


def test_replicas_are_fixed_to_one_once_tp_takes_more_than_half_the_host() -> None:
    resolved = load_space("hopper").resolve(_host(num_gpus=4))
    assert _choices(resolved, "data_parallel_size") == (1, 2, 4)
    base = resolved.defaults()
    trial = optuna.trial.FixedTrial({**base, "tensor_parallel_size": 4, "data_parallel_size": 2})
    assert resolved.sample(trial)["data_parallel_size"] == 1
    trial = optuna.trial.FixedTrial({**base, "tensor_parallel_size": 2, "data_parallel_size": 2})
    assert resolved.sample(trial)["data_parallel_size"] == 2, "2 x 2 fills the 4 GPUs"
    single = load_space("hopper").resolve(_host(num_gpus=1))
    assert _choices(single, "data_parallel_size") == (1,)


def test_a_longrope_models_no_flag_context_is_its_default_and_its_ceiling_the_long_one() -> None:
    # A trial that sets max_model_len to the long context changed vLLM's default (so an export
    # keeps the flag), and the ceiling rule still allows it.
    from search_spaces.known_flags import vllm_default

    context = {"model": {"max_model_len": 131072, "default_max_model_len": 4096}}
    assert vllm_default("max_model_len", context) == 4096
    assert vllm_default("max_model_len", {"model": {"max_model_len": 32768}}) == 32768
    space = parse_space({"parameters": {"max_model_len": {
        "type": "categorical", "choices": [None, 8192, 131072, 262144]}}})
    resolved = space.resolve(context)
    assert [p.choices for p in resolved.params] == [(None, 4096, 8192, 131072)], \
        "the default joins the choices (the baseline runs it); 262144 is over the ceiling"
    assert resolved.defaults() == {"max_model_len": 4096}
    assert resolved.vllm_defaults["max_model_len"] == 4096


def _resolve_for(workload: Any, space: str = "hopper") -> Any:
    from optimizer.run.space_context import space_context

    return load_space(space).resolve(space_context(
        load_preset("h200"), load_model_info("qwen2.5-7b"), workload, "dummy"))


def test_max_model_len_choices_below_the_longest_request_are_dropped_and_logged() -> None:
    """32,000 prompt tokens + 600 output: 8192 would fail every request with HTTP 400."""
    from runners.workload import LengthDistribution, Workload

    workload = Workload(input_len=LengthDistribution(mean=32000),
                        output_len=LengthDistribution(mean=600))
    resolved = _resolve_for(workload)
    assert _choices(resolved, "max_model_len") == (32768,), \
        "no max_model_len below the 32,600-token request is left to sample"
    applied = {r.name: r for r in resolved.applied_rules}
    rule = applied["max-model-len-covers-requests"]
    assert rule.effect == "max_model_len: fixed to 32768 (removed 8192)"
    assert "32600 tokens" in rule.reason, "the log line says how long the longest request is"


def test_a_max_model_len_equal_to_the_longest_request_is_kept() -> None:
    from runners.workload import LengthDistribution, SharedPrefix, Workload

    # vLLM takes prompt + max_tokens == max_model_len; the shared prefix is part of the prompt.
    exact = Workload(input_len=LengthDistribution(kind="uniform", low=100, high=6000),
                     output_len=LengthDistribution(mean=1192),
                     shared_prefix=SharedPrefix(fraction=0.5, num_tokens=1000))
    assert _choices(_resolve_for(exact, "default"), "max_model_len") == (8192, 16384, 32768)
    short = Workload()  # 512 + 128
    resolved = _resolve_for(short, "default")
    assert _choices(resolved, "max_model_len") == (4096, 8192, 16384, 32768)
    assert "max-model-len-covers-requests" not in {r.name for r in resolved.applied_rules}


def test_the_longest_request_is_left_out_where_a_length_has_no_bound() -> None:
    """A normal output without `high`, or prompts from a file: the rule does not apply."""
    from optimizer.run.space_context import workload_facts
    from runners.workload import LengthDistribution, Workload

    fixed = Workload(input_len=LengthDistribution(mean=1000),
                     output_len=LengthDistribution(kind="normal", mean=200, std=50, high=400))
    assert workload_facts(fixed)["max_request_tokens"] == 1400
    tail = Workload(output_len=LengthDistribution(kind="normal", mean=200, std=50))
    assert "max_request_tokens" not in workload_facts(tail)
    assert workload_facts(tail)["max_prompt_tokens"] == 512
