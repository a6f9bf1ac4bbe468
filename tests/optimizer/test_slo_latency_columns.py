"""A study is shown the latencies its SLO bounds (held-out check s17, #5): a study whose only
bound is on TTFT showed TPOT p99 in `status` and report.md and never TTFT, and the export header
said "slo: TTFT p99 <= 2500 ms" above an operating point whose TTFT p99 was 3,740 ms (goodput
counts the requests meeting the bound, as vLLM's --goodput does, so the level with the most
goodput can miss the p99)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from rich.console import Console

from optimizer.cli import main
from optimizer.config import parse_study
from optimizer.export.render import slo_line
from optimizer.report.build import slo_latencies
from optimizer.storage.study import open_study

# The MoE study's recommended trial at concurrency 16 (its operating point): 85% of the
# requests within 2,500 ms of TTFT, p99 3,740 ms; TPOT p99 119 ms.
OPERATING_POINT = {"p99_ttft_ms": 3740.2, "p99_tpot_ms": 119.4, "completed": 200.0,
                   "num_tpot_samples": 200.0, "request_goodput": 3.55,
                   "request_throughput": 4.16}


def _study(tmp_path: Path, slo: dict[str, float]) -> tuple[Path, optuna.Study, Any]:
    data = {"name": "ttft-slo", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
            "slo": slo, "results_dir": str(tmp_path / "results")}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(data))
    cfg = parse_study(data, path=path)
    study = open_study(cfg)
    dist = {"quantization": optuna.distributions.CategoricalDistribution(["none", "fp8"])}
    for attrs, flags, value in (({"baseline": True}, {}, 2.9), ({}, {"quantization": "fp8"},
                                                                 3.55)):
        record: dict[str, Any] = {
            "state": "complete", "params": {}, "flags": flags, "values": [value],
            "metrics": OPERATING_POINT, "conclusion": "measured", "conclusion_short": "ok",
            "verdict": {"label": "compute-bound"}, "wall_s": 60.0}
        study.add_trial(optuna.trial.create_trial(
            params={"quantization": flags.get("quantization", "none")}, distributions=dist,
            value=value, user_attrs={**attrs, "record": record}))
    return path, study, cfg


def _status(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    from optimizer.cli import results

    buffer = io.StringIO()
    monkeypatch.setattr(results, "out", Console(file=buffer, width=160, color_system=None))
    assert main(["status", str(path)]) == 0
    return buffer.getvalue()


@pytest.mark.parametrize(("slo", "shown", "hidden"), [
    ({"ttft_p99_ms": 2500.0}, ["TTFT p99", "3,740"], ["TPOT p99", "119"]),
    ({"tpot_p99_ms": 150.0}, ["TPOT p99", "119"], ["TTFT p99", "3,740"]),
    ({"ttft_p99_ms": 2500.0, "tpot_p99_ms": 150.0}, ["TTFT p99", "3,740", "TPOT p99", "119"],
     []),
])
def test_status_shows_the_p99_columns_of_the_slos_own_bounds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slo: dict[str, float],
        shown: list[str], hidden: list[str]) -> None:
    text = _status(_study(tmp_path, slo)[0], monkeypatch)
    for word in shown:
        assert word in text, (word, text)
    for word in hidden:
        assert word not in text, (word, text)


def test_a_study_without_a_latency_bound_shows_tpot_the_fronts_axis() -> None:
    assert slo_latencies({}) == ("tpot",)
    assert slo_latencies({"e2el_ms": 9000.0}) == ("tpot",)
    assert slo_latencies({"ttft_p99_ms": 2500.0, "tpot_p99_ms": None}) == ("ttft",)


def test_report_markdown_shows_the_ttft_column_of_a_ttft_slo(tmp_path: Path) -> None:
    from optimizer.report import build_report
    from optimizer.report.render import render_markdown

    _, study, cfg = _study(tmp_path, {"ttft_p99_ms": 2500.0})
    text = render_markdown(build_report(study, cfg, with_importances=False))
    every = text.split("## Every trial")[1].split("\n\n")[1]
    header = every.splitlines()[0]
    assert "TTFT p99 ms" in header and "TPOT p99 ms" not in header, header
    assert "3,740" in every and "119" not in every, every
    # Every row has as many cells as the header.
    assert {line.count(" | ") for line in every.splitlines() if line.startswith("| ")} == \
        {header.count(" | ")}


def test_the_export_slo_line_says_the_operating_points_p99_missed_the_bound() -> None:
    line = slo_line({"ttft_p99_ms": 2500.0, "tpot_p99_ms": None}, OPERATING_POINT)
    assert line == ("slo: TTFT p99 <= 2500 ms (the operating point's p99: 3,740 ms, missed); "
                    "85% of its requests within the bound (goodput counts those)"), line
    both = slo_line({"ttft_p99_ms": 5000.0, "tpot_p99_ms": 100.0}, OPERATING_POINT)
    assert both == ("slo: TTFT p99 <= 5000 ms (the operating point's p99: 3,740 ms, met), "
                    "TPOT p99 <= 100 ms (the operating point's p99: 119 ms, missed); 85% of "
                    "its requests within every bound (goodput counts those)"), both


def test_the_export_slo_line_without_recorded_figures_states_the_bounds_alone() -> None:
    assert slo_line({"ttft_p99_ms": 1000.0, "tpot_p99_ms": 10.0}, {}) == \
        "slo: TTFT p99 <= 1000 ms, TPOT p99 <= 10 ms (the operating point's p99s not recorded)"
    assert slo_line({}, OPERATING_POINT) == "slo: none"
    partly = slo_line({"ttft_p99_ms": 1000.0, "e2el_ms": 9000.0}, {"p99_ttft_ms": 900.0})
    assert partly == ("slo: TTFT p99 <= 1000 ms (the operating point's p99: 900 ms, met), "
                      "E2E latency p99 <= 9000 ms (the operating point's p99 not recorded)")
