"""`nightshift start` (create or resume a study and run it to its budget, then say what the
morning holds) and `nightshift stop`."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from typing import Annotated, Any

import typer

from optimizer.cli.app import Command, StorageOpt, StudyArg, app, load_config
from optimizer.cli.live import LiveProgress
from optimizer.cli.output import add_log_file, console, out, setup_logging, styled
from optimizer.cli.results import recommendation_text, write_report_files
from optimizer.config import StudyConfig, resume_command
from optimizer.errors import ConfigError, NightshiftError, describe

logger = logging.getLogger("optimizer.cli")


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@app.command(cls=Command, short_help="Create or resume a study and run it to its budget.")
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
    from optimizer.config.sections import ray_address_problem
    from optimizer.run.runtime import build_daemon

    cfg = load_config(study)
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
        raise typer.Exit(130) from None  # an exit code, not an error: nothing to chain
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
            console.print(styled((what, "yellow"), f"; resume with: {resume}"),
                          soft_wrap=True)

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
        console.print(styled(("error: ", "red"), what), highlight=False, soft_wrap=True)
        console.print(f"resume with: {resume}", soft_wrap=True)
        raise typer.Exit(1) from None  # the error is printed above and its traceback logged
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
        paths = write_report_files(cfg, None, log_to_mlflow=True)
        console.print(f"report: {paths[0]}", soft_wrap=True)
    except Exception as exc:  # the report is a view: the study's results are safe in Optuna
        logger.warning("could not write the report (%s: %s); run `nightshift report %s`",
                       type(exc).__name__, exc, study)
    if summary.mlflow_incomplete:
        # Said before the pointer to MLflow: what it shows now is not the whole study.
        console.print(styled(("MLflow is incomplete:", "yellow"),
                             f" it refused the writes of {summary.mlflow_incomplete} (Optuna "
                             f"holds them; see {cfg.results_dir / 'daemon.log'}); run "
                             f"`{resume}` again once the store takes writes to log them and "
                             "close their runs"), soft_wrap=True)
    review = _mlflow_review(cfg)
    if review:
        console.print(review, soft_wrap=True)
    if summary.best_number is not None and not _no_slo_met(cfg):
        # On a line of its own, never broken: it is meant to be copied.
        console.print(f"export with: nightshift export {study}", soft_wrap=True)


def _finished_before(cfg: StudyConfig) -> int:
    """The search's trials a resumed study finished on earlier starts (0 for a new one, or
    where its storage cannot be read: the live table is a view)."""
    from optimizer.storage.study import finished_trials, is_search_trial, open_study

    try:
        study = open_study(cfg, create=False)
    except Exception:  # a new study (no storage yet), or one `start` refuses with its reason
        return 0
    return sum(is_search_trial(t) for t in finished_trials(study))


def _mlflow_review(cfg: StudyConfig) -> str:
    """How to open the study's runs in the MLflow UI (`mlflow ui` serves on 127.0.0.1:5000);
    "" when the store cannot be read now (the study's results are safe in Optuna)."""
    from optimizer.tracking.tracker import Tracker
    from optimizer.tracking.view import runs_page

    try:
        experiment = Tracker(cfg.tracking_uri).experiment_id(cfg.name)
    except Exception:  # a view: a store that fails here has its own warnings already
        return ""
    return (f"review in MLflow: mlflow ui --backend-store-uri {cfg.tracking_uri}\n"
            f"  then open {runs_page('http://127.0.0.1:5000', experiment)}")


def _recommendation(cfg: StudyConfig) -> str:
    """The recommendation line of the finished study ("" when it has none or cannot be read)."""
    from optimizer.storage.study import open_study

    try:
        return recommendation_text(open_study(cfg, create=False), cfg.objectives)
    except Exception as exc:  # a summary line: never worth failing a finished study over
        logger.warning("could not read the recommended trial (%s: %s)", type(exc).__name__, exc)
        return ""


def _no_slo_met(cfg: StudyConfig) -> bool:
    """Whether no trial of the finished study met the SLO (then nothing is recommended, and
    `export` refuses without `--trial N`); False where the store cannot be read."""
    from optimizer.results.recommendation import is_slo_unmet
    from optimizer.storage.study import open_study

    try:
        return is_slo_unmet(open_study(cfg, create=False))
    except Exception as exc:  # a summary line: never worth failing a finished study over
        logger.warning("could not read the study's trials (%s: %s)", type(exc).__name__, exc)
        return False


def _counts(cfg: StudyConfig) -> str:
    from optimizer.storage.study import count_trials, open_study

    try:
        return count_trials(open_study(cfg, create=False).get_trials(deepcopy=False)).describe()
    except Exception as exc:  # a summary line: never worth failing a finished study over
        logger.warning("could not count the study's trials (%s: %s)", type(exc).__name__, exc)
        return "trials counted by `nightshift status`"


@app.command(cls=Command, short_help="Stop a running daemon.")
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
    from optimizer.storage.lock import read_lock, study_lock_path

    if not (math.isfinite(timeout_s) and timeout_s >= 0):
        raise ConfigError(f"stop --timeout-s: expected seconds >= 0 but got {timeout_s:g}; "
                          "give how long --wait waits.")
    cfg = load_config(study).with_overrides(storage=storage)
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
