"""VllmLauncher: argv building, YAML export, start-up log parsing and failure classification,
on logs reconstructed from vLLM 0.26's own format strings (tests/fixtures/vllm_logs)."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest

from runners.base import EngineConfig, EngineLauncher, FailureReason
from runners.vllm.launcher import VllmLauncher, command_to_shell, config_to_yaml_dict
from runners.vllm.logs import classify_failure, parse_log

LOGS = Path(__file__).parents[1] / "fixtures" / "vllm_logs"


def load_log(name: str) -> str:
    """A fixture log without its provenance header (lines starting with '# ')."""
    text = (LOGS / name).read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("# "))


def build(flags: dict[str, object] | None = None, *, version: str = "0.26.0",
          profile_dir: Path | None = None, **config_kwargs: object
          ) -> tuple[list[str], dict[str, str]]:
    launcher = VllmLauncher(vllm_version=version, python="/usr/bin/python3")
    config = EngineConfig(model=str(config_kwargs.pop("model", "/models/qwen")),
                          flags=flags or {}, **config_kwargs)  # type: ignore[arg-type]
    return launcher.command(config, 8011, Path("/tmp/work"), profile_dir)


def flags_part(argv: list[str]) -> list[str]:
    """argv after the fixed prefix the launcher always emits, less the switch it adds on its
    own (`--enable-mfu-metrics`, tested on its own below)."""
    return [a for a in argv[argv.index("--load-format") + 2:] if a != "--enable-mfu-metrics"]


# ---------------------------------------------------------------------------------- argv


def test_launcher_satisfies_the_engine_launcher_protocol() -> None:
    launcher: EngineLauncher = VllmLauncher(vllm_version="0.26.0")
    assert launcher.name == "vllm"


def test_command_starts_with_module_serve_model_host_port_name_and_load_format() -> None:
    argv, _ = build(load_format="dummy", served_model_name="m")
    assert argv[:13] == ["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve",
                         "/models/qwen", "--host", "127.0.0.1", "--port", "8011",
                         "--served-model-name", "m", "--load-format", "dummy"]


@pytest.mark.parametrize(("flags", "expected"), [
    ({"max_num_seqs": 256}, ["--max-num-seqs", "256"]),
    ({"gpu_memory_utilization": 0.9}, ["--gpu-memory-utilization", "0.9"]),
    ({"enforce_eager": True}, ["--enforce-eager"]),
    ({"enforce_eager": False}, []),
    ({"enable_prefix_caching": False}, ["--no-enable-prefix-caching"]),
    ({"enable_chunked_prefill": False}, ["--no-enable-chunked-prefill"]),
    ({"enable_prefix_caching": True}, ["--enable-prefix-caching"]),
    ({"max_model_len": None}, []),
    ({"kv_cache_dtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
    ({"compilation_config": {"cudagraph_mode": "PIECEWISE"}},
     ["--compilation-config", '{"cudagraph_mode":"PIECEWISE"}']),
    ({"compilation_config.cudagraph_mode": "FULL"},
     ["--compilation-config.cudagraph_mode", "FULL"]),
    ({"cudagraph_capture_sizes": [1, 2, 4]}, ["--cudagraph-capture-sizes", "1", "2", "4"]),
    ({"attention_backend": "FLASHINFER"}, ["--attention-backend", "FLASHINFER"]),
])
def test_flags_become_kebab_case_arguments(flags: dict[str, object],
                                           expected: list[str]) -> None:
    argv, _ = build(flags)
    assert flags_part(argv) == expected, "snake_case flags convert at the process boundary"


def test_skip_tokenizer_init_and_extra_args_are_passed() -> None:
    argv, _ = build({"max_num_seqs": 8}, skip_tokenizer_init=True, extra_args=("-O3",))
    assert "--skip-tokenizer-init" in argv
    assert argv[-1] == "-O3", "extra_args go verbatim after the flags"


def test_reserved_flags_cannot_override_the_runner_port(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        argv, _ = build({"port": 9999, "host": "0.0.0.0"})
    assert argv.count("--port") == 1 and argv[argv.index("--port") + 1] == "8011"
    assert "0.0.0.0" not in argv
    assert "set by the launcher" in caplog.text


def test_model_path_with_spaces_and_metacharacters_stays_one_argv_element() -> None:
    model = "/models/my model; rm -rf $HOME"
    argv, _ = build({"served_model_name": "x"}, model=model)
    assert argv[4] == model
    assert shlex.split(command_to_shell(argv)) == argv, "the shell form round-trips exactly"


def test_profiler_config_flag_on_new_versions(tmp_path: Path) -> None:
    argv, env = build(profile_dir=tmp_path / "trace")
    i = argv.index("--profiler-config")
    assert json.loads(argv[i + 1]) == {
        "profiler": "torch", "torch_profiler_dir": str(tmp_path / "trace"),
        # Not read by the analysis, and slow to export (54 s of a 3 s window on the H200).
        "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False,
        "ignore_frontend": True}
    assert "VLLM_TORCH_PROFILER_DIR" not in env


def test_every_profiler_config_key_is_a_field_of_vllm_0_26s_profiler_config(
        tmp_path: Path) -> None:
    # ProfilerConfig forbids unknown keys: a misspelt one would fail every profiled start.
    fields = json.loads((Path(__file__).parents[1] / "fixtures" /
                         "vllm_0.26.0_profiler_config_fields.json").read_text())["fields"]
    argv, _ = build(profile_dir=tmp_path, version="0.26.0")
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert set(config) <= set(fields)
    assert all(fields[key] == "bool" for key in config if isinstance(config[key], bool))


def test_profiler_config_keys_beyond_the_dir_only_where_they_were_read(tmp_path: Path) -> None:
    argv, _ = build(profile_dir=tmp_path, version="0.20.1")
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert config == {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}, \
        "ProfilerConfig refuses unknown keys: an older vLLM gets only what it has always had"


def test_profiler_env_on_versions_before_0_16(tmp_path: Path) -> None:
    argv, env = build(profile_dir=tmp_path, version="0.10.1.1")
    assert "--profiler-config" not in argv
    assert env["VLLM_TORCH_PROFILER_DIR"] == str(tmp_path)
    assert env["VLLM_TORCH_PROFILER_WITH_STACK"] == "0"


def test_attention_backend_goes_to_env_before_0_11() -> None:
    argv, env = build({"attention_backend": "FLASHINFER"}, version="0.10.2")
    assert "--attention-backend" not in argv
    assert env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"


def test_attention_env_var_from_config_is_passed_but_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        _, env = build(env={"VLLM_ATTENTION_BACKEND": "FLASHINFER"})
    assert env["VLLM_ATTENTION_BACKEND"] == "FLASHINFER"
    assert "silently ignored" in caplog.text


def test_cache_root_and_dev_mode_env(tmp_path: Path, clean_environ: dict[str, str]) -> None:
    launcher = VllmLauncher(vllm_version="0.26.0", cache_root=tmp_path / "cache", dev_mode=True)
    _, env = launcher.command(EngineConfig(model="m", env={"NCCL_DEBUG": "WARN"}), 8000,
                              tmp_path, None)
    assert env == {"VLLM_CACHE_ROOT": str(tmp_path / "cache"), "VLLM_SERVER_DEV_MODE": "1",
                   "NCCL_DEBUG": "WARN"}


def test_version_defaults_to_0_26_without_vllm_installed() -> None:
    try:
        import importlib.metadata as md

        md.version("vllm")
    except md.PackageNotFoundError:
        assert VllmLauncher().vllm_version == "0.26.0"
    else:
        pytest.skip("vllm is installed here")


# ---------------------------------------------------------------------------------- YAML


def test_yaml_export_never_contains_false() -> None:
    config = EngineConfig(model="m", load_format="dummy", skip_tokenizer_init=True, flags={
        "enable_prefix_caching": False, "enforce_eager": False, "max_num_seqs": 64,
        "max_model_len": None,
        "compilation_config": {"cudagraph_mode": "FULL"}})  # type: ignore[dict-item]
    data = config_to_yaml_dict(config)
    assert False not in data.values(), "vLLM drops a YAML false silently"
    assert data == {"load-format": "dummy", "served-model-name": "model",
                    "skip-tokenizer-init": True, "no-enable-prefix-caching": True,
                    "max-num-seqs": 64, "compilation-config": '{"cudagraph_mode":"FULL"}'}


# ---------------------------------------------------------------------------------- logs


def test_parse_healthy_flash_attn_start_with_cuda_graphs() -> None:
    info = parse_log(load_log("healthy_flash_attn_graphs.log"))
    assert info.attention_backend == "FLASH_ATTN"
    assert info.engine_version == "0.26.0"
    assert info.kv_cache_tokens == 1_932_336
    assert info.kv_cache_gib == pytest.approx(103.20)
    assert info.max_model_len == 4096
    assert info.max_concurrency_at_max_len == pytest.approx(471.76)
    assert info.model_memory_gib == pytest.approx(14.29)
    assert info.model_load_s == pytest.approx(3.912184)
    assert info.graph_capture_s == 8 and info.graph_memory_gib == pytest.approx(0.58)
    assert info.init_engine_s == pytest.approx(80.12)
    assert info.compile_s == pytest.approx(53.51)


def test_parse_eager_start_has_no_graph_or_compile_figures() -> None:
    info = parse_log(load_log("eager.log"))
    assert info.kv_cache_tokens == 1_932_336, "separate KV size/concurrency lines parse too"
    assert info.max_concurrency_at_max_len == pytest.approx(471.76)
    assert info.init_engine_s == pytest.approx(8.71)
    assert info.compile_s is None and info.graph_capture_s is None
    assert info.engine_version == "0.26.0"


@pytest.mark.parametrize("line", [
    "INFO 03-11 06:17:30 [gpu_model_runner.py:1] Model loading took 14.9888 GiB and 4.21 seconds",
    "(EngineCore_DP0 pid=1) INFO 12-02 13:20:01 [x.py:2] Model loading took 14.99 GiB memory and "
    "4.21 seconds",
])
def test_parse_model_loading_old_and_new_wording(line: str) -> None:
    info = parse_log(line)
    assert info.model_memory_gib == pytest.approx(14.99, abs=0.01)
    assert info.model_load_s == pytest.approx(4.21)


def test_parse_negative_kv_memory_and_torch_compile_total() -> None:
    info = parse_log(load_log("kv_cache_oom.log"))
    assert info.kv_cache_gib == pytest.approx(-0.43), "a negative budget is kept, not dropped"
    assert info.compile_s == pytest.approx(48.20)
    assert info.kv_cache_tokens is None


def test_parse_old_backend_wording_and_empty_log() -> None:
    assert parse_log("INFO Using Flash Attention backend on V1 engine.").attention_backend == \
        "FLASH_ATTN"
    assert parse_log("") == parse_log("nothing to see"), "an empty log gives an empty EngineInfo"


# ---------------------------------------------------------------------------------- failures


@pytest.mark.parametrize(("name", "returncode", "reason", "in_message"), [
    ("kv_cache_oom.log", 1, FailureReason.OOM_AT_START, "gpu_memory_utilization"),
    ("max_seq_len_too_large.log", 1, FailureReason.KV_CACHE_TOO_SMALL, "93952"),
    ("graph_capture_oom.log", 1, FailureReason.CUDA_GRAPH_CAPTURE, "CUDA out of memory"),
    ("unsupported_fp8_ampere.log", 1, FailureReason.UNSUPPORTED_CONFIG, "kv_cache_dtype"),
    ("unrecognized_argument.log", 2, FailureReason.INVALID_ARGUMENT, "--cuda-graph-sizes"),
    ("port_in_use.log", 1, FailureReason.PORT_IN_USE, "port"),
])
def test_classify_failure_on_fixture(name: str, returncode: int, reason: FailureReason,
                                     in_message: str) -> None:
    failure = classify_failure(load_log(name), returncode, "startup")
    assert failure.reason is reason
    assert in_message in failure.message
    assert failure.message.endswith("."), "a message is one sentence"
    assert failure.log_excerpt, "the deciding lines come with the failure"


def test_kv_too_small_message_names_the_numbers() -> None:
    failure = classify_failure(load_log("max_seq_len_too_large.log"), 1, "startup")
    assert failure.message == ("max_model_len 131072 needs 16.00 GiB of KV cache but only "
                               "11.47 GiB is available; lower max_model_len to at most 93952 "
                               "or raise gpu_memory_utilization.")


def test_kv_too_small_old_wording() -> None:
    log = ("ValueError: The model's max seq len (32768) is larger than the maximum number of "
           "tokens that can be stored in KV cache (20480). Try increasing ...")
    failure = classify_failure(log, 1, "startup")
    assert failure.reason is FailureReason.KV_CACHE_TOO_SMALL
    assert "20,480" in failure.message


def test_excerpt_holds_the_matched_line() -> None:
    failure = classify_failure(load_log("port_in_use.log"), 1, "startup")
    assert "[Errno 98] Address already in use" in failure.log_excerpt
    assert failure.is_retryable


def test_free_memory_below_utilization_is_oom_at_start_with_numbers() -> None:
    log = ("(EngineCore_DP0 pid=3) ValueError: Free memory on device cuda:0 (34.34/139.80 GiB) "
           "on startup is less than desired GPU memory utilization (0.9, 125.82 GiB). Decrease "
           "GPU memory utilization or reduce GPU memory used by other processes.")
    failure = classify_failure(log, 1, "startup")
    assert failure.reason is FailureReason.OOM_AT_START
    assert "34.34 of 139.80 GiB" in failure.message


def test_cuda_oom_outside_graph_capture_is_oom_at_start() -> None:
    log = load_log("graph_capture_oom.log").replace("Capturing CUDA graphs", "Warming up")
    assert classify_failure(log, 1, "startup").reason is FailureReason.OOM_AT_START


def test_oom_after_graph_capture_finished_is_not_blamed_on_capture() -> None:
    log = load_log("healthy_flash_attn_graphs.log") + (
        "\n(EngineCore_DP0 pid=4188) ERROR torch.OutOfMemoryError: CUDA out of memory.")
    failure = classify_failure(log, 1, "run")
    assert failure.reason is FailureReason.CRASH_MID_RUN
    assert "out of GPU memory while serving" in failure.message


def test_benign_error_level_lines_do_not_make_a_start_unsupported() -> None:
    # vLLM logs this at ERROR on healthy starts of pre-Ampere GPUs; only a raised exception
    # line may decide UNSUPPORTED_CONFIG.
    log = ("(EngineCore pid=589) ERROR 03-22 10:54:27 [fa_utils.py:145] Cannot use FA version 2 "
           "is not supported due to FA2 is only supported on devices with compute capability "
           ">= 8\n(EngineCore pid=589) RuntimeError: NCCL error: unhandled system error")
    failure = classify_failure(log, 1, "startup")
    assert failure.reason is FailureReason.STARTUP_CRASH
    assert "NCCL error" in failure.message


def test_unknown_crash_names_exit_code_and_root_error_not_the_wrapper() -> None:
    failure = classify_failure(
        "(EngineCore_DP0 pid=1) KeyError: 'model.layers.0.mlp.gate_proj.weight'\n"
        "(APIServer pid=2) RuntimeError: Engine core initialization failed. See root cause "
        "above. Failed core proc(s): {}", 1, "startup")
    assert failure.reason is FailureReason.STARTUP_CRASH
    assert "code 1" in failure.message and "KeyError" in failure.message


def test_mid_run_kill_names_the_signal() -> None:
    failure = classify_failure("INFO:     Application startup complete.", -9, "run")
    assert failure.reason is FailureReason.CRASH_MID_RUN
    assert "SIGKILL" in failure.message


def test_invalid_choice_is_invalid_argument() -> None:
    log = ("usage: vllm serve [model_tag] [options]\nvllm serve: error: argument "
           "--kv-cache-dtype: invalid choice: 'fp4' (choose from auto, bfloat16, fp8)")
    failure = classify_failure(log, 2, "startup")
    assert failure.reason is FailureReason.INVALID_ARGUMENT
    assert "--kv-cache-dtype" in failure.message


def test_no_valid_backend_is_unsupported() -> None:
    log = ("ValueError: No valid attention backend found for cuda with AttentionSelectorConfig("
           "head_size=576, kv_cache_dtype=fp8). Reasons: {FLASH_ATTN_MLA: [compute capability "
           "not supported]}.")
    assert classify_failure(log, 1, "startup").reason is FailureReason.UNSUPPORTED_CONFIG


def test_launcher_methods_delegate_to_module_functions() -> None:
    launcher = VllmLauncher(vllm_version="0.26.0")
    text = load_log("eager.log")
    assert launcher.parse_log(text) == parse_log(text)
    assert launcher.classify_failure(text, 1, "startup") == classify_failure(text, 1, "startup")


def test_multi_gpu_trials_keep_the_nccl_and_multicast_variables_they_inherit(
        tmp_path: Path, clean_environ: dict[str, str]) -> None:
    import os

    os.environ.update({"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "0",
                       "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "HOME": "/root"})
    launcher = VllmLauncher(vllm_version="0.26.0")
    _, tp2 = launcher.command(EngineConfig(model="m", flags={"tensor_parallel_size": 2},
                                           env={"NCCL_P2P_DISABLE": "1"}), 8000, tmp_path, None)
    assert tp2 == {"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1",
                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}, \
        "inherited NCCL settings are recorded with the trial; the study's own win"
    _, tp1 = launcher.command(EngineConfig(model="m"), 8000, tmp_path, None)
    assert tp1 == {}, "one GPU: no collectives, nothing to record"
