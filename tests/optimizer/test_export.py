"""Export renders data, never code: hostile strings stay quoted in the shell launcher and plain
scalars in the YAML."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import optuna
import pytest
import yaml

from optimizer.config import parse_study
from optimizer.errors import ConfigError, NightshiftError
from optimizer.export import render, select_trial, trial_env

HOSTILE = "$(touch /tmp/nightshift-pwned); `id`; 'q\" \n"


def _study() -> tuple[optuna.Study, object]:
    cfg = parse_study({"name": "x", "model": {"path": "/models/my model; rm -rf ~"},
                       "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 50},
                       "env": {"VLLM_LOGGING_LEVEL": HOSTILE}})
    study = optuna.create_study(direction="maximize")
    for value, tpot in ((3.0, 30.0), (5.0, 60.0)):
        trial = study.ask()
        trial.suggest_categorical("max_num_seqs", [64, 256])
        trial.set_user_attr("record", {
            "state": "complete", "flags": {"max_num_seqs": 64, "enable_prefix_caching": False,
                                           "no_enable_prefix_caching": True},
            "env": {"VLLM_LOGGING_LEVEL": HOSTILE, "CUDA_VISIBLE_DEVICES": "3",
                    "HOME": "/root"},
            "metrics": {"p99_tpot_ms": tpot}, "conclusion": "new best.\nsecond line"})
        study.tell(trial, value)
    return study, cfg


def test_shell_launcher_quotes_every_user_string(tmp_path: Path) -> None:
    study, cfg = _study()
    text = render(select_trial(study, cfg), cfg, "sh")
    script = tmp_path / "serve.sh"
    script.write_text(text.replace("exec vllm serve", "exec printf '%s\\n'"))
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=True)
    args = out.stdout.splitlines()
    assert args[0] == "/models/my model; rm -rf ~", "the model path is one argument"
    assert not Path("/tmp/nightshift-pwned").exists(), "nothing in the env was executed"
    assert f"export VLLM_LOGGING_LEVEL={shlex.quote(HOSTILE)}" in text
    assert "CUDA_VISIBLE_DEVICES" not in text and "HOME" not in text, \
        "placement and non-engine variables are not exported"


def test_yaml_export_is_plain_data_and_never_false() -> None:
    study, cfg = _study()
    text = render(select_trial(study, cfg), cfg, "yaml")
    data = yaml.safe_load(text)
    assert data["max-num-seqs"] == 64
    assert data["no-enable-prefix-caching"] is True
    assert False not in data.values()
    assert "!!python" not in text
    assert all(line.startswith("#") or ":" in line for line in text.splitlines() if line)


def test_env_export_and_pareto_choice() -> None:
    study, cfg = _study()
    assert trial_env({"NCCL_P2P_DISABLE": "0", "PATH": "/bin"}) == \
        {"NCCL_P2P_DISABLE": "0"}
    chosen = select_trial(study, cfg, max_tpot_ms=40)
    assert chosen.values == [3.0], "the best trial within the TPOT limit, not the best overall"
    with pytest.raises(ConfigError, match="no complete trial has a TPOT p99 that low"):
        select_trial(study, cfg, max_tpot_ms=1)
    with pytest.raises(ConfigError, match="--format"):
        render(chosen, cfg, "toml")
    with pytest.raises(ConfigError, match="--trial 9: no such trial"):
        select_trial(study, cfg, number=9)
    empty = optuna.create_study()
    with pytest.raises(NightshiftError, match="no complete trial yet"):
        select_trial(empty, cfg)


def _grid_study(values: dict[str, float], constraints: dict[str, float] | None = None
                ) -> tuple[optuna.Study, object]:
    """The H200 grid's shape: the defaults, then configs named by their changes."""
    cfg = parse_study({"name": "g", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 4},
                       "slo": {"tpot_p99_ms": 10}})
    study = optuna.create_study(direction="maximize")
    dists = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"]),
             "max_num_batched_tokens": optuna.distributions.CategoricalDistribution([8192, 2048])}
    configs = {"defaults": {}, "fp8": {"quantization": "fp8"},
               "fp8+2048": {"quantization": "fp8", "max_num_batched_tokens": 2048},
               "2048": {"max_num_batched_tokens": 2048}}
    for name, value in values.items():
        params = {"quantization": "none", "max_num_batched_tokens": 8192, **configs[name]}
        attrs = {"record": {"state": "complete", "params": params, "flags": configs[name],
                            "metrics": {}, "conclusion": name}}
        if name == "defaults":
            attrs["baseline"] = True
        c = (constraints or {}).get(name)
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, value=value, user_attrs=attrs,
            constraints={"slo": c} if c is not None else None))
    return study, cfg


def test_export_recommends_the_fewest_changes_within_noise_of_the_best() -> None:
    from optimizer.export import choice_note
    from optimizer.results.recommendation import best_trial, recommended_trial

    # Measured on the H200 (study h200-grid): fp8 38.64, fp8 + a 2048-token budget 38.81.
    study, cfg = _grid_study({"defaults": 29.3, "fp8": 38.64, "fp8+2048": 38.81})
    assert best_trial(study).number == 2
    chosen = select_trial(study, cfg)
    assert chosen.number == 1, "the budget change is noise: it is not shipped"
    note = choice_note(study, chosen)
    assert "within 2% of the best measured (trial 2" in note and "--trial 2" in note
    assert note in render(chosen, cfg, "yaml", note=note)
    assert select_trial(study, cfg, number=2).number == 2, "--trial still exports the best"

    # A change that beats noise is kept; the defaults win when nothing beats them.
    study, _ = _grid_study({"defaults": 29.3, "fp8": 38.0, "fp8+2048": 38.81})
    assert recommended_trial(study).number == 2
    study, _ = _grid_study({"defaults": 29.3, "2048": 29.5})
    assert recommended_trial(study).number == 0, "the defaults are within noise of the best"
    # A candidate that misses the SLO (constraint > 0) never replaces a best that meets it.
    study, _ = _grid_study({"defaults": 29.3, "fp8": 38.64, "fp8+2048": 38.81},
                           constraints={"defaults": 1.0, "fp8": 1.0, "fp8+2048": -1.0})
    assert recommended_trial(study).number == 2


def test_recommendation_counts_only_changes_vllm_would_run_with() -> None:
    """An explicit value equal to vLLM's default on the study's host, or a capture size that
    eager mode makes moot, is no flag changed: the recommendation does not pay for it."""
    from optimizer.results.recommendation import recommended_trial
    from optimizer.results.trial_record import STUDY_ATTR_VLLM_DEFAULTS

    study = optuna.create_study(direction="maximize")
    study.set_user_attr(STUDY_ATTR_VLLM_DEFAULTS, {"max_num_seqs": 1024, "quantization": "none",
                                                   "kv_cache_dtype": "auto"})
    dists = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"]),
             "kv_cache_dtype": optuna.distributions.CategoricalDistribution(["auto", "fp8"]),
             "max_num_seqs": optuna.distributions.CategoricalDistribution([256, 1024])}
    for params, value, baseline in (
            ({"quantization": None, "kv_cache_dtype": None, "max_num_seqs": None}, 29.3, True),
            ({"quantization": "fp8", "kv_cache_dtype": "fp8", "max_num_seqs": None}, 38.8, False),
            # one change in what vLLM runs: 1024 is the H200's own max_num_seqs
            ({"quantization": "fp8", "kv_cache_dtype": None, "max_num_seqs": 1024}, 38.6, False)):
        attrs: dict[str, object] = {"record": {"state": "complete", "params": params,
                                               "metrics": {}}}
        if baseline:
            attrs["baseline"] = True
        set_ = {k: v for k, v in params.items() if v is not None}
        study.add_trial(optuna.trial.create_trial(
            params=set_, distributions={k: dists[k] for k in set_}, value=value,
            user_attrs=attrs))
    assert recommended_trial(study).number == 2, \
        "max_num_seqs at the host's default is no change; fp8 KV within noise is one"


def test_report_headline_names_the_recommendation() -> None:
    from optimizer.report import build_report, headline

    study, cfg = _grid_study({"defaults": 29.3, "fp8": 38.64, "fp8+2048": 38.81})
    text = headline(build_report(study, cfg, with_importances=False))
    assert text.startswith("Best: trial 2 (quantization=fp8, max_num_batched_tokens=2048)")
    assert "Recommended: trial 1 (quantization=fp8), 38.6 req/s: within 2% of the best" in text


def _deploy_study(model: dict[str, object], **spec: object) -> tuple[optuna.Study, object]:
    """One complete trial measured the way the quickstart measures: dummy weights, no
    tokenizer, a fixed flag; its record holds the flags the trial ran with."""
    cfg = parse_study({"name": "d", "model": model, "budget": {"trials": 2},
                       "slo": {"tpot_p99_ms": 10}, **spec})
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    ran = {"quantization": "fp8", **cfg.engine_fixed_flags}  # the daemon records what ran
    trial.set_user_attr("record", {"state": "complete", "flags": ran,
                                   "env": {}, "metrics": {}, "conclusion": "new best."})
    study.tell(trial, 30.0)
    return study, cfg


def test_export_of_a_bundled_shape_names_the_checkpoint_it_stands_for() -> None:
    from runners.model_info import BUNDLED_CHECKPOINTS, bundled_shapes

    assert set(BUNDLED_CHECKPOINTS) == set(bundled_shapes()), "every bundled shape names one"
    study, cfg = _deploy_study({"path": "qwen2.5-7b", "load_format": "dummy",
                                "skip_tokenizer_init": True})
    trial = select_trial(study, cfg)
    text = render(trial, cfg, "yaml")
    assert "# run: vllm serve Qwen/Qwen2.5-7B-Instruct --config THIS_FILE" in text
    assert "bundled shape 'qwen2.5-7b'" in text and "stands for Qwen/Qwen2.5-7B-Instruct" in text
    assert "--config serve.yaml" in render(trial, cfg, "yaml", path=Path("serve.yaml"))
    for fmt in ("yaml", "sh", "env"):
        assert "model_configs" not in render(trial, cfg, fmt), \
            f"{fmt}: no path into nightshift's checkout"
    assert "exec vllm serve Qwen/Qwen2.5-7B-Instruct --quantization fp8" in \
        render(trial, cfg, "sh")


def test_export_serves_the_model_as_the_user_gave_it() -> None:
    for given in ("Qwen/Qwen2.5-7B-Instruct", "/models/qwen-7b"):
        study, cfg = _deploy_study({"path": given})
        text = render(select_trial(study, cfg), cfg, "sh")
        assert f"exec {shlex.join(['vllm', 'serve', given])} --quantization fp8" in text
        assert "bundled shape" not in text


def test_export_has_a_served_name_only_where_the_study_set_one() -> None:
    study, cfg = _deploy_study({"path": "Qwen/Qwen2.5-7B-Instruct"})
    chosen = select_trial(study, cfg)
    assert "served-model-name" not in yaml.safe_load(render(chosen, cfg, "yaml")), \
        "nightshift's internal name `model` is not deployed"
    assert "--served-model-name" not in render(chosen, cfg, "sh")
    study, cfg = _deploy_study({"path": "Qwen/Qwen2.5-7B-Instruct",
                                "served_model_name": "chat"})
    assert yaml.safe_load(render(select_trial(study, cfg), cfg, "yaml"))[
        "served-model-name"] == "chat"


def test_export_keeps_fixed_flags_and_extra_args_but_not_benchmark_artefacts() -> None:
    """The fixed flags the trial ran with come from its record, not from today's study file."""
    study, cfg = _deploy_study({"path": "qwen2.5-7b", "load_format": "dummy",
                                "skip_tokenizer_init": True},
                               fixed_flags={"max_model_len": 4096},
                               vllm={"extra_args": ["--enable-log-requests"]})
    chosen = select_trial(study, cfg)
    data = yaml.safe_load(render(chosen, cfg, "yaml"))
    assert data == {"quantization": "fp8", "max-model-len": 4096}, \
        "the trial's change and the fixed flag; no dummy weights, no tokenizer skip"
    sh = render(chosen, cfg, "sh")
    assert "--max-model-len 4096 --enable-log-requests" in sh
    assert "--load-format" not in sh and "--skip-tokenizer-init" not in sh
    assert "--enable-log-requests" in render(chosen, cfg, "yaml"), "extra_args on the run line"


def test_env_export_writes_the_variables_or_says_none_are_needed(tmp_path: Path) -> None:
    study, cfg = _deploy_study({"path": "Qwen/Qwen2.5-7B-Instruct"})
    text = render(select_trial(study, cfg), cfg, "env")
    assert "# environment: none needed" in text
    assert all(line.startswith("#") for line in text.splitlines())
    study, cfg = _study()
    text = render(select_trial(study, cfg), cfg, "env")
    assert text.endswith(f"\nVLLM_LOGGING_LEVEL={shlex.quote(HOSTILE)}\n"), \
        "the one engine variable, quoted; placement and non-engine variables left out"
    env_file = tmp_path / "vllm.env"
    env_file.write_text(text)
    out = subprocess.run(["bash", "-c", 'set -a; . "$1"; printf %s "$VLLM_LOGGING_LEVEL"', "-",
                          str(env_file)], capture_output=True, text=True, check=True)
    assert out.stdout == HOSTILE, "the file sources back to the exact value"
    assert not Path("/tmp/nightshift-pwned").exists()


# -- what the header states and what the launch carries (issue 34) --------------------------


def _morning_study(confirm: dict[str, object] | None = None,
                   fixed_flags: dict[str, object] | None = None
                   ) -> tuple[optuna.Study, object]:
    """The quickstart's shape on the simulated engine: the defaults, a trial that sets CUDA
    graphs off (measured as free: the model prices graphs only in decode-only batches), an fp8
    one with gpu_memory_utilization at vLLM's own 0.92 on this host, and the fp8 one without
    its block size; the stored fingerprint as `start` keeps it."""
    from optimizer.results.trial_record import STUDY_ATTR_FINGERPRINT, STUDY_ATTR_VLLM_DEFAULTS
    from optimizer.run.engine_choice import simulated_hardware
    from optimizer.tuning_memory.fingerprint_of import fingerprint_of
    from runners.model_info import load_model_info

    cfg = parse_study({"name": "m", "engine": "simulated",
                       "model": {"path": "qwen2.5-7b", "load_format": "dummy",
                                 "skip_tokenizer_init": True},
                       "workload": {"input_len": 512, "output_len": 128,
                                    "levels": [{"concurrency": 8}, {"concurrency": 32}]},
                       "budget": {"trials": 4}, "slo": {"ttft_p99_ms": 1000, "tpot_p99_ms": 10},
                       **({"fixed_flags": fixed_flags} if fixed_flags else {})})
    fp = fingerprint_of(cfg, engine="simulated", engine_version="simulated 0.26.0",
                        hardware=simulated_hardware("h200", 2),
                        model=load_model_info("qwen2.5-7b"))
    study = optuna.create_study(direction="maximize")
    study.set_user_attr(STUDY_ATTR_FINGERPRINT, fp.to_dict())
    study.set_user_attr(STUDY_ATTR_VLLM_DEFAULTS, {"gpu_memory_utilization": 0.92,
                                                   "quantization": "none", "block_size": None,
                                                   "cudagraph_mode": "FULL_AND_PIECEWISE"})
    if confirm is not None:
        study.set_user_attr("confirm", confirm)
    cat = optuna.distributions.CategoricalDistribution
    dists = {"quantization": cat(["none", "fp8"]), "cudagraph_mode": cat(
        ["FULL_AND_PIECEWISE", "NONE"]), "gpu_memory_utilization": cat([0.92, 0.95]),
        "block_size": cat([16, 64])}
    flag_of = {"quantization": "quantization", "cudagraph_mode":
               "compilation_config.cudagraph_mode", "gpu_memory_utilization":
               "gpu_memory_utilization", "block_size": "block_size"}
    for params, value in (({}, 30.0), ({"quantization": "fp8", "cudagraph_mode": "NONE"}, 45.0),
                          ({"quantization": "fp8", "gpu_memory_utilization": 0.92,
                            "block_size": 64}, 40.0),
                          ({"quantization": "fp8", "gpu_memory_utilization": 0.92}, 39.9)):
        attrs: dict[str, object] = {"record": {
            "state": "complete", "params": params, "env": {}, "metrics": {},
            "flags": {flag_of[k]: v for k, v in params.items()},
            "conclusion": "fp8 vs the vLLM defaults: goodput 40 req/s, 1.33x the vLLM "
                          "defaults (one measurement each: no interval)."}}
        if not params:
            attrs["baseline"] = True
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: dists[k] for k in params}, value=value,
            user_attrs=attrs))
    return study, cfg


def test_export_never_ships_what_the_audit_calls_an_error(tmp_path: Path) -> None:
    from optimizer.cli import main
    from optimizer.results.recommendation import recommendation_note, recommended_trial

    study, cfg = _morning_study()
    chosen = recommended_trial(study)
    assert chosen.number == 3, "the CUDA-graphs-off trial (45) is never the recommendation"
    assert "calls an error" in recommendation_note(study, chosen)
    script = tmp_path / "s.sh"
    script.write_text(render(chosen, cfg, "sh", study=study))
    assert "cudagraph" not in script.read_text()
    assert main(["audit", "--from-file", str(script)]) == 0
    with pytest.raises(ConfigError, match=r"--trial 1: .*`nightshift audit` calls an error"):
        select_trial(study, cfg, number=1)
    from optimizer.report import build_report, headline

    text = headline(build_report(study, cfg, with_importances=False))
    assert "Recommended: trial 3" in text and "calls an error" in text, \
        "the report names the same trial, for the same reason"


def test_export_header_states_hardware_engine_workload_slo_gain_and_quality() -> None:
    study, cfg = _morning_study()
    text = render(study.trials[3], cfg, "yaml", study=study)
    head = [line for line in text.splitlines() if line.startswith("# ")]
    for start in ("# model: Qwen/Qwen2.5-7B-Instruct", "# gpus: 1 x NVIDIA H200",
                  "# vllm: none ran (the simulated engine models vLLM 0.26.0)",
                  "# engine: SIMULATED", "# workload: input fixed:512 tokens, output "
                  "fixed:128 tokens, levels:concurrency up to 32",
                  "# slo: TTFT p99 <= 1000 ms, TPOT p99 <= 10 ms",
                  "# gain: goodput 1.33x the vLLM defaults (one measurement each: no "
                  "interval); not confirmed", "# quality: skipped"):
        assert sum(line.startswith(start) for line in head) == 1, (start, head)
    assert "dummy weights" in text


def test_export_header_describes_a_trace_by_the_requests_it_replays(tmp_path: Path) -> None:
    """Not the unused input_len/output_len defaults (512/128) a trace study file leaves set."""
    from optimizer.results.trial_record import STUDY_ATTR_FINGERPRINT
    from optimizer.run.engine_choice import simulated_hardware
    from optimizer.tuning_memory.fingerprint_of import fingerprint_of

    (tmp_path / "t.jsonl").write_text(
        '{"timestamp": 0, "input_length": 100, "output_length": 20}\n'
        '{"timestamp": 0.5, "input_length": 900, "output_length": 200}\n')
    trace_cfg = parse_study({"name": "m", "engine": "simulated",
                             "model": {"path": "qwen2.5-7b", "load_format": "dummy"},
                             "workload": {"trace": {"path": "t.jsonl"}},
                             "budget": {"trials": 4}, "slo": {"tpot_p99_ms": 10}},
                            path=tmp_path / "s.yaml")
    fp = fingerprint_of(trace_cfg, engine="simulated", engine_version="simulated 0.26.0",
                        hardware=simulated_hardware("h200", 2), model=None)
    study, cfg = _morning_study()
    study.set_user_attr(STUDY_ATTR_FINGERPRINT, fp.to_dict())
    head = render(study.trials[3], cfg, "sh", study=study).splitlines()
    assert "# workload: trace t.jsonl: 2 requests, input 100-900 tokens (mean 500), output " \
        "20-200 (mean 110), at 2 req/s" in head, head


def test_the_confirmations_interval_wins_over_the_search_measurement() -> None:
    study, cfg = _morning_study(confirm={
        "objective": "goodput", "best_trial": 3, "baseline_trial": 0, "gain": 1.05,
        "ci_low": 0.18, "ci_high": 5.8, "ratios": [1.2, 0.9], "is_confirmed": False})
    text = render(study.trials[3], cfg, "sh", study=study)
    gain = next(line for line in text.splitlines() if line.startswith("# gain: "))
    assert "1.05x the vLLM defaults (95% CI [0.18x, 5.80x] over 2 rounds); not confirmed" \
        in gain and "1.33x" not in gain



def test_a_simulated_confirmation_is_never_called_confirmed_in_the_header() -> None:
    """Defect 7 (session 13): the simulated engine's repeats, however tight, confirm
    nothing: the gain line gives their figures and says they are a model's repeats."""
    from optimizer.results.confirmation import SIMULATED_VERDICT, confirm_summary

    study, cfg = _morning_study(confirm=confirm_summary(
        "goodput", 3, 0, [{"defaults": 30.0, "best": 39.9}] * 2, is_simulated=True))
    text = render(study.trials[3], cfg, "yaml", study=study)
    gain = next(line for line in text.splitlines() if line.startswith("# gain: "))
    assert gain == ("# gain: goodput 1.33x the vLLM defaults (95% CI [1.33x, 1.33x] over 2 "
                    "rounds); not confirmed (re-run interleaved with the defaults on the "
                    f"simulated engine: {SIMULATED_VERDICT})"), gain
    assert "; confirmed" not in text


def test_the_header_states_a_trace_rate_to_three_significant_digits() -> None:
    """Defect 20 (session 13): "up to 4.65483" (a trace's mean rate as stored)."""
    from optimizer.results.trial_record import STUDY_ATTR_FINGERPRINT
    from optimizer.tuning_memory.fingerprint import rounded_load

    study, cfg = _morning_study()
    fp = dict(study.user_attrs[STUDY_ATTR_FINGERPRINT])
    # as a fingerprint stored before its workload was described in words
    study.set_user_attr(STUDY_ATTR_FINGERPRINT, {**fp, "peak_load": 4.65483,
                                                 "workload_text": None})
    text = render(study.trials[3], cfg, "yaml", study=study)
    assert "up to 4.65" in text and "4.654" not in text
    assert [rounded_load(v) for v in (32.0, 1024.0, 4.65483, 1234.5, 0.123456)] == \
        ["32", "1024", "4.65", "1230", "0.123"], "a count whole, a rate to 3 digits"


def test_export_leaves_out_flags_at_vllms_default_and_minimal_says_what_it_dropped() -> None:
    study, cfg = _morning_study()
    trial = study.trials[2]  # fp8, gpu_memory_utilization 0.92 (the host's own), block 64
    data = yaml.safe_load(render(trial, cfg, "yaml", study=study))
    assert data == {"quantization": "fp8", "block-size": 64}
    text = render(trial, cfg, "yaml", study=study, minimal=True)
    assert yaml.safe_load(text) == {"quantization": "fp8"}
    assert "# --minimal dropped block_size: trial 3 ran without it (vLLM's default) and " \
           "measured 39.9 vs 40: within 2%" in text
    assert "left out, as vLLM's own value on the study's host: --gpu-memory-utilization" \
        in text


def test_export_names_a_secret_variable_and_never_writes_its_value(tmp_path: Path) -> None:
    cfg = parse_study({"name": "x", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 1},
                       "slo": {"tpot_p99_ms": 50}})
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    # A record written before secrets were redacted at the runner.
    trial.set_user_attr("record", {"state": "complete", "flags": {},
                                   "env": {"VLLM_S3_SECRET_KEY": "s3cr3t-value",
                                           "VLLM_LOGGING_LEVEL": "INFO"},
                                   "metrics": {}, "conclusion": ""})
    study.tell(trial, 1.0)
    chosen = select_trial(study, cfg)
    for fmt in ("sh", "env", "yaml"):
        text = render(chosen, cfg, fmt)
        assert "s3cr3t-value" not in text, f"the {fmt} export never writes a secret's value"
        assert "VLLM_S3_SECRET_KEY" in text, f"the {fmt} export names the variable to set"
    sh = render(chosen, cfg, "sh")
    script = tmp_path / "serve.sh"
    script.write_text(sh.replace("exec vllm serve", "exec printf '%s\\n'"))
    unset = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                           env={"PATH": "/usr/bin:/bin"})
    assert unset.returncode != 0 and "VLLM_S3_SECRET_KEY" in unset.stderr, \
        "the launcher stops, naming the secret, where it is not set"


# -- the export renders the launch that ran (issue 33) ---------------------------------------


def _launched_study(ran: dict[str, object], today: dict[str, object]
                    ) -> tuple[optuna.Study, object]:
    """One complete trial whose record holds the argv `VllmLauncher` built for the study as
    it was (`ran`), exported under the study file as it is now (`today`)."""
    from runners.base import EngineConfig
    from runners.vllm.launcher import VllmLauncher

    config = EngineConfig(model="/models/qwen", flags={
        "quantization": "fp8", "enable_prefix_caching": False,
        "compilation_config": {"cudagraph_mode": "NONE"}, "cudagraph_capture_sizes": [1, 2]},
        **ran)  # type: ignore[arg-type]
    argv, env = VllmLauncher(vllm_version="0.26.0").command(config, 8123, Path("/tmp/w"), None)
    cfg = parse_study({"name": "d", "model": {"path": "Qwen/Qwen2.5-7B-Instruct"},
                       "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 10}, **today})
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    trial.set_user_attr("record", {"state": "complete", "flags": dict(config.flags),
                                   "argv": argv, "env": env, "metrics": {},
                                   "conclusion": "new best."})
    study.tell(trial, 30.0)
    return study, cfg


def test_export_takes_extra_args_served_name_and_weights_from_the_argv_that_ran() -> None:
    study, cfg = _launched_study(
        {"served_model_name": "chat", "load_format": "dummy",
         "extra_args": ("--enable-log-requests", "--max-log-len", "100")},
        {"vllm": {"extra_args": ["--disable-log-stats"]}})
    chosen = select_trial(study, cfg)
    sh = render(chosen, cfg, "sh")
    exec_line = next(line for line in sh.splitlines() if line.startswith("exec "))
    assert exec_line.endswith("--enable-log-requests --max-log-len 100 \"$@\""), \
        "the extra args that ran, last, as they ran"
    assert "--disable-log-stats" not in sh, "today's study file's extra_args did not run"
    assert "--served-model-name chat" in exec_line, "the served name the engine was given"
    assert "--no-enable-prefix-caching" in exec_line and "--cudagraph-capture-sizes 1 2" in \
        exec_line, "the config's flags, from the record"
    for word in ("--host", "--port", "--load-format", "--enable-mfu-metrics"):
        assert word not in exec_line, f"{word}: the launcher's, not the deployment's"
    assert "measured with dummy weights" in sh, "dummy weights read from the argv"
    data = yaml.safe_load(render(chosen, cfg, "yaml"))
    assert data["served-model-name"] == "chat" and "load-format" not in data


def test_export_of_a_record_without_argv_says_its_extra_args_are_todays() -> None:
    study, cfg = _deploy_study({"path": "Qwen/Qwen2.5-7B-Instruct"},
                               vllm={"extra_args": ["--enable-log-requests"]})
    text = render(select_trial(study, cfg), cfg, "sh")
    assert "--enable-log-requests" in text
    assert "vllm.extra_args from today's study file (the trial's record holds no vllm serve " \
           "command line)" in text


def test_export_never_writes_a_secret_flag_value_of_the_argv_that_ran() -> None:
    study, cfg = _launched_study({"extra_args": ("--hf-token", "hf_secret_value")}, {})
    for fmt in ("sh", "yaml"):
        text = render(select_trial(study, cfg), cfg, fmt)
        assert "hf_secret_value" not in text and "--hf-token '<redacted>'" in text, fmt


# -- no trial met the SLO; the confirmation's noise; what --trial may name (session 13) ---------


def _unmet_study(tmp_path: Path | None = None) -> tuple[optuna.Study, object]:
    """The explore check's impossible SLO (TTFT 6 ms, TPOT 1.5 ms at concurrency 64): three
    trials, none met it anywhere (goodput 0, a violated SLO constraint); trial 1 came closest
    (TPOT p99 22.7 ms). With `tmp_path`, stored where `write_study`'s file points."""
    from tests.builders import study_dict

    spec = {"name": "x", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 3},
            "slo": {"ttft_p99_ms": 6, "tpot_p99_ms": 1.5}}
    if tmp_path is not None:
        spec = study_dict(tmp_path, name="x", trials=3, slo=spec["slo"])
    cfg = parse_study(spec)
    storage = f"sqlite:///{tmp_path}/results/optuna.db" if tmp_path is not None else None
    if tmp_path is not None:
        (tmp_path / "results").mkdir()
    study = optuna.create_study(direction="maximize", storage=storage, study_name="x")
    dist = optuna.distributions.CategoricalDistribution(["none", "fp8"])
    for quantization, tpot in (("none", 29.5), ("fp8", 22.7), ("none", 25.0)):
        attrs: dict[str, object] = {"record": {
            "state": "complete", "params": {"quantization": quantization},
            "flags": {"quantization": quantization} if quantization != "none" else {},
            "metrics": {"p99_tpot_ms": tpot}, "conclusion": "missed",
            "steps": [{"metrics": {"completed": 64, "offered_concurrency": 64.0,
                                   "p99_ttft_ms": 5.0, "p99_tpot_ms": tpot}}]}}
        if not study.trials:
            attrs["baseline"] = True
        study.add_trial(optuna.trial.create_trial(
            params={"quantization": quantization}, distributions={"quantization": dist},
            value=0.0, user_attrs=attrs, constraints={"slo": 1.0}))
    return study, cfg


def test_a_study_where_no_trial_met_the_slo_recommends_nothing_and_says_the_closest_miss(
) -> None:
    from optimizer.cli.results import recommendation_text
    from optimizer.report import build_report, headline
    from optimizer.results.recommendation import no_slo_met, recommended_trial

    study, cfg = _unmet_study()
    slo = cfg.spec.slo.model_dump()
    assert recommended_trial(study) is None, "a config that met the SLO nowhere is no pick"
    line = no_slo_met(study, slo)
    assert line is not None and line.startswith(
        "no trial met the SLO (closest: trial 1 at concurrency 64, TPOT p99 22.7 ms against "
        "1.5 ms)"), line
    assert "relax the SLO or lighten the load" in line
    assert recommendation_text(study, cfg.objectives, slo) == line
    text = headline(build_report(study, cfg, with_importances=False))
    assert text.startswith("No trial met the SLO (closest: trial 1") and "Best:" not in text
    with pytest.raises(NightshiftError, match="no trial met the SLO") as refused:
        select_trial(study, cfg)
    assert not isinstance(refused.value, ConfigError), "the study's state, not bad input"
    with pytest.raises(NightshiftError, match="no trial met the SLO"):
        select_trial(study, cfg, max_tpot_ms=30)
    chosen = select_trial(study, cfg, number=1)  # asked for by number: exported, said so
    assert "# slo: MISSED: this trial met the SLO at no load it ran" in \
        render(chosen, cfg, "sh", study=study)
    # One trial that met it somewhere: recommended as before, no such line.
    study.add_trial(optuna.trial.create_trial(
        params={"quantization": "fp8"}, value=0.5, constraints={"slo": 0.0},
        distributions={"quantization": optuna.distributions.CategoricalDistribution(
            ["none", "fp8"])},
        user_attrs={"record": {"state": "complete", "params": {"quantization": "fp8"},
                               "flags": {"quantization": "fp8"}, "conclusion": "met"}}))
    assert no_slo_met(study, slo) is None and recommended_trial(study).number == 3


def test_export_of_a_study_where_no_trial_met_the_slo_exits_1_unless_a_trial_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.cli import main

    _unmet_study(tmp_path)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(__import__("tests.builders", fromlist=["x"]).study_dict(
        tmp_path, name="x", trials=3, slo={"ttft_p99_ms": 6, "tpot_p99_ms": 1.5})))
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(path), "-o", str(tmp_path / "a.yaml")]) == 1
    assert not (tmp_path / "a.yaml").exists()
    assert main(["export", str(path), "--trial", "1", "-o", str(tmp_path / "b.yaml")]) == 0
    assert main(["export", str(path), "--trial", "1", "--max-tpot-ms", "30"]) == 2


def test_trial_and_max_tpot_ms_together_are_refused() -> None:
    study, cfg = _study()
    with pytest.raises(ConfigError, match="--trial and --max-tpot-ms pick the trial two ways"):
        select_trial(study, cfg, number=0, max_tpot_ms=40)


def _noise(low: float | None, high: float | None) -> dict[str, object]:
    """A final confirmation of trial 3 against the defaults (trial 0), 1.05x over 2 rounds."""
    return {"objective": "goodput", "best_trial": 3, "baseline_trial": 0, "gain": 1.05,
            "ci_low": low, "ci_high": high, "ratios": [1.1, 1.0],
            "is_confirmed": low is not None and low > 1,
            "sentence": "trial 3 (the exported config) vs the defaults (trial 0), re-measured "
                        "interleaved: goodput 1.05x: not confirmed: within noise"}


def test_a_pick_the_confirmation_found_within_noise_recommends_and_exports_the_defaults(
) -> None:
    from optimizer.cli.results import recommendation_text
    from optimizer.export import choice_note
    from optimizer.report import build_report, headline
    from optimizer.results.recommendation import confirmation_sentence, recommended_trial

    study, cfg = _morning_study(confirm=_noise(0.97, 1.13))
    chosen = select_trial(study, cfg)
    assert chosen.number == 0, "the defaults, as docs/commands.md promises"
    note = choice_note(study, chosen)
    assert note.startswith("the vLLM defaults: the final confirmation re-measured the "
                           "search's pick, trial 3, against them: 1.05x the vLLM "
                           "defaults (95% CI [0.97x, 1.13x] over 2 rounds), not confirmed: "
                           "within noise"), note
    assert "`--trial 3` exports it" in note
    text = render(chosen, cfg, "sh", study=study, note=note)
    assert "# gain: none: this is the vLLM defaults; the final confirmation found the search's " \
           "pick, trial 3, within noise of them" in text
    assert "quantization" not in text.split("exec vllm serve")[1], "no flag of trial 3"
    assert recommendation_text(study, cfg.objectives).startswith("recommended: trial 0,")
    assert "Recommended: trial 0 (the vLLM defaults)" in \
        headline(build_report(study, cfg, with_importances=False))
    assert "(the exported config)" not in confirmation_sentence(study)
    assert select_trial(study, cfg, number=3).number == 3, "--trial still exports it"
    # Shown better: the pick stands; one round (no interval): it stands, not confirmed.
    for low, high in ((1.01, 1.13), (None, None)):
        study, _ = _morning_study(confirm=_noise(low, high))
        assert recommended_trial(study).number == 3, (low, high)
        assert "(the exported config)" in confirmation_sentence(study)


def test_trial_n_of_a_confirmation_run_is_refused_naming_the_trial_it_re_measured() -> None:
    study, cfg = _morning_study()
    for label, params, baseline in (("defaults", {}, True),
                                    ("best", {"quantization": "fp8",
                                              "gpu_memory_utilization": 0.92}, False)):
        attrs: dict[str, object] = {"confirm": label, "record": {
            "state": "complete", "params": params, "flags": {}, "conclusion": "re-measured"}}
        if baseline:
            attrs["baseline"] = True
        dists = {k: optuna.distributions.CategoricalDistribution([v]) for k, v in params.items()}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=dists,
                                                  value=31.0, user_attrs=attrs))
    with pytest.raises(ConfigError, match=r"--trial 4: a final confirmation run \(a "
                       r"re-measurement of the vLLM defaults, trial 0\)"):
        select_trial(study, cfg, number=4)
    with pytest.raises(ConfigError, match=r"--trial 5: .*re-measurement of trial 3\)"):
        select_trial(study, cfg, number=5)


def test_a_local_model_folder_exports_as_an_absolute_path_and_config_only_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.config import load_study

    here = tmp_path / "studies"
    (here / "mixtral").mkdir(parents=True)
    (here / "mixtral" / "config.json").write_text("{}")
    path = here / "s.yaml"
    path.write_text(yaml.safe_dump({"name": "d", "model": {"path": "mixtral"},
                                    "budget": {"trials": 2}, "slo": {"tpot_p99_ms": 10}}))
    monkeypatch.chdir(tmp_path)  # elsewhere: `mixtral` names no folder here
    cfg = load_study(path)
    study, _ = _deploy_study({"path": "mixtral"})
    text = render(select_trial(study, cfg), cfg, "sh")
    assert f"exec {shlex.join(['vllm', 'serve', str(here / 'mixtral')])} " in text
    assert "config only (the folder holds no weight files; the study measured dummy " \
           "weights): point this at the checkpoint" in text
    (here / "mixtral" / "model.safetensors").write_bytes(b"")
    text = render(select_trial(study, cfg), cfg, "sh")
    assert str(here / "mixtral") in text and "config only" not in text


def test_a_capacity_search_with_no_operating_point_met_the_slo_nowhere() -> None:
    """The explore check's capacity variant: a probe met the SLO in its 0 s window, the hold
    missed, so the trial had no operating point; it still ended "recommended: trial 0"."""
    from optimizer.results.recommendation import no_slo_met, recommended_trial

    cfg = parse_study({"name": "c", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
                       "slo": {"ttft_p99_ms": 300}})
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        value=0.0, constraints={"slo": 0.0}, user_attrs={"baseline": True, "record": {
            "state": "complete", "params": {}, "conclusion": "no operating point",
            "capacity": {"axis": "concurrency", "met_load": None, "missed_load": 128.0,
                         "status": "unresolved", "num_probes": 2, "held": False},
            "steps": [{"metrics": {"completed": 2, "offered_concurrency": 128.0,
                                   "p99_ttft_ms": 274.0}},
                      {"metrics": {"completed": 384, "offered_concurrency": 128.0,
                                   "p99_ttft_ms": 2529.0}}]}}))
    assert recommended_trial(study) is None
    assert "closest: trial 0 at concurrency 128, TTFT p99 2,529 ms against 300 ms" in \
        (no_slo_met(study, cfg.spec.slo.model_dump()) or "")


def test_the_end_of_a_study_where_no_trial_met_the_slo_offers_no_export_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from optimizer.cli.run import _no_slo_met
    from optimizer.config import load_study
    from tests.builders import study_dict

    _unmet_study(tmp_path)
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study_dict(
        tmp_path, name="x", trials=3, slo={"ttft_p99_ms": 6, "tpot_p99_ms": 1.5})))
    monkeypatch.chdir(tmp_path)
    assert _no_slo_met(load_study(path)), "the end lines print no 'export with' line"


def test_the_export_names_a_baseline_that_ran_fixed_flags_with_them() -> None:
    """The header's gain is its first mention of the baseline: with the flags it ran."""
    from optimizer.export import choice_note

    study, cfg = _morning_study(fixed_flags={"max_model_len": 4096})
    named = "the baseline (vLLM defaults + your fixed flags (max_model_len=4096))"
    gain = next(line for line in render(study.trials[3], cfg, "yaml", study=study).splitlines()
                if line.startswith("# gain: "))
    assert gain.startswith(f"# gain: goodput 1.33x {named} (one measurement each"), gain
    base = render(study.trials[0], cfg, "yaml", study=study)
    assert f"# gain: none: this is {named}" in base
    study, cfg = _morning_study(confirm=_noise(0.97, 1.13), fixed_flags={"max_model_len": 4096})
    note = choice_note(study, select_trial(study, cfg))
    assert note.startswith("the baseline (vLLM defaults + your fixed flags): the final "
                           "confirmation re-measured the search's pick, trial 3, against it: "
                           "1.05x the baseline (vLLM defaults + your fixed flags) (95% CI"), note
    assert "vLLM defaults:" not in note and "the vLLM defaults" not in note
