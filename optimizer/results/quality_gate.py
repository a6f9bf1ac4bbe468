"""The quality gate: whether a study scores output quality, the reference the defaults trial
stores (results/<study>/quality/reference.json, with its noise floor), and `assess`, what a
trial's record says of its quality against that reference and the study file's limits."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from optimizer.storage.study import QUALITY_CONSTRAINT
from runners.atomic import write_atomic
from runners.quality_eval import QualitySample, QualityScores, changes_numerics, compare
from runners.workload import Workload

if TYPE_CHECKING:
    from optimizer.config import StudyConfig
    from runners.base import RunResult

logger = logging.getLogger(__name__)

REFERENCE_FILE = Path("quality") / "reference.json"
CONSTRAINT = QUALITY_CONSTRAINT  # the Optuna constraint a trial outside the limits violates
IDENTICAL = ("not scored: numerically identical to the reference (same weight quantization, "
             "KV cache dtype and dtype)")
QualityStatus = Literal["reference", "scored", "identical", "skipped", "missing"]


def skip_reason(cfg: StudyConfig) -> str | None:
    """Why the study scores no quality (one line, shown wherever quality is); None when it
    does."""
    return cfg.quality_skip_reason


def workload_for(workload: Workload, is_baseline: bool) -> Workload:
    """A trial's workload: the defaults trial also measures the prompts one at a time (the
    reference) besides all at once (the noise floor)."""
    if workload.quality is None or not is_baseline:
        return workload
    return replace(workload, quality=replace(workload.quality, measure_floor=True))


@dataclass(frozen=True)
class QualityAssessment:
    """What a trial's record holds of its quality (`to_dict` in `TrialRecord.quality`)."""

    status: QualityStatus
    summary: str  # one line: the figures, or why there are none
    scores: QualityScores | None = None  # against the reference (the floor, for "reference")
    floor: QualityScores | None = None  # the reference's noise floor
    failed: tuple[str, ...] = ()  # each figure outside its limit, e.g. "ppl_increase 3.7% > 2%"

    @property
    def is_violation(self) -> bool:
        return bool(self.failed)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.status == "scored" and self.scores is not None:
            out.update(self.scores.as_metrics("quality."))
            out["quality.is_within_limits"] = 0.0 if self.failed else 1.0
        if self.floor is not None:
            out.update(self.floor.as_metrics("quality.floor."))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "summary": self.summary,
                "scores": self.scores.to_dict() if self.scores else None,
                "floor": self.floor.to_dict() if self.floor else None,
                "failed": list(self.failed)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QualityAssessment:
        scores, floor = data.get("scores"), data.get("floor")
        return cls(status=data["status"], summary=str(data.get("summary") or ""),
                   scores=QualityScores.from_dict(scores) if scores else None,
                   floor=QualityScores.from_dict(floor) if floor else None,
                   failed=tuple(data.get("failed") or ()))


def describe(scores: QualityScores) -> str:
    return (f"perplexity {scores.ppl_increase:+.2%}, top-k KL {scores.mean_kl:.2g} nats, "
            f"top-1 agreement {scores.top1_agreement:.1%}, greedy match "
            f"{scores.greedy_match_tokens:.1f} tokens")


def limits_failed(cfg: StudyConfig, scores: QualityScores) -> tuple[str, ...]:
    """Each figure outside the study file's `quality` limits, as "name value vs limit"."""
    q = cfg.spec.quality
    out = []
    if q.max_ppl_increase is not None and scores.ppl_increase > q.max_ppl_increase:
        out.append(f"perplexity increase {scores.ppl_increase:.2%} > {q.max_ppl_increase:.2%}")
    if q.max_mean_kl is not None and scores.mean_kl > q.max_mean_kl:
        out.append(f"mean top-k KL {scores.mean_kl:.3g} > {q.max_mean_kl:.3g} nats")
    if q.min_top1_agreement is not None and scores.top1_agreement < q.min_top1_agreement:
        out.append(f"top-1 agreement {scores.top1_agreement:.1%} < "
                   f"{q.min_top1_agreement:.1%}")
    if q.min_greedy_match_tokens is not None and \
            scores.greedy_match_tokens < q.min_greedy_match_tokens:
        out.append(f"greedy match {scores.greedy_match_tokens:.1f} < "
                   f"{q.min_greedy_match_tokens:g} tokens")
    return tuple(out)


def reference_path(cfg: StudyConfig) -> Path:
    return cfg.results_dir / REFERENCE_FILE


def store_reference(cfg: StudyConfig, one_at_a_time: QualitySample,
                    all_at_once: QualitySample, trial_number: int) -> QualityScores:
    """Write the reference (both samples) once; returns the noise floor."""
    floor = compare(all_at_once, one_at_a_time)
    path = reference_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"trial": trial_number, "floor": floor.to_dict(),
                                   "one_at_a_time": one_at_a_time.to_dict(),
                                   "all_at_once": all_at_once.to_dict()}))
    return floor


def load_reference(cfg: StudyConfig) -> tuple[QualitySample, QualityScores] | None:
    """The stored reference sample and its floor; None when none is stored."""
    path = reference_path(cfg)
    try:
        data = json.loads(path.read_text())
        return (QualitySample.from_dict(data["one_at_a_time"]),
                QualityScores.from_dict(data["floor"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("quality reference %s unreadable (%s); trials are not scored", path, exc)
        return None


def assess(cfg: StudyConfig, *, is_baseline: bool, params: Mapping[str, Any],
           defaults: Mapping[str, Any], result: RunResult, trial_number: int,
           ) -> QualityAssessment | None:
    """A measured trial's quality: the defaults store the reference and the floor; a config
    that changes numerics is scored against it and checked against the limits. None when the
    study has no quality section in force and nothing to say."""
    skipped = skip_reason(cfg)
    if skipped is not None:
        return QualityAssessment("skipped", skipped)
    run = result.quality
    if is_baseline:
        if run is None or run.one_at_a_time is None or run.all_at_once is None:
            return QualityAssessment("missing", "no reference: " + (
                run.error if run is not None and run.error else "the evaluation did not run"))
        if reference_path(cfg).is_file():  # a re-measured defaults trial keeps the first
            stored = load_reference(cfg)
            if stored is not None:
                return QualityAssessment("reference", "the reference (stored earlier); floor: "
                                         + describe(stored[1]), floor=stored[1])
        try:
            floor = store_reference(cfg, run.one_at_a_time, run.all_at_once, trial_number)
        except (ValueError, OSError) as exc:
            return QualityAssessment("missing", f"no reference: {exc}")
        return QualityAssessment("reference", "the reference; noise floor (all at once vs one "
                                 "at a time): " + describe(floor), floor=floor)
    changed = changes_numerics(params, defaults)
    if not changed:
        return QualityAssessment("identical", IDENTICAL)
    stored = load_reference(cfg)
    if stored is None:
        return QualityAssessment("missing", "not scored: no reference (the defaults trial "
                                 "stored none)")
    reference, floor = stored
    if run is None or run.all_at_once is None:
        return QualityAssessment("missing", "not scored: " + (
            run.error if run is not None and run.error else "the evaluation did not run"),
            floor=floor)
    try:
        scores = compare(run.all_at_once, reference)
    except ValueError as exc:
        return QualityAssessment("missing", f"not scored: {exc}", floor=floor)
    failed = limits_failed(cfg, scores)
    summary = describe(scores) + (f" (floor: KL {floor.mean_kl:.2g}, top-1 "
                                  f"{floor.top1_agreement:.1%})")
    if failed:
        summary = "outside the quality limits: " + "; ".join(failed) + ". " + summary
    return QualityAssessment("scored", summary, scores=scores, floor=floor, failed=failed)


def is_quality_violation(constraints: Mapping[str, float]) -> bool:
    """Whether a trial's Optuna constraints say it failed the quality gate."""
    return constraints.get(CONSTRAINT, 0.0) > 0


def header_line(stored: Mapping[str, Any] | None, skipped: str | None = None) -> str:
    """The export header's quality line for a trial's stored assessment ("" when the study
    predates the gate and skips nothing)."""
    if stored:
        assessment = QualityAssessment.from_dict(stored)
        if assessment.failed:
            return ("quality: REFUSED by the quality gate, exported with --force-quality: "
                    + assessment.summary)
        return f"quality: {assessment.summary}"
    return f"quality: {skipped}" if skipped else ""


def table_cell(stored: Mapping[str, Any] | None, skipped: str | None = None) -> str:
    """A report table's quality cell ("" when the study predates the gate)."""
    if not stored:
        return skipped or ""
    a = QualityAssessment.from_dict(stored)
    if a.status == "scored" and a.scores is not None:
        cell = (f"ppl {a.scores.ppl_increase:+.1%}, KL {a.scores.mean_kl:.2g}, "
                f"top-1 {a.scores.top1_agreement:.0%}, greedy {a.scores.greedy_match_tokens:.1f}")
        return ("REFUSED: " + cell) if a.failed else cell
    if a.status == "reference" and a.floor is not None:
        return (f"reference; floor: KL {a.floor.mean_kl:.2g}, top-1 "
                f"{a.floor.top1_agreement:.0%}, greedy {a.floor.greedy_match_tokens:.1f}")
    if a.status == "identical":
        return "= reference (same numerics)"
    return a.summary
