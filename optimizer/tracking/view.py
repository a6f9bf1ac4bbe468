"""The study's runs table in MLflow's UI: the saved view (`runs_view`: the trials best first,
the review columns, the charts) and its address (`runs_page`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from optimizer.results.objectives import OBJECTIVES
from optimizer.tracking.tags import TAG_KIND

# A saved view of the runs table (MLflow 3.17: the experiment tag `mlflow.sharedViewState.<key>`
# holding `{name, createdAt, updatedAt, state}`, opened by `?viewStateShareKey=<key>` or from the
# page's Views menu): the trials without the parent, best first, with the columns that matter.
VIEW_KEY = "nightshift"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
# The headline figures a view shows after the review columns (`view_keys`: the objective and
# the gain vs the defaults, 3 significant digits, then the bottleneck).
VIEW_METRICS = ("headline.p99_ttft_ms", "headline.p99_tpot_ms", "headline.output_throughput")
VIEW_TAGS = ("state",)
# MLflow 3.17's runs table groups columns (attributes, metrics, tags) and sorts each group by
# name; the view's `columnOrder` (ag-grid column ids, as `selectedColumns` names them) puts the
# review columns first. Metric names allow no brackets.
# A trial's first objective over the defaults' (> 1 better), per GPU for a rate.
VIEW_GAIN = "gain vs defaults x"


def view_key(objective: str) -> str:
    """The review column of `objective`: its value in its unit, 3 significant digits
    (`goodput in req per s`)."""
    from optimizer.results.objectives import OBJECTIVES

    unit = OBJECTIVES[objective].unit if objective in OBJECTIVES else ""
    # A rate is told per GPU (objectives.per_gpu), as the value Optuna holds.
    if objective in OBJECTIVES and OBJECTIVES[objective].is_per_gpu:
        unit += " per GPU"
    # "/" would make MLflow's charts file it in a section of its own ("goodput in req").
    unit = unit.replace("/", " per ")
    return f"{objective} in {unit}" if unit else objective


def three_digits(value: float) -> float:
    """`value` to 3 significant digits, as the review columns show it."""
    return float(f"{value:.3g}")


# The chart view's cards (MLflow 3.17's RunsChartsCardConfig, as its UI serializes them): a
# parallel-coordinates chart of the searched params against the objective (MLflow's own
# default plots the first metric by name, `headline.completed`), then each load level's
# figures as lines over the level (step).
VIEW_SECTION = "nightshift-review"
VIEW_LEVEL_METRICS = ("request_goodput", "output_throughput", "p99_tpot_ms", "p99_ttft_ms")


def _chart_cards(objectives: Sequence[str], params: Sequence[str]) -> list[dict[str, Any]]:
    base = {"runsCountToCompare": 50, "metricSectionId": VIEW_SECTION, "deleted": False,
            "isGenerated": False}
    cards: list[dict[str, Any]] = [{
        **base, "uuid": "nightshift-parallel", "type": "PARALLEL",
        "displayName": "searched flags vs the objective",
        "selectedParams": list(params)[:8],
        "selectedMetrics": [view_key(o) for o in objectives][:2], "showAllRuns": False}]
    for key in VIEW_LEVEL_METRICS:
        cards.append({
            **base, "uuid": f"nightshift-level-{key}", "type": "LINE", "metricKey": key,
            "selectedMetricKeys": [key], "displayName": f"{key} by load level",
            "lineSmoothness": 0, "xAxisScaleType": "linear", "scaleType": "linear",
            "range": {}, "xAxisKey": "step", "selectedXAxisMetricKey": "",
            "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False,
            "useGlobalXaxisKey": False, "useGlobalLineSmoothing": True})
    return cards


def runs_view(objectives: Mapping[str, str], params: Sequence[str] = ()) -> dict[str, Any]:
    """The runs table's state for a study with `objectives` (name -> "maximize"/"minimize"):
    the trials without the parent run, best first; the columns the objectives' review figures,
    the gain vs the defaults, the bottleneck, whether it is the recommended trial, the
    description (its figure first), then the headline latencies and throughput; sorted by
    the first objective's exact value. Its chart view: `params` (the searched ones) against
    the objectives in parallel coordinates, and the load levels' figures as lines."""
    first = next(iter(objectives), None)
    state: dict[str, Any] = {
        "searchFilter": f"tags.`{TAG_KIND}` != 'study'",
        "selectedColumns": [*(f"metrics.`{view_key(o)}`" for o in objectives),
                            f"metrics.`{VIEW_GAIN}`", "tags.`bottleneck`",
                            "tags.`nightshift.recommended`", "attributes.`Description`",
                            *(f"metrics.`{m}`" for m in VIEW_METRICS),
                            *(f"tags.`{t}`" for t in VIEW_TAGS)],
    }
    # The review columns before the description, which is given less room: it is cut anyway,
    # and its figure comes first.
    state["compareRunCharts"] = _chart_cards(list(objectives), params)
    state["compareRunSections"] = [{"uuid": VIEW_SECTION, "name": "nightshift review",
                                    "display": True, "isReordered": False, "deleted": False,
                                    "isGenerated": False}]
    review = state["selectedColumns"][:len(objectives) + 3]
    state["columnOrder"] = [*review, "attributes.`Description`"]
    state["columnWidths"] = {**{c: 150 for c in review}, "attributes.`Description`": 240}
    if first is not None:
        # Sorted by the value Optuna holds: per GPU for a rate (objectives.per_gpu).
        told = "per_gpu" if first in OBJECTIVES and OBJECTIVES[first].is_per_gpu else ""
        state.update(orderByKey=f"metrics.`objective.{first}{'.' + told if told else ''}`",
                     orderByAsc=objectives[first] == "minimize")
    return state


def runs_page(server_url: str, experiment_id: str) -> str:
    """The study's runs table in the MLflow UI at `server_url` (`mlflow ui` prints it), with
    nightshift's view: the trials, best first, their conclusions and headline figures."""
    return (f"{server_url.rstrip('/')}/#/experiments/{experiment_id}/runs?"
            f"viewStateShareKey={VIEW_KEY}&workflowType=machine_learning")
