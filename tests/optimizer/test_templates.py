"""Hardware templates as seed trials: queued after the defaults (and warm-start seeds), tagged
with their source, named in their conclusion, and reported skipped (with the reason) where the
space or a rule refuses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna

from optimizer.config import load_study
from optimizer.results.trial_record import record_of
from optimizer.run.daemon import Daemon
from optimizer.run.executor import InlineExecutor
from optimizer.run.seeds import template_trial_params
from optimizer.run.space_context import space_context
from optimizer.tracking.payload import tracking_payload
from optimizer.tracking.study_summary import study_summary
from optimizer.tracking.tracker import Tracker
from runners.hardware import load_preset
from runners.model_info import load_model_info
from search_spaces import load_space
from search_spaces.seeds import Template, load_templates, template_seeds
from tests.builders import write_study
from tests.optimizer.test_search_policy import ScriptedRunner


def _hopper(cfg: Any) -> Any:
    return load_space("hopper").resolve(space_context(
        load_preset("h200"), load_model_info("qwen2.5-7b"), cfg.workload, "dummy"))


def test_each_hardware_class_of_the_profile_has_its_template() -> None:
    assert [t.source for t in load_templates("hopper")] == ["template:hopper"]
    assert [t.source for t in load_templates("ampere")] == ["template:ampere"]
    assert [t.source for t in load_templates("24gb")] == ["template:consumer_24gb"]
    assert load_templates("other") == (), "no folklore for a class the file does not name"


def test_the_hopper_template_runs_right_after_the_defaults_tagged_and_named(
        tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, trials=3, max_parallel_trials=1, templates="auto",
                                 seed_trials=[{"max_num_seqs": 256}]))
    space = _hopper(cfg)
    templates, notes = template_trial_params(cfg, space, "hopper")
    assert len(templates) == 1 and "queued after the defaults" in notes[0]
    launched: list[dict[str, Any]] = []
    daemon = Daemon(cfg, space=space, executor=InlineExecutor(
        lambda: ScriptedRunner(lambda flags: 10.0, launched), total_gpus=2),
        registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01,
        seed_trials=[{**space.defaults(), "max_num_seqs": 256}], template_trials=templates)
    daemon.run()
    study = optuna.load_study(study_name=cfg.name, storage=cfg.storage_url)
    trials = sorted(study.trials, key=lambda t: t.number)
    assert trials[0].user_attrs.get("baseline") is True, "the defaults run first"
    template = trials[1]
    assert template.user_attrs.get("seed.source") == "template:hopper", \
        "the template comes right after the defaults, before the study's own seeds"
    assert {k: template.params[k] for k in ("quantization", "kv_cache_dtype",
                                            "max_num_batched_tokens")} == \
        {"quantization": "fp8", "kv_cache_dtype": "fp8", "max_num_batched_tokens": 32768}
    assert trials[2].params["max_num_seqs"] == 256 and "seed.source" not in trials[2].user_attrs
    record = record_of(template)
    assert record is not None and record.seed_source == "template:hopper"
    assert record.conclusion.startswith("the Hopper template (fp8 weights + fp8 KV cache + a "
                                        "32768-token budget): "), record.conclusion
    tags = tracking_payload(record, None, number=template.number)["tags"]
    assert tags["seed.source"] == "template:hopper", "the MLflow run carries the tag"


def test_a_template_the_rules_refuse_is_reported_with_the_rule_not_dropped(
        tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, trials=3, templates="auto"))
    space = load_space("consumer_24gb").resolve(space_context(
        load_preset("h200"), load_model_info("qwen2.5-7b"), cfg.workload, "dummy"))
    templates, notes = template_trial_params(cfg, space, "24gb")
    assert templates == []
    assert notes == [
        "the 24 GB card template (4-bit weights + 0.95 memory + an 8192-token context) "
        "skipped: quantization=awq_marlin or gptq_marlin is not in its domain [none, fp8]; "
        "rule quantization-matches-checkpoint removed it (awq, gptq and compressed-tensors "
        "read pre-quantized weights and this checkpoint has none)"]


def test_a_template_naming_a_param_the_space_lacks_or_the_fixed_flags_contradict_is_skipped(
        tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, trials=3))
    space = _hopper(cfg)
    lacking = Template("t", "hopper", "the T template", "x", {"enforce_eager": True})
    fixed = Template("u", "hopper", "the U template", "y", {"kv_cache_dtype": "fp8"})
    seeds = template_seeds(space, (lacking, fixed), {"kv_cache_dtype": "auto"})
    assert [s.params for s in seeds] == [None, None]
    assert seeds[0].skipped_because == \
        "the T template (x) skipped: space hopper does not search enforce_eager"
    assert "fixed_flags sets kv_cache_dtype='auto'" in seeds[1].skipped_because


def test_templates_are_off_unless_the_study_file_asks(tmp_path: Path) -> None:
    cfg = load_study(write_study(tmp_path, trials=3))
    assert cfg.spec.templates == "off", "an existing study file runs only what it asked for"
    assert template_trial_params(cfg, _hopper(cfg), "hopper") == ([], [])
