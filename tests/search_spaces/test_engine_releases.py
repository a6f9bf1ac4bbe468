"""One flag table per vLLM release, each read from that release's wheel: the installed (or
declared) version picks it, a flag a release removed is refused there and taken by the release
before, a rename is reported with its new name, and a space does not search a knob its release
lacks."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from runners.vllm.flags import flag_table
from search_spaces import parse_space
from search_spaces.engine.releases import flag_change
from search_spaces.engine.tables import (
    DEFAULT_VERSION,
    UnknownVersionError,
    bundled_flags,
    bundled_tables,
    bundled_versions,
    flags_from_data,
)

RELEASES = ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0",
            "0.33.0", "0.34.0")


def _data(minor: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        resources.files("search_spaces.engine").joinpath(f"flags_{minor}.json").read_text())
    return data


def test_every_release_from_0_26_to_the_newest_has_a_table_read_from_its_wheel() -> None:
    assert bundled_versions() == RELEASES
    for table in bundled_tables():
        assert "scripts/vllm_flag_table.py" in _data(".".join(
            table.version.split(".")[:2]))["source"], "generated, not written by hand"
        assert table.default("gpu_memory_utilization") is not None
    assert bundled_flags("0.27.1") is bundled_flags("0.27.0"), \
        "0.27.1 changed no flag, type, default or variable: it shares 0.27's table"
    assert bundled_flags("0.27.1").source == "vLLM 0.27.0-0.27.1's flags (bundled table)"


def test_a_flag_removed_in_0_27_is_refused_for_0_27_and_accepted_for_0_26() -> None:
    assert flag_table("0.26.0").resolve("max_num_partial_prefills") == "max-num-partial-prefills"
    for version in ("0.27.0", "0.27.1", "0.34.0"):
        assert flag_table(version).resolve("max_num_partial_prefills") is None, version
        change = flag_change("max_num_partial_prefills", version)
        assert change is not None and change.change == "removed" and change.release == "0.27.0"
        assert change.sentence == ("--max-num-partial-prefills was removed in vLLM 0.27.0 (the "
                                   "last release with it: 0.26.0)")
    assert flag_change("max_num_partial_prefills", "0.26.0") is None
    later = flag_change("max-num-partial-prefills", "0.25.0")
    assert later is None or later.change == "added later"


def test_0_28_removed_the_attention_dtype_override_and_calculated_kv_scales() -> None:
    for flag in ("override-attention-dtype", "calculate-kv-scales"):
        assert flag in bundled_flags("0.27.1").types and flag not in bundled_flags("0.28.0").types
        change = flag_change(flag, "0.30.0")
        assert change is not None and change.release == "0.28.0", flag


def test_a_renamed_flag_is_reported_with_its_new_name() -> None:
    # No release 0.26-0.34 renamed a flag in this sense (docs/vllm-versions.md), so a release
    # is made from 0.26's table that moves --gpu-memory-utilization to a new name: the new
    # flag names the same config field (CacheConfig.gpu_memory_utilization): a rename.
    old = _data("0.26")
    assert old["config_fields"]["gpu-memory-utilization"] == "CacheConfig.gpu_memory_utilization"
    new = json.loads(json.dumps(old))
    new.update(vllm_version="9.0.0", releases=["9.0.0"])
    for key in ("flags", "types", "config_fields", "defaults"):
        new[key]["gpu-memory-fraction"] = new[key].pop("gpu-memory-utilization")
    tables = [flags_from_data(old), flags_from_data(new)]
    change = flag_change("gpu_memory_utilization", "9.0.0", tables)
    assert change is not None and change.change == "renamed"
    assert change.new_name == "gpu-memory-fraction" and change.release == "9.0.0"
    assert "--gpu-memory-utilization was renamed --gpu-memory-fraction in vLLM 9.0.0" in \
        change.sentence
    new["config_fields"].pop("gpu-memory-fraction")
    dropped = flag_change("gpu_memory_utilization", "9.0.0",
                          [flags_from_data(old), flags_from_data(new)])
    assert dropped is not None and dropped.change == "removed", \
        "a flag that names no field of the one removed is no rename: no guess"


def test_the_installed_version_picks_the_table_and_a_declared_one_serves_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert flag_table().version == DEFAULT_VERSION == "0.26.0", "nothing installed here"
    assert flag_table("0.29.0").version == "0.29.0"
    with pytest.raises(UnknownVersionError, match=r"vLLM 0\.99\.0: no flag table .*0\.34\.0"):
        flag_table("0.99.0")
    # An installed vLLM (its metadata; vLLM is not imported) picks its release's table.
    info = tmp_path / "vllm-0.28.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.28.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert flag_table().version == "0.28.0"
    assert flag_table("0.28.0+cu130") is bundled_flags("0.28.0"), "a local tag is the release"


SPACE = {"name": "s", "description": "d", "parameters": {
    "max_num_seqs": {"type": "categorical", "choices": [64, 128], "default": "vllm"},
    "max_num_partial_prefills": {"type": "categorical", "choices": [1, 2], "default": "vllm"},
    "quantization": {"type": "categorical", "choices": ["none", "bitsandbytes"],
                     "default": "vllm"}}}


def test_a_knob_a_release_lacks_is_not_searched_there() -> None:
    space = parse_space(SPACE)
    old = space.resolve({"engine": bundled_flags("0.26.0").engine_facts()})
    new = space.resolve({"engine": bundled_flags("0.27.0").engine_facts()})
    assert "max_num_partial_prefills" in {p.name for p in old.params}
    assert "max_num_partial_prefills" not in {p.name for p in new.params}
    rule = next(r for r in new.applied_rules if r.name == "not-a-flag-of-release")
    assert rule.reason == "vLLM 0.27.0 has no --max-num-partial-prefills"
    assert "max_num_partial_prefills" in {p.name for p in space.resolve({}).params}, \
        "no release stated: every flag the space declares is searched"


def test_a_value_a_release_dropped_is_not_tried_there() -> None:
    # 0.28 moved bitsandbytes out of vLLM into a plugin: not one of its quantization methods.
    space = parse_space(SPACE)
    for version, expected in (("0.27.1", ("none", "bitsandbytes")), ("0.28.0", ("none",))):
        resolved = space.resolve({"engine": bundled_flags(version).engine_facts()})
        (quantization,) = (p for p in resolved.params if p.name == "quantization")
        assert quantization.choices == expected, version
    assert bundled_flags("0.28.0").resolve("quantization") == "quantization", \
        "the flag stays; a plugin may register a method, so the table does not refuse one"


def test_a_study_fixing_a_removed_flag_is_told_the_release_that_removed_it() -> None:
    from optimizer.config.flag_checks import fixed_flag_problem

    assert fixed_flag_problem("max_num_partial_prefills", 2, bundled_flags("0.26.0")) is None
    problem = fixed_flag_problem("max_num_partial_prefills", 2, bundled_flags("0.27.0"))
    assert problem == ("fixed_flags.max_num_partial_prefills: --max-num-partial-prefills was "
                       "removed in vLLM 0.27.0 (the last release with it: 0.26.0); remove it "
                       "for vLLM 0.27.0")


def test_the_host_scheduler_defaults_follow_the_release() -> None:
    from search_spaces.engine.facts import vllm_scheduler_defaults

    b200, h200 = (179.1, "NVIDIA B200"), (139.8, "NVIDIA H200")
    assert vllm_scheduler_defaults(*b200, "0.26.0")["max_num_batched_tokens"] == 8192
    assert vllm_scheduler_defaults(*b200, "0.28.0")["max_num_batched_tokens"] == 16384
    assert vllm_scheduler_defaults(*h200, "0.34.0") == vllm_scheduler_defaults(*h200, "0.26.0")
    context = {"hardware": {"gpu_memory_gib": b200[0], "gpu_name": b200[1]},
               "engine": {**bundled_flags("0.28.0").engine_facts(),
                          "host_defaults": vllm_scheduler_defaults(*b200, "0.28.0")}}
    space = parse_space({"name": "s", "description": "d", "parameters": {
        "max_num_batched_tokens": {"type": "categorical", "choices": [4096],
                                   "default": "vllm"}}})
    assert space.resolve(context).defaults()["max_num_batched_tokens"] == 16384


@pytest.mark.parametrize("version", ["0.26.0", "0.28.0", "0.34.0"])
def test_every_bundled_space_resolves_for_each_release_on_an_h200(version: str) -> None:
    from optimizer.run.space_context import space_context
    from runners.hardware import load_preset
    from runners.model_info import load_model_info
    from search_spaces import bundled_spaces, load_space

    table = bundled_flags(version)
    context = space_context(load_preset("h200"), load_model_info("qwen2.5-7b"), table=table)
    for name in bundled_spaces():
        resolved = load_space(name).resolve(context)
        if "gpu_memory_utilization" in {p.name for p in resolved.params}:
            assert resolved.vllm_defaults["gpu_memory_utilization"] == \
                table.default("gpu_memory_utilization"), f"{name}: the release's default"
        assert resolved.defaults(), name
