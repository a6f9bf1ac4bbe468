"""A p99 states the requests it rests on, and one under 100 is called thin, by one rule
(optimizer/results/tail_samples.py) wherever a trial's headline p99s are shown: the status
table, the report, MLflow's tags, the conclusion."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest

from optimizer.cli.results import status_rows
from optimizer.cli.table import p99_cell
from optimizer.config import parse_study
from optimizer.report import build_report, render_markdown
from optimizer.results.tail_samples import THIN_RULE, P99Basis, bases_text, thin_note
from optimizer.results.trial_record import TrialRecord
from optimizer.tracking.payload import tracking_payload
from optimizer.tracking.tags import TAG_P99_BASIS, TAG_P99_THIN


@pytest.mark.parametrize("n", [2, 37, 99, 100, 101, 150, 2000, 2001])
def test_a_p99_lies_where_the_rule_says_as_numpy_computes_it(n: int) -> None:
    """vLLM's p99 (numpy's linear percentile) over n requests lies 1 + (n - 1) / 100 places
    from the slowest, interpolated between the requests on either side."""
    values = np.arange(n, dtype=float)  # the r-th slowest is n - r
    p99 = float(np.percentile(values, 99))
    rank = P99Basis(n).rank
    assert p99 == pytest.approx(n - rank), (n, rank, p99)


def test_a_p99_under_100_requests_is_thin_and_says_so_in_words() -> None:
    assert P99Basis(37).is_thin and not P99Basis(100).is_thin
    assert P99Basis(37).cell == "n=37 thin" and P99Basis(2000).cell == "n=2,000"
    assert P99Basis(150).words("TPOT p99") == \
        "TPOT p99 over 150 requests (between the 2nd- and 3rd-slowest)"
    assert P99Basis(101).words("TPOT p99") == "TPOT p99 over 101 requests (about the 2nd-slowest)"
    assert P99Basis(37).words("TPOT p99") == "TPOT p99 over 37 requests: thin, set by its two " \
        "slowest"
    thin = {"p99_ttft_ms": 80.0, "p99_tpot_ms": 9.0, "p99_e2el_ms": 900.0, "completed": 64,
            "num_tpot_samples": 60}
    assert thin_note(thin) == (
        "Its TTFT and E2E latency p99s are over 64 requests: thin, each set by its two "
        "slowest requests; its TPOT p99 is over 60 requests: thin, set by its two slowest "
        "requests (a p99 needs 100 requests or more to say what one request in a hundred "
        "sees).")
    solid = {**thin, "completed": 2000, "num_tpot_samples": 1990}
    assert thin_note(solid) == "", "2,000 requests: nothing to warn of"
    assert bases_text(solid).startswith("TTFT p99 over 2,000 requests (about the 21st-slowest)")
    assert thin_note({"p99_tpot_ms": 9.0}) == "" and bases_text({"p99_tpot_ms": 9.0}) == "", \
        "a record without the counts (written before them) says nothing of them"


def _record(n_tpot: int | None, completed: int = 2000) -> dict[str, Any]:
    metrics: dict[str, Any] = {"output_throughput": 7000.0, "p99_tpot_ms": 8.1,
                               "p99_ttft_ms": 300.0, "completed": completed}
    if n_tpot is not None:
        metrics["num_tpot_samples"] = n_tpot
    return {"state": "complete", "params": {}, "flags": {}, "values": [30.0],
            "metrics": metrics, "steps": [], "failure_reason": None, "failure_message": None,
            "conclusion": "c", "argv": [], "env": {}, "verdict": None, "wall_s": 1.0,
            "is_baseline": False}


def _study(records: list[dict[str, Any]]) -> optuna.Study:
    study = optuna.create_study(direction="maximize")
    distribution = optuna.distributions.CategoricalDistribution([0, 1, 2])
    for k, record in enumerate(records):
        study.add_trial(optuna.trial.create_trial(
            params={"x": k}, distributions={"x": distribution}, value=30.0 + k,
            user_attrs={"record": record}))
    return study


def test_the_status_table_states_each_tpot_p99s_requests_and_marks_a_thin_one() -> None:
    rows = status_rows(_study([_record(37, completed=40), _record(1990), _record(None)])
                       .get_trials(deepcopy=False))
    assert [r.tpot_p99_num_requests for r in rows] == [37, 1990, None]
    assert [p99_cell(r.tpot_p99_ms, r.tpot_p99_num_requests) for r in rows] == \
        ["8.10 n=37 thin", "8.10 n=1,990", "8.10"]


def test_the_report_states_each_p99s_requests_and_the_rule(tmp_path: Path) -> None:
    cfg = parse_study({"name": "r", "model": {"path": "qwen2.5-7b"}, "budget": {"trials": 2},
                       "slo": {"tpot_p99_ms": 10}, "results_dir": str(tmp_path / "results"),
                       "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
                      path=tmp_path / "s.yaml")
    report = build_report(_study([_record(37, completed=40), _record(1990)]), cfg)
    assert [(r.tpot_p99_num_requests, r.ttft_p99_num_requests) for r in report.rows] == \
        [(37, 40), (1990, 2000)]
    md = render_markdown(report)
    assert "| 8.1 n=37 thin |" in md and "| 8.1 n=1,990 |" in md
    assert f"n: the requests each p99 is over; {THIN_RULE}." in md


def test_mlflow_tags_state_each_headline_p99s_requests_and_whether_one_is_thin() -> None:
    thin = TrialRecord.from_user_attr(_record(37, completed=40))
    tags = tracking_payload(thin, None, number=1)["tags"]
    assert tags[TAG_P99_BASIS] == ("TTFT p99 over 40 requests: thin, set by its two slowest; "
                                   "TPOT p99 over 37 requests: thin, set by its two slowest")
    assert tags[TAG_P99_THIN] == "true"
    solid = tracking_payload(TrialRecord.from_user_attr(_record(1990)), None, number=2)["tags"]
    assert solid[TAG_P99_THIN] == "false"
    metrics = tracking_payload(thin, None, number=1)["metrics"]
    assert metrics["headline.num_tpot_samples"] == 37, "the count itself stays a metric"


def test_the_live_table_states_a_finished_trials_tpot_p99_requests(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from optimizer.cli.live import LiveProgress
    from optimizer.run.events import TrialEvent

    cfg = parse_study({"name": "live", "model": {"path": "qwen2.5-7b"},
                       "budget": {"trials": 4}, "slo": {"tpot_p99_ms": 10},
                       "results_dir": str(tmp_path)})
    progress = LiveProgress(cfg)
    progress.on_event(TrialEvent("finished", 0, {}, "complete", 29.6, 8.1, "vLLM defaults",
                                 180.0, "memory-bound", tpot_p99_num_requests=37))
    text = io.StringIO()
    Console(file=text, width=220).print(progress)
    assert "8.10 n=37 thin" in text.getvalue()
