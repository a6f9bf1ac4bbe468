"""What `nightshift regress` tells: the first line (installed vLLM against the references'),
a verdict line per figure, MLflow runs (one experiment per library, a run per case per vLLM
version) and the HTML/Markdown report with a plot per case across versions."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optimizer.regress.library import FIGURES
from optimizer.regress.measure import CaseOutcome, ConfigOutcome, Installed
from optimizer.report.plots import save_figure
from optimizer.tracking.tags import TAG_KIND
from optimizer.tracking.tracker import Tracker
from runners.atomic import write_atomic

if TYPE_CHECKING:
    from mlflow import MlflowClient

logger = logging.getLogger(__name__)

EXPERIMENT_PREFIX = "nightshift-regress/"
KIND_REGRESS = "regress"
TAG_CASE = "nightshift.case"
TAG_LIBRARY = "nightshift.library"
TAG_VERDICT = "verdict"
TAG_VERSION = "vllm_version"
TAG_REF_VERSIONS = "reference_vllm_versions"
TAG_CARD = "card"
TAG_DATE = "date"
# The figure a case's plot follows, by the case's objective.
_PLOT_FIGURE = {"goodput": "goodput", "throughput": "output_throughput",
                "tpot": "tpot_p99_ms", "ttft": "ttft_p99_ms"}


def version_line(installed: Sequence[Installed], reference_versions: Iterable[str],
                 reference_cards: Iterable[str]) -> str:
    """The first line of the output and the report: the installed vLLM against the versions
    the references were taken on (or a drift check where they are the same)."""
    here = sorted({i.vllm_version for i in installed})
    cards = sorted({i.card for i in installed})
    refs = sorted(set(reference_versions))
    ref_cards = sorted(set(reference_cards))
    card_note = "" if set(ref_cards) <= set(cards) else \
        f"; the references were taken on {', '.join(ref_cards)}, this run on {', '.join(cards)}"
    if not refs:
        return (f"installed vLLM {', '.join(here)} on {', '.join(cards)}; no case has a "
                "reference: measured only")
    if refs == here:
        return (f"same version: a drift check of this machine (installed vLLM "
                f"{', '.join(here)} on {', '.join(cards)}, as the references){card_note}")
    return (f"installed vLLM {', '.join(here)} differs from the references' "
            f"({', '.join(refs)}): an upgrade check on {', '.join(cards)}{card_note}")


def version_line_of(outcomes: Sequence[CaseOutcome]) -> str:
    return version_line([o.installed for o in outcomes],
                        [v for o in outcomes for v in o.reference_versions],
                        [c for o in outcomes for c in o.reference_cards])


def interval_scope(outcome: CaseOutcome) -> str:
    """What the case's interval covers, given how it was measured."""
    if outcome.rounds > 1:
        return (f"{outcome.rounds} engine starts per config, interleaved, x {outcome.repeats} "
                "repeat(s) on each: the interval covers start-to-start and run-to-run noise")
    if outcome.repeats > 1:
        return (f"one engine start per config, {outcome.repeats} repeats on the same server: "
                "the interval covers run-to-run noise on one server, not start-to-start "
                "variation (a fresh start can land elsewhere)")
    return "one run per config: no spread of its own; any interval is the reference's alone"


def capacity_lines(outcome: CaseOutcome) -> list[str]:
    """The capacity-moving default changes between each reference's vLLM release and the one
    this case ran on (search_spaces/engine/releases.py), one line each: what may move a figure
    with no flag of the case changed. Empty on the same release, or where a version is no
    release (`not installed`)."""
    from search_spaces.engine.releases import capacity_changes
    from search_spaces.engine.tables import version_key

    here = outcome.installed.vllm_version
    unmodelled = " (the simulated engine does not model it)" \
        if outcome.installed.engine == "simulated" else ""
    lines: list[str] = []
    for ref in outcome.reference_versions:
        if not version_key(ref) or not version_key(here) or version_key(ref) >= version_key(here):
            continue
        for change in capacity_changes(ref, here):
            lines.append(f"capacity-moving default change since vLLM {ref}: "
                         f"{change.release}: {change.text}{unmodelled}")
    return lines


def config_lines(config: ConfigOutcome, threshold: float) -> list[str]:
    lines = [f"{config.name}: {config.verdict}"]
    if config.failure is not None:
        lines.append(f"  engine error ({config.failure.reason.value}): "
                     f"{config.failure.message}")
    for problem in config.flag_problems:
        lines.append(f"  flag: {problem.sentence}")
    lines += [f"  {c.sentence(threshold)}" for c in config.comparisons]
    if config.failure is None and not config.comparisons:
        lines.append("  no reference figure to compare with")
    return lines


def summary_lines(outcomes: Sequence[CaseOutcome], threshold: float) -> list[str]:
    lines = [version_line_of(outcomes)]
    for outcome in outcomes:
        lines.append(f"case {outcome.name}: {outcome.verdict} ({outcome.installed.engine}, "
                     f"{outcome.installed.card}; {interval_scope(outcome)})")
        lines += [f"  {line}" for line in capacity_lines(outcome)]
        for config in outcome.configs:
            lines += [f"  {line}" for line in config_lines(config, threshold)]
    return lines


# -- MLflow -------------------------------------------------------------------------------------


def experiment_name(library: str) -> str:
    return EXPERIMENT_PREFIX + library


def run_name(case: str, vllm_version: str) -> str:
    return f"{case} @ vllm {vllm_version}"


def log_to_mlflow(tracker: Tracker, library: str, outcomes: Sequence[CaseOutcome],
                  threshold: float) -> dict[str, str]:
    """One run per case in the library's experiment, named `<case> @ vllm <version>`; a second
    run of the same version is a new run of the same name, told apart by its `date` tag.
    Returns case -> run id."""
    exp_id = tracker.experiment_id(experiment_name(library))
    client: MlflowClient = tracker.client
    ids: dict[str, str] = {}
    for outcome in outcomes:
        tags = {TAG_KIND: KIND_REGRESS, TAG_LIBRARY: library, TAG_CASE: outcome.name,
                TAG_VERDICT: outcome.verdict, TAG_VERSION: outcome.installed.vllm_version,
                TAG_REF_VERSIONS: ",".join(outcome.reference_versions),
                TAG_CARD: outcome.installed.card,
                "reference_cards": ",".join(outcome.reference_cards),
                TAG_DATE: outcome.date, "engine": outcome.installed.engine,
                "mlflow.note.content": "\n".join(
                    line for c in outcome.configs for line in config_lines(c, threshold))}
        run = client.create_run(exp_id, run_name=run_name(outcome.name,
                                                          outcome.installed.vllm_version),
                                tags=tags)
        run_id = run.info.run_id
        params: dict[str, Any] = {"threshold": threshold, "rounds": outcome.rounds,
                                  "repeats": outcome.repeats}
        metrics: dict[str, float] = {}
        for config in outcome.configs:
            params.update({f"{config.name}.{k}": v for k, v in config.flags.items()})
            params.update({f"{config.name}.env.{k}": v for k, v in config.env.items()})
            for c in config.comparisons:
                metrics[f"{config.name}.reference.{c.figure}"] = c.reference
                metrics[f"{config.name}.ratio.{c.figure}"] = c.ratio
                if c.ci_low is not None and c.ci_high is not None:
                    metrics[f"{config.name}.ratio_ci_low.{c.figure}"] = c.ci_low
                    metrics[f"{config.name}.ratio_ci_high.{c.figure}"] = c.ci_high
            for figure, values in config.samples.items():
                if values:
                    metrics[f"{config.name}.{figure}"] = center_of(values)
        tracker.log_params(run_id, params)
        tracker.log_metrics(run_id, {k: v for k, v in metrics.items() if math.isfinite(v)})
        client.set_terminated(run_id, status="FAILED" if outcome.verdict.startswith("failed")
                              else "FINISHED")
        ids[outcome.name] = run_id
    return ids


def center_of(values: Sequence[float]) -> float:
    """The geometric mean (the arithmetic one where a value is 0)."""
    if all(v > 0 for v in values):
        return math.exp(sum(math.log(v) for v in values) / len(values))
    return sum(values) / len(values)


@dataclass(frozen=True)
class HistoryPoint:
    """One measurement of a config's figure: a reference or an earlier/this regress run."""

    label: str  # "vllm 0.26.0 (reference)" or "vllm 0.26.0 @ 2026-12-04T18:00"
    config: str
    value: float


def history(tracker: Tracker, library: str, outcome: CaseOutcome, figure: str,
            references: Mapping[str, tuple[str, str, float]]) -> list[HistoryPoint]:
    """The case's `figure` across versions: each config's reference (`references`: config ->
    (version, date, value)), then every regress run of the case in the library's experiment,
    oldest first (this one included once logged)."""
    points = [HistoryPoint(f"vllm {v} ref {d[:10]}", name, value)
              for name, (v, d, value) in references.items()]
    exp = tracker.client.get_experiment_by_name(experiment_name(library))
    if exp is None:
        return points
    runs = tracker.client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`{TAG_CASE}` = '{outcome.name}'",
        order_by=["attributes.start_time ASC"], max_results=200)
    for run in runs:
        label = f"vllm {run.data.tags.get(TAG_VERSION, '?')} @ " \
                f"{run.data.tags.get(TAG_DATE, '')[:16]}"
        for config in outcome.configs:
            value = run.data.metrics.get(f"{config.name}.{figure}")
            if value is not None:
                points.append(HistoryPoint(label, config.name, float(value)))
    return points


def plot_figure(outcome: CaseOutcome) -> str:
    """The figure a case's plot follows: its objective's, else the first one it compared."""
    first = next((c.figure for cfg in outcome.configs for c in cfg.comparisons), None)
    wanted = _PLOT_FIGURE.get(outcome.objective, "output_throughput")
    compared = {c.figure for cfg in outcome.configs for c in cfg.comparisons}
    return wanted if wanted in compared or first is None else first


def write_plot(points: Sequence[HistoryPoint], figure: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(p.label for p in points))
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
    for config in dict.fromkeys(p.config for p in points):
        xs = [labels.index(p.label) for p in points if p.config == config]
        ys = [p.value for p in points if p.config == config]
        ax.plot(xs, ys, marker="o", label=config)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=7)
    direction = FIGURES[figure][0]
    ax.set_ylabel(f"{figure} ({'higher' if direction == 'maximize' else 'lower'} is better)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# -- the report files ---------------------------------------------------------------------------


def _exit_words(exit_code: int) -> str:
    return "no case regressed or failed" if exit_code == 0 else "a case regressed or failed"


def render_markdown(library: str, outcomes: Sequence[CaseOutcome], threshold: float,
                    exit_code: int, plots: Mapping[str, str]) -> str:
    lines = [f"# nightshift regress: {library}", "", version_line_of(outcomes), "",
             f"Threshold {threshold:.0%}; exit code {exit_code} ({_exit_words(exit_code)}); "
             f"measured {outcomes[0].date if outcomes else ''}.", ""]
    if any(o.installed.engine == "simulated" for o in outcomes):
        lines += ["> **Simulated engine**: figures come from a roofline model, not a GPU; "
                  "they are not measurements.", ""]
    lines += ["| case | verdict | engine | card | runs |", "|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.name} | **{o.verdict}** | {o.installed.engine} "
                     f"{o.installed.vllm_version} | {o.installed.card} | "
                     f"{o.rounds} x {o.repeats} |")
    for o in outcomes:
        lines += ["", f"## {o.name}: {o.verdict}", "", interval_scope(o) + ".", ""]
        lines += [f"- {line}" for line in capacity_lines(o)] + ([""] if capacity_lines(o) else [])
        for config in o.configs:
            lines.append(f"- **{config.name}**: {config.verdict}")
            lines += [f"  - {line.strip()}" for line in config_lines(config, threshold)[1:]]
        if o.name in plots:
            lines += ["", f"![{o.name} across versions]({plots[o.name]})"]
    return "\n".join(lines) + "\n"


_HTML = """<!doctype html><html><head><meta charset="utf-8">
<title>nightshift regress: {{ library }}</title>
<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}
td,th{padding:.2em .6em;border-bottom:1px solid #ddd}
.regressed,.failed{color:#b00}.improved{color:#070}</style></head><body>
<h1>nightshift regress: {{ library }}</h1>
<p><b>{{ first }}</b></p><p>{{ about }}</p>
{% if simulated %}<p><b>Simulated engine</b>: figures come from a roofline model, not a GPU;
they are not measurements.</p>{% endif %}
<table><tr><th>case</th><th>verdict</th><th>engine</th><th>card</th><th>runs</th></tr>
{% for o in outcomes %}<tr><td>{{ o.name }}</td>
<td class="{{ o.verdict.split()[0] }}">{{ o.verdict }}</td>
<td>{{ o.installed.engine }} {{ o.installed.vllm_version }}</td>
<td>{{ o.installed.card }}</td><td>{{ o.rounds }} x {{ o.repeats }}</td></tr>{% endfor %}
</table>
{% for o in outcomes %}
<h2>{{ o.name }}: <span class="{{ o.verdict.split()[0] }}">{{ o.verdict }}</span></h2>
<p>{{ scope(o) }}.</p>{% if capacity(o) %}<ul>
{% for line in capacity(o) %}<li>{{ line }}</li>{% endfor %}</ul>{% endif %}<ul>
{% for c in o.configs %}<li><b>{{ c.name }}</b>: {{ c.verdict }}<ul>
{% for line in lines(c)[1:] %}<li>{{ line.strip() }}</li>{% endfor %}</ul></li>
{% endfor %}</ul>
{% if o.name in plots %}
<img src="{{ plots[o.name] }}" alt="{{ o.name }} across versions">{% endif %}
{% endfor %}</body></html>
"""


def write_report(out_dir: Path, library: str, outcomes: Sequence[CaseOutcome],
                 threshold: float, exit_code: int,
                 histories: Mapping[str, tuple[str, Sequence[HistoryPoint]]]) -> list[Path]:
    """report.md, report.html and a PNG per case (`histories`: case -> (figure, points))."""
    import jinja2

    out_dir.mkdir(parents=True, exist_ok=True)
    plots: dict[str, str] = {}
    written: list[Path] = []
    for outcome in outcomes:
        figure, points = histories.get(outcome.name, ("", ()))
        if not points:
            continue
        name = f"case-{outcome.name}.png"
        write_plot(points, figure, f"{outcome.name}: {figure} across vLLM versions",
                   out_dir / name)
        plots[outcome.name] = name
        written.append(out_dir / name)
    md = render_markdown(library, outcomes, threshold, exit_code, plots)
    about = md.split("\n")[4]
    html = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined).from_string(
        _HTML).render(library=library, first=version_line_of(outcomes), about=about,
                      outcomes=outcomes, plots=plots, scope=interval_scope,
                      capacity=capacity_lines,
                      lines=lambda c: config_lines(c, threshold),
                      simulated=any(o.installed.engine == "simulated" for o in outcomes))
    write_atomic(out_dir / "report.md", md)
    write_atomic(out_dir / "report.html", html)
    return [out_dir / "report.html", out_dir / "report.md", *written]
