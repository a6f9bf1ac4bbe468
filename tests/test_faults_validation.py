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
from tests.optimizer.test_daemon import load, write_study


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
