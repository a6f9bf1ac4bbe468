"""`nightshift audit` over a table of real launch lines: the argv nightshift itself gave vLLM on
the H200 (tests/fixtures/vllm_logs/h200/trial2.log prints it back as "non-default args"), lines
of the kind vLLM's docs and recipes show, and the mistakes the tuning practice names."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from optimizer.cli import main
from optimizer.export.audit import audit, parse_launch, read_launch_file, read_pid
from search_spaces.engine.tables import bundled_flags
from tests.builders import WORKLOAD, write_study

TABLE = bundled_flags()
H200_EAGER = ("python -m vllm.entrypoints.cli.main serve /root/ns-src/runners/model_configs/"
              "qwen2.5-7b --host 127.0.0.1 --port 47857 --max-model-len 4096 --quantization fp8 "
              "--enforce-eager --skip-tokenizer-init --served-model-name model --load-format "
              "dummy --kv-cache-dtype fp8")


def _codes(line: str, env: dict[str, str] | None = None, **hardware: Any) -> list[str]:
    launch = parse_launch(line.split(), env or {}, TABLE)
    return [f.code for f in audit(launch, table=TABLE, **hardware)]


@pytest.mark.parametrize(("line", "env", "hardware", "expected"), [
    # nightshift's own eager trial on the H200 (study 2, trial 2): the debugging switch.
    (H200_EAGER, {}, {}, ["enforce-eager"]),
    # A docs-style launch: clean.
    ("vllm serve Qwen/Qwen2.5-7B-Instruct --max-model-len 8192 --gpu-memory-utilization 0.9",
     {}, {"max_request_tokens": 4096}, []),
    # A 70B on 4 NVLinked GPUs: clean; the same over PCIe is not.
    ("vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 4 "
     "--max-model-len 32768", {}, {"interconnect": "nvlink"}, []),
    ("vllm serve meta-llama/Llama-3.1-70B-Instruct -tp 4", {}, {"interconnect": "pcie"},
     ["tp-over-pcie"]),
    # Leftovers of a debugging session, and variables this vLLM no longer reads.
    ("vllm serve m --no-enable-prefix-caching --max-model-len 131072",
     {"NCCL_DEBUG": "INFO", "VLLM_ATTENTION_BACKEND": "FLASHINFER",
      "VLLM_TORCH_PROFILER_DIR": "/tmp/p", "HOME": "/root"},
     {"max_request_tokens": 2048},
     ["ignored-env", "ignored-env", "nccl-debug", "profiling-on", "prefix-caching-off",
      "max-model-len-oversized"]),
    # A typo vLLM would refuse, and a misspelt variable it would ignore.
    ("vllm serve m --max-num-seq 256", {"VLLM_CACHE_RO0T": "/c"}, {},
     ["unknown-flag", "unknown-env"]),
    # Aliases and dotted compilation settings: CUDA graphs off by another name.
    ("vllm serve m -tp 1 -O3 -cc.cudagraph_mode=NONE", {}, {}, ["cudagraphs-off"]),
    # fp8 on an A100 (SM 8.0).
    ("vllm serve m --quantization fp8 --kv-cache-dtype fp8", {},
     {"compute_capability": 8.0}, ["fp8-unsupported"]),
    # The profiler left configured.
    ("vllm serve m --profiler-config {\"profiler\":\"torch\",\"torch_profiler_dir\":\"/t\"}",
     {}, {}, ["profiling-on"]),
])
def test_real_launch_lines_get_the_findings_they_deserve(
        line: str, env: dict[str, str], hardware: dict[str, Any], expected: list[str]) -> None:
    assert sorted(_codes(line, env, **hardware)) == sorted(expected)


def test_flags_parse_as_vllms_parser_reads_them() -> None:
    launch = parse_launch(H200_EAGER.split(), {"VLLM_LOGGING_LEVEL": "INFO", "PATH": "/bin"},
                          TABLE)
    assert launch.model == "/root/ns-src/runners/model_configs/qwen2.5-7b"
    assert launch.flags["enforce_eager"] is True and launch.flags["max_model_len"] == 4096
    assert launch.flags["kv_cache_dtype"] == "fp8" and launch.flags["port"] == 47857
    assert launch.env == {"VLLM_LOGGING_LEVEL": "INFO"}, "only engine variables are kept"
    aliases = parse_launch(
        ["vllm", "serve", "m", "-tp", "2", "-dp=2", "--no-enable-prefix-caching"], {}, TABLE)
    assert aliases.flags == {"tensor_parallel_size": 2, "data_parallel_size": 2,
                             "enable_prefix_caching": False}


def test_unknown_flag_suggests_the_closest_real_one() -> None:
    launch = parse_launch(["vllm", "serve", "m", "--max-num-seq", "256"], {}, TABLE)
    finding = next(f for f in audit(launch, table=TABLE) if f.code == "unknown-flag")
    assert "did you mean --max-num-seqs?" in finding.message


def test_a_yaml_false_in_the_config_file_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("enable-prefix-caching: false\nmax-num-seqs: 256\n")
    launch = parse_launch(["vllm", "serve", "m", "--config", str(config)], {}, TABLE)
    assert launch.flags["max_num_seqs"] == 256, "the file's settings are read"
    finding = next(f for f in audit(launch, table=TABLE) if f.code == "config-false-dropped")
    assert "no-enable-prefix-caching: true" in finding.message


def test_launcher_file_with_exports_and_continuations(tmp_path: Path) -> None:
    script = tmp_path / "serve.sh"
    script.write_text("#!/bin/bash\nexport NCCL_DEBUG=INFO VLLM_LOGGING_LEVEL=DEBUG\n"
                      "# tuned 2026-11\nCUDA_VISIBLE_DEVICES=0,1 exec vllm serve my/model \\\n"
                      "  --tensor-parallel-size 2 \\\n  --enforce-eager\n")
    argv, env = read_launch_file(script)
    assert argv[:3] == ["vllm", "serve", "my/model"] and "--enforce-eager" in argv
    assert env == {"NCCL_DEBUG": "INFO", "VLLM_LOGGING_LEVEL": "DEBUG",
                   "CUDA_VISIBLE_DEVICES": "0,1"}


def test_running_process_is_read_from_proc() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "serve",
                             "some/model", "--enforce-eager"],
                            env={"VLLM_ATTENTION_BACKEND": "TRITON_ATTN", "PATH": "/usr/bin"})
    try:  # /proc shows the new argv only once the exec is done: wait for it, not a set time
        deadline = time.monotonic() + 30
        while "serve" not in (argv_env := read_pid(proc.pid))[0]:
            assert time.monotonic() < deadline, f"/proc never showed the argv: {argv_env}"
            time.sleep(0.01)
        argv, env = argv_env
        launch = parse_launch(argv, env, TABLE)
        assert launch.model == "some/model"
        assert {f.code for f in audit(launch, table=TABLE)} == {"enforce-eager", "ignored-env"}
    finally:
        proc.kill()
        proc.wait()


def test_cli_exit_codes_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--hardware", "h200", "--", "vllm", "serve", "m"]) == 0
    capsys.readouterr()
    assert main(["audit", "--hardware", "h200", "--json", "--", "vllm", "serve", "m",
                 "--enforce-eager"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [f["code"] for f in data["findings"]] == ["enforce-eager"]
    assert data["findings"][0]["fix"] == {"enforce_eager": False}
    assert main(["audit", "--", "python", "train.py"]) == 2, "not a vllm serve line: bad input"


def test_a_launch_option_given_before_the_separator_gets_the_hint(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "vllm", "serve", "X", "--enforce-eager"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("error: No such option: --enforce-eager; if it is the launch's, put the "
                      "launch after `--`: nightshift audit -- vllm serve MODEL "
                      "--enforce-eager ..."), err
    assert main(["status", "--enforce-eager", "x.yaml"]) == 2
    assert "after `--`" not in capsys.readouterr().err, "only audit takes a launch"


@pytest.mark.slow
def test_measure_pairs_each_fix_with_the_launch_as_is(
        tmp_path: Path, ray_cluster: None) -> None:
    path = write_study(tmp_path, name="prod", trials=1, workload={
        **WORKLOAD, "output_len": 32, "levels": [{"concurrency": 8}], "num_requests": 24},
        slo={"ttft_p99_ms": 2000, "tpot_p99_ms": 50},
        simulated={"hardware": "h200", "num_gpus": 1, "startup_time_scale": 0.002})
    code = main(["audit", "--hardware", "h200", "--study", str(path), "--measure", "--",
                 "vllm", "serve", "qwen2.5-7b", "--enforce-eager", "--no-enable-prefix-caching"])
    assert code == 1, "findings: exit 1 even when measured"
    import optuna

    measured = optuna.load_study(
        study_name="prod-audit",
        storage=f"sqlite:///{tmp_path}/prod-audit/results/optuna.db")
    records = [t.user_attrs["record"] for t in measured.trials]
    assert [r["state"] for r in records] == ["complete"] * 3, "as is + one trial per fix"
    as_is, no_eager = records[0], records[1]
    assert as_is["is_baseline"] and as_is["flags"]["enforce_eager"] is True
    assert "enforce_eager" not in no_eager["flags"] or not no_eager["flags"]["enforce_eager"]
    assert no_eager["metrics"]["p99_tpot_ms"] < as_is["metrics"]["p99_tpot_ms"], \
        "CUDA graphs back on: decode is faster, as measured"


def test_a_flag_the_release_removed_is_named_with_the_release_that_removed_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    table = bundled_flags("0.27.0")
    launch = parse_launch(["vllm", "serve", "m", "--max-num-partial-prefills", "2"], {}, table)
    (finding,) = audit(launch, table=table)
    assert finding.code == "removed-flag" and finding.severity == "error"
    assert "--max-num-partial-prefills was removed in vLLM 0.27.0" in finding.message
    line = ["--", "vllm", "serve", "m", "--max-num-partial-prefills", "2"]
    assert main(["audit", "--hardware", "h200", "--vllm-version", "0.27.1", *line]) == 1
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "checked against vLLM 0.27.0-0.27.1's flags" in out
    assert "--max-num-partial-prefills was removed in vLLM 0.27.0" in out
    assert main(["audit", "--hardware", "h200", "--vllm-version", "0.26.0", *line]) == 0, \
        "0.26 takes it"
    capsys.readouterr()
    assert main(["audit", "--hardware", "h200", "--vllm-version", "0.99.0", *line]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--vllm-version" in err and "0.34.0" in err, err


def test_a_variable_the_release_names_removed_is_an_error_with_its_hint() -> None:
    table = bundled_flags("0.34.0")
    launch = parse_launch(["vllm", "serve", "m"], {"VLLM_MARLIN_INPUT_DTYPE": "int8"}, table)
    (finding,) = audit(launch, table=table)
    assert finding.code == "removed-env" and finding.severity == "error"
    assert "--quantization humming" in finding.message, "vLLM 0.34's own hint"
    older = bundled_flags("0.33.0")
    assert [f.code for f in audit(parse_launch(["vllm", "serve", "m"], {
        "VLLM_MARLIN_INPUT_DTYPE": "int8"}, older), table=older)] == [], "0.33 reads it"


def test_a_variable_a_release_stopped_reading_is_named_with_that_release_not_a_guess() -> None:
    table = bundled_flags("0.30.0")
    launch = parse_launch(["vllm", "serve", "m"], {"VLLM_MM_HASHER_ALGORITHM": "sha256"}, table)
    (finding,) = audit(launch, table=table)
    assert finding.code == "unknown-env" and finding.message == (
        "VLLM_MM_HASHER_ALGORITHM is not read by vLLM 0.30.0: vLLM 0.30.0 stopped reading it "
        "(the last release that did: 0.29.0); vLLM 0.30.0 has --mm-hasher-algorithm.")
    older = bundled_flags("0.26.0")
    assert audit(parse_launch(["vllm", "serve", "m"], {"VLLM_MM_HASHER_ALGORITHM": "sha256"},
                              older), table=older) == [], "0.26 reads it"
    # A name no release reads still gets the closest one as a guess.
    (typo,) = audit(parse_launch(["vllm", "serve", "m"], {"VLLM_CACHE_RO0T": "/c"}, table),
                    table=table)
    assert typo.message.endswith("did you mean VLLM_CACHE_ROOT?")


def test_the_v1_runner_switch_is_an_error_from_0_34_which_refuses_it_at_start() -> None:
    for version, codes in (("0.33.0", []), ("0.34.0", ["removed-env"])):
        table = bundled_flags(version)
        launch = parse_launch(["vllm", "serve", "m"], {"VLLM_USE_V2_MODEL_RUNNER": "0"}, table)
        findings = audit(launch, table=table)
        assert [f.code for f in findings] == codes, version
    assert findings[0].severity == "error" and "Model Runner V1 is removed" in \
        findings[0].message
    assert audit(parse_launch(["vllm", "serve", "m"], {"VLLM_USE_V2_MODEL_RUNNER": "1"}, table),
                 table=table)[0].code == "unknown-env", "=1 is not refused, only not read"


def test_notes_alone_exit_0_and_a_warning_exits_1(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # The study's longest request is a few hundred tokens: 32768 is a note (info), as
    # nightshift's own export of a space offering it may carry.
    study = write_study(tmp_path, trials=1)
    line = ["--", "vllm", "serve", "m", "--max-model-len", "32768"]
    assert main(["audit", "--hardware", "h200", "--study", str(study), *line]) == 0
    assert "max-model-len-oversized" in capsys.readouterr().out
    assert main(["audit", "--hardware", "h200", "--study", str(study), *line,
                 "--enforce-eager"]) == 1


def test_the_header_counts_the_flags_the_release_does_not_take(
        capsys: pytest.CaptureFixture[str]) -> None:
    line = ["--", "vllm", "serve", "m", "--max-num-partial-prefills", "2",
            "--calculate-kv-scales", "--max-num-seqs", "64"]
    assert main(["audit", "--hardware", "h200", "--vllm-version", "0.33.0", *line]) == 1
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("m: 1 flags (and 2 it does not take), 0 engine variables"), header
