"""The loader and its one-line errors, vLLM defaults, and sampling spaces into real studies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from search_spaces import (
    SpaceError,
    bundled_spaces,
    load_space,
    parse_space,
    recommend_space,
    to_flags,
)

# Host and model contexts as the optimizer builds them. Hardware figures are datasheet values
# as NVML reports them (GiB); model shapes come from runners/model_configs/*/config.json.
QWEN_7B = {"num_attention_heads": 28, "num_key_value_heads": 4, "quant_method": None,
           "max_position_embeddings": 32768, "num_params": 7_615_616_512}
LLAMA_8B = {"num_attention_heads": 32, "num_key_value_heads": 8, "quant_method": None,
            "max_position_embeddings": 131072, "num_params": 8_030_261_248}
LLAMA_8B_AWQ = {**LLAMA_8B, "quant_method": "awq"}
CONTEXTS: dict[str, dict[str, Any]] = {
    "h200": {
        "hardware": {"num_gpus": 1, "compute_capability": 9.0, "gpu_memory_gib": 139.8,
                     "interconnect": "none", "hardware_class": "hopper",
                     "gpu_name": "NVIDIA H200"},
        "model": QWEN_7B,
    },
    "8xh100_nvlink": {
        "hardware": {"num_gpus": 8, "compute_capability": 9.0, "gpu_memory_gib": 79.6,
                     "interconnect": "nvlink", "hardware_class": "hopper",
                     "gpu_name": "NVIDIA H100 80GB HBM3"},
        "model": LLAMA_8B,
    },
    "a100": {
        "hardware": {"num_gpus": 4, "compute_capability": 8.0, "gpu_memory_gib": 79.2,
                     "interconnect": "nvlink", "hardware_class": "ampere",
                     "gpu_name": "NVIDIA A100-SXM4-80GB"},
        "model": LLAMA_8B_AWQ,
    },
    "2x4090_pcie": {
        "hardware": {"num_gpus": 2, "compute_capability": 8.9, "gpu_memory_gib": 23.6,
                     "interconnect": "pcie", "hardware_class": "24gb",
                     "gpu_name": "NVIDIA GeForce RTX 4090"},
        "model": QWEN_7B,
    },
    "no_gpu": {
        "hardware": {"num_gpus": 0, "compute_capability": 0.0, "gpu_memory_gib": 0.0,
                     "interconnect": "none", "hardware_class": "none", "gpu_name": "none"},
    },
}
SPACES = ["default", "hopper", "ampere", "consumer_24gb"]


def _objective_score(params: dict[str, Any]) -> float:
    """A deterministic stand-in for throughput, so TPE has something to model."""
    score: float = float(params.get("max_num_seqs", 1) or 1) ** 0.5
    if params.get("kv_cache_dtype") == "fp8":
        score *= 1.3
    if params.get("enforce_eager"):
        score *= 0.7
    return score


def test_bundled_spaces_lists_the_four_shipped_spaces() -> None:
    assert bundled_spaces() == sorted(SPACES), "every shipped YAML is listed, nothing else"


@pytest.mark.parametrize("name", SPACES)
def test_bundled_space_params_all_have_help(name: str) -> None:
    space = load_space(name)
    assert space.description, f"{name} has a description"
    for param in space.params:
        assert param.help, f"{name}.{param.name} has a help line"


@pytest.mark.parametrize("context_name", list(CONTEXTS))
@pytest.mark.parametrize("name", SPACES)
def test_every_bundled_space_resolves_on_every_host(name: str, context_name: str) -> None:
    resolved = load_space(name).resolve(CONTEXTS[context_name])
    defaults = resolved.defaults()
    assert resolved.check(defaults) == [], "the defaults baseline is a config of the space"
    assert set(defaults) == {p.name for p in resolved.params}, "defaults cover every param"
    for param_name, distribution in resolved.distributions().items():
        assert not distribution.single(), f"{param_name} is sampled only when it has a choice"
    json.dumps(resolved.to_dict())  # loggable to MLflow as is
    size = resolved.size()
    assert size is not None and size >= 1, "bundled spaces are all discrete"


@pytest.mark.parametrize("context_name", list(CONTEXTS))
@pytest.mark.parametrize("name", SPACES)
def test_sampling_50_trials_never_breaks_a_rule(name: str, context_name: str) -> None:
    resolved = load_space(name).resolve(CONTEXTS[context_name])
    sampler = optuna.samplers.TPESampler(seed=7, n_startup_trials=10, multivariate=True)
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.enqueue_trial(resolved.defaults())
    seen: list[dict[str, Any]] = []

    def objective(trial: optuna.Trial) -> float:
        params = resolved.sample(trial)
        assert resolved.check(params) == [], f"trial {trial.number} sampled a valid config"
        seen.append(params)
        return _objective_score(params)

    study.optimize(objective, n_trials=50)
    assert len(seen) == 50, "every trial completed (no distribution incompatibility)"
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert seen[0] == resolved.defaults(), "the enqueued defaults baseline runs first"


def test_ask_tell_with_distributions_accepts_every_sampled_config() -> None:
    resolved = load_space("default").resolve(CONTEXTS["2x4090_pcie"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    distributions = resolved.distributions()
    for _ in range(30):
        trial = study.ask()
        params = resolved.sample(trial)
        for key, value in trial.params.items():
            assert distributions[key]._contains(distributions[key].to_internal_repr(value))
            assert params[key] == pytest.approx(value), "sample returns what Optuna recorded"
        study.tell(trial, 1.0)


def test_unsampled_names_what_a_cut_short_sampling_left_out() -> None:
    resolved = load_space("default").resolve(CONTEXTS["2x4090_pcie"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(10):
        trial = study.ask()
        resolved.sample(trial)
        assert resolved.unsampled(trial.params) == [], "a whole config lacks nothing"
        study.tell(trial, 1.0)
    names = [p.name for p in resolved.params]
    assert names[0] == "tensor_parallel_size"
    assert resolved.unsampled({"tensor_parallel_size": 1}) == names[1:]
    whole = resolved.defaults()
    # The last parameter the defaults give a value (a conditional one such as spec_tokens, set
    # only with a speculative method, is None in them and not missing when left out).
    last = [name for name in names if whole.get(name) is not None][-1]
    assert resolved.unsampled({k: v for k, v in whole.items() if k != last}) == [last]


def test_vllm_defaults_follow_the_gpu() -> None:
    h200 = load_space("default").resolve(CONTEXTS["h200"]).defaults()
    a100 = load_space("default").resolve(CONTEXTS["a100"]).defaults()
    assert (h200["max_num_batched_tokens"], h200["max_num_seqs"]) == (8192, 1024)
    assert (a100["max_num_batched_tokens"], a100["max_num_seqs"]) == (2048, 256), (
        "vLLM gives the A100 the small defaults even with 80 GB")
    assert h200["gpu_memory_utilization"] == 0.92
    assert h200["max_model_len"] == 32768, "max_model_len defaults to the model's positions"
    assert h200["quantization"] == "none" and h200["attention_backend"] == "auto"
    assert a100["quantization"] == "none", "a pre-quantized checkpoint is detected, no flag"


def test_vllm_default_joins_choices_in_numeric_order() -> None:
    resolved = load_space("consumer_24gb").resolve(CONTEXTS["8xh100_nvlink"])
    by_name = {p.name: p for p in resolved.params}
    assert by_name["max_model_len"].choices == (4096, 8192, 16384, 131072)
    assert by_name["max_num_seqs"].choices == (32, 64, 128, 256, 1024)


def test_unknown_model_leaves_max_model_len_to_vllm() -> None:
    resolved = load_space("default").resolve(CONTEXTS["no_gpu"])
    by_name = {p.name: p for p in resolved.params}
    assert by_name["max_model_len"].choices[0] is None, "None (no flag) comes first"
    assert "max_model_len" not in resolved.to_flags(resolved.defaults())


def test_defaults_give_no_flags_on_a_single_h200() -> None:
    resolved = load_space("hopper").resolve(CONTEXTS["h200"])
    flags = resolved.to_flags(resolved.defaults())
    assert "attention_backend" not in flags and "quantization" not in flags
    assert "kv_cache_dtype" not in flags and "enforce_eager" not in flags


def test_to_flags_drops_no_flag_values_and_negates_true_defaults() -> None:
    flags = to_flags({
        "quantization": "none", "attention_backend": "auto", "kv_cache_dtype": "fp8",
        "enforce_eager": False, "enable_prefix_caching": False, "enable_chunked_prefill": True,
        "max_num_seqs": 128, "cudagraph_mode": "PIECEWISE", "async_scheduling": False,
        "max_model_len": None,
    })
    assert flags == {
        "kv_cache_dtype": "fp8",
        "no_enable_prefix_caching": True,
        "max_num_seqs": 128,
        "compilation_config.cudagraph_mode": "PIECEWISE",
        "no_async_scheduling": True,
    }
    assert to_flags({"enforce_eager": True}) == {"enforce_eager": True}


def test_to_flags_rejects_unknown_names() -> None:
    with pytest.raises(SpaceError, match="did you mean 'max_num_seqs'"):
        to_flags({"max_num_seq": 8})


def test_load_by_path_and_by_name_agree(tmp_path: Path) -> None:
    copy = tmp_path / "mine.yaml"
    copy.write_text((Path(load_space.__code__.co_filename).parent / "hopper.yaml").read_text())
    assert load_space(copy).params == load_space("hopper").params
    assert load_space(str(copy)).source == str(copy)


def test_unknown_bundled_name_suggests_the_closest() -> None:
    with pytest.raises(SpaceError, match="did you mean 'hopper'"):
        load_space("hoper")


def test_missing_file_is_a_space_error(tmp_path: Path) -> None:
    with pytest.raises(SpaceError, match="no such file"):
        load_space(tmp_path / "absent.yaml")


@pytest.mark.parametrize(("hardware_class", "expected"), [
    ("hopper", "hopper"), ("ampere", "ampere"), ("24gb", "consumer_24gb"),
    ("other", "default"), ("none", "default"),
])
def test_recommend_space_maps_hardware_classes(hardware_class: str, expected: str) -> None:
    assert recommend_space(hardware_class) == expected
    assert expected in bundled_spaces()


def test_check_reports_params_outside_the_space() -> None:
    resolved = load_space("default").resolve(CONTEXTS["h200"])
    params = {**resolved.defaults(), "max_num_seqs": 3, "bogus": 1}
    del params["enforce_eager"]
    problems = resolved.check(params)
    assert any("max_num_seqs=3 is outside" in p for p in problems)
    assert any("'bogus' is not a param" in p for p in problems)
    assert any("enforce_eager is missing" in p for p in problems)


def test_size_counts_conditional_fixes_once() -> None:
    space = parse_space({"parameters": {
        "attention_backend": {"type": "categorical", "choices": ["FLASH_ATTN", "FLEX_ATTENTION"],
                              "default": "FLASH_ATTN"},
        "kv_cache_dtype": {"type": "categorical", "choices": ["auto", "fp8"]},
        "max_num_seqs": {"type": "int", "low": 64, "high": 256, "step": 64, "default": 256},
    }})
    resolved = space.resolve(CONTEXTS["h200"])
    # FLASH_ATTN x {auto, fp8} + FLEX_ATTENTION x {auto}, times 4 values of max_num_seqs.
    assert resolved.size() == 3 * 4


def test_size_is_none_for_a_continuous_param() -> None:
    space = parse_space({"parameters": {
        "gpu_memory_utilization": {"type": "float", "low": 0.8, "high": 0.95}}})
    assert space.resolve({}).size() is None


def test_int_range_grows_to_take_vllm_default() -> None:
    space = parse_space({"parameters": {
        "max_num_seqs": {"type": "int", "low": 32, "high": 128, "log": True}}})
    resolved = space.resolve(CONTEXTS["h200"])
    assert (resolved.params[0].low, resolved.params[0].high) == (32, 1024)
    assert resolved.defaults() == {"max_num_seqs": 1024}


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


_PARAM_OK = "parameters:\n  max_num_seqs: {type: categorical, choices: [64, 128]}\n"
BAD_YAML = [
    ("unknown_param", "parameters:\n  max_num_seq: {type: categorical, choices: [1]}\n",
     "parameters.max_num_seq", "did you mean 'max_num_seqs'"),
    ("kebab_name", "parameters:\n  max-num-seqs: {type: categorical, choices: [1]}\n",
     "parameters.max-num-seqs", "did you mean 'max_num_seqs'"),
    ("low_ge_high", "parameters:\n  max_num_seqs: {type: int, low: 512, high: 64}\n",
     "parameters.max_num_seqs.low", "must be < high"),
    ("log_low_zero",
     "parameters:\n  long_prefill_token_threshold: {type: int, low: 0, high: 64, log: true,"
     " default: 0}\n",
     "parameters.long_prefill_token_threshold.log", "low > 0"),
    ("empty_choices", "parameters:\n  max_num_seqs: {type: categorical, choices: []}\n",
     "parameters.max_num_seqs.choices", "non-empty"),
    ("wrong_type_choice",
     "parameters:\n  enforce_eager: {type: categorical, choices: [false, 'yes']}\n",
     "parameters.enforce_eager.choices[1]", "true or false"),
    ("int_choice_is_string",
     "parameters:\n  max_num_seqs: {type: categorical, choices: [64, '128']}\n",
     "parameters.max_num_seqs.choices[1]", "integer"),
    ("bad_backend",
     "parameters:\n  attention_backend: {type: categorical, choices: [FLASH_ATN]}\n",
     "parameters.attention_backend.choices[0]", "did you mean 'FLASH_ATTN'"),
    ("bad_kv_dtype",
     "parameters:\n  kv_cache_dtype: {type: categorical, choices: [auto, fp4]}\n",
     "parameters.kv_cache_dtype.choices[1]", "must be one of"),
    ("bad_quantization",
     "parameters:\n  quantization: {type: categorical, choices: [none, awq-marlin]}\n",
     "parameters.quantization.choices[1]", "did you mean 'awq_marlin'"),
    ("gmu_above_one",
     "parameters:\n  gpu_memory_utilization: {type: float, low: 0.9, high: 1.05}\n",
     "parameters.gpu_memory_utilization.high", "<= 1"),
    ("gmu_zero",
     "parameters:\n  gpu_memory_utilization: {type: categorical, choices: [0, 0.9]}\n",
     "parameters.gpu_memory_utilization.choices[0]", "> 0"),
    ("unknown_type", "parameters:\n  max_num_seqs: {type: integer, low: 1, high: 8}\n",
     "parameters.max_num_seqs.type", "did you mean 'int'"),
    ("unknown_param_key",
     "parameters:\n  max_num_seqs: {type: categorical, choices: [1], defualt: 1}\n",
     "parameters.max_num_seqs", "did you mean 'default'"),
    ("range_for_enum", "parameters:\n  attention_backend: {type: int, low: 1, high: 2}\n",
     "parameters.attention_backend.type", "must be categorical"),
    ("tp_as_range", "parameters:\n  tensor_parallel_size: {type: int, low: 1, high: 8}\n",
     "parameters.tensor_parallel_size.type", "must be categorical"),
    ("step_off_grid",
     "parameters:\n  max_num_seqs: {type: int, low: 64, high: 200, step: 64, default: 64}\n",
     "parameters.max_num_seqs.high", "low + k*step"),
    ("default_off_grid",
     "parameters:\n  max_num_seqs: {type: int, low: 64, high: 256, step: 64, default: 100}\n",
     "parameters.max_num_seqs.default", "not on the grid"),
    ("bad_default",
     "parameters:\n  kv_cache_dtype: {type: categorical, choices: [auto], default: fp16}\n",
     "parameters.kv_cache_dtype.default", "must be one of"),
    ("multiline_help",
     "parameters:\n  max_num_seqs: {type: categorical, choices: [1], help: \"a\\nb\"}\n",
     "parameters.max_num_seqs.help", "one-line"),
    ("no_parameters", "name: x\n", "parameters", "non-empty mapping"),
    ("unknown_top_key", _PARAM_OK + "rulez: []\n", "'rulez'", "did you mean 'rules'"),
    ("not_a_mapping", "- a\n- b\n", "bad.yaml", "expected a mapping"),
    ("kv_before_backend",
     "parameters:\n  kv_cache_dtype: {type: categorical, choices: [auto, fp8]}\n"
     "  attention_backend: {type: categorical, choices: [auto, FLASH_ATTN]}\n",
     "parameters.attention_backend", "before parameters.kv_cache_dtype"),
    ("rule_unknown_param", _PARAM_OK + "rules:\n  - {name: r, reason: why, max: "
     "{max_num_sequences: 64}}\n", "rules[0] (r).max", "did you mean 'max_num_seqs'"),
    ("rule_unknown_context_key", _PARAM_OK + "rules:\n  - {name: r, reason: why, when: "
     "{hardware.gpus: 2}, max: {max_num_seqs: 64}}\n",
     "rules[0] (r).when.hardware.gpus", "did you mean 'hardware.num_gpus'"),
    ("rule_param_without_prefix", _PARAM_OK + "rules:\n  - {name: r, reason: why, when: "
     "{max_num_seqs: 64}, max: {max_num_seqs: 64}}\n",
     "rules[0] (r).when.max_num_seqs", "did you mean 'params.max_num_seqs'"),
    ("rule_reads_later_param",
     "parameters:\n  max_num_seqs: {type: categorical, choices: [64, 128]}\n"
     "  enforce_eager: {type: categorical, choices: [false, true]}\n"
     "rules:\n  - {name: r, reason: why, when: {params.enforce_eager: true},"
     " fix: {max_num_seqs: 64}}\n",
     "rules[0] (r)", "declare enforce_eager before max_num_seqs"),
    ("conditional_remove",
     "parameters:\n  enforce_eager: {type: categorical, choices: [false, true]}\n"
     "  max_num_seqs: {type: categorical, choices: [64, 128]}\n"
     "rules:\n  - {name: r, reason: why, when: {params.enforce_eager: true},"
     " remove: {max_num_seqs: [64]}}\n",
     "rules[0] (r)", "may only fix"),
    ("rule_two_actions", _PARAM_OK + "rules:\n  - {name: r, reason: why, max: {max_num_seqs: 64},"
     " min: {max_num_seqs: 64}}\n", "rules[0] (r)", "exactly one action"),
    ("rule_no_reason", _PARAM_OK + "rules:\n  - {name: r, max: {max_num_seqs: 64}}\n",
     "rules[0] (r).reason", "one-line"),
    ("rule_bad_operator", _PARAM_OK + "rules:\n  - {name: r, reason: why, when: "
     "{hardware.num_gpus: {lte: 2}}, max: {max_num_seqs: 64}}\n",
     "rules[0] (r).when.hardware.num_gpus", "allowed: eq, ne, in, not_in, lt, le"),
    ("rule_bad_interconnect", _PARAM_OK + "rules:\n  - {name: r, reason: why, when: "
     "{hardware.interconnect: PCIe}, max: {max_num_seqs: 64}}\n",
     "rules[0] (r).when.hardware.interconnect", "did you mean 'pcie'"),
    ("rule_bad_value", "parameters:\n  attention_backend: {type: categorical, choices: [auto]}\n"
     "rules:\n  - {name: r, reason: why, remove: {attention_backend: [FLASHINFR]}}\n",
     "rules[0] (r).remove.attention_backend", "did you mean 'FLASHINFER'"),
    ("rule_list_condition", _PARAM_OK + "rules:\n  - {name: r, reason: why, when: "
     "{hardware.num_gpus: [1, 2]}, max: {max_num_seqs: 64}}\n",
     "rules[0] (r).when.hardware.num_gpus", "{in: [...]}"),
    ("rule_duplicate_name", _PARAM_OK + "rules:\n  - {name: r, reason: why, max: {max_num_seqs:"
     " 64}}\n  - {name: r, reason: why, max: {max_num_seqs: 64}}\n",
     "rules[1].name", "already taken"),
    ("rule_builtin_name", _PARAM_OK + "rules:\n  - {name: fp8-needs-sm89, reason: why, max: "
     "{max_num_seqs: 64}}\n", "rules[0].name", "already taken"),
    ("yaml_syntax", "parameters: [unclosed\n", "bad.yaml", "not valid YAML at line"),
]


@pytest.mark.parametrize(("text", "field", "hint"), [c[1:] for c in BAD_YAML],
                         ids=[c[0] for c in BAD_YAML])
def test_bad_yaml_gives_one_line_error_naming_file_and_field(
    tmp_path: Path, text: str, field: str, hint: str
) -> None:
    with pytest.raises(SpaceError) as info:
        load_space(_write(tmp_path, text))
    message = str(info.value)
    assert "\n" not in message, "errors are one line"
    assert message.startswith(str(tmp_path / "bad.yaml")), "the error names the file"
    assert field in message, f"the error names the field {field}: {message}"
    assert hint in message, f"the error says how to fix it ({hint}): {message}"


def test_effective_params_fill_vllms_defaults_and_derive_the_capture_size() -> None:
    """vLLM 0.26 (config/vllm.py:1788-1798): unset, the largest capture size is
    min(max_num_seqs x (1 + draft tokens) x 2, 512); either way at most the token budget."""
    from search_spaces import effective_params

    host = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "stream_interval": 1}
    assert effective_params({"stream_interval": None, "max_cudagraph_capture_size": None},
                            host) == {"stream_interval": 1, "max_cudagraph_capture_size": 512}
    assert effective_params({"max_cudagraph_capture_size": None, "max_num_seqs": 64,
                             "spec_method": "ngram", "spec_tokens": 2}, host)[
        "max_cudagraph_capture_size"] == 384
    assert effective_params({"max_cudagraph_capture_size": 512,
                             "max_num_batched_tokens": 256}, host)[
        "max_cudagraph_capture_size"] == 256
    assert effective_params({"async_scheduling": None}, host) == {"async_scheduling": None}


def test_effective_capture_size_is_the_last_of_vllms_capture_list() -> None:
    """config/vllm.py:1820-1880: the size is cut down to the last entry of vLLM's list (steps of
    8 below 256, of 16 above); no CUDA graphs, no capture."""
    from search_spaces import effective_params

    host = {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    size = "max_cudagraph_capture_size"
    assert effective_params({size: None, "max_num_seqs": 130}, host)[size] == 256
    assert effective_params({size: 300}, host)[size] == 288
    assert effective_params({size: 64, "enforce_eager": True}, host)[size] == 0
    assert effective_params({size: 64, "cudagraph_mode": "NONE"}, host)[size] == 0
    assert effective_params({size: None, "spec_method": "suffix", "spec_tokens": None},
                            host)[size] is None, "a suffix method's drafts default to its depth"
