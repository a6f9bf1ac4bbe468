"""The `nightshift` subcommands (start, status, stop, export, report, audit, hw) on one typer
app, registered in the order `--help` lists them."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from optimizer.cli.live import LiveProgress
from optimizer.cli.output import add_log_file, console, out, setup_logging
from optimizer.config import StudyConfig, load_study
from optimizer.errors import ConfigError, NightshiftError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="nightshift: tune vLLM serving configs overnight (Optuna + Ray + MLflow).")
logger = logging.getLogger("optimizer.cli")

StudyArg = Annotated[Path, typer.Argument(help="The study YAML (see examples/quickstart.yaml).")]


def _load(study: Path) -> StudyConfig:
    return load_study(study)


# -- start ----------------------------------------------------------------------------------


@app.command()
def start(
    study: StudyArg,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Run on the simulated engine (no GPU needed); figures are "
                          "simulated, never measurements.")] = False,
    tracking_uri: Annotated[str | None, typer.Option(
        help="MLflow tracking URI (default sqlite:///mlruns/mlflow.db).")] = None,
    storage: Annotated[str | None, typer.Option(
        help="Optuna RDB URL (default sqlite under the results dir).")] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Join an existing Ray cluster (auto or ray://host:10001).")] = None,
    trials: Annotated[int | None, typer.Option(help="Override budget.trials.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress",
                                              help="Log lines only, no live table.")] = False,
) -> None:
    """Create or resume a study and run it until its budget ends or it is stopped.

    Example: nightshift start examples/quickstart.yaml --dry-run
    """
    from optimizer.runtime import build_daemon

    cfg = _load(study)
    cfg = cfg.with_overrides(tracking_uri=tracking_uri, storage=storage, trials=trials)
    setup_logging(verbose)
    progress = None if no_progress or not console.is_terminal else LiveProgress(cfg)
    daemon, notes = build_daemon(cfg, dry_run=dry_run, ray_address=ray_address,
                                 on_event=progress.on_event if progress else None)
    # Only now, with the study validated, does anything get written under results_dir.
    log_file = add_log_file(cfg.results_dir / "daemon.log")
    for note in notes:
        logger.info(note)
    resume = f"nightshift start {study}" + (" --dry-run" if dry_run else "")

    def _on_signal(signum: int, frame: Any) -> None:
        now = daemon.stopping
        daemon.request_stop(now=now)
        what = ("stopping now: failing trials in flight" if now else
                "stopping: finishing trials in flight (signal again to stop now)")
        console.print(f"[yellow]{what}[/]; resume with: {resume}")

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        if progress is not None:
            with progress:
                summary = daemon.run()
        else:
            summary = daemon.run()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        logging.getLogger().removeHandler(log_file)
        log_file.close()
    if summary.stopped_early:
        console.print(f"study {cfg.name} stopped with {summary.total_finished} trials "
                      f"finished; resume with: {resume}")
    else:
        console.print(f"study {cfg.name} done: {summary.total_finished} trials finished.")
    if summary.best_number is not None:
        console.print(f"best: trial {summary.best_number} {summary.best_values}; export with: "
                      f"nightshift export {study}")
    try:
        paths = _write_report(cfg, None, log_to_mlflow=True)
        console.print(f"report: {paths[0]}")
    except Exception as exc:  # the report is a view: the study's results are safe in Optuna
        logger.warning("could not write the report (%s: %s); run `nightshift report %s`",
                       type(exc).__name__, exc, study)

# -- status / stop --------------------------------------------------------------------------


@app.command()
def status(study: StudyArg,
           storage: Annotated[str | None, typer.Option(help="Optuna RDB URL.")] = None) -> None:
    """Show the progress of a running or finished study.

    Example: nightshift status examples/quickstart.yaml
    """
    from optuna.trial import TrialState

    from optimizer.conclusions import shorten
    from optimizer.lock import read_lease, read_lock, study_lock_path
    from optimizer.study import ATTR_RECORD, best_trial, make_storage, open_study

    cfg = _load(study).with_overrides(storage=storage)
    store = make_storage(cfg.storage_url)
    opened = open_study(cfg, create=False, storage=store)
    holder = read_lock(study_lock_path(cfg)) or \
        read_lease(store, store.get_study_id_from_name(cfg.name))
    trials = opened.get_trials(deepcopy=False)
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    running = f"running (pid {holder.get('pid')})" if holder is not None else "not running"
    out.print(f"study [bold]{cfg.name}[/]: daemon {running}; "
              + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    table = Table(expand=True)
    for col in ("trial", "state", *cfg.objectives, "flags beyond defaults", "conclusion"):
        table.add_column(col, overflow="fold")
    for t in trials:
        if t.state == TrialState.WAITING:
            continue  # queued, never started: counted in the line above
        record = t.user_attrs.get(ATTR_RECORD) or {}
        values = t.values if t.values else [None] * len(cfg.objectives)
        table.add_row(str(t.number), record.get("state", t.state.name.lower()),
                      *["" if v is None else f"{v:.4g}" for v in values],
                      " ".join(f"{k}={v}" for k, v in (record.get("flags") or {}).items())
                      or ("(defaults)" if record.get("flags") == {} else ""),
                      record.get("conclusion_short") or shorten(record.get("conclusion", "")))
    out.print(table)
    best = best_trial(opened)
    if best is not None:
        out.print(f"best: trial {best.number} values={best.values}")


@app.command()
def stop(study: StudyArg,
         now: Annotated[bool, typer.Option("--now", help="Fail the trials in flight instead "
                                                         "of letting them finish.")] = False,
         wait: Annotated[bool, typer.Option("--wait/--no-wait")] = True,
         timeout_s: Annotated[float, typer.Option(help="How long --wait waits.")] = 600.0,
         storage: Annotated[str | None, typer.Option(help="Optuna RDB URL.")] = None,
         ) -> None:
    """Stop a running daemon (it finishes the trials in flight unless --now).

    Example: nightshift stop examples/quickstart.yaml --now
    """
    from optimizer.lock import read_lock, study_lock_path

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


@app.command()
def export(
    study: StudyArg,
    trial: Annotated[int | None, typer.Option(
        help="Trial number (default: the recommended: the best, or the config with the fewest "
             "changes from the defaults within 2% of it).")] = None,
    fmt: Annotated[str, typer.Option("--format", help="yaml, sh or env.")] = "yaml",
    output: Annotated[Path | None, typer.Option("--output", "-o",
                                                help="File to write (default stdout).")] = None,
    max_tpot_ms: Annotated[float | None, typer.Option(
        help="Choose the best trial whose TPOT p99 is at most this (a Pareto choice).")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna RDB URL.")] = None,
) -> None:
    """Write a trial's config as a `vllm serve --config` YAML, a shell command or env vars.

    Example: nightshift export examples/quickstart.yaml --format sh -o serve.sh
    """
    from optimizer.export import choice_note, render, select_trial
    from optimizer.study import open_study

    cfg = _load(study).with_overrides(storage=storage)
    opened = open_study(cfg, create=False)
    chosen = select_trial(opened, cfg, number=trial, max_tpot_ms=max_tpot_ms)
    note = choice_note(opened, chosen) if trial is None and max_tpot_ms is None else ""
    text = render(chosen, cfg, fmt, note=note, path=output)
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text)
        if fmt == "sh":
            output.chmod(0o755)
        console.print(f"wrote trial {chosen.number} as {fmt} to {output}")


# -- report ---------------------------------------------------------------------------------


def _write_report(cfg: StudyConfig, output: Path | None, *, log_to_mlflow: bool) -> list[Path]:
    from optimizer.report import build_report, write_report
    from optimizer.study import open_study
    from optimizer.tracking import Tracker

    built = build_report(open_study(cfg, create=False), cfg)
    paths = write_report(built, output or cfg.results_dir / "report")
    if log_to_mlflow:
        Tracker(cfg.tracking_uri).log_study_files(cfg.name, paths, "report")
    return paths


@app.command()
def report(
    study: StudyArg,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Folder to write into (default <results_dir>/report).")] = None,
    mlflow: Annotated[bool, typer.Option(
        "--mlflow/--no-mlflow", help="Also log the files to the study's MLflow parent run.")
    ] = True,
    storage: Annotated[str | None, typer.Option(help="Optuna RDB URL.")] = None,
) -> None:
    """Write the study's report: report.html and report.md with PNG plots (best config and its
    gain over the defaults, Pareto front, importances, bottlenecks, failures).

    Example: nightshift report examples/quickstart.yaml -o morning/
    """
    cfg = _load(study).with_overrides(storage=storage)
    paths = _write_report(cfg, output, log_to_mlflow=mlflow)
    out.print(f"wrote {', '.join(str(p) for p in paths)}")


# -- audit ----------------------------------------------------------------------------------


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def audit(
    ctx: typer.Context,
    from_file: Annotated[Path | None, typer.Option(
        "--from-file", help="A shell launcher holding the `vllm serve` line (and exports).")
    ] = None,
    pid: Annotated[int | None, typer.Option(
        help="A running server: read /proc/PID/cmdline and environ.")] = None,
    hardware: Annotated[str | None, typer.Option(
        help="A hardware preset (h200, a100, ...) instead of probing this machine.")] = None,
    study: Annotated[Path | None, typer.Option(
        help="A study file: its workload bounds --max-model-len, and --measure runs on it.")
    ] = None,
    measure: Annotated[bool, typer.Option(
        "--measure", help="Measure each fix against the launch as is (needs --study).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Findings as JSON, for scripts.")
                       ] = False,
) -> None:
    """Check a `vllm serve` launch before tuning it: flags, env and --config file, each finding
    with its reason and expected cost. Exit code 0 clean, 1 findings, 2 bad input.

    Example: nightshift audit -- vllm serve Qwen/Qwen2.5-7B --enforce-eager
    """
    from optimizer import audit as auditing
    from runners.hardware import load_preset, probe
    from runners.vllm.flags import flag_table

    if sum(x is not None for x in (from_file, pid)) + bool(ctx.args) != 1:
        raise ConfigError("audit: give exactly one launch: `-- vllm serve ...`, --from-file F "
                          "or --pid N.")
    if from_file is not None:
        argv, env = auditing.read_launch_file(from_file)
    elif pid is not None:
        argv, env = auditing.read_pid(pid)
    else:
        argv, env = list(ctx.args), dict(os.environ)
    table = flag_table()
    launch = auditing.parse_launch(argv, env, table)
    profile = load_preset(hardware) if hardware else probe()
    cfg = _load(study) if study is not None else None
    longest = None
    if cfg is not None:
        w = cfg.spec.workload
        longest = (w.input_len.high or w.input_len.mean) + (w.output_len.high or
                                                             w.output_len.mean)
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
        console.print(f"measuring the launch as is against each fix: {path}")
        start(path, dry_run=False, tracking_uri=None, storage=None, ray_address=None,
              trials=None, verbose=False, no_progress=True)
    if findings:
        raise typer.Exit(1)


# -- hw -------------------------------------------------------------------------------------


@app.command()
def hw(output: Annotated[Path | None, typer.Option("--output", "-o",
                                                   help="Save the profile as JSON.")] = None,
       measure: Annotated[bool, typer.Option(help="Measure bandwidth and FLOP/s with torch.")
                          ] = False) -> None:
    """Print (and save) this machine's GPU profile, read through NVML.

    Example: nightshift hw -o hw.json
    """
    import json

    from runners.hardware import probe

    profile = probe(measure=measure)
    if not profile.has_gpu:
        out.print("no NVIDIA GPU found (NVML unavailable); the profile is empty.")
    data = profile.to_dict()
    out.print_json(json.dumps(data, default=str))
    if output is not None:
        output.write_text(json.dumps(data, indent=2, default=str))
