"""`nightshift regress` end to end, without a terminal: check the library and the store before
anything starts, measure each case, compare, log to MLflow, write the report, and the exit
code (0 no case regressed or failed, 1 a regression or failure)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from optimizer.config import check_workload
from optimizer.errors import ConfigError, TrackingError, translate
from optimizer.regress.compare import PASSING
from optimizer.regress.library import DEFAULT_FIGURES, CaseSpec, LibrarySpec
from optimizer.regress.measure import CaseOutcome, Installed, installed, measure_case
from optimizer.regress.report import (
    HistoryPoint,
    center_of,
    config_lines,
    experiment_name,
    history,
    interval_scope,
    log_to_mlflow,
    plot_figure,
    version_line,
    write_report,
)
from optimizer.tracking.tracker import Tracker
from runners.model_info import bundled_shapes, load_model_info

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RegressResult:
    exit_code: int  # 0 no case regressed or failed; 1 any regression or failure
    outcomes: tuple[CaseOutcome, ...]
    report_files: tuple[Path, ...]
    run_ids: Mapping[str, str]  # case -> MLflow run


def select_cases(spec: LibrarySpec, names: Sequence[str]) -> list[CaseSpec]:
    known = {c.name: c for c in spec.cases}
    for name in names:
        if name not in known:
            raise ConfigError(f"--case {name}: no such case in library {spec.name!r}; its "
                              f"cases are {', '.join(known)}.")
    return [c for c in spec.cases if not names or c.name in names]


def prepare(spec: LibrarySpec, cases: Sequence[CaseSpec], tracking_uri: str | None,
            simulated_variant: Mapping[str, Any] | None, source: Path | None = None,
            ) -> tuple[list[Installed], Tracker | None]:
    """Everything checked before any engine starts: each case's engine, model and workload
    (its prompts, trace or dataset files and its fit in the model's context, as a study checks
    them; paths against the library file's folder), and a writable MLflow store (None: not
    logging). Bad input raises ConfigError."""
    here = []
    for case in cases:
        try:
            check_workload(case.study_config(source))
        except ConfigError as exc:
            raise translate(exc, f"cases {case.name}: {exc}") from exc
        info = installed(case, simulated_variant)
        if info.engine == "simulated" and load_model_info(case.model.path) is None:
            raise ConfigError(f"cases {case.name}: model.path: the simulated engine needs the "
                              f"model's shape; give a directory with config.json or one of "
                              f"{', '.join(bundled_shapes())} (got {case.model.path!r}).")
        here.append(info)
    tracker = None
    if tracking_uri is not None:
        try:
            tracker = Tracker(tracking_uri)
            tracker.check_writable(experiment_name(spec.name))
        except TrackingError as exc:  # at the start a store that refuses is bad input
            raise translate(exc, f"--tracking-uri: {exc}", into=ConfigError) from exc
    return here, tracker


def first_line(spec: LibrarySpec, cases: Sequence[CaseSpec], here: Sequence[Installed]) -> str:
    refs = [c.reference for case in cases for c in case.configs if c.reference is not None]
    return version_line(here, [r.vllm_version for r in refs], [r.card for r in refs])


def regress(spec: LibrarySpec, cases: Sequence[CaseSpec], here: Sequence[Installed],
            tracker: Tracker | None, workdir: Path, report_dir: Path | None,
            source: Path | None = None, say: Callable[[str], None] = logger.info,
            ) -> RegressResult:
    """Measure each case (in library order), then log and report. `say` gets a line per case
    as it finishes."""
    outcomes: list[CaseOutcome] = []
    for case, info in zip(cases, here, strict=True):
        say(f"case {case.name}: {len(case.configs)} config(s) x {case.rounds} round(s) x "
            f"{case.repeats} repeat(s) on {info.engine} vLLM {info.vllm_version}")
        outcome = measure_case(case, info, workdir, spec.threshold, source=source)
        outcomes.append(outcome)
        say(f"case {outcome.name}: {outcome.verdict} ({interval_scope(outcome)})")
        for config in outcome.configs:
            for line in config_lines(config, spec.threshold):
                say(f"  {line}")
    exit_code = 0 if all(o.verdict in PASSING for o in outcomes) else 1
    run_ids: dict[str, str] = {}
    if tracker is not None:
        run_ids = log_to_mlflow(tracker, spec.name, outcomes, spec.threshold)
    files: list[Path] = []
    if report_dir is not None:
        histories = {}
        by_name = {c.name: c for c in cases}
        for outcome in outcomes:
            figure = plot_figure(outcome)
            refs = {}
            for held in by_name[outcome.name].configs:
                ref = held.reference
                if ref is not None and figure in ref.figures:
                    refs[held.name] = (ref.vllm_version, ref.date, ref.figures[figure].center)
            points = history(tracker, spec.name, outcome, figure, refs) if tracker else []
            if tracker is None:  # no store: the reference and this run only
                points = [HistoryPoint(f"vllm {v} ref {d[:10]}", n, val)
                          for n, (v, d, val) in refs.items()]
                label = f"vllm {outcome.installed.vllm_version} @ {outcome.date[:16]}"
                points += [HistoryPoint(label, c.name, center_of(c.samples[figure]))
                           for c in outcome.configs if c.samples.get(figure)]
            histories[outcome.name] = (figure, points)
        files = write_report(report_dir, spec.name, outcomes, spec.threshold, exit_code,
                             histories)
    return RegressResult(exit_code, tuple(outcomes), tuple(files), run_ids)


def default_workdir(spec: LibrarySpec) -> Path:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path("results") / "regress" / spec.name / stamp


def measured_references(outcomes: Sequence[CaseOutcome]
                        ) -> dict[str, dict[str, dict[str, Any]]]:
    """This run's samples as references (case -> config -> reference), for each config that
    measured: what `--save-references` writes."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for outcome in outcomes:
        for config in outcome.configs:
            if config.failure is not None or not config.samples:
                continue
            out.setdefault(outcome.name, {})[config.name] = {
                "vllm_version": outcome.installed.vllm_version,
                "card": outcome.installed.card, "date": outcome.date,
                "figures": {k: {"samples": list(v)} for k, v in config.samples.items()
                            if v and k in DEFAULT_FIGURES},
                "source": f"nightshift regress, {config.num_runs} start(s) x "
                          f"{outcome.repeats} repeat(s)"}
    return out
