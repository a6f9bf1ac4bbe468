"""The report's PNG plots (matplotlib, files only): throughput vs TPOT p99 with the Pareto
front (`pareto_figure`), the objective per trial, and parameter importances."""

from __future__ import annotations

import io
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from optimizer.report.build import Report
from optimizer.report.knobs import TOO_FEW_FOR_IMPORTANCES
from runners.atomic import write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

IMPORTANCES_TEXT_CHARS = 70  # a line of the importances' note, at 10 pt on its 7.5-inch figure
LABEL_COLOURS = {
    "compute-bound": "#d62728", "memory-bound": "#1f77b4", "communication-bound": "#9467bd",
    "launch-bound": "#ff7f0e", "kv-capacity-bound": "#8c564b", "at-physical-limit": "#2ca02c",
    "compute-and-memory-bound": "#e377c2",
}


def save_figure(fig: Figure, path: Path) -> None:
    """`fig` as a PNG at `path`, whole or not at all (a report cut by kill -9 keeps the plots
    it had)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    write_atomic(path, buffer.getvalue())


def write_plots(report: Report, out_dir: Path) -> None:
    import matplotlib.pyplot as plt

    fig = pareto_figure(report)
    save_figure(fig, out_dir / "pareto.png")
    plt.close(fig)
    _write_history_and_importances(report, out_dir)


def pareto_figure(report: Report) -> Figure:
    """Throughput against TPOT p99, coloured by bottleneck label, with the Pareto front drawn
    as the legend says: its trials boxed and joined (a front of one trial is a box)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    # (trial, TPOT p99 ms, output tok/s) of each measured complete trial
    points = [(r, r.p99_tpot_ms, r.output_throughput_per_gpu) for r in report.rows
              if r.state == "complete" and r.output_throughput_per_gpu and r.p99_tpot_ms]
    for label in sorted({r.label for r, _, _ in points}):
        group = [(x, y) for r, x, y in points if r.label == label]
        ax.scatter([x for x, _ in group], [y for _, y in group], s=36,
                   color=LABEL_COLOURS.get(label, "#7f7f7f"), label=label or "unclassified",
                   alpha=0.85)
    front = sorted((x, y) for r, x, y in points if r.number in report.pareto)
    if front:
        # Markers as well as the line: a front of one trial has no segment to draw.
        ax.plot([x for x, _ in front], [y for _, y in front], color="black", lw=1, ls="--",
                marker="s", markersize=10, markerfacecolor="none", markeredgewidth=1,
                label=f"Pareto front ({len(front)} trial{'s' if len(front) > 1 else ''})")
    for row, marker, name in ((report.baseline, "*", "defaults"), (report.best, "o", "best")):
        per_gpu = row.output_throughput_per_gpu if row is not None else None
        if row is not None and per_gpu and row.p99_tpot_ms:
            ax.scatter([row.p99_tpot_ms], [per_gpu], s=220, marker=marker,
                       facecolors="none", edgecolors="black", linewidths=1.4)
            ax.annotate(f"{name} (#{row.number})", (row.p99_tpot_ms, per_gpu),
                        textcoords="offset points", xytext=(8, 6), fontsize=8)
    if "tpot_p99_ms" in report.slo:
        ax.axvline(report.slo["tpot_p99_ms"], color="grey", lw=1, ls=":",
                   label=f"SLO TPOT p99 {report.slo['tpot_p99_ms']:g} ms")
    ax.set_xlabel("TPOT p99 (ms)")
    ax.set_ylabel("output throughput per GPU (tok/s)")
    ax.set_title("Throughput per GPU vs TPOT p99 (each trial's operating point)")
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def _write_history_and_importances(report: Report, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objective = report.objective
    # History: the objective per trial, by state, with the best so far and the defaults.
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=110)
    styles = {"complete": ("o", "#1f77b4"), "pruned": ("v", "#ff7f0e"), "failed": ("x", "#d62728")}
    for state, (marker, colour) in styles.items():
        rows = [r for r in report.rows if r.state == state]
        if rows:
            ax.scatter([r.number for r in rows], [r.value or 0.0 for r in rows],
                       marker=marker, color=colour, label=state, s=30)
    best_so_far: list[float] = []
    for r in report.rows:
        v = r.value if r.state == "complete" and r.value is not None else None
        prev = best_so_far[-1] if best_so_far else None
        if v is None:
            best_so_far.append(prev if prev is not None else math.nan)
        elif prev is None or math.isnan(prev):
            best_so_far.append(v)
        else:
            best_so_far.append(max(prev, v) if report.is_maximize else min(prev, v))
    ax.step([r.number for r in report.rows], best_so_far, where="post", color="black", lw=1,
            label="best so far")
    if report.baseline is not None and report.baseline.value is not None:
        ax.axhline(report.baseline.value, color="grey", ls="--", lw=1, label="defaults")
    ax.set_xlabel("trial")
    ax.set_ylabel(objective)
    ax.set_title(f"{objective} per trial (failed trials at 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    save_figure(fig, out_dir / "history.png")
    plt.close(fig)

    fig = importances_figure(report)
    save_figure(fig, out_dir / "importances.png")
    plt.close(fig)


def importances_figure(report: Report) -> Figure:
    """What moved the objective (fANOVA over the complete trials), or why nothing is ranked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    objective = report.objective
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * max(3, len(report.importances)) + 1), dpi=110)
    items = sorted(report.importances.items(), key=lambda kv: kv[1])
    if items:
        ax.barh([k for k, _ in items], [v for _, v in items], color="#1f77b4")
        ax.set_xlabel(f"importance for {objective} (fANOVA)")
    else:
        # Wrapped to the figure's width: one line of it ran off both edges.
        ax.text(0.5, 0.5, textwrap.fill(TOO_FEW_FOR_IMPORTANCES, IMPORTANCES_TEXT_CHARS),
                ha="center", va="center", transform=ax.transAxes, wrap=True)
        ax.set_axis_off()
    ax.set_title("Parameter importances")
    fig.tight_layout()
    return fig
