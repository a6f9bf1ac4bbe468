"""A study is shown the latencies its SLO bounds (held-out check s17, #5): a study whose only
bound is on TTFT showed TPOT p99 in `status` and report.md and never TTFT, and the export header
said "slo: TTFT p99 <= 2500 ms" above an operating point whose TTFT p99 was 3,740 ms (goodput
counts the requests meeting the bound, as vLLM's --goodput does, so the level with the most
goodput can miss the p99). The live table `start` draws showed TPOT only (its events carried no
TTFT): it shows the SLO's own p99s too."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from rich.console import Console

from optimizer.cli import main
from optimizer.cli.live import LiveProgress
from optimizer.config import parse_study
from optimizer.export.render import slo_line
from optimizer.results.tail_samples import slo_latencies
from optimizer.run.events import TrialEvent
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


def _live(tmp_path: Path, slo: dict[str, float], *events: TrialEvent) -> str:
    cfg = parse_study({"name": "live", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 4},
                       "slo": slo, "results_dir": str(tmp_path)})
    progress = LiveProgress(cfg)
    for event in events:
        progress.on_event(event)
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(progress)
    return buffer.getvalue()


# The MoE study's operating point, as the daemon tells it when the trial is recorded.
FINISHED = TrialEvent("finished", 0, {}, "complete", 3.55, 119.4, "vLLM defaults", 60.0,
                      "compute-bound", tpot_p99_num_requests=200, ttft_p99_ms=3740.2,
                      ttft_p99_num_requests=200)


@pytest.mark.parametrize(("slo", "shown", "hidden"), [
    ({"ttft_p99_ms": 2500.0}, ["TTFT p99", "3,740 n=200"], ["TPOT p99", "119"]),
    ({"tpot_p99_ms": 150.0}, ["TPOT p99", "119 n=200"], ["TTFT p99", "3,740"]),
    ({"ttft_p99_ms": 2500.0, "tpot_p99_ms": 150.0},
     ["TTFT p99", "3,740 n=200", "TPOT p99", "119 n=200"], []),
])
def test_the_live_table_shows_the_p99_columns_of_the_slos_own_bounds(
        tmp_path: Path, slo: dict[str, float], shown: list[str], hidden: list[str]) -> None:
    text = _live(tmp_path, slo, FINISHED)
    for word in shown:
        assert word in text, (word, text)
    for word in hidden:
        assert word not in text, (word, text)


class _OneLoadRunner:
    """A `Runner` whose every level measures the MoE study's operating point."""

    def run(self, config: Any, workload: Any, workdir: Path,
            on_step: Any = None) -> Any:
        from runners.base import RunResult, StepMetrics
        from tests.builders import benchmark_metrics

        steps = []
        for index, level in enumerate(workload.levels):
            step = StepMetrics(step=index, level=level, metrics=benchmark_metrics(
                None, completed=200, num_tpot_samples=200, p99_ttft_ms=3740.2,
                p99_tpot_ms=119.4, request_goodput=3.55, request_throughput=4.16))
            steps.append(step)
            if on_step is not None:
                on_step(step)
        return RunResult(status="complete", steps=tuple(steps))

    def close(self) -> None:
        return None


def test_the_daemons_events_carry_the_operating_points_ttft_p99(tmp_path: Path) -> None:
    from optimizer.config import load_study
    from optimizer.run.daemon import Daemon
    from optimizer.run.executor import InlineExecutor
    from optimizer.tracking.study_summary import study_summary
    from optimizer.tracking.tracker import Tracker
    from search_spaces import load_space
    from tests.builders import categorical_space, write_study

    space_path = categorical_space(tmp_path, max_num_seqs=[256])
    cfg = load_study(write_study(tmp_path, trials=1, search_space=str(space_path),
                                 slo={"ttft_p99_ms": 2500.0}))
    events: list[TrialEvent] = []
    Daemon(cfg, space=load_space(space_path).resolve({}),
           executor=InlineExecutor(_OneLoadRunner, total_gpus=1),
           registry_dir=tmp_path / "engines", tracker=Tracker(cfg.tracking_uri),
           workload=cfg.workload, study_params={}, study_artifacts={},
           summarize=study_summary, on_event=events.append, poll_s=0.01).run()
    steps = [e for e in events if e.kind == "step"]
    assert steps and all(e.ttft_p99_ms == 3740.2 for e in steps), steps
    (finished,) = [e for e in events if e.kind == "finished"]
    assert (finished.ttft_p99_ms, finished.ttft_p99_num_requests) == (3740.2, 200), finished
    assert "3,740 n=200" in _live(tmp_path, {"ttft_p99_ms": 2500.0}, *events)
