"""What the classifier answers: the labels, the kinds of evidence that decide one, and the
`Verdict` (as a trial stores it in its user attributes, read back by
`optimizer.results.trial_record.verdict_of`, and as the tracker logs it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal, get_args

# compute-and-memory-bound: the level's FLOP and byte figures sit within the roofline's margin
# of each other (`Thresholds.ridge_margin`), at the ridge point: neither ceiling is shown to bind
# more than the other, so the label names both rather than the side a small difference picks.
Label = Literal["compute-bound", "memory-bound", "compute-and-memory-bound",
                "communication-bound", "launch-bound", "kv-capacity-bound", "at-physical-limit",
                "unknown"]
LABELS: Final[tuple[Label, ...]] = get_args(Label)
Source = Literal["trace", "telemetry", "metrics", "roofline", "config"]

@dataclass(frozen=True)
class Verdict:
    """The classifier's answer. `evidence` holds only the numbers that decided it."""

    label: Label
    roofline_fraction: float | None  # roofline time / measured step time; None without inputs
    evidence: dict[str, float] = field(default_factory=dict)
    reason: str = ""  # one sentence, naming the evidence used
    detail: str = ""  # the short phrase `sentence` puts in parentheses
    sources: tuple[Source, ...] = ()  # the kinds of evidence that decided
    # The load the label and its advice describe, as `sentence` shows it: "9.9 req/s, the
    # highest load that met the SLO"; "" where unknown (fixed levels name none).
    load: str = ""

    def as_user_attr(self, **extra: float | int | str | None) -> dict[str, Any]:
        """JSON-able, for `trial.set_user_attr(trial_record.ATTR_VERDICT, ...)`; `extra` adds
        what `BottleneckPruner` reads (`tensor_parallel_size`, `objective_value`, `step`)."""
        out: dict[str, Any] = {**asdict(self), "sources": list(self.sources)}
        out.update({k: v for k, v in extra.items() if v is not None})
        return out

    @classmethod
    def from_user_attr(cls, data: Mapping[str, Any]) -> Verdict:
        label = data.get("label")
        rf = data.get("roofline_fraction")
        return cls(label=label if label in LABELS else "unknown",
                   roofline_fraction=float(rf) if isinstance(rf, int | float) else None,
                   evidence={str(k): float(v) for k, v in (data.get("evidence") or {}).items()
                             if isinstance(v, int | float)},
                   reason=str(data.get("reason") or ""), detail=str(data.get("detail") or ""),
                   sources=tuple(data.get("sources") or ()), load=str(data.get("load") or ""))

    def as_metrics(self) -> dict[str, float]:
        """Flat figures for the tracker (`bottleneck.<name>`), and the operating point's two
        utilisations under the names the per-level figures use (`roofline.compute_util`,
        `roofline.bandwidth_util`, `vllm_mfu.compute_util`, `vllm_mfu.bandwidth_util`)."""
        out = {f"bottleneck.{k}": v for k, v in self.evidence.items()}
        if self.roofline_fraction is not None:
            out["bottleneck.roofline_fraction"] = self.roofline_fraction
        for key, name in (("compute_utilization", "roofline.compute_util"),
                          ("bandwidth_utilization", "roofline.bandwidth_util"),
                          ("vllm_compute_utilization", "vllm_mfu.compute_util"),
                          ("vllm_bandwidth_utilization", "vllm_mfu.bandwidth_util")):
            if key in self.evidence:
                out[name] = self.evidence[key]
        return out
