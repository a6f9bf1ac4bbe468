"""The report as text: the `headline` sentence, Markdown and HTML (jinja2), and `write_report`,
which writes them with the plots into one folder."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

from optimizer.report.build import Report, TrialRow
from optimizer.report.knobs import TOO_FEW_FOR_IMPORTANCES, left_out_text
from optimizer.report.plots import LABEL_COLOURS, write_plots
from optimizer.results import gains
from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.conclusion import capacity_text, shorten
from optimizer.results.objectives import OBJECTIVES, PER_GPU_RULE, on_all_gpus, value_unit
from optimizer.results.recommendation import NOISE_FRACTION
from optimizer.results.tail_samples import LATENCY_HEADERS, THIN_RULE, P99Basis, slo_latencies
from optimizer.results.trial_record import objective_unit
from runners.atomic import write_atomic

KNOB_EFFECTS_INTRO = (
    "Trials that changed one knob alone from the {short}, each against the {short} measured "
    "in this study, largest effect first: that knob's effect at the {short}, not combined "
    "with others. The spread is the larger of the two trials' spreads over their repeats on "
    "one server ((max - min) / median; of two repeats, the larger), not a start-to-start "
    "interval.")

REPORT_FILES = ("report.html", "report.md", "pareto.png", "history.png", "importances.png")


def _with_unit(value: float | None, objective: str) -> str:
    return f"{_fmt(value)} {objective_unit(objective)}".rstrip()


def _figure(row: TrialRow, objective: str) -> str:
    """A trial's value with its unit; for a rate on more than one GPU, as measured and per GPU
    (`14.5 req/s on 2 GPUs = 7.25 req/s per GPU`): the per-GPU figure is what is compared."""
    if row.value is None or row.num_gpus <= 1 or not OBJECTIVES[objective].is_per_gpu:
        return _with_unit(row.value, objective)
    return (f"{_with_unit(on_all_gpus(objective, row.value, row.num_gpus), objective)} on "
            f"{row.num_gpus} GPUs = {_with_unit(row.value, objective)} per GPU")


def _figure_at(row: TrialRow, report: Report) -> str:
    """`_figure` of the best or the baseline as the headline shows it: where their gain was
    taken at one load (`Gain.load`) or at none, with its operating point's load named and its
    figure at the load compared beside it; else as it is (each at its config's best)."""
    text = _figure(row, report.objective)
    bounds, loads = report.gain_bounds, row.loads
    if bounds is None or loads is None or (bounds.load is None and not bounds.not_comparable):
        return text
    if loads.operating is not None:
        text += f" at {loads.operating}"
    if bounds.load is not None and bounds.load != loads.operating:
        there = replace(row, value=loads.value_at(bounds.load))
        text += f" and {_figure(there, report.objective)} at {bounds.load}"
    return text


def _gain_text(report: Report) -> str:
    """The best's gain over the defaults, per GPU (said so where a side used more than one GPU,
    with the ratio as measured beside it)."""
    bounds = report.gain_bounds
    if bounds is None:
        return ""
    words = report.baseline_words
    whole = report.gain_as_measured
    if whole is None:
        return gains.format_gain(bounds, words.the)
    best, base = report.best, report.baseline
    assert best is not None and base is not None  # a gain has both
    measured = f"{whole.value:.2f}x" if whole.value is not None else "no ratio"
    return (f"{gains.format_gain(bounds, f'{words.the} per GPU')}; {measured} as "
            f"measured, on {best.num_gpus} GPU{'s' if best.num_gpus != 1 else ''} against "
            f"the {words.short} on {base.num_gpus} GPU{'s' if base.num_gpus != 1 else ''}")


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return ""
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}"


def _p99(value: float | None, num_requests: int | None) -> str:
    """A p99 cell with the requests it is over: `15.4 n=2,000`, `15.4 n=37 thin`
    (optimizer/results/tail_samples.py)."""
    shown = _fmt(value)
    if not shown or num_requests is None:
        return shown
    return f"{shown} {P99Basis(num_requests).cell}"


def _changes(row: TrialRow, words: BaselineWords = DEFAULTS, *,
             in_sentence: bool = False) -> str:
    """A trial's flags beyond the baseline's (vLLM's defaults, with the study's fixed flags
    where it has any): a table cell, or (`in_sentence`) words for inside the headline's
    parentheses, the baseline named with its fixed flags."""
    if row.is_baseline:
        return words.in_parens if in_sentence else words.cell
    listed = ", ".join(f"{k}={v}" for k, v in row.changes.items())
    same = "the defaults' flags" if not words.has_fixed_flags else "the baseline's flags"
    return listed or (same if in_sentence else f"(same flags as {words.short})")


def _bracket(row: TrialRow) -> str:
    if row.capacity is None:
        return ""
    return capacity_text(row.capacity, None)


def best_tags(report: Report) -> dict[str, str]:
    """The best trial as `nightshift history` shows it (the study run's `best.*` tags): its
    change from the defaults, its figure with its capacity bracket, and the gain over the
    defaults with what bounds it (absent without a baseline or when the best is the defaults)."""
    best = report.best
    if best is None:
        return {}
    metric = f"{report.objective} {_figure_at(best, report)}"
    if best.capacity is not None:
        metric += f" ({_bracket(best)})"
    if report.no_slo_met:  # the best measured missed the SLO: no best config to show
        return {"best.change": "none: no trial met the SLO",
                "best.metric": f"{metric}, missed the SLO"}
    tags = {"best.change": _changes(best, report.baseline_words), "best.metric": metric}
    bounds = report.gain_bounds
    if bounds is not None and report.baseline is not None and \
            best.number != report.baseline.number:
        tags["best.gain"] = _gain_text(report)
    return tags


def headline(report: Report) -> str:
    """One sentence: the best config and its gain over the baseline (the vLLM defaults, or
    them + the study's fixed flags), with what bounds it."""
    words = report.baseline_words
    missing = (f" No baseline: {words.the} could not be measured ({report.no_baseline})."
               if report.no_baseline else "")
    if report.best is None:
        return "No trial has completed yet." + missing
    if report.no_slo_met:
        # No best and no recommendation: a config that met the SLO nowhere is no result.
        text = report.no_slo_met[0].upper() + report.no_slo_met[1:] + "." + missing
        return text + (f" {_rerun(report)}: {report.confirm}." if report.confirm else "")
    best = report.best
    text = (f"Best: trial {best.number} ({_changes(best, words, in_sentence=True)}), "
            f"{report.objective} {_figure_at(best, report)}")
    if best.capacity is not None:
        text += f" ({_bracket(best)})"
    bounds = report.gain_bounds
    if bounds is not None and report.baseline is not None and \
            best.number != report.baseline.number:
        base = report.baseline
        base_capacity = f", {_bracket(base)}" if base.capacity is not None else ""
        text += (f", {_gain_text(report)} (trial {base.number}: "
                 f"{_figure_at(base, report)}{base_capacity}) measured in the "
                 "same study")
    if best.label:
        text += f"; {best.label}"
    text += "." + missing
    if report.recommended is not None:
        text += (f" Recommended: trial {report.recommended.number} "
                 f"({_changes(report.recommended, words, in_sentence=True)}), "
                 f"{_figure(report.recommended, report.objective)}: "
                 + (report.recommended_why.split(": ", 1)[-1].split("; `--trial")[0]
                    if report.recommended_why else f"within {NOISE_FRACTION:.0%} of the best "
                    f"with fewer changes from the {words.short}") + ".")
    if report.confirm:
        text += f" {_rerun(report)}: {report.confirm}."
    return text


def _rerun(report: Report) -> str:
    """What the final repeats are called: a model's repeats are not a re-measurement."""
    return "Re-run (simulated)" if report.is_simulated else "Re-measured"


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
better; {{ per_gpu_rule }}){% if r.slo %}; SLO: {% for k, v in r.slo.items() %}{{ k }}
{{ v }}{% if not loop.last %}, {% endif %}{% endfor %}{% endif %};
<span id="counts">{{ counts }}</span>; written {{ r.generated }}</p>
{% if r.baseline_words.has_fixed_flags %}<p class="meta" id="baseline">Baseline:
{{ r.baseline_words.name }}; every trial runs these fixed flags too.</p>{% endif %}
{% if r.is_simulated %}<div class="banner" id="simulated"><b>Simulated engine.</b> These figures
come from nightshift's roofline model of the config and hardware, not from a GPU: they test the
pipeline, they are not measurements.</div>{% endif %}
<p class="headline" id="headline">{{ headline }}</p>
<div class="plots">
 <img src="pareto.png" alt="Pareto front: output throughput vs TPOT p99">
 <img src="history.png" alt="objective per trial">
</div>
<h2>Pareto front (throughput vs TPOT p99)</h2>
<table id="pareto"><tr><th>trial</th><th>change vs {{ r.baseline_words.short }}</th>
<th>out tok/s/GPU</th><th>TPOT p99 ms</th><th>TTFT p99 ms</th><th>bottleneck</th></tr>
{% for row in front %}<tr><td>{{ row.number }}</td><td>{{ changes(row) }}</td>
<td class="num">{{ fmt(row.output_throughput_per_gpu) }}</td>
<td class="num">{{ p99(row.p99_tpot_ms, row.tpot_p99_num_requests) }}</td>
<td class="num">{{ p99(row.p99_ttft_ms, row.ttft_p99_num_requests) }}</td>
<td>{{ row.label }}</td></tr>
{% endfor %}</table>
<p>n: the requests each p99 is over; {{ thin_rule }}.</p>
<p>Export a point of the front: <code>nightshift export STUDY.yaml --max-tpot-ms N</code>
(the best {{ r.objective }} whose TPOT p99 is at most N) or <code>--trial N</code>.</p>
<h2>Every trial</h2>
<table id="trials"><tr><th>trial</th><th>state</th>
<th>change vs {{ r.baseline_words.short }}</th>
<th>{{ r.objective }} {{ unit }}</th><th>out tok/s/GPU</th><th>TPOT p99 ms</th><th>TTFT p99 ms</th>
<th>start-up s</th><th>bottleneck</th><th>quality</th><th>conclusion</th></tr>
{% for row in r.rows %}<tr class="{{ 'best' if r.best and not r.no_slo_met
 and row.number == r.best.number else
 ('baseline' if row.is_baseline else '') }}"><td>{{ row.number }}</td><td>{{ row.state }}</td>
<td>{{ changes(row) }}</td><td class="num">{{ fmt(row.value) }}</td>
<td class="num">{{ fmt(row.output_throughput_per_gpu) }}</td>
<td class="num">{{ p99(row.p99_tpot_ms, row.tpot_p99_num_requests) }}</td>
<td class="num">{{ p99(row.p99_ttft_ms, row.ttft_p99_num_requests) }}</td>
<td class="num">{{ fmt(row.startup_s) }}</td>
<td>{% if row.label %}<span class="label" style="background: {{ colours.get(row.label, '#7f7f7f')
}}">{{ row.label }}</span>{% endif %}</td><td>{{ row.quality }}</td>
<td title="{{ row.conclusion }}">{{ short(row) }}</td></tr>
{% endfor %}</table>
<h2>Parameter importances</h2>
{% if r.importances %}<img src="importances.png" alt="parameter importances"
style="max-width: 700px">{% else %}<p>{{ too_few }}</p>{% endif %}
{% if r.knob_effects or left_out %}<h2>One knob at a time</h2>
<p>{{ knob_intro }}</p>
{% if r.knob_effects %}<table id="knob-effects"><tr><th>knob</th><th>value</th><th>trial</th>
<th>{{ r.objective }} vs {{ r.baseline_words.short }}</th><th>verdict</th></tr>
{% for e in r.knob_effects %}<tr><td>{{ e.param }}</td><td>{{ e.shown_value }}</td>
<td>{{ e.number }}</td><td class="num">{{ short_gain(e.gain) }}</td><td>{{ e.verdict }}</td></tr>
{% endfor %}</table>{% endif %}
{% if left_out %}<p id="knobs-left-out">{{ left_out }}</p>{% endif %}{% endif %}
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


def trial_counts(report: Report) -> str:
    """`12 trials (3 more queued, not run yet); 4 confirmation runs (...)`: the search's
    trials, and apart from them what is not one."""
    text = f"{len(report.rows)} trial{'s' if len(report.rows) != 1 else ''}"
    if report.queued:
        text += f" ({report.queued} more queued, not run yet)"
    if report.confirmation_runs:
        text += (f"; {report.confirmation_runs} confirmation "
                 f"run{'s' if report.confirmation_runs != 1 else ''} besides (re-measurements "
                 f"of the recommended config and the {report.baseline_words.short}, not "
                 "trials)")
    if report.repeats:
        text += (f"; {report.repeats} repeat{'s' if report.repeats != 1 else ''} of a "
                 "measured config, not launched")
    return text


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
        r=report, headline=headline(report), front=front,
        changes=partial(_changes, words=report.baseline_words), fmt=_fmt,
        p99=_p99, thin_rule=THIN_RULE,
        counts=trial_counts(report),
        short=_short, too_few=TOO_FEW_FOR_IMPORTANCES, unit=value_unit(report.objective),
        per_gpu_rule=PER_GPU_RULE,
        colours=LABEL_COLOURS, labels=_labels(report),
        knob_intro=KNOB_EFFECTS_INTRO.format(short=report.baseline_words.short),
        short_gain=gains.short_gain, left_out=left_out_text(report.knobs_not_comparable,
                                                           report.baseline_words.short))


def _short(row: TrialRow) -> str:
    """A table's conclusion: the short form the daemon stored, else the full one cut."""
    return row.conclusion_short or shorten(row.conclusion)


def _latency_cells(row: TrialRow, latencies: tuple[str, ...]) -> str:
    """The row's p99s of `latencies` (`ttft`, `tpot`) as Markdown cells, each with its n."""
    figures = {"ttft": (row.p99_ttft_ms, row.ttft_p99_num_requests),
               "tpot": (row.p99_tpot_ms, row.tpot_p99_num_requests)}
    return " | ".join(_p99(*figures[k]) for k in latencies)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    lines = [f"# nightshift report: {report.study}", ""]
    if report.is_simulated:
        lines += ["> **Simulated engine**: figures come from a roofline model, not a GPU; "
                  "they are not measurements.", ""]
    slo = ", ".join(f"{k} {v:g}" for k, v in report.slo.items())
    words = report.baseline_words
    # The SLO's own p99 columns; the front's also TPOT, its axis.
    latencies = slo_latencies(report.slo)
    front_latencies = ("tpot", *(k for k in latencies if k != "tpot"))
    lines += [f"Objective: {report.objective}" + (f"; SLO: {slo}" if slo else "") +
              f"; {trial_counts(report)}; written {report.generated}. {PER_GPU_RULE}"
              + (f" Baseline: {words.name}; every trial runs these fixed flags too."
                 if words.has_fixed_flags else ""), "",
              headline(report), "", "![Pareto front](pareto.png)", "",
              "![objective per trial](history.png)", "", "## Pareto front", "",
              f"| trial | change vs {words.short} | out tok/s/GPU | "
              + "".join(f"{LATENCY_HEADERS[k]} | " for k in front_latencies) + "bottleneck |",
              "|---|---|---|" + "---|" * len(front_latencies) + "---|"]
    for row in report.rows:
        if row.number in report.pareto:
            lines.append(f"| {row.number} | {_md_cell(_changes(row, words))} | "
                         f"{_fmt(row.output_throughput_per_gpu)} | "
                         f"{_latency_cells(row, front_latencies)} | {row.label} |")
    lines += ["", "## Every trial", "",
              f"| trial | state | change vs {words.short} | {report.objective} "
              f"{value_unit(report.objective)} | out tok/s/GPU | "
              + "".join(f"{LATENCY_HEADERS[k]} | " for k in latencies)
              + "bottleneck | quality | conclusion |",
              "|---|---|---|---|---|" + "---|" * len(latencies) + "---|---|---|"]
    for row in report.rows:
        lines.append(f"| {row.number} | {row.state} | {_md_cell(_changes(row, words))} | "
                     f"{_fmt(row.value)} | {_fmt(row.output_throughput_per_gpu)} | "
                     f"{_latency_cells(row, latencies)} | {row.label} | "
                     f"{_md_cell(row.quality)} | {_md_cell(_short(row))} |")
    lines += ["", f"n: the requests each p99 is over; {THIN_RULE}."]
    lines += ["", "## Parameter importances", "", "![importances](importances.png)", ""]
    for name, value in sorted(report.importances.items(), key=lambda kv: -kv[1]):
        lines.append(f"- {name}: {value:.2f}")
    if not report.importances:
        lines.append(TOO_FEW_FOR_IMPORTANCES + ".")
    if report.knob_effects or report.knobs_not_comparable:
        lines += ["", "## One knob at a time", "", KNOB_EFFECTS_INTRO.format(short=words.short)]
    if report.knob_effects:
        lines += ["", f"| knob | value | trial | {report.objective} vs {words.short} | verdict |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e.param} | {_md_cell(e.shown_value)} | {e.number} | "
                  f"{gains.short_gain(e.gain)} | {e.verdict} |" for e in report.knob_effects]
    if report.knobs_not_comparable:
        lines += ["", left_out_text(report.knobs_not_comparable, words.short)]
    lines += ["", "## Failures by reason", ""]
    lines += [f"- {reason}: {count}" for reason, count in report.failures.items()] or \
        ["No trial failed."]
    return "\n".join(lines) + "\n"


def write_report(report: Report, out_dir: Path) -> list[Path]:
    """Write the HTML, Markdown and PNGs into `out_dir`; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_plots(report, out_dir)
    write_atomic(out_dir / "report.html", render_html(report))
    write_atomic(out_dir / "report.md", render_markdown(report))
    return [out_dir / name for name in REPORT_FILES]
