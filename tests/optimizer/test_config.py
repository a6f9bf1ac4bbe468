"""The study file: every bad input is one line naming the field and the fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from optimizer.config import load_study, parse_study
from optimizer.config.sections import SLOSpec
from optimizer.errors import ConfigError
from optimizer.storage.study import engine_config
from runners.workload import SLO, SLO_BOUNDS

BASE = {"name": "s", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 3},
        "slo": {"tpot_p99_ms": 50}}


def test_quickstart_example_is_valid() -> None:
    cfg = load_study(Path(__file__).parents[2] / "examples" / "quickstart.yaml")
    assert cfg.name == "quickstart"
    assert cfg.objectives == ["goodput"] and cfg.directions == ["maximize"]
    workload = cfg.workload
    assert [lv.max_concurrency for lv in workload.levels] == [8, 32]


def test_defaults_fill_a_minimal_study() -> None:
    cfg = parse_study(dict(BASE))
    assert cfg.storage_url == "sqlite:///results/s/optuna.db"
    assert cfg.workload.slo.tpot_p99_ms == 50


@pytest.mark.parametrize(("patch", "expected"), [
    ({"slo": {"tpot_p99_ms": -5}}, "slo.tpot_p99_ms: Input should be greater than 0 but got -5."),
    ({"budgett": {"trials": 1}}, "unknown key 'budgett'; did you mean 'budget'?"),
    ({"model": {"pat": "x"}}, "unknown key 'model.pat'; did you mean 'path'?"),
    ({"workload": {"levels": [{}]}}, "workload.levels[0]: a load level needs request_rate"),
    ({"name": "../etc"}, "name: must be 1-100 letters"),
    ({"slo": {}}, "objective goodput needs slo.ttft_p99_ms"),
    ({"objective": "latency"}, "objective"),
    ({"budget": {}}, "budget: set trials and/or wall_hours"),
    ({"workload": {"input_len": {"kind": "uniform", "low": 9, "high": 3}}},
     "low (9) must be <= high (3)"),
    ({"workload": {"num_requests": None}}, "set num_requests or duration_s"),
    ({"env": {"bad name": "1"}}, "is not an environment variable name"),
    ({"ray": {"resources": {"GPU": 2}}}, "ray.resources: 'GPU' is set by nightshift per trial"),
    ({"ray": {"resources": {"pool": 0}}}, "pool must be > 0 but got 0"),
    ({"ray": {"adress": "auto"}}, "unknown key 'ray.adress'; did you mean 'address'?"),
    ({"workload": {"input_len": "five hundred"}}, "workload.input_len: give a whole number of "
     "tokens (e.g. 512) or a distribution {kind: uniform, low: .., high: ..} but got 'five "
     "hundred'."),
    ({"seed_trials": [{"max_num_seqs": 64}, {"quantisation": "fp8"}]},
     "seed_trials[1]: 'quantisation' is not a param nightshift searches; did you mean "
     "'quantization'?"),
    ({"seed_trials": [{"zzqq": 1}]}, "seed_trials[0]: 'zzqq' is not a param nightshift "
     "searches; name params of the search space, as its YAML spells them."),
    ({"workload": {"output_len": 512.5}}, "workload.output_len: give a whole number of tokens "
     "(e.g. 512) or a distribution {kind: uniform, low: .., high: ..} but got 512.5."),
])
def test_bad_study_fields_give_one_line_errors(patch: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_study({**BASE, **patch})
    message = str(info.value)
    assert expected in message, message
    assert "\n" not in message, "errors are one line"
    assert message.startswith("study.yaml: "), "errors name the file"


def test_missing_required_section_says_what_to_add() -> None:
    data = {k: v for k, v in BASE.items() if k != "budget"}
    with pytest.raises(ConfigError, match="budget is required; add it"):
        parse_study(data)


def test_broken_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "study.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        load_study(bad)
    with pytest.raises(ConfigError, match="no such study file"):
        load_study(tmp_path / "absent.yaml")
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_study(bad)


def test_paths_resolve_against_the_study_file(tmp_path: Path) -> None:
    data = {**BASE, "results_dir": "out", "workload": {"prompts_file": "p.jsonl"}}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = load_study(path)
    assert cfg.results_dir == tmp_path / "out"
    assert cfg.workload.prompts_file == tmp_path / "p.jsonl"


def test_overrides_from_the_command_line() -> None:
    cfg = parse_study(dict(BASE)).with_overrides(trials=7, tracking_uri="sqlite:///x.db")
    assert cfg.spec.budget.trials == 7 and cfg.tracking_uri == "sqlite:///x.db"
    with pytest.raises(ConfigError, match=r"--trials: .*greater than or equal to 1"):
        parse_study(dict(BASE)).with_overrides(trials=0)


@pytest.mark.parametrize(("override", "expected"), [
    ({"trials": 10**20}, "--trials: Input should be less than or equal to 100000"),
    ({"storage": ""}, "--storage: '' is not a database URL"),
    ({"tracking_uri": ""}, "--tracking-uri: it is empty"),
])
def test_an_override_is_checked_as_the_study_files_own_value_is(
        override: dict[str, Any], expected: str) -> None:
    # A copy took them unchecked: 10**20 trials ran, '' fell back to the default store.
    with pytest.raises(ConfigError) as info:
        parse_study(dict(BASE)).with_overrides(**override)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value), info.value


def test_an_override_keeps_what_the_study_file_left_unset() -> None:
    cfg = parse_study({**BASE, "workload": {"trace": {"path": "t.jsonl"}}})
    assert "levels" not in cfg.with_overrides(trials=3).spec.workload.model_fields_set, \
        "a trace without levels still replays as recorded after an override"


def test_multi_objective_pair() -> None:
    cfg = parse_study({**BASE, "objective": ["throughput", "tpot"]})
    assert cfg.directions == ["maximize", "minimize"] and cfg.is_multi_objective


# -- issue 19 item 3: fixed flags fix what the space samples ----------------------------------


def _hopper_space() -> Any:
    from optimizer.run.space_context import space_context
    from runners.hardware import load_preset
    from runners.model_info import load_model_info
    from search_spaces import load_space

    return load_space("hopper").resolve(space_context(load_preset("h200"),
                                                      load_model_info("qwen2.5-7b")))


def test_a_fixed_flag_is_no_longer_searched_and_every_trial_and_the_baseline_run_it() -> None:
    import optuna

    space, removed = _hopper_space().with_fixed({"max_num_seqs": 64, "enable_lora": True})
    assert "max_num_seqs" not in space.distributions(), "taken out of the search"
    assert len(removed) == 1 and removed[0].startswith("fixed_flags.max_num_seqs=64"), \
        "one log line per param taken out (enable_lora was never searched)"
    assert space.defaults()["max_num_seqs"] == 64, "the baseline runs the fixed value"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(12):
        params = space.sample(study.ask())
        assert params["max_num_seqs"] == 64, "no trial samples a fixed flag"
        assert not [p for p in space.check(params) if "max_num_seqs" in p]


def test_fixed_flags_win_over_a_sampled_value_in_the_engine_config() -> None:
    from optimizer.storage.study import engine_config

    cfg = parse_study({**BASE, "fixed_flags": {"max_num_seqs": 64, "cudagraph_mode": "PIECEWISE",
                                               "enable_prefix_caching": False}})
    flags = engine_config(cfg, {"max_num_seqs": 512}).flags
    assert flags["max_num_seqs"] == 64
    assert flags["compilation_config.cudagraph_mode"] == "PIECEWISE", "rendered as the space does"
    assert flags["no_enable_prefix_caching"] is True and "enable_prefix_caching" not in flags


def test_the_baseline_is_named_with_the_fixed_flags() -> None:
    from optimizer.config import baseline_name

    assert baseline_name({}) == "vLLM defaults"
    assert baseline_name({"max_num_seqs": 64}) == \
        "vLLM defaults + your fixed flags (max_num_seqs=64)"
    assert parse_study({**BASE, "fixed_flags": {"max_num_seqs": 64}}).baseline_name.startswith(
        "vLLM defaults + your fixed flags")


def test_a_fixed_value_that_breaks_the_token_budget_is_refused() -> None:
    from search_spaces import SpaceError

    with pytest.raises(SpaceError, match="fixed_flags: max_num_batched_tokens can be 16"):
        _hopper_space().with_fixed({"max_num_batched_tokens": 16})


@pytest.mark.parametrize("flags", [{"enable_lora": True}, {"max_loras": 4},
                                   {"max_model_len": 8192}, {"kv_cache_dtype": "fp8_e5m2"},
                                   {"compilation_config": {"mode": 3}},
                                   {"cudagraph_capture_sizes": [1, 2, 4]}, {"seed": 7},
                                   {"max_lora_rank": 16}])
def test_any_flag_of_vllm_can_be_fixed(flags: dict) -> None:
    assert parse_study({**BASE, "fixed_flags": flags}).spec.fixed_flags == flags


@pytest.mark.parametrize(("given", "read"), [("8k", 8000), ("8K", 8192), ("1.5k", 1500),
                                             ("4096", 4096), ("1m", 1_000_000)])
def test_max_model_len_in_vllms_human_form_is_read_as_vllm_reads_it(given: str,
                                                                     read: int) -> None:
    cfg = parse_study({**BASE, "fixed_flags": {"max_model_len": given}})
    assert cfg.spec.fixed_flags["max_model_len"] == read, "an integer, as vLLM parses it"
    assert engine_config(cfg, {}).flags["max_model_len"] == read


def test_secret_flags_and_placement_variables_are_refused_naming_the_fix() -> None:
    cases = [({"vllm": {"extra_args": ["--hf-token", "hf_x"]}}, "env.HF_TOKEN"),
             ({"vllm": {"extra_args": ["--api-key=k"]}}, "its own random key"),
             ({"fixed_flags": {"hf_token": "hf_x"}}, "env.HF_TOKEN"),
             ({"env": {"VLLM_API_KEY": "k"}}, "its own random key"),
             ({"env": {"CUDA_VISIBLE_DEVICES": "1"}}, "placement"),
             ({"env": {"LD_PRELOAD": "/nonexistent/lib.so"}}, "not a file")]
    for extra, words in cases:
        with pytest.raises(ConfigError, match=words):
            parse_study({**BASE, **extra})


def test_a_secret_in_env_is_named_in_the_written_study_and_read_back_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_study({**BASE, "env": {"HF_TOKEN": "hf_secret_value",
                                       "VLLM_LOGGING_LEVEL": "INFO"}})
    written = cfg.to_dict()
    assert written["env"] == {"HF_TOKEN": "${HF_TOKEN}", "VLLM_LOGGING_LEVEL": "INFO"}
    assert "hf_secret_value" not in repr(written)
    assert engine_config(cfg, {}).env["HF_TOKEN"] == "hf_secret_value", "the engine gets it"
    monkeypatch.setenv("HF_TOKEN", "from_the_environment")
    again = parse_study({**BASE, "env": written["env"]})
    assert again.spec.env["HF_TOKEN"] == "from_the_environment"
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(ConfigError, match=r"env\.HF_TOKEN: .* not set here"):
        parse_study({**BASE, "env": written["env"]})


@pytest.mark.parametrize(("extra", "field"), [
    ({"slo": {"ttft_p99_ms": 0.8}}, "slo.ttft_p99_ms"),
    ({"slo": {"tpot_p99_ms": 0.05}}, "slo.tpot_p99_ms"),
    ({"slo": {"ttft_p99_ms": 500, "e2el_ms": 300}}, "slo.e2el_ms"),
    ({"workload": {"request_timeout_s": 0.001}}, "workload.request_timeout_s"),
    ({"workload": {"startup_timeout_s": 0.01}}, "workload.startup_timeout_s"),
    ({"workload": {"capacity": {"axis": "concurrency", "low": 1, "high": 8},
                   "levels": [{"concurrency": 4}]}}, "workload.levels"),
    ({"storage": "sqlite:///~/optuna.db"}, "storage: SQLite does not expand ~"),
    ({"storage": "sqlite:////proc/x/optuna.db"}, "storage: .* kernel file system"),
])
def test_limits_no_engine_meets_and_settings_that_do_nothing_are_refused(extra: dict,
                                                                        field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_study({**BASE, **extra})


# -- issue 19 items 6, 7: extra_args and values checked against vLLM's flag table --------------


@pytest.mark.parametrize("args", [["-O3"], ["--enable-log-requests"], ["--max-loras", "2"],
                                  ["--compilation-config.mode=3"], ["--enable-lora"],
                                  ["--max-loras=4", "--enable-lora", "--max-lora-rank", "16"],
                                  ["--cudagraph-capture-sizes", "1", "2", "4"],
                                  ["--max-num-scheduled-tokens", "8k"]])
def test_extra_args_of_flags_nightshift_neither_sets_nor_searches_pass(args: list) -> None:
    assert parse_study({**BASE, "vllm": {"extra_args": args}}).spec.vllm.extra_args == args


@pytest.mark.parametrize(("args", "expected"), [
    (["--host", "0.0.0.0"], "vllm.extra_args[0]: nightshift sets --host itself"),
    (["--port", "9000"], "nightshift sets --port itself"),
    (["--load-format", "auto"], "set model.load_format instead"),
    (["-tp", "2"], "--tensor-parallel-size is a flag a nightshift space may search"),
    (["--no-enable-prefix-caching"], "set fixed_flags.enable_prefix_caching"),
    (["--max-loras", "2", "--uds", "/tmp/s"], "vllm.extra_args[2]: nightshift sets --uds"),
    (["--enable-lorra"], "did you mean --enable-lora?"),
    (["--max-loras", "many"], "vllm.extra_args[0]: --max-loras must be an integer"),
    (["--max-loras=-2"], "--max-loras must be >= 1"),
    (["--max-cpu-loras"], "--max-cpu-loras needs a value"),
    (["--enable-lora", "yes"], "--enable-lora takes no value"),
    (["--enable-lora=true"], "--enable-lora takes no value"),
    (["--lora-dtype", "auto", "--logprobs-mode", "word"], "vllm.extra_args[2]: --logprobs-mode "
                                                          "must be one of"),
])
def test_extra_args_that_would_override_nightshift_are_refused(args: list, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_study({**BASE, "vllm": {"extra_args": args}})
    assert expected in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_an_extra_arg_repeating_a_fixed_flag_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"repeats fixed_flags\.max_loras"):
        parse_study({**BASE, "fixed_flags": {"max_loras": 2},
                     "vllm": {"extra_args": ["--max-loras", "4"]}})


def test_the_installed_parser_makes_a_table_when_vllm_imports() -> None:
    import argparse

    from runners.vllm.flags import flags_from_parser
    from search_spaces.engine.tables import value_problem

    parser = argparse.ArgumentParser()
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"])
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    table = flags_from_parser(parser, version="9.9")
    assert table.resolve("max_num_seqs") == "max-num-seqs" and table.resolve("-tp")
    assert value_problem(table.types["kv-cache-dtype"], "fp9") is not None
    assert value_problem(table.types["enforce-eager"], True) is None
    assert value_problem(table.types["max-num-seqs"], "many") is not None


def test_duplicate_keys_and_alias_bombs_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE) + "name: t\n")
    with pytest.raises(ConfigError, match="line 8, column 1: duplicate key 'name'"):
        load_study(path)
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"b{i}: &b{i} [" + ", ".join([f"*{'a' if i == 0 else f'b{i - 1}'}"] * 10) + "]\n"
        for i in range(6))
    path.write_text(yaml.safe_dump(BASE) + bomb)
    with pytest.raises(ConfigError, match="once aliases are expanded"):
        load_study(path)
    path.write_text(yaml.safe_dump(BASE) + "x: &x {k: 1}\ny: {<<: *x, j: 2}\n")
    with pytest.raises(ConfigError, match="unknown key 'x'"):  # merge keys still load
        load_study(path)


def test_the_workload_must_fit_the_context_vllm_derives_from_the_models_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.config import check_before_start

    monkeypatch.chdir(tmp_path)
    long = {"input_len": 40_000, "output_len": 16, "num_requests": 8,
            "levels": [{"concurrency": 4}]}
    with pytest.raises(ConfigError, match="over the max_model_len of 32768"):
        check_before_start(parse_study({**BASE, "workload": long}))
    fixed = {**BASE, "workload": long, "fixed_flags": {"max_model_len": "64k"}}
    # vLLM 0.26 refuses a max_model_len over the context it derives from config.json
    # (Qwen2.5-7B has no rope_scaling: 32768) unless told to allow it.
    with pytest.raises(ConfigError, match=r"fixed_flags\.max_model_len: 64000 is over the "
                                          r"32768 tokens vLLM derives.*VLLM_ALLOW_LONG"):
        check_before_start(parse_study(fixed))
    check_before_start(parse_study({**fixed, "env": {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}}))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the engine inherits the shell's
    check_before_start(parse_study(fixed))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    # A lognormal of mean 8k (sigma 1) without `high` draws past 32k once in about 34 requests.
    tail = {**long, "input_len": {"kind": "lognormal", "mean": 8192, "std": 1.0}}
    with pytest.raises(ConfigError, match="4-sigma tail: set `high`"):
        check_before_start(parse_study({**BASE, "workload": tail}))
    bounded = {**tail, "input_len": {**tail["input_len"], "high": 30_000}}
    check_before_start(parse_study({**BASE, "workload": bounded}))
    # llama-3.1's rope_scaling (type llama3) leaves vLLM's context at max_position_embeddings.
    llama = {**BASE, "model": {"path": "llama-3.1-8b"}}
    check_before_start(parse_study({**llama, "workload": {**long, "input_len": 130_000}}))
    with pytest.raises(ConfigError, match="over the max_model_len of 131072"):
        check_before_start(parse_study({**llama, "workload": {**long, "input_len": 140_000}}))
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists()


def test_a_longrope_models_workload_must_fit_vllms_default_context_unless_one_is_fixed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Phi-3-mini-128k's shape: vLLM 0.26 serves its original 4096 tokens unless max_model_len
    # is given (config/model.py:2244-2255), though it accepts one up to 131072.
    from optimizer.config import check_before_start

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "phi3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "intermediate_size": 8192, "vocab_size": 32064,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
        "rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}}))
    study = {**BASE, "model": {"path": str(model)},
             "workload": {"input_len": 8000, "output_len": 16, "num_requests": 8,
                          "levels": [{"concurrency": 4}]}}
    with pytest.raises(ConfigError, match=r"over the max_model_len of 4096 \(vLLM's default "
                       r"for .*LongRoPE.*set fixed_flags\.max_model_len \(up to 131072"):
        check_before_start(parse_study(study))
    check_before_start(parse_study({**study, "fixed_flags": {"max_model_len": 16384}}))
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists()


def test_a_database_server_that_refuses_is_named_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 19 item 7: a storage URL that parses and whose driver is installed, but whose server
    does not answer, is one line and exit 2 before the daemon writes its log, lock or MLflow
    experiment (port 9 on loopback refuses; pymysql is a real, pure-Python driver)."""
    from optimizer.cli import main
    from tests.builders import write_study

    path = write_study(tmp_path)
    argv = ["start", str(path), "--no-progress",
            "--storage", "mysql+pymysql://u:secret@127.0.0.1:9/optuna"]
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "storage: cannot connect to" in lines[0], lines
    assert "secret" not in lines[0], "the password is never printed"
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists(), \
        "bad input writes nothing"


@pytest.mark.parametrize("value", ["off", "auto"])
def test_templates_take_the_bare_words_the_readme_gives(tmp_path: Path, value: str) -> None:
    # YAML 1.1 reads a bare `off` as false: "templates: Input should be 'auto' or 'off' but got
    # False" for the documented value.
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE) + f"templates: {value}\n")
    assert load_study(path).spec.templates == value


def test_a_conversations_longest_context_is_the_tail_of_its_sum_not_n_longest_draws() -> None:
    """Five turns of normal(1000, 300) prompts: 5 x the 4-sigma draw (11,000 tokens) would
    refuse plausible files on a 8-16k model; the sum's 4-sigma tail is 5,000 + 4 x 300 x
    sqrt(5) = 7,684. Bounded draws keep the strict bound (n x high)."""
    from optimizer.config.workload_checks import _longest_sum
    from optimizer.config.workload_spec import LengthSpec

    assert _longest_sum(LengthSpec(kind="normal", mean=1000, std=300), 5) == 7684
    assert _longest_sum(LengthSpec(kind="normal", mean=1000, std=300, high=1500), 5) == 7500
    assert _longest_sum(LengthSpec(mean=128), 4) == 512
    assert _longest_sum(LengthSpec(mean=128), 0) == 0


def test_the_workload_is_built_once_and_each_section_becomes_the_runners_value() -> None:
    from runners.load_level import LoadLevel
    from runners.workload import SLO, LengthDistribution, SharedPrefix

    cfg = parse_study({**BASE, "slo": {"ttft_p99_ms": 500, "tpot_p99_ms": 50},
                       "workload": {"input_len": {"kind": "uniform", "low": 100, "high": 900,
                                                  "mean": 500},
                                    "levels": [{"request_rate": 2.0, "concurrency": 4,
                                                "burstiness": 0.5}],
                                    "warmup_requests": 3,
                                    "shared_prefix": {"fraction": 0.5, "tokens": 64,
                                                      "num_prefixes": 2}}})
    assert cfg.workload is cfg.workload, "one Workload per loaded study, not one per reader"
    w = cfg.workload
    assert w.input_len == LengthDistribution(kind="uniform", mean=500, low=100, high=900)
    assert w.levels == (LoadLevel(request_rate_rps=2.0, max_concurrency=4, burstiness=0.5),)
    assert w.shared_prefix == SharedPrefix(fraction=0.5, num_tokens=64, num_prefixes=2)
    assert w.slo == SLO(ttft_p99_ms=500, tpot_p99_ms=50)
    assert w.num_warmup_requests == 3
    assert w.vocab_size == 152064, "the bundled shape's vocabulary, read from its config.json"


def test_a_capacity_section_becomes_the_runners_search_field_for_field() -> None:
    from runners.capacity.search import CapacitySearch

    capacity = {"axis": "request_rate", "low": 1.0, "high": 40.0, "tolerance": 0.1,
                "max_probes": 6, "probe_duration_s": 20.0, "min_window_requests": 50,
                "min_window_s": 5.0, "max_window_s": 60.0, "warmup_s": 3.0}
    cfg = parse_study({**BASE, "workload": {"capacity": capacity}})
    assert cfg.workload.capacity == CapacitySearch(**capacity)  # type: ignore[arg-type]


def test_storage_and_tracking_uri_naming_one_sqlite_file_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Optuna would create its tables in it, then MLflow refuse Optuna's schema version.
    from optimizer.config import check_before_start

    monkeypatch.chdir(tmp_path)
    study = {**BASE, "storage": "sqlite:///stores/one.db",
             "tracking_uri": f"sqlite:///{tmp_path}/stores/./one.db"}
    with pytest.raises(ConfigError, match=r"tracking_uri: .* is the same SQLite file as "
                                          r"storage; .* need a file each"):
        check_before_start(parse_study(study))
    assert not (tmp_path / "stores").exists()
    check_before_start(parse_study({**study, "tracking_uri": "sqlite:///stores/mlflow.db"}))


# -- explore s13: inputs refused at start -------------------------------------------------------


@pytest.mark.parametrize(("name", "fix"), [
    ("VLLM_ATTENTION_BACKEND", "remove it and set fixed_flags.attention_backend instead"),
    ("VLLM_TORCH_PROFILER_DIR", "remove it and set workload.profile instead"),
    ("VLLM_USE_V1", "remove it (nothing: V1 is the only engine)"),
])
def test_an_env_var_vllm_ignores_is_refused_at_start_with_the_key_that_sets_it(
        name: str, fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable audit's table calls ignored (its export would fail `nightshift audit`)
    is refused before anything is written, naming the study key to use instead."""
    from optimizer.config import check_before_start
    from optimizer.export.audit import REMOVED_ENV

    assert name in REMOVED_ENV, "the study refuses what the audit flags: one table"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_before_start(parse_study({**BASE, "env": {name: "x"}}))
    message = str(info.value)
    assert message.startswith(f"study.yaml: env.{name}: vLLM 0.26.0 ignores it"), message
    assert message.endswith(f"; {fix}."), message
    assert "\n" not in message
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists()
    check_before_start(parse_study({**BASE, "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"}}))


def test_fewer_requests_than_a_levels_concurrency_are_refused_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 requests sent once never put 8 in flight: figures "at concurrency 8" would be of a load
    never applied. A rate's cap, duration_s (requests cycle) or a capacity search is not."""
    from optimizer.config import check_before_start

    monkeypatch.chdir(tmp_path)
    few = {"input_len": 512, "output_len": 128, "levels": [{"concurrency": 2},
                                                           {"concurrency": 8}],
           "num_requests": 2, "warmup_requests": 50}
    with pytest.raises(ConfigError) as info:
        check_before_start(parse_study({**BASE, "workload": few}))
    assert str(info.value) == (
        "study.yaml: workload.num_requests: 2 requests, each sent once, never reach "
        "levels[1]'s concurrency of 8; raise num_requests to at least 8 (a p99 wants many "
        "more), lower that concurrency, or set duration_s.")
    default_level = {"input_len": 512, "output_len": 128, "num_requests": 8}  # concurrency 16
    with pytest.raises(ConfigError, match="never reach the default level's concurrency of 16"):
        check_before_start(parse_study({**BASE, "workload": default_level}))
    for fine in ({**few, "num_requests": 8},
                 {**few, "duration_s": 30},
                 {**few, "levels": [{"request_rate": 4, "concurrency": 8}]},
                 {"input_len": 512, "output_len": 128, "num_requests": 2,
                  "capacity": {"axis": "concurrency", "low": 1, "high": 8}}):
        check_before_start(parse_study({**BASE, "workload": fine}))
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists()


def test_an_e2el_bound_alone_defines_goodput_as_vllm_bench_serve_counts_it() -> None:
    """`vllm bench serve --goodput e2el:5000` counts a request good when it ends within 5 s;
    the load generator counts every bound set the same way (tests/runners/test_loadgen.py)."""
    cfg = parse_study({**BASE, "slo": {"e2el_ms": 5000}, "objective": "goodput"})
    assert cfg.workload.slo.e2el_ms == 5000 and cfg.workload.slo.tpot_p99_ms is None
    with pytest.raises(ConfigError, match=r"objective goodput needs slo\.ttft_p99_ms, "
                                          r"slo\.tpot_p99_ms and/or slo\.e2el_ms\.$"):
        parse_study({**BASE, "slo": {}})


def test_every_bound_the_slo_section_takes_counts_towards_goodput() -> None:
    """One list says which bounds define goodput (`SLO.is_set`: the study, the load generator,
    the search, regress and the screen read it): a bound added to the section is in it."""
    assert SLO_BOUNDS == tuple(f.name for f in dataclasses.fields(SLO)) == \
        tuple(SLOSpec.model_fields)
    for name in SLO_BOUNDS:
        assert SLOSpec.model_validate({name: 5000.0}).is_set, name
    assert not SLOSpec().is_set


def test_a_level_longer_than_the_whole_wall_budget_is_refused_and_one_within_it_is_not(
) -> None:
    """8 requests at 0.0001 req/s plan ~22 h of arrivals (the day a level may take allows it):
    in a 2 h wall budget the trial can never end, so the study is refused, naming the level;
    the same level in a day's budget, or without one, and a short level in 2 h, start."""
    sparse = {"input_len": 64, "output_len": 16, "num_requests": 8,
              "levels": [{"concurrency": 8, "request_rate": 0.0001}]}
    with pytest.raises(ConfigError, match=r"workload\.levels\[0\]: 8 requests at 0\.0001 "
                       r"requests/s take 22\.2 h to send, over the study's whole "
                       r"budget\.wall_hours of 2 h; raise request_rate"):
        parse_study({**BASE, "workload": sparse, "budget": {"wall_hours": 2}})
    parse_study({**BASE, "workload": sparse, "budget": {"wall_hours": 23}})
    parse_study({**BASE, "workload": sparse, "budget": {"trials": 2}})
    parse_study({**BASE, "workload": {**sparse, "levels": [{"request_rate": 4}]},
                 "budget": {"wall_hours": 2}})
    with pytest.raises(ConfigError, match=r"workload\.duration_s: each level sends for 2\.0 h"):
        parse_study({**BASE, "workload": {**sparse, "num_requests": None, "duration_s": 7200},
                     "budget": {"wall_hours": 1}})
