"""The study fingerprint and the compatibility rule, field by field (docs/tuning-memory.md), and
the warm-start plan on earlier studies held in memory (no store)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from optimizer.config import parse_study
from optimizer.run.engine_choice import simulated_hardware
from optimizer.run.runtime import _prompt_lengths
from optimizer.tuning_memory.earlier_studies import EarlierStudy, plan_warm_start
from optimizer.tuning_memory.fingerprint import Fingerprint, compatibility, describe_workload
from optimizer.tuning_memory.fingerprint_of import fingerprint_of
from runners.model_info import load_model_info
from search_spaces import load_space


def study(**overrides: Any) -> dict[str, Any]:
    return {"name": "here", "engine": "simulated",
            "model": {"path": "qwen2.5-7b", "load_format": "dummy"},
            "workload": {"input_len": 512, "output_len": 128, "levels": [{"concurrency": 16}]},
            "slo": {"tpot_p99_ms": 40}, "budget": {"trials": 4}, **overrides}


def fingerprint(num_gpus: int = 2, model: str = "qwen2.5-7b", load_format: str = "dummy",
                **overrides: Any) -> Fingerprint:
    data = study(**overrides)
    data["model"] = {**data["model"], "path": model, "load_format": load_format}
    cfg = parse_study(data)
    return fingerprint_of(cfg, engine="simulated", engine_version="simulated 0.26.0",
                          hardware=simulated_hardware("h200", num_gpus),
                          model=load_model_info(model))


BASE = fingerprint()


def test_fingerprint_holds_hardware_engine_model_and_workload_shape() -> None:
    fp = BASE
    assert (fp.gpu_model, fp.gpu_count, fp.interconnect) == ("NVIDIA H200", 2, "nvlink")
    assert fp.compute_capability == 9.0 and fp.gpu_memory_gib > 100
    assert fp.engine == "simulated" and fp.engine_version == "simulated 0.26.0"
    assert fp.architecture == "Qwen2ForCausalLM" and fp.weights == "dummy"
    assert fp.num_params and 7e9 < fp.num_params < 8e9, "the 7B shape's parameter count"
    assert (fp.input_len, fp.output_len) == ("fixed:512", "fixed:128")
    assert (fp.arrival, fp.peak_load) == ("levels:concurrency", 16.0)
    assert fp.slo_tpot_p99_ms == 40 and fp.slo_ttft_p99_ms is None


def test_fingerprint_round_trips_through_json_with_the_same_hash() -> None:
    back, missing = Fingerprint.from_dict(json.loads(BASE.to_json()))
    assert back == BASE and not missing
    assert back.hash == BASE.hash and len(BASE.hash) == 12
    tags = BASE.tags()
    assert tags["fingerprint.hash"] == BASE.hash
    assert tags["fingerprint.gpu_model"] == "NVIDIA H200"
    assert json.loads(tags["fingerprint.json"]) == BASE.to_dict()


def test_same_study_is_compatible_with_itself() -> None:
    assert compatibility(BASE, fingerprint()) == compatibility(BASE, BASE)
    assert compatibility(BASE, BASE).is_compatible


@pytest.mark.parametrize(("other", "field"), [
    (fingerprint(num_gpus=4), "gpu_count"),
    (fingerprint(model="llama-3.1-8b"), "architecture"),
    (fingerprint(load_format="auto"), "weights"),
    (fingerprint(workload={"input_len": 1100, "output_len": 128,
                           "levels": [{"concurrency": 16}]}), "input_len_mean"),
    (fingerprint(workload={"input_len": 512, "output_len": 20,
                           "levels": [{"concurrency": 16}]}), "output_len_mean"),
    (fingerprint(workload={"input_len": 512, "output_len": 128,
                           "levels": [{"request_rate": 4.0}]}), "arrival"),
    (fingerprint(workload={"input_len": 512, "output_len": 128,
                           "levels": [{"concurrency": 64}]}), "peak_load"),
    (fingerprint(slo={"tpot_p99_ms": 60}), "slo_tpot_p99_ms"),
    (fingerprint(slo={"tpot_p99_ms": 40, "ttft_p99_ms": 2000}), "slo_ttft_p99_ms"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_field_outside_its_tolerance_makes_studies_incompatible_and_is_named(
        other: Fingerprint, field: str) -> None:
    if field == "architecture":  # the llama 8B differs in shape too
        assert other.model_shape != BASE.model_shape
    result = compatibility(BASE, other)
    assert not result.is_compatible
    assert any(r.startswith(f"{field}:") for r in result.reasons), result.reasons
    assert other.hash != BASE.hash, "a compared field is part of the hash"


def test_lengths_and_load_within_twice_are_compatible_and_version_is_only_reported() -> None:
    near = fingerprint(workload={"input_len": 1000, "output_len": 70,
                                 "levels": [{"concurrency": 8}, {"concurrency": 30}]})
    newer = replace(near, engine_version="0.27.0", objectives=("throughput",))
    result = compatibility(BASE, newer)
    assert result.is_compatible, result.reasons
    assert any("engine version" in n for n in result.notes)
    assert any("objective" in n for n in result.notes)
    assert newer.hash != BASE.hash, "tolerated differences still differ in hash"
    assert replace(BASE, engine_version="0.27.0").hash == BASE.hash, \
        "the version is reported, not part of the hash"


def test_an_input_len_beside_a_prompts_file_is_no_reason_to_refuse_an_earlier_study() -> None:
    """The file gives the lengths: an earlier study that also set input_len (unused, and now
    refused beside a file) still matches one that leaves it out."""
    from_file = replace(BASE, prompts_file="prompts.jsonl")
    earlier = replace(from_file, input_len_kind="normal", input_len_mean=4096.0)
    assert compatibility(from_file, earlier).is_compatible
    assert not compatibility(BASE, replace(BASE, input_len_mean=4096.0)).is_compatible, \
        "synthesised prompts still compare their lengths"


def test_an_unknown_field_is_never_compatible() -> None:
    unknown_gpu = replace(BASE, gpu_model=None)
    result = compatibility(BASE, unknown_gpu)
    assert not result.is_compatible and result.reasons == ("gpu_model: unknown there",)
    data = BASE.to_dict()
    del data["interconnect"]  # a fingerprint stored before the field existed
    older, missing = Fingerprint.from_dict(data)
    result = compatibility(BASE, older, missing)
    assert not result.is_compatible
    assert any(r.startswith("interconnect: unknown there") for r in result.reasons)


def test_workload_fields_other_features_add_are_compared_when_set() -> None:
    bursty = replace(BASE, burstiness=0.5)
    assert not compatibility(BASE, bursty).is_compatible
    assert any(r.startswith("burstiness:") for r in compatibility(BASE, bursty).reasons)
    shared = replace(BASE, shared_prefix={"len": 256})
    assert any(r.startswith("shared_prefix:") for r in compatibility(BASE, shared).reasons)
    assert compatibility(replace(BASE, dataset="sharegpt"),
                         replace(BASE, dataset="sharegpt")).is_compatible


# -- the warm-start plan ----------------------------------------------------------------------

SPACE = load_space("hopper").resolve({
    "hardware": {"num_gpus": 2, "compute_capability": 9.0, "gpu_memory_gib": 140.0,
                 "interconnect": "nvlink", "hardware_class": "hopper",
                 "gpu_name": "NVIDIA H200"}, "model": {}})


def earlier(name: str, fp: Fingerprint | None, changes: dict[str, Any] | None,
            started_ms: int) -> EarlierStudy:
    tags = {} if changes is None else {"best.changes": json.dumps(changes)}
    return EarlierStudy(name=name, run_id=name, experiment_id="0", started_ms=started_ms,
                        status="FINISHED", fingerprint=fp, missing=frozenset(), tags=tags,
                        params={}, metrics={})


def test_auto_seeds_compatible_bests_newest_first_and_says_why_others_are_skipped() -> None:
    studies = [
        earlier("new", BASE, {"max_num_seqs": 512}, 3000),
        earlier("other-gpus", fingerprint(num_gpus=4), {"max_num_seqs": 128}, 2500),
        earlier("no-fp", None, {"max_num_seqs": 64}, 2200),
        earlier("unfinished", BASE, None, 2100),
        earlier("defaults-best", BASE, {}, 2050),
        earlier("same-as-seed", BASE, {"kv_cache_dtype": "fp8"}, 2000),
        earlier("outside", BASE, {"no_such_knob": 3}, 1500),
        earlier("old", BASE, {"max_num_seqs": 128}, 1000),
    ]
    seed = {**SPACE.defaults(), "kv_cache_dtype": "fp8"}
    plan = plan_warm_start("auto", BASE, studies, space=SPACE, fixed_flags={},
                           seed_trials=[seed])
    assert [s.source for s in plan.seeds] == ["warm_start:new", "warm_start:old"]
    assert plan.seeds[0].params == {**SPACE.defaults(), "max_num_seqs": 512}
    text = "\n".join(plan.lines)
    assert "skipped other-gpus: gpu_count: 4 there, 2 here" in text
    assert "skipped no-fp: it recorded no fingerprint" in text
    assert "skipped unfinished: it recorded no best config" in text
    assert "skipped defaults-best: its best is the vLLM defaults" in text
    assert "skipped same-as-seed: its best (kv_cache_dtype=fp8) is seed_trials[0] already" \
        in text
    assert "skipped outside: its best (no_such_knob=3) sets no_such_knob, which this space " \
        "does not search" in text
    assert plan.lines[0].startswith("seeded from new ") and "compatible fingerprint" in \
        plan.lines[0]


def test_a_best_the_space_rules_refuse_is_dropped_with_the_rule() -> None:
    plan = plan_warm_start("auto", BASE, [earlier("e", BASE, {"max_num_seqs": 3}, 1)],
                           space=SPACE, fixed_flags={})
    assert not plan.seeds
    assert plan.lines[0].startswith("skipped e: its best (max_num_seqs=3) this space's rules "
                                    "refuse it: max_num_seqs=3 is outside its domain")


def test_named_studies_are_used_whatever_their_fingerprint_and_the_differences_said() -> None:
    studies = [earlier("a", fingerprint(num_gpus=4), {"max_num_seqs": 128}, 2),
               earlier("b", None, {"max_num_seqs": 512}, 1)]
    plan = plan_warm_start(["b", "a"], BASE, studies, space=SPACE, fixed_flags={})
    assert [s.source for s in plan.seeds] == ["warm_start:b", "warm_start:a"]
    assert "named; it recorded no fingerprint" in plan.lines[0]
    assert "named; differs: gpu_count: 4 there, 2 here" in plan.lines[1]
    with pytest.raises(ValueError, match="nope"):
        plan_warm_start(["nope"], BASE, studies, space=SPACE, fixed_flags={})


def test_off_seeds_nothing_and_fixed_flags_refuse_a_conflicting_best() -> None:
    studies = [earlier("e", BASE, {"max_num_seqs": 128}, 1)]
    assert plan_warm_start("off", BASE, studies, space=SPACE, fixed_flags={}).seeds == ()
    plan = plan_warm_start("auto", BASE, studies, space=SPACE,
                           fixed_flags={"max_num_seqs": 256})
    assert not plan.seeds and "fixed_flags fixes it to 256" in plan.lines[0]


def test_other_fixed_flags_make_another_baseline_and_so_an_incompatible_study() -> None:
    fixed = fingerprint(fixed_flags={"max_model_len": 4096})
    assert fixed.fixed_flags == {"max_model_len": 4096} and BASE.fixed_flags == {}
    assert any(r.startswith("fixed_flags:") for r in compatibility(BASE, fixed).reasons)


def test_level_burstiness_and_trace_content_enter_the_fingerprint(tmp_path: Path) -> None:
    """A Poisson study and one whose level is bursty are not the same workload; two traces of
    one name but other content are not either (their digest is compared)."""
    def study(workload: dict[str, Any]) -> Any:
        data = {"name": "s", "engine": "simulated", "model": {"path": "qwen2.5-7b",
                                                               "load_format": "dummy"},
                "workload": workload, "slo": {"tpot_p99_ms": 50}, "budget": {"trials": 1}}
        return parse_study(data, path=tmp_path / "s.yaml")

    def fp(workload: dict[str, Any]) -> Any:
        return fingerprint_of(study(workload), engine="simulated", engine_version="x",
                              hardware=None, model=None)

    poisson = fp({"levels": [{"request_rate": 4}]})
    bursty = fp({"levels": [{"request_rate": 4, "burstiness": 0.2}]})
    assert poisson.burstiness == 1.0 and bursty.burstiness == 0.2
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 4}\n'
                     '{"timestamp": 1, "input_length": 8, "output_length": 4}\n')
    first = fp({"trace": {"path": "t.jsonl"}})
    assert first.arrival == "trace:request_rate" and first.peak_load == pytest.approx(1.0)
    trace.write_text('{"timestamp": 0, "input_length": 99, "output_length": 4}\n'
                     '{"timestamp": 1, "input_length": 8, "output_length": 4}\n')
    second = fp({"trace": {"path": "t.jsonl"}})
    assert first.trace != second.trace, "same name, other content"
    assert "max_gap_s" not in first.trace, "left unset, the fingerprint is what it was before"
    trace.write_text("".join(f'{{"timestamp": {t}, "input_length": 8, "output_length": 4}}\n'
                             for t in (0, 1, 3601)))
    idle = fp({"trace": {"path": "t.jsonl"}})
    cut = fp({"trace": {"path": "t.jsonl", "max_gap_s": 1}})
    assert idle.peak_load == pytest.approx(2 / 3601) and cut.peak_load == pytest.approx(1.0), \
        "the default level replays at the rate of the gaps as cut"


def test_a_traces_text_prompts_are_labelled_recorded_lengths(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 9, "output_length": 2, "prompt": "Some text"}\n'
        '{"timestamp": 1, "input_length": 8, "output_length": 2}\n')
    cfg = parse_study({"name": "s", "engine": "simulated",
                       "model": {"path": "qwen2.5-7b", "load_format": "dummy"},
                       "workload": {"trace": {"path": "t.jsonl"}}, "slo": {"tpot_p99_ms": 50},
                       "budget": {"trials": 1}},
                      path=tmp_path / "s.yaml")
    assert _prompt_lengths(cfg, cfg.workload) == "recorded_where_text", \
        "a text prompt's length is the trace's own input_length, not token ids nor a count"


# -- prompts from a file: the lengths its requests ask --------------------------------------

_TRACE = [(0, 100, 20), (250, 900, 200), (500, 440, 110)]  # ms, input and output tokens


def _file_study(tmp_path: Path, workload: dict[str, Any]) -> Fingerprint:
    (tmp_path / "t.jsonl").write_text("".join(
        f'{{"timestamp": "{1733400000000 + t}", "input_length": {n_in}, '
        f'"output_length": {n_out}}}\n' for t, n_in, n_out in _TRACE))
    (tmp_path / "p.jsonl").write_text('{"prompt": [11, 12, 13, 14], "output_len": 6}\n'
                                      '{"prompt": [11, 12], "output_len": 2}\n')
    data = {"name": "s", "engine": "simulated",
            "model": {"path": "qwen2.5-7b", "load_format": "dummy", "skip_tokenizer_init": True},
            "workload": workload, "slo": {"tpot_p99_ms": 50}, "budget": {"trials": 1}}
    return fingerprint_of(parse_study(data, path=tmp_path / "s.yaml"), engine="simulated",
                          engine_version="x", hardware=simulated_hardware("h200", 1),
                          model=load_model_info("qwen2.5-7b"))


def test_a_trace_study_is_described_by_what_it_replays_not_the_unused_defaults(
        tmp_path: Path) -> None:
    """input_len/output_len default to 512/128, which a trace never sends: the fingerprint and
    the export header describe the trace's requests, and warm start compares their lengths."""
    fp = _file_study(tmp_path, {"trace": {"path": "t.jsonl", "timestamp_unit_s": 0.001}})
    assert (fp.input_len_kind, fp.input_len_mean) == ("trace", 480.0)
    assert (fp.output_len_kind, fp.output_len_mean) == ("trace", pytest.approx(110.0))
    assert (fp.input_len, fp.output_len) == ("trace:100-900 mean 480", "trace:20-200 mean 110")
    assert describe_workload(fp) == (
        "trace t.jsonl: 3 requests, input 100-900 tokens (mean 480), output 20-200 "
        "(mean 110), at 4 req/s"), "two gaps over 0.5 s"
    first = _file_study(tmp_path, {"trace": {"path": "t.jsonl", "timestamp_unit_s": 0.001},
                                   "num_requests": 2})
    assert (first.input_len_mean, first.output_len_mean) == (500.0, 110.0), \
        "the requests replayed: the trace's first num_requests"


def test_a_prompts_files_lengths_are_its_requests(tmp_path: Path) -> None:
    fp = _file_study(tmp_path, {"prompts_file": "p.jsonl", "num_requests": 4,
                                "levels": [{"concurrency": 2}]})
    assert (fp.input_len_kind, fp.input_len_mean, fp.output_len_mean) == \
        ("prompts_file", 3.0, 4.0)
    assert describe_workload(fp) == (
        "prompts p.jsonl: 4 requests a level, input 2-4 tokens (mean 3), output 2-6 (mean 4), "
        "levels:concurrency up to 2")


def test_warm_start_compares_the_replayed_lengths(tmp_path: Path) -> None:
    fp = _file_study(tmp_path, {"trace": {"path": "t.jsonl", "timestamp_unit_s": 0.001}})
    assert compatibility(fp, fp).is_compatible
    longer = replace(fp, input_len_mean=4000.0)
    assert "input_len_mean: 4000 there, 480 here (more than 2x apart)" in \
        compatibility(fp, longer).reasons
    synthetic = replace(BASE, input_len_mean=4000.0)
    assert any(r.startswith("input_len_mean: 4000 there, 480 here")
               for r in compatibility(replace(fp, trace=None, prompts_file=None),
                                      synthetic).reasons), "the real lengths, never 512"


def _stored_before_replayed_lengths(fp: Fingerprint) -> dict[str, Any]:
    """`fp` as a study of the same file stored it before its lengths were recorded: the study
    file's unused defaults as its lengths, and no workload_text."""
    data = {**fp.to_dict(), "input_len": "fixed:512", "input_len_kind": "fixed",
            "input_len_mean": 512.0, "output_len": "fixed:128", "output_len_kind": "fixed",
            "output_len_mean": 128.0}
    del data["workload_text"]
    return data


def test_a_study_of_the_same_trace_stored_before_its_lengths_were_recorded_still_seeds_and_resumes(
        tmp_path: Path) -> None:
    fp = _file_study(tmp_path, {"trace": {"path": "t.jsonl", "timestamp_unit_s": 0.001}})
    stored = _stored_before_replayed_lengths(fp)
    older, missing = Fingerprint.from_dict(stored)
    assert compatibility(fp, older, missing).is_compatible, \
        compatibility(fp, older, missing).reasons
    assert describe_workload(older) == (
        "trace, its lengths not recorded (a study fingerprinted before they were), "
        "trace:request_rate up to 4"), "never the unused fixed:512"
    import optuna

    from optimizer.results.trial_record import STUDY_ATTR_FINGERPRINT
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(study_name="here", storage=url).set_user_attr(
        STUDY_ATTR_FINGERPRINT, stored)
    assert _refusal(url, fp) == "", "its own study file resumes it"
    other = replace(fp, trace={**fp.trace, "sha256": "0" * 12})
    assert "workload.trace" in _refusal(url, other), "another trace is still refused"


def test_a_synthetic_fingerprint_keeps_its_fields_and_hash() -> None:
    """Stored studies of synthesised prompts keep their hash and stay compatible: the new
    words (workload_text) are reported, never hashed, and a fingerprint without them is no
    less known."""
    assert (BASE.input_len_kind, BASE.input_len_mean, BASE.output_len_mean) == \
        ("fixed", 512.0, 128.0)
    assert describe_workload(BASE) == \
        "input fixed:512 tokens, output fixed:128 tokens, levels:concurrency up to 16"
    data = BASE.to_dict()
    del data["workload_text"]  # as a study stored it before
    older, missing = Fingerprint.from_dict(data)
    assert older.hash == BASE.hash and compatibility(BASE, older, missing).is_compatible
    assert describe_workload(older) == describe_workload(BASE)


# -- a resume under a changed study file ----------------------------------------------------


def _stored_study(tmp_path: Path, fp: Fingerprint) -> str:
    import optuna

    from optimizer.results.trial_record import STUDY_ATTR_FINGERPRINT

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    stored = optuna.create_study(study_name="here", storage=url, direction="maximize")
    stored.set_user_attr(STUDY_ATTR_FINGERPRINT, fp.to_dict())
    return url


def _refusal(url: str, fp: Fingerprint) -> str:
    from optimizer.errors import ConfigError
    from optimizer.run.runtime import refuse_a_changed_study

    cfg = parse_study(study()).with_overrides(storage=url)
    try:
        refuse_a_changed_study(cfg, fp)
    except ConfigError as exc:
        assert exc.exit_code == 2
        return str(exc)
    return ""


def test_resuming_the_same_study_file_is_not_refused(tmp_path: Path) -> None:
    assert _refusal(_stored_study(tmp_path, BASE), BASE) == ""


def test_a_new_study_name_or_no_storage_yet_is_not_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'none.db'}"
    assert _refusal(url, BASE) == "" and not (tmp_path / "none.db").exists()


@pytest.mark.parametrize(("changed", "named"), [
    (fingerprint(workload={"input_len": 2048, "output_len": 128,
                           "levels": [{"concurrency": 16}]}), "workload.input_len: fixed:512 ->"),
    (fingerprint(slo={"tpot_p99_ms": 20}), "slo.tpot_p99_ms: 40 -> 20"),
    (fingerprint(load_format="auto"), "weights (model.load_format): dummy -> real"),
    (fingerprint(model="llama-3.1-8b"), "(model: qwen2.5-7b -> llama-3.1-8b)"),
    (fingerprint(num_gpus=1), "hardware gpu_count: 2 -> 1"),
    (replace(BASE, engine="vllm"), "engine: simulated -> vllm"),
    (replace(BASE, engine_version="simulated 0.32.0"),
     "vLLM release (vllm.version, or the installed vLLM): simulated 0.26.0 -> simulated 0.32.0"),
])
def test_a_changed_study_file_is_refused_naming_the_change_and_how_to_start_anew(
        tmp_path: Path, changed: Fingerprint, named: str) -> None:
    import optuna

    url = _stored_study(tmp_path, BASE)
    message = _refusal(url, changed)
    assert named in message, message
    assert "give the study a new `name:`" in message and "\n" not in message
    stored = optuna.load_study(study_name="here", storage=url)
    assert stored.user_attrs["fingerprint"] == BASE.to_dict(), "nothing written"


def test_a_study_file_naming_another_vllm_release_is_refused_on_resume(tmp_path: Path) -> None:
    """A study run on one vLLM release is not resumed on another (its defaults trial was
    measured on the old one: 0.28 changed the KV budget's sizing): the declared `vllm.version`
    reaches the fingerprint and the refusal names both releases and what to do. A release
    unknown on either side (a driver without vLLM, a study naming none) is not compared."""
    from optimizer.run.runtime import study_fingerprint

    url = _stored_study(tmp_path, BASE)
    cfg = parse_study(study(vllm={"version": "0.32.0"}))
    here = study_fingerprint(cfg, dry_run=True)
    assert here.engine_version == "simulated 0.32.0"
    message = _refusal(url, replace(BASE, engine_version=here.engine_version))
    assert "simulated 0.26.0 -> simulated 0.32.0" in message and \
        "and the vLLM it ran" in message, message
    assert _refusal(url, replace(BASE, engine_version=None)) == ""
    assert _refusal(url, replace(BASE, engine_version="simulated 0.26")) == "", \
        "the same release, written short"
    (tmp_path / "real").mkdir()
    real = _stored_study(tmp_path / "real", replace(BASE, engine_version="0.26.0+cu126"))
    assert _refusal(real, replace(BASE, engine_version="0.26.0+cu128")) == "", \
        "a rebuild of one release for another CUDA is that release"
    assert "0.26.0+cu126 -> 0.27.0" in _refusal(real, replace(BASE, engine_version="0.27.0"))
    (tmp_path / "unknown").mkdir()
    assert _refusal(_stored_study(tmp_path / "unknown", replace(BASE, engine_version=None)),
                    BASE) == ""


def test_a_study_stored_before_fingerprints_is_resumed(tmp_path: Path) -> None:
    import optuna

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(study_name="here", storage=url, direction="maximize")
    assert _refusal(url, fingerprint(num_gpus=1)) == ""
