"""A finished trial as data: the record kept in Optuna's user attributes (the source of truth),
its headline metrics, and the one-line conclusion a user reads in the morning."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from optimizer.config import OBJECTIVE_DIRECTIONS
from optimizer.study import NOISE_FRACTION, metrics_value, step_value
from runners.base import RunResult, StepMetrics

_UNITS = {"goodput": "req/s", "throughput": "tok/s", "tpot": "ms TPOT p99",
          "ttft": "ms TTFT p99"}


def headline_step(objective: str, steps: Sequence[StepMetrics]) -> StepMetrics | None:
    """The load level that gave the trial its value (see `study.objective_value`)."""
    measured = [s for s in steps if s.metrics.completed > 0]
    if not measured:
        return None
    return max(measured, key=lambda s: step_value(objective, s))


def summary_metrics(result: RunResult, objectives: Sequence[str]) -> dict[str, float]:
    """Flat metrics for the tracker: the headline level in vLLM's names, the objectives, what
    the engine told at start, telemetry and (later) bottleneck shares."""
    out: dict[str, float] = {}
    step = headline_step(objectives[0], result.steps)
    if step is not None:
        out.update(step.metrics.as_dict())
        out["headline_level"] = float(step.step)
        for objective in objectives:
            value = spread(objective, step)
            if value is not None:
                out[f"spread.{objective}"] = value
        for k, v in step.server_metrics.items():
            out[f"server.{k.replace(':', '_')}"] = float(v)
    for objective in objectives:
        values = [step_value(objective, s) for s in result.steps if s.metrics.completed > 0]
        if values:
            out[f"objective.{objective}"] = max(values)
    out.update({f"engine.{k}": v for k, v in result.engine.as_metrics().items()})
    out.update({f"gpu.{k}": float(v) for k, v in result.telemetry.items()})
    if result.trace_summary:
        out.update({f"trace.{k}": float(v) for k, v in result.trace_summary.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)})
    probes = [s for s in result.steps if s.meets_slo is not None]
    if probes:  # a capacity search: the highest load within the SLO (0 when none was)
        within = [s for s in probes if s.meets_slo]
        out["capacity.concurrency"] = float(max(
            (s.level.max_concurrency or 0 for s in within), default=0))
        out["capacity.request_rate_rps"] = float(max(
            (s.level.request_rate_rps or 0.0 for s in within), default=0.0))
        out["capacity.num_probes"] = float(len(probes))
    out["trial_wall_s"] = result.wall_s
    return out


def spread(objective: str, step: StepMetrics) -> float | None:
    """How much a repeated level's objective varied: (max - min) / median; None when the level
    ran once (or its median is 0)."""
    if len(step.repeats) < 2:
        return None
    values = sorted(metrics_value(objective, m) for m in step.repeats)
    median = values[len(values) // 2]
    return (values[-1] - values[0]) / abs(median) if median else None


def step_records(steps: Sequence[StepMetrics]) -> list[dict[str, Any]]:
    """Each load level (or capacity probe) with its offered load, so the latency-vs-load curve
    is in the record and in MLflow (metrics at step = level)."""
    out = []
    for s in steps:
        metrics = s.metrics.as_dict()
        if s.level.max_concurrency is not None:
            metrics["offered_concurrency"] = float(s.level.max_concurrency)
        if s.level.request_rate_rps is not None:
            metrics["offered_rate_rps"] = s.level.request_rate_rps
        if s.meets_slo is not None:
            metrics["meets_slo"] = float(s.meets_slo)
        if s.repeats:
            metrics["repeats"] = float(len(s.repeats))
            for objective in ("goodput", "throughput", "tpot"):
                value = spread(objective, s)
                if value is not None:
                    metrics[f"spread.{objective}"] = value
        out.append({"step": s.step, "level": asdict(s.level), "metrics": metrics,
                    "server": dict(s.server_metrics), "elapsed_s": s.elapsed_s,
                    "meets_slo": s.meets_slo})
    return out


def _fmt(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def param_changes(params: Mapping[str, Any], reference: Mapping[str, Any]) -> list[str]:
    keys = [k for k in params if params.get(k) != reference.get(k)]
    return [f"{k}={reference.get(k)}→{params.get(k)}" for k in keys]


def conclude(*, params: Mapping[str, Any], state: str, objective: str,
             value: float | None, failure_reason: str | None = None,
             failure_message: str | None = None, is_baseline: bool = False,
             best: tuple[int, Mapping[str, Any], float] | None = None,
             pruned_at: int | None = None, prune_reason: str | None = None) -> str:
    """One line: what changed vs the best so far, what it did to the metric, what we learned."""
    unit = _UNITS.get(objective, "")
    if state == "failed":
        change = ", ".join(f"{k}={v}" for k, v in params.items()) if is_baseline else \
            ", ".join(param_changes(params, best[1])) if best else ""
        prefix = f"{change}: " if change else ""
        return f"{prefix}failed ({failure_reason}): {failure_message or 'no detail'}"
    if is_baseline:
        shown = f"{objective} {_fmt(value)} {unit}" if value is not None else "no measurement"
        return f"vLLM defaults: {shown}; the baseline every other trial is compared with."
    if best is None:
        shown = f"{_fmt(value)} {unit}" if value is not None else "no value"
        return f"first measured config: {objective} {shown}."
    number, best_params, best_value = best
    changes = param_changes(params, best_params) or ["same params"]
    change = ", ".join(changes[:4]) + (f" (+{len(changes) - 4} more)" if len(changes) > 4 else "")
    if value is None:
        return f"{change} vs trial {number}: no measurement."
    delta = (value - best_value) / best_value * 100 if best_value else 0.0
    maximize = OBJECTIVE_DIRECTIONS[objective] == "maximize"
    better = value > best_value if maximize else value < best_value
    head = f"{change} vs best trial {number}: {objective} {_fmt(value)} {unit} ({delta:+.0f}%)"
    if state == "pruned":
        why = prune_reason or "below the median of earlier trials there"
        return f"{head} at level {pruned_at}; pruned: {why.rstrip('.')}."
    if abs(delta) < NOISE_FRACTION * 100:
        nominal = " (nominally the new best)" if better else ""
        return f"{head}: within noise of the best{nominal}; this change does not matter here."
    if better:
        return f"{head}: new best."
    return f"{head}: worse; keep {', '.join(c.split('→')[0] for c in changes[:2])} as in the best."


def failed_record(params: Mapping[str, Any], reason: str, message: str, conclusion: str,
                  *, is_baseline: bool = False) -> dict[str, Any]:
    """The record of a trial that produced no measurement (rejected, lost, interrupted)."""
    return {"state": "failed", "params": dict(params), "flags": {}, "values": None,
            "metrics": {}, "steps": [], "failure_reason": reason, "failure_message": message,
            "conclusion": conclusion, "argv": [], "env": {}, "wall_s": 0.0,
            "is_baseline": is_baseline}
