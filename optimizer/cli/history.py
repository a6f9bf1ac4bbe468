"""`nightshift history`: what earlier studies of a model or fingerprint found (the tuning
memory, optimizer/tuning_memory/earlier_studies.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from optimizer.cli.app import Command, app, load_config
from optimizer.cli.output import out
from optimizer.errors import ConfigError, TrackingError, cause_of, headline, translate


@app.command(cls=Command, short_help="What earlier studies of a model or fingerprint found.")
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
    from optimizer.tuning_memory.earlier_studies import (
        history_rows,
        read_studies,
        select,
        trial_conclusions,
    )

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

        cfg = load_config(study)
        uri = uri or cfg.tracking_uri
        like = study_fingerprint(cfg, dry_run=dry_run)
    uri = uri or default_tracking_uri()
    problem = tracking_uri_problem(uri) or sqlite_file_problem("tracking_uri", uri)
    if problem is not None:
        raise ConfigError(f"history --tracking-uri: {problem.removeprefix('tracking_uri: ')}."
                          ) from cause_of(problem)
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
        hint = ("MLflow 3 opens no file store unless MLFLOW_ALLOW_FILE_STORE=true is set; give "
                "sqlite:///mlruns/mlflow.db" if "MLFLOW_ALLOW_FILE_STORE" in str(exc) else
                f"{headline(exc)}; check --tracking-uri")
        raise translate(exc, f"history --tracking-uri: MLflow cannot open {uri} ({hint}).",
                        into=ConfigError) from exc
    try:
        found = select(read_studies(client), model=model, fingerprint_hash=fingerprint,
                       like=like)
    except Exception as exc:  # MLflow raises many types; all mean "cannot read the store"
        raise translate(exc, f"history: the tracking store {uri} could not be read "
                        f"({headline(exc)}); check --tracking-uri.",
                        into=TrackingError) from exc
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
