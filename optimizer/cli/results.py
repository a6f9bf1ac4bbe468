"""What a study found: `nightshift status` (the trial table and the best), `report` (HTML,
Markdown, plots) and `export` (the recommended config as a deployment)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from optimizer.cli.app import Command, StorageOpt, StudyArg, app, check_output_file, load_config
from optimizer.cli.output import console, out, styled
from optimizer.cli.table import TableRow, figure, moved_note, trial_table
from optimizer.config import StudyConfig
from optimizer.errors import ConfigError
from optimizer.results.baseline_words import DEFAULTS, BaselineWords
from optimizer.results.objectives import value_unit
from optimizer.results.tail_samples import THIN_RULE, slo_latencies
from runners.atomic import write_atomic

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial


@app.command(cls=Command, short_help="Show the trials of a running or finished study.")
def status(study: StudyArg, storage: StorageOpt = None) -> None:
    """Show the progress of a running or finished study: its trials counted by state (the
    final confirmation runs and repeats of a measured config apart), a table of them fitted to
    the terminal (short conclusions; the full ones are in MLflow and the report) and the best.

    \b
    Example:
      nightshift status examples/quickstart.yaml
    """
    from optimizer.results.recommendation import confirmation_sentence
    from optimizer.results.trial_record import confirmation_of
    from optimizer.storage.lock import read_lease, read_lock, study_lock_path
    from optimizer.storage.study import count_trials, existing_storage, open_study

    cfg = load_config(study).with_overrides(storage=storage)
    store = existing_storage(cfg)
    opened = open_study(cfg, create=False, storage=store)
    holder = read_lock(study_lock_path(cfg)) or \
        read_lease(store, store.get_study_id_from_name(cfg.name))
    trials = opened.get_trials(deepcopy=False)
    running = f"running (pid {holder.get('pid')})" if holder is not None else "not running"
    out.print(styled("study ", (cfg.name, "bold"), f": daemon {running}; "
                     f"{count_trials(trials).describe()}"), highlight=False, soft_wrap=True)
    is_simulated = is_simulated_study(opened)
    if is_simulated:
        out.print(SIMULATED_HEADER, highlight=False, soft_wrap=True)
    rows = status_rows(trials, cfg.baseline_words, cfg.objectives[0])
    slo = cfg.spec.slo.model_dump()
    latencies = slo_latencies(slo)  # the p99 columns of the SLO's own bounds
    out.print(trial_table(rows, cfg.objectives, out.width,
                          title=SIMULATED_TITLE if is_simulated else None,
                          baseline=cfg.baseline_words, latencies=latencies))
    moved = moved_note(rows)  # the load each marked figure is at, where it moved
    if moved:
        out.print(moved, highlight=False, soft_wrap=True)
    if any(r.p99(k)[1] is not None for r in rows for k in latencies):
        out.print(f"n: the requests each p99 is over; {THIN_RULE}.", highlight=False,
                  soft_wrap=True)
    pick = recommendation_text(opened, cfg.objectives, slo)
    if pick:
        out.print(pick, highlight=False, soft_wrap=True)
    sentence = confirmation_sentence(opened)
    if sentence:
        confirmed = confirmation_of(opened)
        what = "simulated repeats" if confirmed is not None and confirmed.is_simulated \
            else "re-measured"
        out.print(f"{what}: {sentence}", highlight=False, soft_wrap=True)


# The simulated engine's figures are a model's: every view of them says so, apart from the
# report's banner and the export header (which say it their own way).
SIMULATED_HEADER = "engine: SIMULATED (figures from a model, not measurements)"
SIMULATED_TITLE = "simulated figures (a model, not measurements)"
SIMULATED_MARK = " (simulated)"  # after a figure of a line of its own


def is_simulated_study(study: Any) -> bool:
    """Whether the study ran the simulated engine: its stored fingerprint says so, or a trial's
    launch command does (a study from before fingerprints)."""
    from optimizer.results.confirmation import is_simulated_run
    from optimizer.results.trial_record import stored_fingerprint

    fp = stored_fingerprint(study)
    if fp is not None and fp.engine is not None:
        return fp.engine == "simulated"
    return any(is_simulated_run(t) for t in study.get_trials(deepcopy=False))


def status_rows(trials: Sequence[FrozenTrial], words: BaselineWords = DEFAULTS,
                objective: str | None = None) -> list[TableRow]:
    """The table's rows: every trial that started, the search's and the confirmation runs (a
    repeat of a measured config launched nothing; the status line counts it). `words` names
    the baseline's row: "(vLLM defaults)", or "(baseline)" where the study fixes flags. With
    the study's first `objective`, a row whose operating point moved (a level's load not
    applied) names the load its figures are at (`TableRow.at_load`)."""
    from optuna.trial import TrialState

    from optimizer.results.at_load import compared_loads
    from optimizer.results.trial_record import confirm_label, is_baseline, ran_nothing, record_of

    def is_defaults(t: FrozenTrial) -> bool:  # the defaults' trial, not a confirmation re-run
        return is_baseline(t) and confirm_label(t) is None

    baseline = next((t for t in trials if is_defaults(t) and t.state == TrialState.COMPLETE),
                    None)
    base_record = record_of(baseline) if baseline is not None else None
    base_flags = base_record.flags if base_record is not None else {}
    # The defaults' sampled params (measured or not), for a trial whose record holds no flags.
    base_params = next((t.params for t in trials if is_defaults(t) and t.params), None)
    rows = []
    for t in trials:
        if t.state == TrialState.WAITING or ran_nothing(t):
            continue
        record = record_of(t)
        state = record.state if record is not None else \
            "running" if t.state == TrialState.RUNNING else t.state.name.lower()
        values: list[float | None] = []
        if state == "complete" and t.values:
            values = list(t.values)
        elif state == "pruned" and t.intermediate_values:
            values = [t.intermediate_values[max(t.intermediate_values)]]
        flags = record.flags if record is not None else None
        changes = None if flags is None else \
            {k: v for k, v in flags.items() if base_flags.get(k) != v}
        if not flags and not is_baseline(t):
            # A failed record (lost, rejected) holds its params, not the launch's flags: an
            # empty dict there is no sign of the defaults. Its params against the defaults'.
            changes = None if base_params is None or not t.params else \
                {k: v for k, v in t.params.items() if base_params.get(k) != v}
        confirm = confirm_label(t)
        which = words.short if confirm == "defaults" else confirm
        note = f"(confirmation: {which})" if confirm else \
            (words.cell if is_baseline(t) else "")
        metrics = record.metrics if record is not None else {}
        verdict = (record.verdict if record is not None else None) or {}
        # A pruned trial's figure is its last level's, not an operating point's.
        loads = compared_loads(objective, record) if state == "complete" else None
        at_load = loads.figures_at if loads is not None else ""
        rows.append(TableRow(
            number=t.number, state=state, changes=changes, values=values,
            tpot_p99_ms=_finite(metrics.get("p99_tpot_ms")),
            tpot_p99_num_requests=_count(metrics.get("num_tpot_samples")),
            ttft_p99_ms=_finite(metrics.get("p99_ttft_ms")),
            ttft_p99_num_requests=_count(metrics.get("completed")),
            label=str(verdict.get("label") or ""),
            conclusion=(record.conclusion_short or record.conclusion) if record is not None
            else "",
            elapsed_s=_finite(record.wall_s) if record is not None else None,
            changes_note=note, at_load=at_load))
    return rows


def _count(value: Any) -> int | None:
    finite = _finite(value)
    return int(finite) if finite is not None and finite >= 1 else None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def recommendation_text(study: Any, objectives: Sequence[str],
                        slo: Mapping[str, float | None] | None = None) -> str:
    """`recommended: trial 9, goodput 37.1 req/s` (" at concurrency=8" where its operating point
    moved, "(simulated)" after the figures of a trial the simulated engine ran) and, where it
    is not the best measured, why
    (recommendation.recommendation_note); where no trial met the SLO, that line instead
    (recommendation.no_slo_met; `slo`, the study's bounds, else the stored fingerprint's);
    the end-of-run line and `status` print it. "" when none."""
    from optimizer.results.at_load import compared_loads
    from optimizer.results.confirmation import is_simulated_run
    from optimizer.results.recommendation import (
        no_slo_met,
        recommendation_note,
        recommended_trial,
    )
    from optimizer.results.trial_record import record_of

    unmet = no_slo_met(study, slo)
    if unmet is not None:
        return unmet
    pick = recommended_trial(study)
    if pick is None or not pick.values:
        return ""
    note = recommendation_note(study, pick)
    loads = compared_loads(objectives[0], record_of(pick))
    mark = SIMULATED_MARK if is_simulated_run(pick) else ""
    return (f"recommended: trial {pick.number}, {values_text(objectives, pick.values)}"
            f"{loads.moved_phrase() if loads is not None else ''}{mark}"
            + (f" ({note})" if note else ""))


def values_text(objectives: Sequence[str], values: Sequence[float]) -> str:
    """`goodput 34.4 req/s/GPU` (a rate per GPU, as Optuna holds it); several objectives
    joined: `throughput 8,190 tok/s/GPU, 8.10 ms TPOT p99`."""
    parts = []
    for name, value in zip(objectives, values, strict=False):
        unit = value_unit(name)
        parts.append(f"{name} {figure(value, unit)}" if name.lower() not in unit.lower()
                     else figure(value, unit))
    return ", ".join(parts)


@app.command(cls=Command,
             short_help="Write a trial's config for vllm serve (YAML, shell or env).")
def export(
    study: StudyArg,
    trial: Annotated[int | None, typer.Option(
        metavar="N", help="Export trial N (default: the recommended one: the best that "
                          "`nightshift audit` passes, or the config with the fewest changes "
                          "from the defaults within 2% of it, or the defaults where the final "
                          "confirmation found it within noise of them; where no trial met the "
                          "SLO there is none, and only --trial N exports). Not with "
                          "--max-tpot-ms."
    )] = None,
    fmt: Annotated[str, typer.Option(
        "--format", metavar="FORMAT", help="yaml (for `vllm serve --config`), sh (a launcher) "
                                           "or env (environment variables).")] = "yaml",
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="FILE", help="File to write (default: stdout).")] = None,
    max_tpot_ms: Annotated[float | None, typer.Option(
        metavar="MS", help="Export the best trial whose TPOT p99 is at most MS milliseconds "
                           "(a point of the Pareto front).")] = None,
    storage: StorageOpt = None,
    force_quality: Annotated[bool, typer.Option(
        help="Export a --trial the quality gate refused (its header says so).")] = False,
    minimal: Annotated[bool, typer.Option(
        help="Also leave out each flag the study measured as making no difference: a trial "
             "that ran the config with that flag at vLLM's default, within 2% (the header "
             "names each and the trial).")] = False,
    to_library: Annotated[Path | None, typer.Option(
        "--to-library", metavar="LIB.yaml",
        help="Append the trial and the vLLM defaults, with their measured figures as "
             "references, as a case of this benchmark library (created if absent) for "
             "`nightshift regress`.")] = None,
    case: Annotated[str | None, typer.Option(
        metavar="NAME", help="The case's name with --to-library (default: the study's); a "
                             "case of that name is replaced.")] = None,
    tracking_uri: Annotated[str | None, typer.Option(
        metavar="URI", help="With --to-library: the MLflow store whose study run names the "
                            "GPU (default: the study file's).")] = None,
) -> None:
    """Write a trial's config as a `vllm serve --config` YAML, a shell launcher or environment
    variables; or, with --to-library, add it to a benchmark library.

    \b
    Examples:
      nightshift export examples/quickstart.yaml -o best.yaml
      nightshift export examples/quickstart.yaml --format sh --max-tpot-ms 20 -o serve.sh
      nightshift export examples/quickstart.yaml --to-library bench.yaml --case qwen7b-chat
    """
    from optimizer.export import choice_note, render, select_trial
    from optimizer.export.choice import study_tpot_pick, tpot_note
    from optimizer.storage.study import open_study

    cfg = load_config(study).with_overrides(storage=storage)
    if trial is not None and max_tpot_ms is not None:
        raise ConfigError("export --trial and --max-tpot-ms pick the trial two ways; give "
                          "one.")
    if max_tpot_ms is not None and not (math.isfinite(max_tpot_ms) and max_tpot_ms > 0):
        raise ConfigError(f"export --max-tpot-ms: expected a number of milliseconds > 0 but "
                          f"got {max_tpot_ms:g}; give the TPOT p99 limit to pick within.")
    if output is not None:
        check_output_file("export --output", output)
    if to_library is not None:
        check_output_file("export --to-library", to_library)
    if to_library is not None and (output is not None or fmt != "yaml"):
        raise ConfigError("export --to-library writes a library case; leave out --output and "
                          "--format.")
    if (case is not None or tracking_uri is not None) and to_library is None:
        raise ConfigError("export --case and --tracking-uri are for a library case; give "
                          "--to-library LIB.yaml too.")
    opened = open_study(cfg, create=False)
    chosen = select_trial(opened, cfg, number=trial, max_tpot_ms=max_tpot_ms,
                          force_quality=force_quality)
    if to_library is not None:
        from optimizer.regress.export import case_from_study, study_gpu_param
        from optimizer.regress.library import append_case
        from optimizer.results.trial_record import mlflow_study_key

        name = case or cfg.name
        entry = case_from_study(opened, cfg, chosen, name,
                                study_gpu_param(tracking_uri or cfg.tracking_uri, cfg.name,
                                                mlflow_study_key(opened)))
        done = append_case(to_library, entry, to_library.stem)
        console.print(f"{done} case {name!r} in {to_library}: "
                      f"{', '.join(c['name'] for c in entry['configs'])}", soft_wrap=True)
        return
    note = choice_note(opened, chosen) if trial is None and max_tpot_ms is None else ""
    level = None  # the fixed level it was picked at, which every line of the header describes
    if max_tpot_ms is not None:  # the load its figures are from (export.choice.tpot_pick)
        pick = study_tpot_pick(opened, cfg, max_tpot_ms)
        note, level = tpot_note(opened, cfg, max_tpot_ms, pick), pick.level
    if trial is None and max_tpot_ms is None:
        from optimizer.results.recommendation import RECOMMENDATION_RULE

        note = f"recommended: {RECOMMENDATION_RULE}" + (f"; {note}" if note else "")
    text = render(chosen, cfg, fmt, note=note, path=output, study=opened, minimal=minimal,
                  level=level)
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text, mode=0o700 if fmt == "sh" else 0o600)
        console.print(f"wrote trial {chosen.number} as {fmt} to {output}", soft_wrap=True)


def write_report_files(cfg: StudyConfig, output: Path | None, *,
                       log_to_mlflow: bool) -> list[Path]:
    """The study's report written (into `output`, else its results directory), and logged to
    its MLflow parent run where `log_to_mlflow`; the files written."""
    from optimizer.report import build_report, write_report
    from optimizer.results.trial_record import mlflow_study_key
    from optimizer.storage.study import open_study
    from optimizer.tracking.tracker import Tracker

    study = open_study(cfg, create=False)
    built = build_report(study, cfg)
    paths = write_report(built, output or cfg.results_dir / "report")
    if log_to_mlflow:
        Tracker(cfg.tracking_uri).log_study_files(cfg.name, paths, "report",
                                                  mlflow_study_key(study))
    return paths


@app.command(cls=Command, short_help="Write the study's report (HTML, Markdown, plots).")
def report(
    study: StudyArg,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", metavar="DIR",
        help="Folder to write into (default: <results_dir>/report).")] = None,
    mlflow: Annotated[bool, typer.Option(
        "--mlflow/--no-mlflow", help="Also log the files to the study's MLflow parent run.")
    ] = True,
    storage: StorageOpt = None,
) -> None:
    """Write the study's report: report.html and report.md with PNG plots (the best config and
    its gain over the defaults, the Pareto front, parameter importances, bottlenecks,
    failures). A finished study writes it already; this writes it again at any time.

    \b
    Example:
      nightshift report examples/quickstart.yaml -o morning/
    """
    cfg = load_config(study).with_overrides(storage=storage)
    from optimizer.config.prestart import directory_problem

    problem = directory_problem("report --output", output)
    if problem is not None:
        raise ConfigError(f"{problem} (made if absent).")
    paths = write_report_files(cfg, output, log_to_mlflow=mlflow)
    out.print(f"wrote {', '.join(str(p) for p in paths)}", soft_wrap=True)


# Extra arguments are the launch after `--`; an unknown option before it is a usage error.
