"""The quality gate end to end on the simulated engine (real processes, the inline executor, a
real Optuna and MLflow store): the defaults store the reference and its noise floor, a lossy
config over a tight limit is refused (never the best, named in its conclusion, not exported
unless forced), the export and the report show the figures; with dummy weights every place
says the gate was skipped. The simulated logprobs are a model: the test checks the path."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import optuna
import pytest
from mlflow.tracking import MlflowClient

from optimizer.config import load_study
from optimizer.errors import ConfigError
from optimizer.export import render, select_trial
from optimizer.report import build_report
from optimizer.report.render import render_markdown
from optimizer.results.quality_gate import reference_path
from optimizer.results.recommendation import best_trial, recommended_trial
from optimizer.results.trial_record import record_of
from optimizer.run.daemon import Daemon
from optimizer.run.executor import InlineExecutor
from optimizer.run.seeds import seed_trial_params
from optimizer.tracking.study_summary import study_summary
from optimizer.tracking.tracker import Tracker
from runners.engine import EngineRunner
from runners.simulated.launcher import SimulatedLauncher
from search_spaces import load_space
from tests.builders import categorical_space, write_study

SMALL_WORKLOAD = {"input_len": 32, "output_len": 8, "levels": [{"concurrency": 4}],
                  "num_requests": 8, "warmup_requests": 2}
QUALITY = {"num_prompts": 6, "max_tokens": 6, "top_k": 4, "max_mean_kl": 0.002,
           "max_ppl_increase": None, "min_top1_agreement": None}


def _run(tmp_path: Path, model: Mapping[str, Any], seeds: list[dict[str, Any]],
         quality: Mapping[str, Any] | None = None) -> tuple[optuna.Study, Any]:
    space_path = categorical_space(tmp_path, quantization=["none", "fp8"],
                                   kv_cache_dtype=["auto", "fp8"], max_num_seqs=[256, 128])
    overrides: dict[str, Any] = {"model": dict(model), "workload": SMALL_WORKLOAD,
                                 "seed_trials": seeds}
    if quality is not None:
        overrides["quality"] = dict(quality)
    cfg = load_study(write_study(tmp_path, trials=len(seeds) + 1,
                                 search_space=str(space_path), **overrides))
    space = load_space(space_path).resolve({})
    daemon = Daemon(cfg, space=space, seed_trials=seed_trial_params(cfg, space),
                    executor=InlineExecutor(
        lambda: EngineRunner(SimulatedLauncher("h200", startup_time_scale=0.002, seed=0),
                             tmp_path / "engines"), total_gpus=2),
        registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
        workload=cfg.workload, study_params={}, study_artifacts={},
        summarize=study_summary, poll_s=0.01)
    daemon.run()
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage_url), cfg


def _by_params(study: optuna.Study, **params: Any) -> optuna.trial.FrozenTrial:
    for trial in study.get_trials(deepcopy=False):
        record = record_of(trial)
        if record is not None and all(record.params.get(k) == v for k, v in params.items()) \
                and not record.is_baseline:
            return trial
    raise AssertionError(f"no trial with {params}")


def test_a_lossy_config_over_the_limit_is_refused_never_best_and_export_shows_quality(
        tmp_path: Path) -> None:
    # The 7B shape: decode is memory-bound there, so fp8 weights are the fastest config.
    study, cfg = _run(tmp_path, {"path": "qwen2.5-7b", "load_format": "auto"},
                      [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8"},
                       {"max_num_seqs": 128}], QUALITY)
    baseline = next(t for t in study.get_trials(deepcopy=False)
                    if (r := record_of(t)) is not None and r.is_baseline)
    base = record_of(baseline)
    assert base is not None and base.quality and base.quality["status"] == "reference", base
    assert reference_path(cfg).is_file(), "the reference is stored once, in the results dir"
    assert base.metrics["quality.floor.mean_kl"] > 0, "batching alone moves logprobs"

    lossy = _by_params(study, quantization="fp8")
    kv = _by_params(study, kv_cache_dtype="fp8")
    same = _by_params(study, max_num_seqs=128)
    lossy_record, kv_record, same_record = record_of(lossy), record_of(kv), record_of(same)
    assert lossy_record and kv_record and same_record
    assert lossy.constraints.get("quality") == 1.0, lossy_record.quality
    assert "refused by the quality gate (mean top-k KL" in lossy_record.conclusion
    assert kv.constraints.get("quality") == 0.0, kv_record.quality
    assert kv_record.metrics["quality.mean_kl"] < lossy_record.metrics["quality.mean_kl"]
    assert same_record.quality and same_record.quality["status"] == "identical"
    assert "quality" not in same.constraints, "a numerically identical config is not scored"

    assert lossy.values and max(t.values[0] for t in study.trials if t.values) == \
        lossy.values[0], "the premise: the refused config is the fastest"
    best, recommended = best_trial(study), recommended_trial(study)
    assert best is not None and best.number != lossy.number
    assert recommended is not None and recommended.number != lossy.number

    chosen = select_trial(study, cfg)
    header = render(chosen, cfg, "yaml")
    assert "# quality: " in header, header
    kv_header = render(select_trial(study, cfg, number=kv.number), cfg, "yaml")
    assert "top-k KL" in kv_header and "floor" in kv_header, kv_header
    with pytest.raises(ConfigError, match="quality gate refused it"):
        select_trial(study, cfg, number=lossy.number)
    forced = render(select_trial(study, cfg, number=lossy.number, force_quality=True), cfg,
                    "sh")
    assert "REFUSED by the quality gate" in forced

    markdown = render_markdown(build_report(study, cfg, with_importances=False))
    report = build_report(study, cfg, with_importances=False)
    assert lossy.number not in report.pareto, "a refused config is no point of the front"
    assert "| quality |" in markdown and "REFUSED: " in markdown and "reference; floor" in \
        markdown, markdown

    client = MlflowClient(cfg.tracking_uri)
    runs = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id],
                              filter_string="tags.`nightshift.kind` = 'trial'")
    logged = [r.data.metrics for r in runs if "quality.mean_kl" in r.data.metrics]
    assert len(logged) == 2 and all("quality.top1_agreement" in m and
                                    "quality.greedy_match_tokens" in m and
                                    "quality.ppl_increase" in m for m in logged), logged
    assert any("quality.floor.mean_kl" in r.data.metrics for r in runs)
    parent = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id],
                                filter_string="tags.`nightshift.kind` = 'study'")[0]
    offered = json.loads(parent.data.tags["best.params"])
    assert offered == record_of(best).params and offered.get("quantization") != "fp8", \
        "the best a later study's warm start is offered is never a refused config"


def test_a_dummy_weights_study_says_the_gate_was_skipped_everywhere(tmp_path: Path) -> None:
    study, cfg = _run(tmp_path, {"path": "qwen2.5-0.5b", "load_format": "dummy",
                                 "skip_tokenizer_init": True}, [{"quantization": "fp8"}])
    records = [r for t in study.get_trials(deepcopy=False) if (r := record_of(t)) is not None
               and r.state == "complete"]
    assert len(records) == 2
    assert all(r.quality and r.quality["summary"] == "skipped: dummy weights" for r in records)
    assert not any("quality" in t.constraints for t in study.get_trials(deepcopy=False))
    assert not reference_path(cfg).exists()
    header = render(select_trial(study, cfg), cfg, "yaml")
    assert "# quality: skipped: dummy weights" in header, header
    markdown = render_markdown(build_report(study, cfg, with_importances=False))
    assert "skipped: dummy weights" in markdown


def test_quality_on_with_dummy_weights_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = write_study(tmp_path, quality={"enabled": "on"})
    with pytest.raises(ConfigError, match=r"quality\.enabled: on needs real weights"):
        load_study(path)
    real = load_study(write_study(tmp_path, model={"path": "qwen2.5-0.5b"},
                                  quality={"enabled": True}))  # YAML's bare `on`
    assert real.spec.quality.enabled == "on" and real.quality_eval is not None
