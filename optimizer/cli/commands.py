"""The `nightshift` subcommands (start, status, stop, export, regress, report, audit, history,
hw) on one typer app, registered in the order `--help` lists them."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperCommand

from optimizer.cli.live import LiveProgress
from optimizer.cli.output import add_log_file, console, out, setup_logging
from optimizer.cli.table import TableRow, figure, trial_table
from optimizer.config import StudyConfig, load_study, resume_command
from optimizer.errors import ConfigError, NightshiftError, describe
from optimizer.objectives import value_unit
from runners.atomic import write_atomic

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

class _Command(TyperCommand):
    """A subcommand whose usage line names a required argument plainly (`STUDY.yaml`), where
    typer 0.29 writes `{STUDY.yaml}`."""

    def collect_usage_pieces(self, ctx: typer.Context) -> list[str]:  # type: ignore[override]
        pieces = [piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
                  for piece in super().collect_usage_pieces(ctx)]
        if self.context_settings.get("allow_extra_args"):  # audit: the launch it checks
            pieces.append("[-- vllm serve MODEL ...]")
        return pieces


# Click's plain help (rich_markup_mode=None): paragraphs rewrapped to the terminal, no type
# column; a paragraph that starts with \b (the examples) is kept as written.
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  help="nightshift: tune vLLM serving configs overnight (Optuna + Ray + MLflow)."
                       "\n\nRun `nightshift COMMAND --help` for a command's options and an "
                       "example. Exit codes: 0 ok, 1 failure, 2 bad input.")
logger = logging.getLogger("optimizer.cli")

StudyArg = Annotated[Path, typer.Argument(
    metavar="STUDY.yaml", show_default=False,
    help="The study file (see examples/quickstart.yaml).")]
StorageOpt = Annotated[str | None, typer.Option(
    metavar="URL", help="Optuna RDB URL, where the study file's storage is not the one to read.")]


def _load(study: Path) -> StudyConfig:
    return load_study(study)


def _check_output_file(option: str, path: Path) -> None:
    """A file the command is to write: refused (ConfigError) where it is a directory or its
    directory does not exist, before anything is read or written."""
    if path.is_dir():
        raise ConfigError(f"{option}: {str(path)!r:.120} is a directory; give a file name.")
    if not path.absolute().parent.is_dir():
        raise ConfigError(f"{option}: the directory of {str(path)!r:.120} does not exist; "
                          "create it or give a file in an existing directory.")


# -- start ----------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@app.command(cls=_Command, short_help="Create or resume a study and run it to its budget.")
def start(
    study: StudyArg,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Run on the simulated engine (no GPU needed); figures are "
                          "simulated, never measurements.")] = False,
    tracking_uri: Annotated[str | None, typer.Option(
        metavar="URI", help="MLflow tracking URI (default: the study file's, else "
                            "sqlite:///mlruns/mlflow.db).")] = None,
    storage: Annotated[str | None, typer.Option(
        metavar="URL", help="Optuna RDB URL (default: sqlite under the results dir).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        metavar="ADDRESS", help="Join an existing Ray cluster: auto, or ray://HOST:10001.")
    ] = None,
    trials: Annotated[int | None, typer.Option(
        metavar="N", help="Run N trials instead of the study file's budget.trials.")] = None,
    verbose: Annotated[bool, typer.Option(
        "--verbose", "-v", help="Log DEBUG lines too (each level, each pruning decision).")
    ] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress",
                                              help="Log lines only, no live table.")] = False,
) -> None:
    """Create or resume a study and run it until its budget ends or it is stopped.

    Ctrl-C (or `nightshift stop`) finishes the trials in flight; a second Ctrl-C fails them.
    Starting again resumes where it stopped.

    \b
    Example:
      nightshift start examples/quickstart.yaml --dry-run
    """
    from optimizer.config.schema import ray_address_problem
    from optimizer.run.runtime import build_daemon

    cfg = _load(study)
    cfg = cfg.with_overrides(tracking_uri=tracking_uri, storage=storage, trials=trials)
    problem = None if ray_address is None else ray_address_problem(ray_address)
    if problem is not None:
        raise ConfigError(f"--ray-address: {problem}.")
    setup_logging(verbose)
    progress = None if no_progress or not console.is_terminal else \
        LiveProgress(cfg, done_before=_finished_before(cfg))
    resume = resume_command(study, dry_run=dry_run, storage=storage, tracking_uri=tracking_uri,
                            ray_address=ray_address, trials=trials)
    try:
        daemon, notes = build_daemon(cfg, dry_run=dry_run, ray_address=ray_address,
                                     on_event=progress.on_event if progress else None,
                                     resume=resume)
    except KeyboardInterrupt:  # before the daemon's own handler: Ray may be starting
        console.print(f"interrupted while starting: nothing was launched; resume with: "
                      f"{resume}", soft_wrap=True)
        raise typer.Exit(130) from None
    # Only now, with the study validated, does anything get written under results_dir.
    log_file = add_log_file(cfg.results_dir / "daemon.log")
    for note in notes:
        logger.info(note)

    def _on_signal(signum: int, frame: Any) -> None:
        now = daemon.stopping
        daemon.request_stop(now=now)
        what = ("stopping now: failing trials in flight" if now else
                "stopping: finishing trials in flight (signal again to stop now)")
        logger.info("%s (%s)", what, signal.Signals(signum).name)
        # The terminal may be gone (SIGHUP): a message it cannot take must not end the study.
        with contextlib.suppress(OSError, ValueError):
            console.print(f"[yellow]{what}[/]; resume with: {resume}", soft_wrap=True)

    # SIGHUP (the terminal closed) stops the study as SIGTERM does, never kills it outright.
    old = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS}
    try:
        if progress is not None:
            with progress:
                summary = daemon.run()
        else:
            summary = daemon.run()
    except Exception as exc:
        if isinstance(exc, NightshiftError) and exc.exit_code == 2:
            raise  # refused before anything ran (another daemon holds the study)
        # The daemon stopped mid-study (its trials ended, its engines and workers gone): one
        # line and the resume command here, the traceback in the daemon's log only.
        log_file.handle(logging.LogRecord(logger.name, logging.ERROR, __file__, 0,
                                          "the daemon stopped on an error", None,
                                          sys.exc_info()))
        what = str(exc) if isinstance(exc, NightshiftError) else (
            f"the daemon stopped on an unexpected error ({describe(exc)}); its trials in "
            f"flight were stopped and their engines ended; the traceback is in "
            f"{cfg.results_dir / 'daemon.log'}.")
        console.print(f"[red]error:[/] {what}", highlight=False, soft_wrap=True)
        console.print(f"resume with: {resume}", soft_wrap=True)
        raise typer.Exit(1) from None
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    counts = _counts(cfg)
    if summary.stopped_early:
        console.print(f"study {cfg.name} stopped: {counts}.", soft_wrap=True)
        console.print(f"resume with: {resume}", soft_wrap=True)
    else:
        console.print(f"study {cfg.name} done: {counts}.", soft_wrap=True)
    pick = _recommendation(cfg)
    if pick:
        console.print(pick, soft_wrap=True)
    try:
        paths = _write_report(cfg, None, log_to_mlflow=True)
        console.print(f"report: {paths[0]}", soft_wrap=True)
    except Exception as exc:  # the report is a view: the study's results are safe in Optuna
        logger.warning("could not write the report (%s: %s); run `nightshift report %s`",
                       type(exc).__name__, exc, study)
    if summary.mlflow_incomplete:
        # Said before the pointer to MLflow: what it shows now is not the whole study.
        console.print(f"[yellow]MLflow is incomplete:[/] it refused the writes of "
                      f"{summary.mlflow_incomplete} (Optuna holds them; see "
                      f"{cfg.results_dir / 'daemon.log'}); run `{resume}` again once the store "
                      "takes writes to log them and close their runs", soft_wrap=True)
    review = _mlflow_review(cfg)
    if review:
        console.print(review, soft_wrap=True)
    if summary.best_number is not None:
        # On a line of its own, never broken: it is meant to be copied.
        console.print(f"export with: nightshift export {study}", soft_wrap=True)


def _finished_before(cfg: StudyConfig) -> int:
    """The search's trials a resumed study finished on earlier starts (0 for a new one, or
    where its storage cannot be read: the live table is a view)."""
    from optimizer.study import finished_trials, is_search_trial, open_study

    try:
        study = open_study(cfg, create=False)
    except Exception:  # a new study (no storage yet), or one `start` refuses with its reason
        return 0
    return sum(is_search_trial(t) for t in finished_trials(study))


def _mlflow_review(cfg: StudyConfig) -> str:
    """How to open the study's runs in the MLflow UI (`mlflow ui` serves on 127.0.0.1:5000);
    "" when the store cannot be read now (the study's results are safe in Optuna)."""
    from optimizer.tracking import Tracker, runs_page

    try:
        experiment = Tracker(cfg.tracking_uri).experiment_id(cfg.name)
    except Exception:  # a view: a store that fails here has its own warnings already
        return ""
    return (f"review in MLflow: mlflow ui --backend-store-uri {cfg.tracking_uri}\n"
            f"  then open {runs_page('http://127.0.0.1:5000', experiment)}")


def _recommendation(cfg: StudyConfig) -> str:
    """The recommendation line of the finished study ("" when it has none or cannot be read)."""
    from optimizer.study import open_study

    try:
        return recommendation_text(open_study(cfg, create=False), cfg.objectives)
    except Exception as exc:  # a summary line: never worth failing a finished study over
        logger.warning("could not read the recommended trial (%s: %s)", type(exc).__name__, exc)
        return ""


def recommendation_text(study: Any, objectives: Sequence[str]) -> str:
    """`recommended: trial 9, goodput 37.1 req/s` and, where it is not the best measured, why
    (study.recommendation_note); the end-of-run line and `status` print it. "" when none."""
    from optimizer.recommendation import recommendation_note, recommended_trial

    pick = recommended_trial(study)
    if pick is None or not pick.values:
        return ""
    note = recommendation_note(study, pick)
    return (f"recommended: trial {pick.number}, {values_text(objectives, pick.values)}"
            + (f" ({note})" if note else ""))


def _counts(cfg: StudyConfig) -> str:
    from optimizer.study import count_trials, open_study

    try:
        return count_trials(open_study(cfg, create=False).get_trials(deepcopy=False)).describe()
    except Exception as exc:  # a summary line: never worth failing a finished study over
        logger.warning("could not count the study's trials (%s: %s)", type(exc).__name__, exc)
        return "trials counted by `nightshift status`"


# -- status / stop --------------------------------------------------------------------------


@app.command(cls=_Command, short_help="Show the trials of a running or finished study.")
def status(study: StudyArg, storage: StorageOpt = None) -> None:
    """Show the progress of a running or finished study: its trials counted by state (the
    final confirmation runs and repeats of a measured config apart), a table of them fitted to
    the terminal (short conclusions; the full ones are in MLflow and the report) and the best.

    \b
    Example:
      nightshift status examples/quickstart.yaml
    """
    from optimizer.lock import read_lease, read_lock, study_lock_path
    from optimizer.study import count_trials, existing_storage, open_study

    cfg = _load(study).with_overrides(storage=storage)
    store = existing_storage(cfg)
    opened = open_study(cfg, create=False, storage=store)
    holder = read_lock(study_lock_path(cfg)) or \
        read_lease(store, store.get_study_id_from_name(cfg.name))
    trials = opened.get_trials(deepcopy=False)
    running = f"running (pid {holder.get('pid')})" if holder is not None else "not running"
    out.print(f"study [bold]{cfg.name}[/]: daemon {running}; "
              f"{count_trials(trials).describe()}", highlight=False, soft_wrap=True)
    out.print(trial_table(status_rows(trials), cfg.objectives, out.width))
    pick = recommendation_text(opened, cfg.objectives)
    if pick:
        out.print(pick, highlight=False, soft_wrap=True)
    confirmed = (opened.user_attrs.get("confirm") or {}).get("sentence")
    if confirmed:
        out.print(f"re-measured: {confirmed}", highlight=False, soft_wrap=True)


def status_rows(trials: Sequence[FrozenTrial]) -> list[TableRow]:
    """The table's rows: every trial that started, the search's and the confirmation runs (a
    repeat of a measured config launched nothing; the status line counts it)."""
    from optuna.trial import TrialState

    from optimizer.records import ATTR_RECORD
    from optimizer.study import (
        ATTR_BASELINE,
        ATTR_CONFIRM,
        ATTR_CUT_SHORT,
        ATTR_DUPLICATE_OF,
        ATTR_NOT_LAUNCHED,
    )

    baseline = next((t for t in trials if t.user_attrs.get(ATTR_BASELINE)
                     and ATTR_CONFIRM not in t.user_attrs
                     and t.state == TrialState.COMPLETE), None)
    base_flags = ((baseline.user_attrs.get(ATTR_RECORD) or {}).get("flags") or {}) \
        if baseline is not None else {}
    # The defaults' sampled params (measured or not), for a trial whose record holds no flags.
    base_params = next((t.params for t in trials if t.user_attrs.get(ATTR_BASELINE)
                        and ATTR_CONFIRM not in t.user_attrs and t.params), None)
    rows = []
    for t in trials:
        if t.state == TrialState.WAITING or any(
                a in t.user_attrs for a in (ATTR_DUPLICATE_OF, ATTR_CUT_SHORT, ATTR_NOT_LAUNCHED)):
            continue
        record = t.user_attrs.get(ATTR_RECORD) or {}
        state = str(record.get("state") or ("running" if t.state == TrialState.RUNNING
                                             else t.state.name.lower()))
        values: list[float | None] = []
        if state == "complete" and t.values:
            values = list(t.values)
        elif state == "pruned" and t.intermediate_values:
            values = [t.intermediate_values[max(t.intermediate_values)]]
        flags = record.get("flags")
        changes = None if flags is None else \
            {k: v for k, v in flags.items() if base_flags.get(k) != v}
        if not flags and not t.user_attrs.get(ATTR_BASELINE):
            # A failed record (lost, rejected) holds its params, not the launch's flags: an
            # empty dict there is no sign of the defaults. Its params against the defaults'.
            changes = None if base_params is None or not t.params else \
                {k: v for k, v in t.params.items() if base_params.get(k) != v}
        confirm = t.user_attrs.get(ATTR_CONFIRM)
        note = f"(confirmation: {confirm})" if confirm else \
            ("(vLLM defaults)" if t.user_attrs.get(ATTR_BASELINE) else "")
        metrics = record.get("metrics") or {}
        rows.append(TableRow(
            number=t.number, state=state, changes=changes, values=values,
            tpot_p99_ms=_finite(metrics.get("p99_tpot_ms")),
            label=str((record.get("verdict") or {}).get("label") or ""),
            conclusion=str(record.get("conclusion_short") or record.get("conclusion") or ""),
            elapsed_s=_finite(record.get("wall_s")), changes_note=note))
    return rows


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def values_text(objectives: Sequence[str], values: Sequence[float]) -> str:
    """`goodput 34.4 req/s/GPU` (a rate per GPU, as Optuna holds it); several objectives
    joined: `throughput 8,190 tok/s/GPU, 8.10 ms TPOT p99`."""
    parts = []
    for name, value in zip(objectives, values, strict=False):
        unit = value_unit(name)
        parts.append(f"{name} {figure(value, unit)}" if name.lower() not in unit.lower()
                     else figure(value, unit))
    return ", ".join(parts)


@app.command(cls=_Command, short_help="Stop a running daemon.")
def stop(study: StudyArg,
         now: Annotated[bool, typer.Option("--now", help="Fail the trials in flight instead "
                                                         "of letting them finish.")] = False,
         wait: Annotated[bool, typer.Option(
             "--wait/--no-wait", help="Return once the daemon has exited (at most --timeout-s),"
                                      " or as soon as the signal is sent.")] = True,
         timeout_s: Annotated[float, typer.Option(
             metavar="SECONDS", help="How long --wait waits.")] = 600.0,
         storage: StorageOpt = None,
         ) -> None:
    """Stop a running daemon: it finishes the trials in flight unless --now. Resume the study
    with `nightshift start`.

    \b
    Example:
      nightshift stop examples/quickstart.yaml --now
    """
    from optimizer.lock import read_lock, study_lock_path

    if not (math.isfinite(timeout_s) and timeout_s >= 0):
        raise ConfigError(f"stop --timeout-s: expected seconds >= 0 but got {timeout_s:g}; "
                          "give how long --wait waits.")
    cfg = _load(study).with_overrides(storage=storage)
    lock_path = study_lock_path(cfg)
    holder = read_lock(lock_path)
    if holder is None or not holder.get("pid"):
        raise ConfigError(f"no daemon is running study {cfg.name!r}; nothing to stop.")
    pid = int(holder["pid"])
    os.kill(pid, signal.SIGTERM)
    if now:
        time.sleep(0.5)
        os.kill(pid, signal.SIGTERM)
    out.print(f"sent stop to daemon pid {pid}{' (now)' if now else ''}")
    if wait:
        deadline = time.monotonic() + timeout_s
        while read_lock(lock_path) is not None and time.monotonic() < deadline:
            time.sleep(0.5)
        if read_lock(lock_path) is not None:
            raise NightshiftError(f"daemon pid {pid} still runs after {timeout_s:g} s; "
                                  "run `nightshift stop --now` or wait longer.")
        out.print("daemon stopped")


# -- export ---------------------------------------------------------------------------------


@app.command(cls=_Command,
             short_help="Write a trial's config for vllm serve (YAML, shell or env).")
def export(
    study: StudyArg,
    trial: Annotated[int | None, typer.Option(
        metavar="N", help="Export trial N (default: the recommended one: the best that "
                          "`nightshift audit` passes, or the config with the fewest changes "
                          "from the defaults within 2% of it)."
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
    from optimizer.study import open_study

    cfg = _load(study).with_overrides(storage=storage)
    if max_tpot_ms is not None and not (math.isfinite(max_tpot_ms) and max_tpot_ms > 0):
        raise ConfigError(f"export --max-tpot-ms: expected a number of milliseconds > 0 but "
                          f"got {max_tpot_ms:g}; give the TPOT p99 limit to pick within.")
    if output is not None:
        _check_output_file("export --output", output)
    if to_library is not None:
        _check_output_file("export --to-library", to_library)
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
        from optimizer.study import mlflow_study_key

        name = case or cfg.name
        entry = case_from_study(opened, cfg, chosen, name,
                                study_gpu_param(tracking_uri or cfg.tracking_uri, cfg.name,
                                                mlflow_study_key(opened)))
        done = append_case(to_library, entry, to_library.stem)
        console.print(f"{done} case {name!r} in {to_library}: "
                      f"{', '.join(c['name'] for c in entry['configs'])}", soft_wrap=True)
        return
    note = choice_note(opened, chosen) if trial is None and max_tpot_ms is None else ""
    if trial is None and max_tpot_ms is None:
        from optimizer.recommendation import RECOMMENDATION_RULE

        note = f"recommended: {RECOMMENDATION_RULE}" + (f"; {note}" if note else "")
    text = render(chosen, cfg, fmt, note=note, path=output, study=opened, minimal=minimal)
    if output is None:
        sys.stdout.write(text)
    else:
        write_atomic(output, text, mode=0o700 if fmt == "sh" else 0o600)
        console.print(f"wrote trial {chosen.number} as {fmt} to {output}", soft_wrap=True)


# -- regress --------------------------------------------------------------------------------


@app.command(cls=_Command,
             short_help="Re-measure a benchmark library on the installed vLLM (CI gate).")
def regress(
    library: Annotated[Path, typer.Argument(
        metavar="LIBRARY.yaml", show_default=False,
        help="The benchmark library (see docs/regress.md).")],
    tracking_uri: Annotated[str | None, typer.Option(
        metavar="URI", help="MLflow store (default: the library's tracking_uri, else "
                            "MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db).")] = None,
    report_dir: Annotated[Path | None, typer.Option(
        "--report", metavar="DIR",
        help="Folder for report.html, report.md and a plot per case (default: the work "
             "folder's report/).")] = None,
    case: Annotated[list[str] | None, typer.Option(
        metavar="NAME", help="Run only this case (repeatable).")] = None,
    workdir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Engine logs per case, config and round (default: "
                            "results/regress/<library>/<UTC time>).")] = None,
    mlflow: Annotated[bool, typer.Option(
        "--mlflow/--no-mlflow", help="Log a run per case to MLflow.")] = True,
    simulated_vllm: Annotated[Path | None, typer.Option(
        metavar="VARIANT.json",
        help="Simulated engine only: a JSON file naming the vLLM release it pretends to be "
             "(version, and the flags its parser renamed or dropped; docs/regress.md), to "
             "try an upgrade's renamed flags on CPU.")] = None,
    save_references: Annotated[Path | None, typer.Option(
        metavar="LIB.yaml", help="Write the library with this run's samples as the references "
                                 "of every config that measured (the next run compares with "
                                 "this one).")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    """Re-measure every case of a benchmark library on the installed vLLM, compare each figure
    with its reference (ratio with a 95% interval) and judge each case held, improved,
    regressed (worse than the library's threshold and outside the interval) or failed to start
    (naming a flag the installed parser does not take). Exit code 0 when every case held or
    improved, 1 on any regression or failure, 2 for bad input.

    \b
    Examples:
      nightshift regress bench.yaml
      nightshift regress bench.yaml --case qwen7b-chat --report docs/h200/regress/
    """
    import json

    from optimizer.config.loading import default_tracking_uri
    from optimizer.config.prestart import directory_problem
    from optimizer.config.store_checks import sqlite_file_problem, tracking_uri_problem
    from optimizer.regress.library import load_library
    from optimizer.regress.run import (
        default_workdir,
        first_line,
        prepare,
        select_cases,
    )
    from optimizer.regress.run import regress as run_regress

    setup_logging(verbose)
    spec = load_library(library)
    cases = select_cases(spec, case or [])
    variant = None
    if simulated_vllm is not None:
        try:
            variant = json.loads(simulated_vllm.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--simulated-vllm: cannot read {simulated_vllm} as JSON "
                              f"({type(exc).__name__}); give a JSON object.") from None
        from runners.simulated.launcher import VllmVariant

        if not isinstance(variant, dict):
            raise ConfigError(f"--simulated-vllm: expected a JSON object but got "
                              f"{type(variant).__name__}; see docs/regress.md.")
        try:
            VllmVariant.from_dict(variant)
        except ValueError as exc:
            raise ConfigError(f"--simulated-vllm: {exc}") from None
    uri = tracking_uri or spec.tracking_uri or default_tracking_uri()
    problem = tracking_uri_problem(uri) if tracking_uri is not None else None
    if problem is not None:
        raise ConfigError(f"--tracking-uri: {problem}")
    problem = sqlite_file_problem("tracking_uri", uri) if mlflow else None
    if problem is not None:
        where = "--tracking-uri" if tracking_uri is not None else f"{library.name}: tracking_uri"
        raise ConfigError(f"{where}: {problem.removeprefix('tracking_uri: ')}.")
    # Where the run writes, checked before any engine starts: not after an hour of measuring.
    for option, folder in (("--workdir", workdir), ("--report", report_dir)):
        problem = directory_problem(option, folder)
        if problem is not None:
            raise ConfigError(f"{problem}.")
    if save_references is not None:
        _check_output_file("--save-references", save_references)
    here, tracker = prepare(spec, cases, uri if mlflow else None, variant,
                            source=library.resolve())
    work = workdir or default_workdir(spec)
    out.print(first_line(spec, cases, here), highlight=False, soft_wrap=True)
    result = run_regress(spec, cases, here, tracker, work, report_dir or work / "report",
                         source=library.resolve(),
                         say=lambda line: out.print(line, highlight=False, soft_wrap=True))
    verdicts = ", ".join(f"{o.name} {o.verdict}" for o in result.outcomes)
    out.print(f"verdicts: {verdicts}; exit {result.exit_code}", highlight=False,
              soft_wrap=True)
    if result.report_files:
        out.print(f"report: {result.report_files[0]}", highlight=False, soft_wrap=True)
    if result.run_ids:
        out.print(f"MLflow: experiment nightshift-regress/{spec.name} in {uri} (a run per "
                  "case per vLLM version; select runs and Compare to set versions side by "
                  "side)", highlight=False, soft_wrap=True)
    if save_references is not None:
        from optimizer.regress.library import with_new_references
        from optimizer.regress.run import measured_references

        with_new_references(library, measured_references(result.outcomes), save_references)
        out.print(f"references from this run: {save_references}", highlight=False,
                  soft_wrap=True)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


# -- report ---------------------------------------------------------------------------------


def _write_report(cfg: StudyConfig, output: Path | None, *, log_to_mlflow: bool) -> list[Path]:
    from optimizer.report import build_report, write_report
    from optimizer.study import mlflow_study_key, open_study
    from optimizer.tracking import Tracker

    study = open_study(cfg, create=False)
    built = build_report(study, cfg)
    paths = write_report(built, output or cfg.results_dir / "report")
    if log_to_mlflow:
        Tracker(cfg.tracking_uri).log_study_files(cfg.name, paths, "report",
                                                  mlflow_study_key(study))
    return paths


@app.command(cls=_Command, short_help="Write the study's report (HTML, Markdown, plots).")
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
    cfg = _load(study).with_overrides(storage=storage)
    from optimizer.config.prestart import directory_problem

    problem = directory_problem("report --output", output)
    if problem is not None:
        raise ConfigError(f"{problem} (made if absent).")
    paths = _write_report(cfg, output, log_to_mlflow=mlflow)
    out.print(f"wrote {', '.join(str(p) for p in paths)}", soft_wrap=True)


# -- audit ----------------------------------------------------------------------------------


# Extra arguments are the launch after `--`; an unknown option before it is a usage error.
@app.command(cls=_Command, context_settings={"allow_extra_args": True},
             short_help="Check a vllm serve launch before tuning it.")
def audit(
    ctx: typer.Context,
    from_file: Annotated[Path | None, typer.Option(
        "--from-file", metavar="FILE",
        help="A shell launcher holding the `vllm serve` line (and its exports).")] = None,
    pid: Annotated[int | None, typer.Option(
        metavar="PID", help="A running server: read /proc/PID/cmdline and environ.")] = None,
    hardware: Annotated[str | None, typer.Option(
        metavar="PRESET", help="A hardware preset (see `nightshift hw`) instead of probing "
                               "this machine.")] = None,
    study: Annotated[Path | None, typer.Option(
        metavar="STUDY.yaml", help="A study file: its workload bounds --max-model-len, and "
                                   "--measure runs on it.")] = None,
    measure: Annotated[bool, typer.Option(
        "--measure", help="Measure each fix against the launch as is (needs --study).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Findings as JSON, for scripts.")
                       ] = False,
    vllm_version: Annotated[str | None, typer.Option(
        "--vllm-version", metavar="X.Y.Z",
        help="Check against this vLLM release's flags where vLLM is not installed here "
             "(default: the installed one, else 0.26.0).")] = None,
) -> None:
    """Check a `vllm serve` launch before tuning it: flags, environment and --config file, each
    finding with its reason and expected cost. Exit code 0 clean, 1 findings, 2 bad input.
    The launch goes after `--`.

    \b
    Examples:
      nightshift audit -- vllm serve Qwen/Qwen2.5-7B --enforce-eager
      nightshift audit --json --from-file launch.sh
    """
    from optimizer import audit as auditing
    from runners.hardware import load_preset
    from runners.hardware_probe import probe
    if sum(x is not None for x in (from_file, pid)) + bool(ctx.args) != 1:
        raise ConfigError("audit: give exactly one launch: `-- vllm serve ...`, --from-file F "
                          "or --pid N.")
    if from_file is not None:
        argv, env = auditing.read_launch_file(from_file)
    elif pid is not None:
        argv, env = auditing.read_pid(pid)
    else:
        argv, env = list(ctx.args), dict(os.environ)
    from runners.hardware import preset_names

    if hardware is not None and hardware not in preset_names():
        raise ConfigError(f"audit --hardware: expected one of {', '.join(preset_names())} but "
                          f"got {hardware!r:.60}; pick one of those.")
    table = auditing.table_of(vllm_version)
    launch = auditing.parse_launch(argv, env, table)
    profile = load_preset(hardware) if hardware else probe()
    cfg = _load(study) if study is not None else None
    longest = None
    if cfg is not None:
        w = cfg.spec.workload
        longest = (w.input_len.high or w.input_len.mean) + (w.output_len.high or
                                                             w.output_len.mean)
        if w.shared_prefix is not None:  # input_len is the part after the prefix
            longest += w.shared_prefix.tokens
    findings = auditing.audit(
        launch, table=table, interconnect=profile.interconnect if profile.has_gpu else None,
        compute_capability=profile.compute_capability if profile.has_gpu else None,
        max_request_tokens=longest)
    if as_json:
        sys.stdout.write(auditing.report_json(launch, findings) + "\n")
    else:
        out.print(f"[bold]{launch.model or '(no model)'}[/]: {len(launch.flags)} flags, "
                  f"{len(launch.env)} engine variables, checked against {launch.flag_source}")
        for f in findings:
            colour = {"error": "red", "warning": "yellow", "info": "cyan"}[f.severity]
            out.print(f"[{colour}]{f.severity}[/] {f.code}: {f.message} [dim]cost: {f.cost}[/]",
                      highlight=False)
        if not findings:
            out.print("[green]no findings[/]")
    if measure:
        if cfg is None:
            raise ConfigError("audit --measure: give --study STUDY.yaml (model, workload, "
                              "engine) to measure on.")
        path = auditing.paired_study(cfg.to_dict(), launch, findings,
                                     cfg.results_dir.parent / f"{cfg.name}-audit")
        console.print(f"measuring the launch as is against each fix: {path}", soft_wrap=True)
        start(path, dry_run=False, tracking_uri=None, storage=None, ray_address=None,
              trials=None, verbose=False, no_progress=True)
    if findings:
        raise typer.Exit(1)


# -- history --------------------------------------------------------------------------------


@app.command(cls=_Command, short_help="What earlier studies of a model or fingerprint found.")
def history(
    model: Annotated[str | None, typer.Option(
        metavar="M", help="Studies of this model: a study file's model.path (qwen2.5-7b) or "
                          "an architecture (Qwen2ForCausalLM).")] = None,
    fingerprint: Annotated[str | None, typer.Option(
        metavar="HASH", help="Studies with this fingerprint hash (or a prefix of it), as "
                             "`nightshift start` prints it.")] = None,
    study: Annotated[Path | None, typer.Option(
        metavar="STUDY.yaml", help="Studies compatible with this study file on this machine "
                                   "(the ones its warm_start: auto would consider, and its "
                                   "own study, marked).")] = None,
    tracking_uri: Annotated[str | None, typer.Option(
        metavar="URI", help="MLflow tracking URI (default: --study's, else "
                            "MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db).")] = None,
    limit: Annotated[int, typer.Option(metavar="N", help="At most N studies.")] = 20,
    trials: Annotated[bool, typer.Option(
        "--trials", help="Also list each trial's conclusion under its study.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="With --study: as `start --dry-run` would run it (simulated).")
    ] = False,
) -> None:
    """Print what earlier studies concluded, newest first: date, engine version, card, the
    best config's change from the defaults, its figure with what bounds it, and the study's
    conclusion (with --study, its own study too, marked). Reads the MLflow store only;
    nothing is written.

    \b
    Examples:
      nightshift history --model qwen2.5-7b
      nightshift history --study examples/quickstart.yaml --trials
    """
    import re
    from urllib.parse import urlparse

    from mlflow import MlflowClient

    from optimizer.cli.table import history_table
    from optimizer.config.loading import default_tracking_uri
    from optimizer.config.store_checks import sqlite_file_problem, tracking_uri_problem
    from optimizer.memory import history_rows, read_studies, select, trial_conclusions

    if fingerprint is not None and not re.fullmatch(r"[0-9a-fA-F]{4,12}", fingerprint):
        raise ConfigError(f"history --fingerprint: expected 4-12 hex digits of a fingerprint "
                          f"hash but got {fingerprint!r:.40}; copy it from `nightshift start`.")
    if fingerprint is not None and study is not None:
        raise ConfigError("history: give --fingerprint or --study, not both; --study finds "
                          "compatible fingerprints, --fingerprint one hash.")
    if limit < 1:
        raise ConfigError(f"history --limit must be >= 1 but got {limit}.")
    like = None
    uri = tracking_uri
    if study is not None:
        from optimizer.run.runtime import study_fingerprint

        cfg = _load(study)
        uri = uri or cfg.tracking_uri
        like = study_fingerprint(cfg, dry_run=dry_run)
    uri = uri or default_tracking_uri()
    problem = tracking_uri_problem(uri) or sqlite_file_problem("tracking_uri", uri)
    if problem is not None:
        raise ConfigError(f"history --tracking-uri: {problem.removeprefix('tracking_uri: ')}.")
    what = " and ".join(p for p in (
        f"model {model}" if model else "", f"fingerprint {fingerprint}" if fingerprint else "",
        f"studies compatible with {study} (fingerprint {like.hash})" if like else "") if p) \
        or "any model"
    if urlparse(uri).scheme == "sqlite" and \
            not Path(uri.removeprefix("sqlite:///")).is_file():  # reading must create nothing
        out.print(f"no earlier studies for {what}: no tracking store at {uri}.",
                  highlight=False, soft_wrap=True)
        return
    try:
        client = MlflowClient(uri)
    except Exception as exc:  # MLflow raises many types; all mean "not a store it opens"
        first = (str(exc).splitlines() or [""])[0]
        hint = ("MLflow 3 opens no file store unless MLFLOW_ALLOW_FILE_STORE=true is set; give "
                "sqlite:///mlruns/mlflow.db" if "MLFLOW_ALLOW_FILE_STORE" in str(exc) else
                f"{type(exc).__name__}: {first[:160]}; check --tracking-uri")
        raise ConfigError(f"history --tracking-uri: MLflow cannot open {uri} ({hint}).") \
            from None
    try:
        found = select(read_studies(client), model=model, fingerprint_hash=fingerprint,
                       like=like)
    except Exception as exc:  # MLflow raises many types; all mean "cannot read the store"
        raise NightshiftError(f"history: the tracking store {uri} could not be read "
                              f"({type(exc).__name__}: {str(exc)[:160]}); check "
                              "--tracking-uri.") from None
    this = cfg.name if like is not None and study is not None else None
    if not found:
        unknown = "" if like is None or like.gpu_model is not None else (
            " This machine has no GPU, so the study's hardware is unknown and no study is "
            "compatible with it; give --dry-run (as simulated) or --model.")
        out.print(f"no earlier studies for {what} in {uri}.{unknown}", highlight=False,
                  soft_wrap=True)
        return
    shown = found[:limit]
    more = f" (newest {limit} of {len(found)}; --limit for more)" if len(found) > limit else ""
    # --study's own study (the one just run, or the one a start would resume) is listed too,
    # marked: the quickstart's own results are what a user asks for right after it.
    rows = [dataclasses.replace(r, study=f"{r.study} (this study)") if r.study == this else r
            for r in history_rows(shown)]
    out.print(history_table(rows, out.width,
                            title=f"{len(shown)} studies for {what}, newest first{more}"))
    if trials:
        for earlier in shown:
            out.print(f"\n{earlier.name} ({earlier.date}):", highlight=False, soft_wrap=True,
                      markup=False)
            for t in trial_conclusions(client, earlier):
                seed = f" [{t.seed_source}]" if t.seed_source else ""
                out.print(f"  t{t.number:03d} {t.state}{seed}: {t.conclusion}",
                          highlight=False, soft_wrap=True, markup=False)


# -- hw -------------------------------------------------------------------------------------


def _print_facts() -> None:
    """Every measured fact, bundled and the user's, with its evidence and how to override it."""
    from search_spaces.known_facts import FactError, facts_file, load_facts

    path = facts_file()
    try:
        known = load_facts(path)
    except FactError as exc:
        raise ConfigError(str(exc)) from None
    out.print(f"measured facts: bundled (search_spaces/facts/known_facts.yaml) and {path} "
              f"({'present' if path.is_file() else 'none written yet'}); a study file's "
              "known_facts.ignore: [ID] turns one off.", highlight=False, soft_wrap=True,
              markup=False)
    for fact in known:
        out.print(f"{fact.id} [{fact.source}]: {fact.describe()}", highlight=False,
                  soft_wrap=True, markup=False)


@app.command(cls=_Command, short_help="Show this machine's GPU profile, or a preset's.")
def hw(output: Annotated[Path | None, typer.Option(
           "--output", "-o", metavar="FILE", help="Also save the profile as JSON.")] = None,
       measure: Annotated[bool, typer.Option(
           "--measure", help="Measure bandwidth and FLOP/s with torch (needs a GPU).")
       ] = False,
       preset: Annotated[str | None, typer.Option(
           metavar="NAME", help="Show a recorded preset (what a simulated study models) "
                                "instead of this machine.")] = None,
       facts: Annotated[bool, typer.Option(
           "--facts", help="List the measured facts the search-space rules apply (bundled "
                           "and the tuning memory's file) instead of the profile.")] = False,
       ) -> None:
    """Print (and save) this machine's GPU profile, read through NVML, or a hardware preset's.
    Without a GPU it says so and which preset a simulated study models.

    \b
    Examples:
      nightshift hw -o hw.json
      nightshift hw --preset a100-80gb
      nightshift hw --facts
    """
    import json

    if facts:
        _print_facts()
        return

    from optimizer.config.schema import SimulatedSpec
    from runners.hardware import load_preset, preset_names
    from runners.hardware_probe import probe

    if preset is not None:
        if preset not in preset_names():
            raise ConfigError(f"hw --preset: expected one of {', '.join(preset_names())} but "
                              f"got {preset!r}; pick one of those.")
        profile = load_preset(preset)
    else:
        profile = probe(measure=measure)
    if not profile.has_gpu:
        default = SimulatedSpec.model_fields["hardware"].default
        for line in (
                "no NVIDIA GPU found on this machine (NVML is missing or sees none): no "
                "profile to show.",
                "A simulated study (engine: simulated, or start --dry-run) models a preset: "
                f"simulated.hardware in its study file, {default} unless set.",
                f"The presets: {', '.join(preset_names())}; see one with "
                "`nightshift hw --preset NAME`."):
            out.print(line, highlight=False, soft_wrap=True)
        if output is not None:
            raise NightshiftError(f"hw: no GPU profile to save, so {output} was not written; "
                                  "run on a machine with a GPU, or give --preset NAME.")
        return
    data = profile.to_dict()
    if output is not None:
        _check_output_file("hw --output", output)
        write_atomic(output, json.dumps(data, indent=2, default=str))
    out.print_json(json.dumps(data, default=str))
