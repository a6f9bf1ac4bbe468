"""Issue 19 items 3, 6 (extra_args) and 7, reproduced through `nightshift start`: bad input is
refused in one line with exit 2 before anything is written, whichever way it arrives (study
file, command-line override, environment), and a fixed flag fixes what every trial runs.

| input                              | before (issue 19)              | now                  |
|------------------------------------|--------------------------------|----------------------|
| --storage bogus://x                | exit 2 after daemon.log, lock, | one line, exit 2,    |
|                                    | an MLflow experiment           | nothing written      |
| --storage in a missing dir tree    | the tree was created           | one line, exit 2     |
| MLFLOW_TRACKING_URI=bogus://x      | traceback, exit 1              | one line, exit 2     |
| prompts_file not UTF-8             | accepted; every trial failed   | one line, exit 2     |
| vllm.extra_args: [--host, 0.0.0.0] | passed after --host 127.0.0.1  | one line, exit 2     |
| fixed_flags: {max_num_seqs: 64}    | trials ran 64, 512, 256        | every trial runs 64  |

The held-out corpus of malformed study files is tests/test_bad_study_files.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from optimizer.cli import main
from tests.builders import load, write_study


def _refused(capsys: pytest.CaptureFixture[str], tmp_path: Path, expected: str) -> None:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], lines
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists(), \
        "bad input writes nothing"


@pytest.mark.parametrize(("argv", "expected"), [
    (["--storage", "bogus://x"], "storage: 'bogus' is not a database"),
    (["--storage", "sqlite:////nonexistent-nightshift/a/b/optuna.db"], "storage: neither"),
    (["--tracking-uri", "bogus://x"], "--tracking-uri: MLflow does not store to scheme"),
])
def test_bad_store_on_the_command_line_is_refused_before_anything_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
        expected: str) -> None:
    path = write_study(tmp_path)
    assert main(["start", str(path), "--no-progress", *argv]) == 2
    _refused(capsys, tmp_path, expected)


def test_bad_tracking_uri_from_the_environment_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_study(tmp_path, tracking_uri=None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "bogus://x")
    monkeypatch.chdir(tmp_path)
    assert main(["start", str(path), "--no-progress"]) == 2
    _refused(capsys, tmp_path, "tracking_uri: MLflow does not store to scheme 'bogus'")


def test_a_prompts_file_the_load_generator_cannot_read_is_refused_up_front(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.jsonl").write_bytes(b'{"prompt": "\xff\xfe"}\n')
    path = write_study(tmp_path, workload={"prompts_file": "p.jsonl", "output_len": 16,
                                           "levels": [{"concurrency": 2}], "num_requests": 4})
    assert main(["start", str(path), "--no-progress"]) == 2
    _refused(capsys, tmp_path, "workload.prompts_file")


def test_extra_args_cannot_move_the_engine_off_loopback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_study(tmp_path, vllm={"extra_args": ["--host", "0.0.0.0"]})
    assert main(["start", str(path), "--no-progress"]) == 2
    _refused(capsys, tmp_path, "vllm.extra_args[0]: nightshift sets --host itself")


@pytest.mark.slow
def test_a_fixed_flag_is_what_every_trial_and_the_baseline_run(
        tmp_path: Path, ray_cluster: None) -> None:
    path = write_study(tmp_path, trials=3, fixed_flags={"max_num_seqs": 64},
                       sampler={"name": "random", "seed": 3}, workload={
                           "input_len": 64, "output_len": 16, "levels": [{"concurrency": 4}],
                           "num_requests": 8, "warmup_requests": 0})
    assert main(["start", str(path), "--no-progress"]) == 0
    records: list[dict[str, Any]] = [t.user_attrs["record"] for t in load(tmp_path).trials]
    assert len(records) >= 3
    assert {r["params"]["max_num_seqs"] for r in records} == {64}, "no trial samples it"
    assert all(r["flags"].get("max_num_seqs") == 64 for r in records if r.get("flags")), \
        "every engine, the baseline included, ran the fixed value"


def _one_line(capsys: pytest.CaptureFixture[str], *expected: str) -> None:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert all(part in lines[0] for part in expected), err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["status"], ["export"], ["report"]])
def test_a_read_command_on_a_study_never_run_creates_no_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: list[str]) -> None:
    # They opened sqlite:///results/<name>/optuna.db for reading, which created it.
    path = write_study(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main([*command, str(path)]) == 2
    _one_line(capsys, "no study named 'e2e': there is no storage file")
    assert not (tmp_path / "results").exists(), "reading creates nothing"


@pytest.mark.parametrize(("config", "expected"), [
    ("{not json", "config.json: not JSON"),
    ("[1, 2]", "expected a JSON object but got list"),
    ("{}", "'num_attention_heads' is not in it"),
    ('{"num_attention_heads": 8, "hidden_size": 64, "num_hidden_layers": "x"}',
     "'num_hidden_layers' must be a whole number >= 1 but got 'x'"),
    ('{"num_attention_heads": 8, "hidden_size": 64, "num_hidden_layers": 2, '
     '"vocab_size": 1e30}', "'vocab_size' must be a whole number"),
])
def test_a_model_config_json_that_is_no_decoders_shape_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, expected: str) -> None:
    # JSONDecodeError, AttributeError, KeyError and ValueError tracebacks before.
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config)
    path = write_study(tmp_path, model={"path": str(tmp_path / "m"), "load_format": "dummy",
                                        "skip_tokenizer_init": True})
    assert main(["start", str(path), "--no-progress"]) == 2
    _one_line(capsys, f"study.yaml: model.path: {tmp_path / 'm' / 'config.json'}: ", expected)
    assert not (tmp_path / "results").exists() and not (tmp_path / "mlruns").exists(), \
        "bad input writes nothing"


def test_warm_start_naming_a_study_an_existing_store_lacks_writes_nothing_to_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The study's experiment was created (the write probe) before the names were looked up.
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
    (tmp_path / "mlruns").mkdir()
    MlflowClient(uri).create_experiment("other")
    path = write_study(tmp_path, warm_start=["nope"])
    assert main(["start", str(path), "--no-progress"]) == 2
    _one_line(capsys, "study.yaml: warm_start: no study named 'nope'")
    assert MlflowClient(uri).get_experiment_by_name("e2e") is None, "no experiment made"


_STUDY = ("name: s\nengine: simulated\nmodel: {path: qwen2.5-7b, load_format: dummy}\n"
          "slo: {tpot_p99_ms: 50}\nbudget: {trials: 1}\n")
_LIBRARY = ("name: lib\ncases:\n  - name: c\n    engine: simulated\n"
            "    model: {path: qwen2.5-7b, load_format: dummy}\n"
            "    workload: {input_len: 64, output_len: 16, num_requests: 8}\n"
            "    slo: {tpot_p99_ms: 50}\n    configs: [{name: defaults, flags: {}}]\n")


@pytest.mark.parametrize(("argv", "files", "expected"), [
    (["regress", "l.yaml", "--workdir", "f"], {"l.yaml": _LIBRARY, "f": "x"},
     "--workdir: "),
    (["regress", "l.yaml", "--report", "f", "--no-mlflow"], {"l.yaml": _LIBRARY, "f": "x"},
     "--report: "),
    (["regress", "l.yaml", "--save-references", "d", "--no-mlflow"],
     {"l.yaml": _LIBRARY, "d/": ""}, "--save-references: 'd' is a directory"),
    (["regress", "l.yaml"], {"l.yaml": "tracking_uri: sqlite:///d\n" + _LIBRARY, "d/": ""},
     "l.yaml: tracking_uri: 'd' is a directory"),
    (["export", "s.yaml", "--max-tpot-ms", "nan"], {"s.yaml": _STUDY},
     "export --max-tpot-ms: expected a number of milliseconds > 0 but got nan"),
    (["start", "s.yaml", "--dry-run", "--ray-address", "head:99999"], {"s.yaml": _STUDY},
     "--ray-address: expected auto, HOST:PORT or ray://HOST:PORT but got 'head:99999'"),
    (["report", "s.yaml", "-o", "f/report"], {"s.yaml": _STUDY, "f": "x"},
     "report --output: "),
    (["stop", "s.yaml", "--timeout-s", "-1"], {"s.yaml": _STUDY},
     "stop --timeout-s: expected seconds >= 0 but got -1"),
    (["history", "--tracking-uri", "sqlite:///d"], {"d/": ""},
     "history --tracking-uri: 'd' is a directory"),
    (["history", "--tracking-uri", "sqlite:///t.txt"], {"t.txt": "notes"},
     "history --tracking-uri: 't.txt' exists and is not a SQLite database"),
    (["history", "--tracking-uri", "./runs"], {},
     "history --tracking-uri: MLflow cannot open ./runs (MLflow 3 opens no file store"),
    (["hw", "--preset", "h200", "-o", "d"], {"d/": ""}, "hw --output: 'd' is a directory"),
    (["hw", "--preset", "h200", "-o", "no/such/hw.json"], {},
     "hw --output: the directory of 'no/such/hw.json' does not exist"),
    (["audit", "--from-file", "a.sh"], {"a.sh": b"\xff\xfe\x00vllm serve"},
     "--from-file a.sh: not UTF-8 text"),
    (["audit", "--from-file", "a.sh"], {"a.sh": "vllm serve m --x 'open"},
     "--from-file a.sh: cannot split"),
    (["audit", "--hardware", "h900", "--", "vllm", "serve", "m"], {},
     "audit --hardware: expected one of"),
    (["audit", "--", "vllm", "serve", "m", "--config", "c.yaml"], {},
     "the launch's --config 'c.yaml' does not exist here"),
    (["audit", "--", "vllm", "serve", "m", "--config", "c.yaml"], {"c.yaml": "- a\n"},
     "the launch's --config 'c.yaml' holds a list"),
    (["audit", "--", "vllm", "serve", "m", "--config", "c.yaml"], {"c.yaml": b"\xff\xfe"},
     "the launch's --config 'c.yaml' cannot be read as YAML"),
])
def test_a_bad_file_given_to_a_command_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str], files: dict[str, str | bytes], expected: str) -> None:
    # Tracebacks before (IsADirectoryError, UnicodeDecodeError, sqlite3.DatabaseError, ...),
    # regress's after measuring every case; for a --config the launch names but that is not
    # there, "no findings"; for nan, "no trial has a TPOT p99 that low".
    monkeypatch.chdir(tmp_path)
    for name, content in files.items():
        target = tmp_path / name
        if name.endswith("/"):
            target.mkdir()
        elif isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    assert main(argv) == 2
    _one_line(capsys, expected)
    assert not (tmp_path / "no").exists() and not (tmp_path / "results").exists(), \
        "bad input writes nothing"
