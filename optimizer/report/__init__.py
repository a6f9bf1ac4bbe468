"""The morning report of a study: the best config and its gain over vLLM's defaults measured in
the same study, the Pareto front (output throughput vs TPOT p99), parameter importances, every
trial's bottleneck label and conclusion, and failures by reason; as HTML and Markdown with PNG
plots (matplotlib), which the CLI also logs to the study's MLflow parent run. This package's
public face: callers import from here (`from optimizer.report import build_report, headline`).

Built from the trial records in Optuna's storage (the source of truth), so a report can be
written for a running, stopped or finished study, and again at any time. Modules: `build` (the
data: `TrialRow`, `Report`, `build_report`), `knobs` (which knobs mattered: one-change
effects, importances), `plots` (the PNGs), `render` (`headline`, Markdown, HTML,
`write_report`).
"""

from optimizer.report.build import Report, TrialRow, build_report, pareto_front
from optimizer.report.knobs import (
    TOO_FEW_FOR_IMPORTANCES,
    KnobEffect,
    OneKnob,
    importances_floor,
    knob_effects,
    one_knob,
)
from optimizer.report.render import (
    REPORT_FILES,
    headline,
    render_html,
    render_markdown,
    write_report,
)

__all__ = [
    "REPORT_FILES",
    "TOO_FEW_FOR_IMPORTANCES",
    "KnobEffect",
    "OneKnob",
    "Report",
    "TrialRow",
    "build_report",
    "headline",
    "importances_floor",
    "knob_effects",
    "one_knob",
    "pareto_front",
    "render_html",
    "render_markdown",
    "write_report",
]
