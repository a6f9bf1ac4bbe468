"""The tuning memory's bad input and empty stores: `warm_start` naming a study the store does not
hold, and `nightshift history`'s options (exit 2, one line) and its answer when nothing is
found (exit 0). No study runs here."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimizer.cli import main
from tests.builders import write_study


def test_warm_start_naming_a_study_the_store_lacks_exits_2_before_a_trial_is_queued(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_study(tmp_path, warm_start=["nope"])
    assert main(["start", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "warm_start: no study named 'nope' in the tracking store" in err and "\n" not in err
    assert not (tmp_path / "results").exists(), "nothing is written under results_dir"


@pytest.mark.parametrize("value", ["on", "[]", "[a, 1]", "sometimes", "[named]"])
def test_a_bad_warm_start_value_exits_2_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    path = write_study(tmp_path)
    path.write_text(path.read_text() + f"warm_start: {value}\n")
    assert main(["start", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "warm_start:" in err and "\n" not in err, err


def test_warm_start_off_is_read_from_a_bare_yaml_off(tmp_path: Path) -> None:
    from optimizer.config import load_study

    path = write_study(tmp_path)
    path.write_text(path.read_text() + "warm_start: off\n")
    assert load_study(path).spec.warm_start == "off"
    assert load_study(write_study(tmp_path)).spec.warm_start == "auto", "the default"


@pytest.mark.parametrize("args", [["--fingerprint", "xyz"], ["--limit", "0"],
                                  ["--tracking-uri", "ftp://x"],
                                  ["--fingerprint", "abcd", "--study", "s.yaml"]])
def test_history_bad_input_exits_2_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    assert main(["history", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: history") and "\n" not in err, err


def test_history_of_an_empty_or_absent_store_says_so_and_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"sqlite:///{tmp_path}/none/mlflow.db"
    assert main(["history", "--model", "qwen2.5-7b", "--tracking-uri", uri]) == 0
    assert "no earlier studies for model qwen2.5-7b" in capsys.readouterr().out
    assert not (tmp_path / "none").exists(), "reading creates no store"


@pytest.mark.parametrize("width", [60, 80, 120, 160, 200])
def test_history_table_fits_the_terminal_and_keeps_each_figure_s_bound(width: int) -> None:
    from rich.console import Console

    from optimizer.cli.table import history_table
    from optimizer.tuning_memory.earlier_studies import HistoryRow

    bound = "1.98x the vLLM defaults (95% CI [1.52x, 2.44x] over 3 rounds)"
    rows = [HistoryRow("second", "2026-12-04 17:24", "FINISHED", "simulated 0.26.0",
                       "2 x NVIDIA H200 (nvlink)", "abc123abc123",
                       "kv_cache_dtype=fp8, quantization=fp8", f"goodput 120 req/s; {bound}",
                       "Best: trial 1 (kv_cache_dtype=fp8, quantization=fp8), goodput 120 "
                       "req/s, " + bound + "; memory-bound.")]
    console = Console(width=width, record=True)
    console.print(history_table(rows, width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width, text
    assert "[1.52x, 2.44x]" in " ".join(text.split()), f"the interval is shown:\n{text}"


@pytest.mark.parametrize("width", [100, 140, 160, 200])
def test_history_table_never_breaks_a_flag_inside_its_name(width: int) -> None:
    from rich.console import Console

    from optimizer.cli.table import history_table
    from optimizer.tuning_memory.earlier_studies import HistoryRow

    change = ("data_parallel_size=2, attention_backend=FLASHINFER, kv_cache_dtype=fp8, "
              "quantization=fp8 (+7 more)")
    rows = [HistoryRow("quickstart", "2026-12-04 17:24", "FINISHED", "simulated 0.26.0",
                       "2 x NVIDIA H200 (nvlink)", "abc123abc123", change,
                       "goodput 47.8 req/s; 1.45x the vLLM defaults (one measurement each: "
                       "no interval)", "Best: trial 7 (data_parallel_size=2, "
                       "attention_backend=FLASHINFER), goodput 47.8 req/s.")]
    console = Console(width=width, record=True)
    console.print(history_table(rows, width))
    text = console.export_text()
    words = {w.strip("(),…") for w in text.split()}
    for flag in ("data_parallel_size=2", "attention_backend=FLASHINFER"):
        assert flag in words or flag[:8] not in text, f"{flag} broken at {width}:\n{text}"
    assert "data_parallel_size=2" in words, "the first change always shows"
