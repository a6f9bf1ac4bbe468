"""The morning report of a study: the best config and its gain over vLLM's defaults measured in
the same study, the Pareto front (output throughput vs TPOT p99), parameter importances, every
trial's bottleneck label and conclusion, and failures by reason; as HTML and Markdown with PNG
plots (matplotlib), which the CLI also logs to the study's MLflow parent run.

Built from the trial records in Optuna's storage (the source of truth), so a report can be
written for a running, stopped or finished study, and again at any time.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from optimizer import gains
from optimizer.config import StudyConfig
from optimizer.objectives import OBJECTIVES
from optimizer.records import capacity_text, objective_unit, shorten
from optimizer.study import (
    ATTR_CONFIRM,
    ATTR_RECORD,
    NOISE_FRACTION,
    best_trial,
    is_search_trial,
    no_baseline_reason,
    recommended_trial,
)
from runners.capacity import bracket_from_metrics
from runners.workload import Bracket

logger = logging.getLogger(__name__)

TOO_FEW_FOR_IMPORTANCES = ("too few complete trials to rank parameters (a ranking needs two more "
                           "than the parameters that varied, and at least 4)")
REPORT_FILES = ("report.html", "report.md", "pareto.png", "history.png", "importances.png")
_LABEL_COLOURS = {
    "compute-bound": "#d62728", "memory-bound": "#1f77b4", "communication-bound": "#9467bd",
    "launch-bound": "#ff7f0e", "kv-capacity-bound": "#8c564b", "at-physical-limit": "#2ca02c",
}


@dataclass(frozen=True)
class TrialRow:
    """One trial as the report shows it."""

    number: int
    state: str  # complete, pruned, failed, running, waiting
    changes: Mapping[str, Any]  # flags that differ from the defaults baseline's
    value: float | None  # the first objective
    output_throughput: float | None  # tok/s at the headline level
    p99_tpot_ms: float | None
    p99_ttft_ms: float | None
    startup_s: float | None
    wall_s: float | None
    label: str  # bottleneck label, "" when unclassified
    conclusion: str
    failure_reason: str
    is_baseline: bool
    capacity: Bracket | None = None  # after a capacity search: where its capacity lies
    conclusion_short: str = ""  # the conclusion for a table cell (<= ~70 characters)


@dataclass(frozen=True)
class Report:
    study: str
    objective: str
    is_maximize: bool
    is_simulated: bool  # figures from the simulated engine: never measurements
    rows: tuple[TrialRow, ...]
    baseline: TrialRow | None
    best: TrialRow | None
    pareto: tuple[int, ...]  # trial numbers on the throughput / TPOT p99 front
    importances: Mapping[str, float]
    failures: Mapping[str, int]  # failure reason -> trials
    slo: Mapping[str, float]
    confirm: str = ""  # the interleaved re-measurement of best vs defaults, when it ran
    queued: int = 0  # configs enqueued (seeds, a grid) that no worker has started yet
    recommended: TrialRow | None = None  # what `export` writes, when it is not the best
    no_baseline: str = ""  # why the defaults could not be measured (no gain is stated then)
    generated: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))

    @property
    def gain(self) -> float | None:
        """How many times better the best is than the defaults (>1 = better), or None: the
        point only; `gain_bounds` says what bounds it."""
        bounds = self.gain_bounds
        return bounds.value if bounds is not None else None

    @property
    def gain_bounds(self) -> gains.Gain | None:
        """The best's gain over the defaults with its bounds: the ratio their capacity
        brackets allow after a capacity search, else one measurement each (no bounds)."""
        if self.best is None or self.baseline is None:
            return None
        if self.best.capacity is not None and self.baseline.capacity is not None:
            return gains.capacity_gain(self.best.capacity, self.baseline.capacity)
        return gains.point_gain(self.best.value, self.baseline.value,
                                maximize=self.is_maximize)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _row(trial: FrozenTrial, baseline_flags: Mapping[str, Any],
         axis: str | None = None) -> TrialRow:
    record: Mapping[str, Any] = trial.user_attrs.get(ATTR_RECORD) or {}
    metrics: Mapping[str, Any] = record.get("metrics") or {}
    flags: Mapping[str, Any] = record.get("flags") or {}
    changes = {k: v for k, v in flags.items() if baseline_flags.get(k) != v}
    values = record.get("values") or (trial.values if trial.state == TrialState.COMPLETE
                                      else None)
    value = _number(values[0]) if values else None
    if value is None and trial.state == TrialState.PRUNED:
        value = _number(trial.intermediate_values.get(max(trial.intermediate_values, default=0)))
    verdict = record.get("verdict") or {}
    return TrialRow(
        number=trial.number,
        state=str(record.get("state") or trial.state.name.lower()),
        changes=changes, value=value,
        output_throughput=_number(metrics.get("output_throughput")),
        p99_tpot_ms=_number(metrics.get("p99_tpot_ms")),
        p99_ttft_ms=_number(metrics.get("p99_ttft_ms")),
        startup_s=_number(metrics.get("engine.startup_s")),
        wall_s=_number(record.get("wall_s")),
        label=str(verdict.get("label") or ""),
        conclusion=str(record.get("conclusion") or ""),
        failure_reason=str(record.get("failure_reason") or ""),
        is_baseline=bool(record.get("is_baseline") or trial.user_attrs.get("baseline")),
        capacity=bracket_from_metrics(axis, metrics)  # type: ignore[arg-type]
        if axis in ("concurrency", "request_rate") else None,
        conclusion_short=str(record.get("conclusion_short") or ""),
    )


def pareto_front(rows: Sequence[TrialRow]) -> tuple[int, ...]:
    """Complete trials no other beats on both output throughput (higher) and TPOT p99 (lower)."""
    points: list[tuple[int, float, float]] = [
        (r.number, r.output_throughput, r.p99_tpot_ms) for r in rows
        if r.state == "complete" and r.output_throughput is not None
        and r.p99_tpot_ms is not None]
    front = []
    for number, tput, tpot in points:
        dominated = any(t2 >= tput and p2 <= tpot and (t2 > tput or p2 < tpot)
                        for n2, t2, p2 in points if n2 != number)
        if not dominated:
            front.append(number)
    return tuple(sorted(front))


def importances_floor(trials: Sequence[optuna.trial.FrozenTrial]) -> int:
    """How many complete trials a ranking of parameters needs: one observation per varied
    parameter's main effect, one for the mean and one for noise, and never fewer than 4. With
    fewer, fANOVA still returns numbers (a 2-trial study ranked two parameters 0.59 and 0.41),
    but they describe which value the two trials happened to differ in, not an effect."""
    varied = {name for name in {k for t in trials for k in t.params}
              if len({repr(t.params.get(name)) for t in trials}) > 1}
    return max(4, len(varied) + 2)


def _importances(study: optuna.Study) -> dict[str, float]:
    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if is_search_trial(t)]
    if len(complete) < importances_floor(complete):
        logger.info("no parameter importances: %d complete trials, fewer than the %d a ranking "
                    "needs", len(complete), importances_floor(complete))
        return {}
    try:
        # fANOVA explains the variance of the objective, whichever way it is optimised.
        return {k: float(v) for k, v in optuna.importance.get_param_importances(
            study, target=lambda t: t.values[0],
            evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0)).items()}
    except (RuntimeError, ValueError) as exc:  # e.g. one param value only: nothing to rank
        logger.info("no parameter importances: %s", exc)
        return {}


def build_report(study: optuna.Study, cfg: StudyConfig, *,
                 with_importances: bool = True) -> Report:
    # A repeat of a measured config launched nothing: its original stands for it. The final
    # interleaved re-measurements are reported as the confirmation, not as trials.
    # Enqueued configs no worker has started (a grid's or the seeds' tail) are counted, not rows.
    trials = [t for t in study.get_trials(deepcopy=False) if is_search_trial(t)]
    queued = sum(t.state == TrialState.WAITING for t in trials)
    trials = [t for t in trials if t.state != TrialState.WAITING]
    baseline_trial = next((t for t in trials if t.user_attrs.get("baseline")
                           and t.state == TrialState.COMPLETE), None)
    baseline_flags = ((baseline_trial.user_attrs.get(ATTR_RECORD) or {}).get("flags") or {}
                      if baseline_trial is not None else {})
    capacity = cfg.spec.workload.capacity
    axis = capacity.axis if capacity is not None else None
    rows = tuple(_row(t, baseline_flags, axis) for t in trials)
    objective = cfg.objectives[0]
    is_max = OBJECTIVES[objective].direction == "maximize"
    # The study's own best: one that met the SLO somewhere, when any did (constraint "slo").
    chosen = best_trial(study)
    best = next((r for r in rows if chosen is not None and r.number == chosen.number
                 and r.state == "complete"), None)
    baseline = next((r for r in rows if r.is_baseline and r.state == "complete"), None)
    pick = recommended_trial(study)
    recommended = next((r for r in rows if pick is not None and r.number == pick.number
                        and best is not None and r.number != best.number), None)
    argv_texts = [" ".join((t.user_attrs.get(ATTR_RECORD) or {}).get("argv") or [])
                  for t in trials]
    slo = {k: float(v) for k, v in cfg.spec.slo.model_dump().items() if v is not None}
    return Report(
        study=cfg.name, objective=objective, is_maximize=is_max,
        is_simulated=any("runners.simulated" in a for a in argv_texts),
        rows=rows, baseline=baseline, best=best, pareto=pareto_front(rows),
        importances=_importances(study) if with_importances else {},
        failures=dict(Counter(r.failure_reason for r in rows
                              if r.state == "failed" and r.failure_reason)),
        slo=slo, confirm=_confirmation(study, axis),
        queued=queued, recommended=recommended,
        no_baseline=no_baseline_reason(study) or "")


def _confirmation(study: optuna.Study, axis: str | None) -> str:
    """The re-measurement's sentence; after a capacity search, also the capacity ratio every
    round's two brackets allow (each round's runs re-bracket both configs, so the ratio lies
    in each round's range, hence in their overlap)."""
    sentence = str((study.user_attrs.get("confirm") or {}).get("sentence") or "")
    if not sentence or axis not in ("concurrency", "request_rate"):
        return sentence
    runs = sorted((t for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get(ATTR_CONFIRM) and t.state == TrialState.COMPLETE),
                  key=lambda t: t.number)
    brackets: dict[str, list[Bracket]] = {"defaults": [], "best": []}
    for t in runs:
        metrics = (t.user_attrs.get(ATTR_RECORD) or {}).get("metrics") or {}
        bracket = bracket_from_metrics(axis, metrics)  # type: ignore[arg-type]
        label = str(t.user_attrs[ATTR_CONFIRM])
        if bracket is not None and label in brackets:
            brackets[label].append(bracket)
    rounds = [gains.capacity_gain(b, d) for d, b in zip(brackets["defaults"], brackets["best"],
                                                         strict=False)]
    if not rounds:
        return sentence
    lows = [g.low for g in rounds if g.low is not None]
    highs = [g.high for g in rounds if g.high is not None]
    low, high = (max(lows) if lows else None), (min(highs) if highs else None)
    if low is not None and high is not None and low > high:
        return (f"{sentence}; the re-measured capacity brackets disagree between rounds "
                "(no common ratio): noise beyond the brackets")
    overlap = gains.format_gain(gains.Gain(None, low, high, "capacity"))
    return f"{sentence}; re-measured capacity brackets, in every one of {len(rounds)} " \
        f"rounds: {overlap}"


# --- plots ----------------------------------------------------------------------------------


def _plots(report: Report, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    objective = report.objective
    # Pareto: throughput against TPOT p99, coloured by bottleneck label.
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    # (trial, TPOT p99 ms, output tok/s) of each measured complete trial
    points = [(r, r.p99_tpot_ms, r.output_throughput) for r in report.rows
              if r.state == "complete" and r.output_throughput and r.p99_tpot_ms]
    for label in sorted({r.label for r, _, _ in points}):
        group = [(x, y) for r, x, y in points if r.label == label]
        ax.scatter([x for x, _ in group], [y for _, y in group], s=36,
                   color=_LABEL_COLOURS.get(label, "#7f7f7f"), label=label or "unclassified",
                   alpha=0.85)
    front = sorted((x, y) for r, x, y in points if r.number in report.pareto)
    if front:
        ax.plot([x for x, _ in front], [y for _, y in front], color="black", lw=1, ls="--",
                label="Pareto front")
    for row, marker, name in ((report.baseline, "*", "defaults"), (report.best, "o", "best")):
        if row is not None and row.output_throughput and row.p99_tpot_ms:
            ax.scatter([row.p99_tpot_ms], [row.output_throughput], s=220, marker=marker,
                       facecolors="none", edgecolors="black", linewidths=1.4)
            ax.annotate(f"{name} (#{row.number})", (row.p99_tpot_ms, row.output_throughput),
                        textcoords="offset points", xytext=(8, 6), fontsize=8)
    if "tpot_p99_ms" in report.slo:
        ax.axvline(report.slo["tpot_p99_ms"], color="grey", lw=1, ls=":",
                   label=f"SLO TPOT p99 {report.slo['tpot_p99_ms']:g} ms")
    ax.set_xlabel("TPOT p99 (ms)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("Throughput vs TPOT p99 (headline load level)")
    ax.grid(alpha=0.3)
    if points:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out_dir / "pareto.png")
    plt.close(fig)

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
    fig.savefig(out_dir / "history.png")
    plt.close(fig)

    # Importances: what moved the objective (fANOVA over the complete trials).
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * max(3, len(report.importances)) + 1), dpi=110)
    items = sorted(report.importances.items(), key=lambda kv: kv[1])
    if items:
        ax.barh([k for k, _ in items], [v for _, v in items], color="#1f77b4")
        ax.set_xlabel(f"importance for {objective} (fANOVA)")
    else:
        ax.text(0.5, 0.5, TOO_FEW_FOR_IMPORTANCES, ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
    ax.set_title("Parameter importances")
    fig.tight_layout()
    fig.savefig(out_dir / "importances.png")
    plt.close(fig)


# --- text -----------------------------------------------------------------------------------


def _with_unit(value: float | None, objective: str) -> str:
    return f"{_fmt(value)} {objective_unit(objective)}".rstrip()


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"


def _changes(row: TrialRow) -> str:
    if row.is_baseline:
        return "(vLLM defaults)"
    return ", ".join(f"{k}={v}" for k, v in row.changes.items()) or "(same flags as defaults)"


def _bracket(row: TrialRow) -> str:
    if row.capacity is None:
        return ""
    return capacity_text(row.capacity, None)


def headline(report: Report) -> str:
    """One sentence: the best config and its gain over the defaults, with what bounds it."""
    missing = (f" No baseline: the defaults could not be measured ({report.no_baseline})."
               if report.no_baseline else "")
    if report.best is None:
        return "No trial has completed yet." + missing
    best = report.best
    text = (f"Best: trial {best.number} ({_changes(best)}), {report.objective} "
            f"{_with_unit(best.value, report.objective)}")
    if best.capacity is not None:
        text += f" ({_bracket(best)})"
    bounds = report.gain_bounds
    if bounds is not None and report.baseline is not None and \
            best.number != report.baseline.number:
        base = report.baseline
        base_capacity = f", {_bracket(base)}" if base.capacity is not None else ""
        text += (f", {gains.format_gain(bounds)} (trial {base.number}: "
                 f"{_with_unit(base.value, report.objective)}{base_capacity}) measured in the "
                 "same study")
    if best.label:
        text += f"; {best.label}"
    text += "." + missing
    if report.recommended is not None:
        text += (f" Recommended: trial {report.recommended.number} "
                 f"({_changes(report.recommended)}), "
                 f"{_with_unit(report.recommended.value, report.objective)}: within "
                 f"{NOISE_FRACTION:.0%} of the best with fewer changes from the defaults.")
    if report.confirm:
        text += f" Re-measured: {report.confirm}."
    return text


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>nightshift report: {{ r.study }}</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
 h1 { margin-bottom: 0.2em; } .meta { color: #666; }
 .banner { background: #fff3cd; border: 1px solid #e0c36a; padding: 0.6em 1em; margin: 1em 0; }
 .headline { font-size: 1.15em; background: #eef6ee; border-left: 4px solid #2ca02c;
             padding: 0.6em 1em; }
 table { border-collapse: collapse; width: 100%; font-size: 0.85em; margin: 0.5em 0 1.5em; }
 th, td { border-bottom: 1px solid #ddd; padding: 4px 6px; text-align: left;
          vertical-align: top; }
 th { background: #f4f4f4; } td.num { text-align: right; white-space: nowrap; }
 tr.best td { background: #eef6ee; } tr.baseline td { background: #f3f3fb; }
 .label { border-radius: 3px; padding: 1px 5px; color: white; font-size: 0.9em;
          white-space: nowrap; }
 img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
 .plots { display: grid; grid-template-columns: 1fr 1fr; gap: 1em; }
</style></head><body>
<h1>nightshift report: {{ r.study }}</h1>
<p class="meta">objective: {{ r.objective }} ({{ "higher" if r.is_maximize else "lower" }} is
better){% if r.slo %}; SLO: {% for k, v in r.slo.items() %}{{ k }} {{ v }}{% if not loop.last
%}, {% endif %}{% endfor %}{% endif %}; {{ r.rows|length }} trials{% if r.queued %}
({{ r.queued }} more queued, not run yet){% endif %}; written {{ r.generated }}</p>
{% if r.is_simulated %}<div class="banner" id="simulated"><b>Simulated engine.</b> These figures
come from nightshift's roofline model of the config and hardware, not from a GPU: they test the
pipeline, they are not measurements.</div>{% endif %}
<p class="headline" id="headline">{{ headline }}</p>
<div class="plots">
 <img src="pareto.png" alt="Pareto front: output throughput vs TPOT p99">
 <img src="history.png" alt="objective per trial">
</div>
<h2>Pareto front (throughput vs TPOT p99)</h2>
<table id="pareto"><tr><th>trial</th><th>change vs defaults</th><th>out tok/s</th>
<th>TPOT p99 ms</th><th>TTFT p99 ms</th><th>bottleneck</th></tr>
{% for row in front %}<tr><td>{{ row.number }}</td><td>{{ changes(row) }}</td>
<td class="num">{{ fmt(row.output_throughput) }}</td>
<td class="num">{{ fmt(row.p99_tpot_ms) }}</td>
<td class="num">{{ fmt(row.p99_ttft_ms) }}</td><td>{{ row.label }}</td></tr>
{% endfor %}</table>
<p>Export a point of the front: <code>nightshift export STUDY.yaml --max-tpot-ms N</code>
(the best {{ r.objective }} whose TPOT p99 is at most N) or <code>--trial N</code>.</p>
<h2>Every trial</h2>
<table id="trials"><tr><th>trial</th><th>state</th><th>change vs defaults</th>
<th>{{ r.objective }} {{ unit }}</th><th>out tok/s</th><th>TPOT p99 ms</th><th>TTFT p99 ms</th>
<th>start-up s</th><th>bottleneck</th><th>conclusion</th></tr>
{% for row in r.rows %}<tr class="{{ 'best' if r.best and row.number == r.best.number else
 ('baseline' if row.is_baseline else '') }}"><td>{{ row.number }}</td><td>{{ row.state }}</td>
<td>{{ changes(row) }}</td><td class="num">{{ fmt(row.value) }}</td>
<td class="num">{{ fmt(row.output_throughput) }}</td>
<td class="num">{{ fmt(row.p99_tpot_ms) }}</td>
<td class="num">{{ fmt(row.p99_ttft_ms) }}</td><td class="num">{{ fmt(row.startup_s) }}</td>
<td>{% if row.label %}<span class="label" style="background: {{ colours.get(row.label, '#7f7f7f')
}}">{{ row.label }}</span>{% endif %}</td><td title="{{ row.conclusion }}">{{ short(row)
}}</td></tr>
{% endfor %}</table>
<h2>Parameter importances</h2>
{% if r.importances %}<img src="importances.png" alt="parameter importances"
style="max-width: 700px">{% else %}<p>{{ too_few }}</p>{% endif %}
<h2>Bottlenecks</h2>
<table id="labels"><tr><th>label</th><th>trials</th></tr>
{% for label, numbers in labels.items() %}<tr><td>{{ label }}</td><td>{{ numbers|join(", ") }}</td>
</tr>{% endfor %}</table>
<h2>Failures by reason</h2>
{% if r.failures %}<table id="failures"><tr><th>reason</th><th>trials</th></tr>
{% for reason, count in r.failures.items() %}<tr><td>{{ reason }}</td><td class="num">{{ count }}
</td></tr>{% endfor %}</table>{% else %}<p>No trial failed.</p>{% endif %}
</body></html>
"""


def _labels(report: Report) -> dict[str, list[int]]:
    labels: dict[str, list[int]] = {}
    for row in report.rows:
        if row.label:
            labels.setdefault(row.label, []).append(row.number)
    return labels


def render_html(report: Report) -> str:
    import jinja2

    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    front = [r for r in report.rows if r.number in report.pareto]
    return env.from_string(_HTML).render(
        r=report, headline=headline(report), front=front, changes=_changes, fmt=_fmt,
        short=_short, too_few=TOO_FEW_FOR_IMPORTANCES, unit=objective_unit(report.objective),
        colours=_LABEL_COLOURS, labels=_labels(report))


def _short(row: TrialRow) -> str:
    """A table's conclusion: the short form the daemon stored, else the full one cut."""
    return row.conclusion_short or shorten(row.conclusion)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    lines = [f"# nightshift report: {report.study}", ""]
    if report.is_simulated:
        lines += ["> **Simulated engine**: figures come from a roofline model, not a GPU; "
                  "they are not measurements.", ""]
    slo = ", ".join(f"{k} {v:g}" for k, v in report.slo.items())
    lines += [f"Objective: {report.objective}" + (f"; SLO: {slo}" if slo else "") +
              f"; {len(report.rows)} trials" +
              (f" ({report.queued} more queued, not run yet)" if report.queued else "") +
              f"; written {report.generated}.", "",
              headline(report), "", "![Pareto front](pareto.png)", "",
              "![objective per trial](history.png)", "", "## Pareto front", "",
              "| trial | change vs defaults | out tok/s | TPOT p99 ms | bottleneck |",
              "|---|---|---|---|---|"]
    for row in report.rows:
        if row.number in report.pareto:
            lines.append(f"| {row.number} | {_md_cell(_changes(row))} | "
                         f"{_fmt(row.output_throughput)} | {_fmt(row.p99_tpot_ms)} | "
                         f"{row.label} |")
    lines += ["", "## Every trial", "",
              f"| trial | state | change vs defaults | {report.objective} "
              f"{objective_unit(report.objective)} | out tok/s | "
              "TPOT p99 ms | bottleneck | conclusion |", "|---|---|---|---|---|---|---|---|"]
    for row in report.rows:
        lines.append(f"| {row.number} | {row.state} | {_md_cell(_changes(row))} | "
                     f"{_fmt(row.value)} | {_fmt(row.output_throughput)} | "
                     f"{_fmt(row.p99_tpot_ms)} | {row.label} | {_md_cell(_short(row))} |")
    lines += ["", "## Parameter importances", "", "![importances](importances.png)", ""]
    for name, value in sorted(report.importances.items(), key=lambda kv: -kv[1]):
        lines.append(f"- {name}: {value:.2f}")
    if not report.importances:
        lines.append(TOO_FEW_FOR_IMPORTANCES + ".")
    lines += ["", "## Failures by reason", ""]
    lines += [f"- {reason}: {count}" for reason, count in report.failures.items()] or \
        ["No trial failed."]
    return "\n".join(lines) + "\n"


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Write the HTML, Markdown and PNGs into `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _plots(report, out_dir)
    (out_dir / "report.html").write_text(render_html(report))
    (out_dir / "report.md").write_text(render_markdown(report))
    return [out_dir / name for name in REPORT_FILES]
