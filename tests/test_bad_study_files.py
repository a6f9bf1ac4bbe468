"""A held-out corpus of malformed and hostile study files (tests/fixtures/bad_studies/, each
with a comment line saying what is wrong and which field the error must name): `nightshift
start` refuses every one in one line naming the field, exit 2, in seconds and bounded memory,
with nothing written under the working directory's results/ or mlruns/."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from optimizer.cli import main

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "bad_studies"
FILES = sorted(CORPUS.glob("*.yaml"))
_NAMES = re.compile(rb"\[error names: ([^\]]+)\]")


def _expected(path: Path) -> str:
    found = _NAMES.search(path.read_bytes().splitlines()[0])
    assert found, f"{path.name}: the first line says which field the error names"
    return found.group(1).decode()


def _refused_once(err: str, expected: str, name: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"{name}: exactly one line, got {lines[:5]}"
    assert lines[0].startswith(f"error: {name}"), f"{name}: the study file named first: " \
        f"{lines[0]}"
    assert expected in lines[0], f"{name}: the error names {expected!r}: {lines[0]}"
    assert "Traceback" not in err
    return lines[0]


def _nothing_written(cwd: Path, name: str) -> None:
    assert not (cwd / "results").exists() and not (cwd / "mlruns").exists(), \
        f"{name}: bad input writes nothing"


def test_the_corpus_holds_about_fifty_files_each_saying_what_is_wrong() -> None:
    assert len(FILES) >= 50
    for path in FILES:
        assert path.read_bytes().startswith(b"# "), f"{path.name} starts with its comment"
        _expected(path)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_bad_study_is_refused_in_one_line_with_exit_2_and_nothing_written(
        path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracemalloc.start()
    # CPU seconds, not wall: what refusing the file costs, whatever else the host runs.
    started = time.process_time()
    try:
        code = main(["start", str(path), "--dry-run", "--no-progress"])
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    cpu_s = time.process_time() - started
    err = capsys.readouterr().err
    assert code == 2, f"{path.name}: exit 2 for bad input, got {code}: {err[-500:]}"
    _refused_once(err, _expected(path), path.name)
    _nothing_written(tmp_path, path.name)
    assert cpu_s < 20, f"{path.name}: refused in seconds, took {cpu_s:.1f} s of CPU"
    # The file itself is at most 2 MB; refusing it must not build anything much larger (an
    # alias bomb expanded, 20,000 nested lists composed).
    assert peak_bytes < 64 * 2**20, f"{path.name}: peak {peak_bytes / 2**20:.0f} MiB"


@pytest.mark.parametrize("name", ["fixed_flags_alias_bomb", "deep_nesting", "extra_args_host"])
def test_bad_study_through_a_real_process_is_one_line_and_exit_2(name: str,
                                                                 tmp_path: Path) -> None:
    path = CORPUS / f"{name}.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([sys.executable, "-m", "optimizer.cli", "start", str(path),
                           "--dry-run", "--no-progress"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-800:]
    _refused_once(done.stderr, _expected(path), name)
    assert done.stdout == ""
    _nothing_written(tmp_path, name)


def test_a_trace_with_hours_between_requests_passes_when_max_gap_s_cuts_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin of milliseconds.yaml that must start: the pre-start replay span reads the
    trace as the runner replays it, with its gaps cut to `trace.max_gap_s`."""
    from optimizer.config import check_before_start, parse_study
    from optimizer.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    data = {"name": "ok", "engine": "simulated",
            "model": {"path": "qwen2.5-7b", "load_format": "dummy",
                      "skip_tokenizer_init": True},
            "workload": {"trace": {"path": str(CORPUS / "traces" / "milliseconds.jsonl")}},
            "slo": {"tpot_p99_ms": 50}, "budget": {"trials": 1}}
    with pytest.raises(ConfigError, match=r"workload\.trace"):
        check_before_start(parse_study(data))
    data["workload"]["trace"]["max_gap_s"] = 5  # type: ignore[index]
    check_before_start(parse_study(data))
