"""The one flag table and its renderer: a new vLLM flag is one table entry (argv, `--config` YAML
and `fixed_flags` follow from it), negation and defaults come from the table, and the facts the
search space keeps for itself (it may not import runners) agree with the table and the engine
facts."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import pytest

from optimizer.config.flag_checks import fixed_flag_problem
from runners.base import EngineConfig
from runners.vllm import facts
from runners.vllm.flags import (
    VllmFlags,
    bundled_flags,
    flags_from_data,
    to_argv,
    to_config_dict,
    value_problem,
)
from runners.vllm.launcher import VllmLauncher
from search_spaces import KNOWN_FLAGS, to_flags, vllm_default
from search_spaces.rules import FP8_QUANTIZATIONS
from search_spaces.space import HOST_DEFAULTS, QUANTIZATIONS


def _bundled_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("runners.vllm").joinpath("flags_0.26.json").read_text())
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
    rendered = to_argv(dict(config.flags))
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


# -- the search space's own copy (search_spaces may not import runners): held equal here -----


def _cli(name: str) -> str:
    return KNOWN_FLAGS[name].cli_name or name


@pytest.mark.parametrize("name", sorted(KNOWN_FLAGS))
def test_every_searchable_flag_is_a_flag_of_the_table_with_a_compatible_domain(name: str) -> None:
    table = bundled_flags()
    spec = KNOWN_FLAGS[name]
    kebab = table.resolve(_cli(name).partition(".")[0])
    assert kebab is not None, f"{name}: searched, so vLLM 0.26 must have it"
    flag = table.types[kebab]
    if "." in _cli(name):
        assert flag.kind == "json", f"{name}: a nested setting of a JSON flag"
        return
    expected = {"bool": ("bool",), "int": ("int",), "float": ("float",),
                "enum": ("choice", "str", "any")}[spec.kind]
    assert flag.kind in expected, f"{name}: space {spec.kind}, table {flag.kind}"
    for choice in (c for c in spec.enum if c not in spec.no_flag):
        assert value_problem(flag, choice) is None, f"{name}: {choice} is a value vLLM takes"
    if spec.low is not None and spec.kind in ("int", "float"):
        low = spec.low if not spec.is_low_exclusive else spec.low + 1e-9
        assert value_problem(flag, int(low) if spec.kind == "int" else low) is None, \
            f"{name}: the space's lowest value is one vLLM takes"


@pytest.mark.parametrize("name", sorted(KNOWN_FLAGS))
def test_the_spaces_vllm_defaults_and_negation_are_the_tables(name: str) -> None:
    table = bundled_flags()
    spec = KNOWN_FLAGS[name]
    cli = _cli(name)
    if spec.kind == "bool":
        assert table.is_negatable(cli) == (vllm_default(name) is not False), \
            f"{name}: the space negates exactly the booleans the table calls negatable"
        assert to_argv(to_flags({name: False}), table) == to_argv({cli: False}, table)
    if name in HOST_DEFAULTS:  # the host decides (the next test)
        return
    default = table.default(cli)
    if default is None and spec.no_flag:
        default = spec.no_flag[0]
    if vllm_default(name) is not None:  # None: the space's copy leaves it to the table
        assert vllm_default(name) == default, \
            f"{name}: space {vllm_default(name)!r}, table {default!r}"
    assert vllm_default(name, {"engine": table.engine_facts()}) == default, \
        f"{name}: with the release's table passed in, the space takes its default"


@pytest.mark.parametrize(("memory_gib", "gpu"), [(139.8, "NVIDIA H200"), (79.6, "NVIDIA A100"),
                                                 (23.6, "NVIDIA GeForce RTX 4090")])
def test_the_spaces_host_defaults_are_the_engine_facts(memory_gib: float, gpu: str) -> None:
    context = {"hardware": {"gpu_memory_gib": memory_gib, "gpu_name": gpu}}
    expected = facts.vllm_scheduler_defaults(memory_gib, gpu)
    for name, value in expected.items():
        assert vllm_default(name, context) == value, f"{gpu}: {name}"


def test_the_spaces_fp8_methods_are_the_engine_facts() -> None:
    assert set(FP8_QUANTIZATIONS) == set(facts.FP8_ONLINE_QUANTIZATIONS), \
        "the fp8-needs-SM89 rule removes exactly the online fp8 methods"
    assert set(facts.FP8_ONLINE_QUANTIZATIONS) <= set(QUANTIZATIONS)
    assert set(facts.FP8_ONLINE_QUANTIZATIONS) <= facts.FP8_WEIGHT_METHODS
    assert facts.bytes_per_param("AWQ") == facts.bytes_per_param("gptq") == 0.5
    assert facts.bytes_per_param(None) == facts.DEFAULT_BYTES_PER_PARAM == 2.0


def test_the_installed_parser_gives_negation_and_defaults_as_argparse_states_them() -> None:
    import argparse

    from runners.vllm.flags import flags_from_parser

    parser = argparse.ArgumentParser()
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--enable-log-requests", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    table = flags_from_parser(parser, version="9.9")
    assert table.is_negatable("enable_prefix_caching"), "None: decided at start-up"
    assert not table.is_negatable("enforce_eager") and not table.is_negatable(
        "enable_log_requests"), "False is the default, or there is no --no- form"
    assert to_argv({"enable_prefix_caching": False, "enforce_eager": False,
                    "enable_log_requests": False}, table) == ["--no-enable-prefix-caching"]
    assert table.default("block_size") == 16 and table.default("enforce_eager") is False
    with pytest.raises(KeyError):
        table.default("max_num_seqs")


def test_launching_the_bundled_release_renders_with_the_bundled_table() -> None:
    from runners.vllm.flags import table_for

    assert table_for("0.26.0") is bundled_flags(), "no vLLM import to launch 0.26.0"
    assert table_for("0.26.0+cu129") is bundled_flags()
