"""Commands that check something besides a study's search: `nightshift regress` (the
benchmark library re-measured), `audit` (a vLLM launch against its flag table) and `hw`
(this machine's GPU profile, or a preset's)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from optimizer.cli.app import Command, app, check_output_file, load_config
from optimizer.cli.output import console, out, setup_logging, styled
from optimizer.cli.run import start
from optimizer.errors import ConfigError, NightshiftError, cause_of, translate
from runners.atomic import write_atomic


@app.command(cls=Command,
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
            raise translate(exc, f"--simulated-vllm: cannot read {simulated_vllm} as JSON "
                            f"({type(exc).__name__}); give a JSON object.",
                            into=ConfigError) from exc
        from runners.simulated.launcher import VllmVariant

        if not isinstance(variant, dict):
            raise ConfigError(f"--simulated-vllm: expected a JSON object but got "
                              f"{type(variant).__name__}; see docs/regress.md.")
        try:
            VllmVariant.from_dict(variant)
        except ValueError as exc:
            raise translate(exc, f"--simulated-vllm: {exc}", into=ConfigError) from exc
    uri = tracking_uri or spec.tracking_uri or default_tracking_uri()
    problem = tracking_uri_problem(uri) if tracking_uri is not None else None
    if problem is not None:
        raise ConfigError(f"--tracking-uri: {problem}") from cause_of(problem)
    problem = sqlite_file_problem("tracking_uri", uri) if mlflow else None
    if problem is not None:
        where = "--tracking-uri" if tracking_uri is not None else f"{library.name}: tracking_uri"
        raise ConfigError(f"{where}: {problem.removeprefix('tracking_uri: ')}."
                          ) from cause_of(problem)
    # Where the run writes, checked before any engine starts: not after an hour of measuring.
    for option, folder in (("--workdir", workdir), ("--report", report_dir)):
        problem = directory_problem(option, folder)
        if problem is not None:
            raise ConfigError(f"{problem}.")
    if save_references is not None:
        check_output_file("--save-references", save_references)
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


@app.command(cls=Command, context_settings={"allow_extra_args": True},
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
    finding with its reason and expected cost. Exit code 0 clean or notes only (info),
    1 a warning or an error, 2 bad input.
    The launch goes after `--`.

    \b
    Examples:
      nightshift audit -- vllm serve Qwen/Qwen2.5-7B --enforce-eager
      nightshift audit --json --from-file launch.sh
    """
    from optimizer.export import audit as auditing
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
    cfg = load_config(study) if study is not None else None
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
        out.print(styled((launch.model or "(no model)", "bold"),
                         f": {len(launch.flags)} flags"
                         + (f" (and {len(launch.unknown)} it does not take)" if launch.unknown
                            else "")
                         + f", {len(launch.env)} engine variables, checked against "
                         f"{launch.flag_source}"), soft_wrap=True)
        for f in findings:
            colour = {"error": "red", "warning": "yellow", "info": "cyan"}[f.severity]
            out.print(styled((f.severity, colour), f" {f.code}: {f.message} ",
                             (f"cost: {f.cost}", "dim")), highlight=False, soft_wrap=True)
        if not findings:
            out.print(styled(("no findings", "green")))
    if measure:
        if cfg is None:
            raise ConfigError("audit --measure: give --study STUDY.yaml (model, workload, "
                              "engine) to measure on.")
        path = auditing.paired_study(cfg.to_dict(), launch, findings,
                                     cfg.results_dir.parent / f"{cfg.name}-audit")
        console.print(f"measuring the launch as is against each fix: {path}", soft_wrap=True)
        start(path, dry_run=False, tracking_uri=None, storage=None, ray_address=None,
              trials=None, verbose=False, no_progress=True)
    # An info finding is a note (a max_model_len far above the workload's longest request):
    # nightshift's own export may carry one, and `audit --study` on it must still pass.
    if any(f.severity != "info" for f in findings):
        raise typer.Exit(1)


def _print_facts() -> None:
    """Every measured fact, bundled and the user's, with its evidence and how to override it."""
    from search_spaces.known_facts import FactError, facts_file, load_facts

    path = facts_file()
    try:
        known = load_facts(path)
    except FactError as exc:
        raise translate(exc, str(exc)) from exc
    out.print(f"measured facts: bundled (search_spaces/facts/known_facts.yaml) and {path} "
              f"({'present' if path.is_file() else 'none written yet'}); a study file's "
              "known_facts.ignore: [ID] turns one off.", highlight=False, soft_wrap=True,
              markup=False)
    for fact in known:
        out.print(f"{fact.id} [{fact.source}]: {fact.describe()}", highlight=False,
                  soft_wrap=True, markup=False)


@app.command(cls=Command, short_help="Show this machine's GPU profile, or a preset's.")
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

    from optimizer.config.sections import SimulatedSpec
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
        check_output_file("hw --output", output)
        write_atomic(output, json.dumps(data, indent=2, default=str))
    out.print_json(json.dumps(data, default=str))
