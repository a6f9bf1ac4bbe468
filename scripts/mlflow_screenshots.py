"""Screenshots of a finished study's MLflow pages, as a user opens them (docs/mlflow/*.png):
a real `mlflow server` on 127.0.0.1 over the study's store, rendered by headless Chromium.

    PYTHONPATH=. python scripts/mlflow_screenshots.py sqlite:///mlruns/mlflow.db quickstart OUT

(docs/mlflow/*.png are these, of the quickstart on 2026-12-06, cut to 1200 px and 96 colours.)

The study's runs view is brought up to date first (`Tracker.mark_experiment`), as a resume of
the study would."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import quote

from optimizer.tracking.tags import TAG_KIND, TAG_RECOMMENDED
from optimizer.tracking.tracker import Tracker
from optimizer.tracking.view import runs_page
from tests.optimizer.test_mlflow_ui import _mlflow_server, _screenshot


def main(uri: str, study: str, out: Path) -> None:
    if uri.startswith("sqlite:///"):  # the server runs elsewhere: an absolute path
        uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
    tracker = Tracker(uri)
    exp = tracker.client.get_experiment_by_name(study)
    assert exp is not None, f"no study {study!r} in {uri}"
    exp_id = str(exp.experiment_id)
    parent = tracker.client.search_runs([exp_id], f"tags.`{TAG_KIND}` = 'study'")[0]
    objective = str(parent.data.params.get("objective", "goodput")).split(",")[0]
    runs = tracker.client.search_runs([exp_id], f"tags.`{TAG_KIND}` = 'trial'",
                                      order_by=[f"metrics.`objective.{objective}` DESC"])
    # The searched params: those whose value differs between the trials.
    names = sorted({k for r in runs for k in r.data.params})
    searched = [k for k in names if len({r.data.params.get(k) for r in runs}) > 1]
    tracker.mark_experiment(exp_id, {objective: "maximize"}, searched)
    pick = next(r for r in runs if r.data.tags.get(TAG_RECOMMENDED) == "true")
    defaults = next(r for r in runs if r.data.tags.get("baseline") == "true")
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/nightshift-screenshots")
    work.mkdir(exist_ok=True)
    with _mlflow_server(uri, work) as server:
        ml = "workflowType=machine_learning"
        compare = json.dumps([pick.info.run_id, defaults.info.run_id, runs[1].info.run_id])
        pages = {
            "runs-view.png": runs_page(server, exp_id),
            "chart-view.png": runs_page(server, exp_id) + "&compareRunsMode=CHART",
            "recommended-run.png": f"{server}/#/experiments/{exp_id}/runs/{pick.info.run_id}?{ml}",
            "per-level-charts.png": f"{server}/#/experiments/{exp_id}/runs/{pick.info.run_id}/"
                                    f"model-metrics?{ml}",
            "compare.png": f"{server}/#/compare-runs?runs={quote(compare)}&experiments="
                           f"{quote(json.dumps([exp_id]))}&{ml}",
        }
        for name, url in pages.items():
            _screenshot(url, out / name, work)
            print(out / name, url)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
