"""The one home of vLLM's engine facts (`search_spaces.engine`): a new vLLM flag is one table
entry (argv, `--config` YAML and `fixed_flags` follow from it), negation and defaults come from
the table, the search space's defaults and value sets are the table's, and "is the KV cache
fp8?" is one function, right for every fp8 spelling the releases list."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from optimizer.config.flag_checks import fixed_flag_problem
from runners.base import EngineConfig
from runners.vllm.launcher import VllmLauncher
from search_spaces import KNOWN_FLAGS, parse_space, to_flags, vllm_default
from search_spaces.engine import facts
from search_spaces.engine.render import bool_flag, to_argv, to_config_dict
from search_spaces.engine.tables import (
    DEFAULT_VERSION,
    VllmFlags,
    bundled_flags,
    bundled_tables,
    flags_from_data,
    value_problem,
)
from search_spaces.known_flags import engine_key


def _bundled_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("search_spaces.engine").joinpath("flags_0.26.json").read_text())
    return data


def _table_with(name: str, kind: str, entry: dict[str, Any] | None = None,
                *, negatable: bool = False) -> VllmFlags:
    """The bundled table plus one flag, added as a new vLLM release would add it."""
    data = _bundled_data()
    data["flags"][name] = kind
    if entry is not None:
        data["types"][name] = entry
    if negatable:
        data["negatable"].append(name)
    return flags_from_data(data)


def test_a_new_boolean_flag_is_one_table_entry_for_argv_yaml_and_fixed_flags() -> None:
    table = _table_with("enable-warp-drive", "bool", {"type": "bool"}, negatable=True)
    assert to_argv({"enable_warp_drive": True}, table) == ["--enable-warp-drive"]
    assert to_argv({"enable_warp_drive": False}, table) == ["--no-enable-warp-drive"], \
        "a negatable boolean's False is spelled --no-<flag>"
    assert to_config_dict({"enable_warp_drive": False}, table) == \
        {"no-enable-warp-drive": True}, "never a YAML false (vLLM drops it)"
    assert fixed_flag_problem("enable_warp_drive", False, table) is None
    assert "must be true or false" in str(fixed_flag_problem("enable_warp_drive", 3, table))
    assert fixed_flag_problem("enable_warp_drive", True) is not None, \
        "the bundled 0.26 table does not have it: refused there"


def test_a_new_value_flag_is_one_table_entry_with_its_type_checked() -> None:
    table = _table_with("max-warp-factor", "value", {"type": "int", "ge": 1})
    assert to_argv({"max_warp_factor": 9}, table) == ["--max-warp-factor", "9"]
    assert to_config_dict({"max_warp_factor": 9}, table) == {"max-warp-factor": 9}
    assert fixed_flag_problem("max_warp_factor", 9, table) is None
    assert "must be >= 1" in str(fixed_flag_problem("max_warp_factor", 0, table))
    assert "did you mean 'max_warp_factor'" in str(
        fixed_flag_problem("max_warp_factr", 9, table))


def test_a_boolean_false_is_left_out_unless_the_table_says_it_is_negatable() -> None:
    table = bundled_flags()
    assert to_argv({"enforce_eager": False, "enable_prefix_caching": False}, table) == \
        ["--no-enable-prefix-caching"]
    assert to_config_dict({"enforce_eager": False, "enable_chunked_prefill": False,
                           "max_num_seqs": 64, "compilation_config": {"mode": 3}}, table) == \
        {"no-enable-chunked-prefill": True, "max-num-seqs": 64,
         "compilation-config": '{"mode":3}'}


def test_the_launcher_and_the_export_yaml_render_through_the_same_table(tmp_path: Any) -> None:
    config = EngineConfig(model="m", flags={"enable_prefix_caching": False, "max_num_seqs": 8,
                                            "cudagraph_capture_sizes": [1, 2]})
    argv, _ = VllmLauncher(vllm_version="0.26.0").command(config, 8000, tmp_path, None)
    rendered = to_argv(dict(config.flags), bundled_flags("0.26.0"))
    assert " ".join(rendered) in " ".join(argv)


def test_every_table_default_and_negatable_names_a_flag_of_the_table() -> None:
    table = bundled_flags()
    for name in table.defaults:
        assert name.partition(".")[0] in table.types, name
    assert table.default("gpu_memory_utilization") == facts.VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    assert table.default("gpu_memory_utilization") == 0.92, "vLLM 0.26's default (REFERENCE.md)"
    with pytest.raises(ValueError, match="unknown flags"):
        data = _bundled_data()
        data["negatable"].append("enable-nothing")
        flags_from_data(data)


# -- the search space reads the table: no copy of its defaults or value sets -----------------


@pytest.mark.parametrize("name", sorted(n for n in KNOWN_FLAGS if KNOWN_FLAGS[n].kind == "bool"))
def test_a_searched_boolean_is_negated_as_the_table_says(name: str) -> None:
    table = bundled_flags()
    key = engine_key(name)
    assert table.types[key].kind == "bool", f"{name}: a boolean of vLLM {DEFAULT_VERSION}"
    assert to_argv(to_flags({name: False}), table) == to_argv({name: False}, table), \
        f"{name}: the space and the renderer spell its False the same way"
    assert bool_flag(name, False, table.is_negatable(name)) == (
        {f"no_{name}": True} if vllm_default(name) is not False else {})


@pytest.mark.parametrize("name", sorted(KNOWN_FLAGS))
def test_every_value_a_space_may_search_is_one_the_table_takes(name: str) -> None:
    """A space's domain is its own (narrower) choice; never a value vLLM would refuse."""
    table = bundled_flags()
    spec = KNOWN_FLAGS[name]
    key = engine_key(name)
    flag = table.types.get(key.partition(".")[0])
    assert flag is not None, f"{name}: searched, so vLLM {DEFAULT_VERSION} must have --{key}"
    if "." in key:
        assert flag.kind == "json", f"{name}: a nested setting of a JSON flag"
        return
    for choice in (c for c in spec.enum if c not in spec.no_flag):
        assert value_problem(flag, choice) is None, f"{name}: {choice} is a value vLLM takes"
    if spec.low is not None and spec.kind in ("int", "float"):
        low = spec.low if not spec.is_low_exclusive else spec.low + 1e-9
        assert value_problem(flag, int(low) if spec.kind == "int" else low) is None, \
            f"{name}: the space's lowest value is one vLLM takes"


def test_the_spaces_defaults_are_the_tables_and_follow_a_release_passed_in() -> None:
    base = bundled_flags()
    assert vllm_default("kv_cache_dtype") == base.default("kv_cache_dtype") == "auto"
    assert vllm_default("gpu_memory_utilization") == base.default("gpu_memory_utilization")
    assert vllm_default("cudagraph_mode") == base.default("compilation_config.cudagraph_mode")
    assert vllm_default("quantization") == "none", "unset (None in the table): no flag"
    altered = {**base.engine_facts(),
               "defaults": {**base.defaults, "gpu-memory-utilization": 0.8}}
    assert vllm_default("gpu_memory_utilization", {"engine": altered}) == 0.8, \
        "a release passed in states its own default"


def test_a_flag_removed_in_0_27_is_absent_from_0_27s_facts_and_not_searched_there() -> None:
    flag = "max-num-partial-prefills"
    assert flag in bundled_flags("0.26.0").engine_facts()["flags"]
    assert flag not in bundled_flags("0.27.0").engine_facts()["flags"]
    space = parse_space({"name": "s", "parameters": {
        "max_num_partial_prefills": {"type": "categorical", "choices": [1, 2]}}})
    assert space.resolve({"engine": bundled_flags("0.27.0").engine_facts()}).params == ()
    assert len(space.resolve({}).params) == 1, "0.26, the default release, has it"


def test_the_spaces_kv_cache_dtypes_are_the_tables() -> None:
    assert KNOWN_FLAGS["kv_cache_dtype"].enum == bundled_flags().types["kv-cache-dtype"].choices


@pytest.mark.parametrize(("memory_gib", "gpu"), [(139.8, "NVIDIA H200"), (79.6, "NVIDIA A100"),
                                                 (23.6, "NVIDIA GeForce RTX 4090")])
def test_the_spaces_host_defaults_are_the_engine_facts(memory_gib: float, gpu: str) -> None:
    context = {"hardware": {"gpu_memory_gib": memory_gib, "gpu_name": gpu}}
    for name, value in facts.vllm_scheduler_defaults(memory_gib, gpu).items():
        assert vllm_default(name, context) == value, f"{gpu}: {name}"


# -- derived facts: asked of one function -----------------------------------------------------


def _kv_dtypes() -> set[str]:
    return {v for t in bundled_tables()
            for v in (*t.types["kv-cache-dtype"].choices, *t.types["kv-cache-dtype"].known_values)}


@pytest.mark.parametrize("dtype", sorted(_kv_dtypes()))
def test_fp8_kv_detection_holds_for_each_dtype_spelling_of_every_release(dtype: str) -> None:
    expected = dtype.startswith("fp8")  # vLLM's fp8 KV dtypes: fp8, fp8_e4m3, fp8_ds_mla, ...
    assert facts.kv_cache_is_fp8(dtype) is expected, dtype
    assert facts.kv_cache_is_fp8(dtype.upper()) is expected, f"{dtype}: case does not matter"
    assert facts.EngineFlags({"kv_cache_dtype": dtype}).kv_cache_is_fp8 is expected
    assert facts.EngineFlags({"kv_cache_dtype": dtype}).kv_bytes_per_element == (
        1.0 if expected else 2.0)


def test_an_unset_kv_cache_dtype_is_not_fp8() -> None:
    assert not facts.kv_cache_is_fp8(None) and not facts.kv_cache_is_fp8("auto")
    assert facts.EngineFlags({}).kv_cache_dtype == "auto"


def test_the_fp8_kv_dtypes_include_the_six_spellings_the_tables_list() -> None:
    assert {d for d in _kv_dtypes() if facts.kv_cache_is_fp8(d)} == {
        "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "fp8_per_token_head"}


def test_weight_quantization_facts_come_from_the_flag_or_the_checkpoint() -> None:
    assert facts.EngineFlags({"quantization": "fp8_per_block"}).weights_are_fp8()
    assert facts.EngineFlags({}).weights_are_fp8("modelopt"), "an fp8 checkpoint"
    assert not facts.EngineFlags({}).weights_are_fp8("awq")
    assert facts.EngineFlags({"quantization": "AWQ"}).bytes_per_param() == 0.5
    assert facts.EngineFlags({}).bytes_per_param("gptq") == 0.5
    assert facts.EngineFlags({}).bytes_per_param(None, "float32") == 4.0
    assert facts.EngineFlags({}).bytes_per_param() == facts.DEFAULT_BYTES_PER_PARAM == 2.0
    assert set(facts.FP8_ONLINE_QUANTIZATIONS) <= facts.FP8_WEIGHT_METHODS


def test_the_fp8_rule_removes_every_fp8_kv_dtype_the_space_lists_below_sm89() -> None:
    choices = ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "bfloat16"]
    space = parse_space({"name": "s", "parameters": {
        "kv_cache_dtype": {"type": "categorical", "choices": choices}}})
    kept = space.resolve({"hardware": {"compute_capability": 8.0}}).params[0].choices
    assert kept == ("auto", "bfloat16"), "no fp8 spelling survives on an SM 8.0 GPU"
    kept = space.resolve({"hardware": {"compute_capability": 9.0}}).params[0].choices
    assert kept == tuple(choices)
