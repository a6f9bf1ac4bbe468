"""Measured facts as data (search_spaces/known_facts.py): a knob value measured pathological on
a hardware class with a vLLM release is removed by the rules there, named with its evidence,
and overridable; no bundled study or template on Hopper measures `fp8_per_block` on vLLM 0.26."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from optimizer.config import load_study
from optimizer.run.seeds import seed_trial_params
from optimizer.run.space_context import space_context
from runners.hardware import load_preset
from runners.model_info import load_model_info
from runners.simulated.sizing import ENGINE_VERSION
from search_spaces import load_space
from search_spaces.known_facts import (
    FactError,
    bundled_facts,
    load_facts,
    parse_facts,
    release_of,
)
from search_spaces.seeds import load_templates, template_seeds

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted(p for p in [*ROOT.glob("bench/**/*.yaml"), *ROOT.glob("examples/**/*.yaml")]
                 if isinstance(yaml.safe_load(p.read_text()), dict)
                 and "model" in yaml.safe_load(p.read_text()))
FACT = "hopper-vllm0.26-quantization-fp8_per_block"


def _hopper(version: str | None, **kwargs: object) -> object:
    return load_space("hopper").resolve(space_context(
        load_preset("h200"), load_model_info("qwen2.5-7b"), vllm_version=version,
        **kwargs))  # type: ignore[arg-type]


def _quantizations(space: object) -> tuple[object, ...]:
    return next(p.choices for p in space.params if p.name == "quantization")  # type: ignore[attr-defined]


def test_the_bundled_table_holds_fp8_per_block_on_hopper_with_vllm_0_26_and_its_evidence() -> None:
    fact = next(f for f in bundled_facts() if f.id == FACT)
    assert (fact.hardware_class, fact.vllm_version, fact.param, fact.value, fact.effect) == \
        ("hopper", "0.26", "quantization", "fp8_per_block", "exclude")
    assert "306 s" in fact.evidence["figures"] and "475 ms" in fact.evidence["figures"]


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1+cu129", f"simulated {ENGINE_VERSION}"])
def test_hopper_with_vllm_0_26_removes_fp8_per_block_and_says_why(version: str) -> None:
    space = _hopper(version)
    assert "fp8_per_block" not in _quantizations(space)
    rule = next(r for r in space.applied_rules if r.name == f"known-fact:{FACT}")  # type: ignore[attr-defined]
    assert "306 s" in rule.reason and "known_facts.ignore" in rule.reason


@pytest.mark.parametrize("version", [None, "0.27.0", "0.2.6"])
def test_another_release_or_an_unknown_one_keeps_fp8_per_block(version: str | None) -> None:
    assert "fp8_per_block" in _quantizations(_hopper(version))


def test_another_hardware_class_keeps_it() -> None:
    space = load_space("default").resolve(space_context(
        load_preset("l4"), load_model_info("qwen2.5-7b"), vllm_version="0.26.0"))
    assert not any(r.name.startswith("known-fact:") for r in space.applied_rules)


def test_a_hopper_fact_does_not_reach_a_blackwell_card() -> None:
    from dataclasses import replace

    from runners.hardware import GpuInfo

    b200 = replace(load_preset("h200"), gpus=(GpuInfo(0, "NVIDIA B200", memory_gib=178.4,
                                                      compute_capability=(10, 0)),))
    space = load_space("default").resolve(space_context(
        b200, load_model_info("qwen2.5-7b"), vllm_version="0.26.0"))
    assert not any(r.name.startswith("known-fact:") for r in space.applied_rules)
    assert load_templates(b200.hardware_class) == ()


def test_a_study_files_ignore_overrides_the_fact() -> None:
    assert "fp8_per_block" in _quantizations(_hopper("0.26.0", ignore_facts=[FACT]))


def test_a_user_fact_with_a_bundled_id_replaces_it_and_a_new_one_applies(tmp_path: Path) -> None:
    user = tmp_path / "facts.yaml"
    user.write_text(yaml.safe_dump({"facts": [
        {"id": "hopper-vllm0.26-max_num_seqs-1024", "hardware_class": "hopper",
         "vllm_version": "0.26", "param": "max_num_seqs", "value": 1024, "effect": "exclude",
         "evidence": {"study": "s", "trial": "3, 5", "figures": "TPOT p99 900 ms"}}]}))
    facts = load_facts(user)
    assert {f.id for f in facts} == {FACT, "hopper-vllm0.26-max_num_seqs-1024"}
    space = _hopper("0.26.0", known_facts=facts)
    seqs = next(p.choices for p in space.params if p.name == "max_num_seqs")  # type: ignore[attr-defined]
    assert 1024 not in seqs and "fp8_per_block" not in _quantizations(space)


def test_a_user_entry_with_effect_keep_overrides_the_bundled_fact(tmp_path: Path) -> None:
    user = tmp_path / "facts.yaml"
    user.write_text(yaml.safe_dump({"facts": [
        {"id": FACT, "hardware_class": "hopper", "vllm_version": "0.26",
         "param": "quantization", "value": "fp8_per_block", "effect": "keep"}]}))
    assert "fp8_per_block" in _quantizations(_hopper("0.26.0", known_facts=load_facts(user)))


@pytest.mark.parametrize(("entry", "field"), [
    ({"effect": "rank_first"}, "effect"),
    ({"vllm_version": 0.26}, "vllm_version"),
    ({"colour": "red"}, "colour"),
])
def test_a_malformed_fact_names_its_field(entry: dict[str, object], field: str) -> None:
    raw = {"id": "x", "hardware_class": "hopper", "vllm_version": "0.26", "param": "q",
           "value": 1, "effect": "exclude", **entry}
    with pytest.raises(FactError, match=rf"facts\[0\]\.{field}"):
        parse_facts({"facts": [raw]}, "f.yaml")


def test_release_of_reads_the_version_as_nightshift_reports_it() -> None:
    assert release_of("simulated 0.26.0") == "0.26.0" and release_of("0.26.0+cu129") == "0.26.0"
    assert release_of(None) is None and release_of("") is None


@pytest.mark.parametrize("path", STUDIES, ids=[str(p.relative_to(ROOT)) for p in STUDIES])
def test_no_bundled_study_or_template_on_hopper_measures_fp8_per_block_on_vllm_0_26(
        path: Path) -> None:
    cfg = load_study(path)
    name = cfg.spec.search_space
    local = path.parent / name
    space = load_space(local if local.is_file() else ("hopper" if name == "auto" else name))
    resolved = space.resolve(space_context(
        load_preset("h200"), load_model_info(cfg.spec.model.path), cfg.workload,
        cfg.spec.model.load_format, vllm_version="0.26.0", known_facts=load_facts(
            Path("/nonexistent")), ignore_facts=cfg.spec.known_facts.ignore))
    assert not cfg.spec.known_facts.ignore, "a bundled study does not override the fact"
    assert cfg.spec.fixed_flags.get("quantization") != "fp8_per_block"
    quant = next((p for p in resolved.params if p.name == "quantization"), None)
    assert quant is None or "fp8_per_block" not in quant.choices
    configs = [resolved.defaults(), *seed_trial_params(cfg, resolved),
               *(s.params for s in template_seeds(resolved, load_templates("hopper"),
                                                  cfg.spec.fixed_flags) if s.params)]
    assert all(c.get("quantization") != "fp8_per_block" for c in configs)


def test_a_facts_file_with_broken_yaml_is_worded_as_a_study_files_yaml_error(
        tmp_path: Path) -> None:
    user = tmp_path / "facts.yaml"
    user.write_text("facts:\n  - id: x\n    param: [q\n", encoding="utf-8")
    with pytest.raises(FactError, match=rf"^{user}: not valid YAML at line \d+, column \d+: "
                                        r".*; fix the syntax\.$"):
        load_facts(user)
