"""What limits a measured config: a pure classifier from evidence (profiler trace shares, NVML
telemetry, /metrics, the roofline of the measured prefill/decode step mix, vLLM's own MFU
counters) to a `Verdict`, and the one-line conclusion built on it. This package's public face:
callers import from here (`from optimizer import bottleneck; bottleneck.classify(...)`).

Rules and thresholds are explained in docs/bottleneck.md; `classify` never does I/O, so it is
tested on recorded summaries. Modules, each importing only those before it:
`memory_fit` (bytes per weight, fp8 facts, `memory_problem`), `roofline` (decode and step-mix
rooflines, `level_metrics`), `evidence` (`Evidence`, `evidence_from`), `verdict` (the labels,
`Verdict`), `thresholds` (`Thresholds`), `ridge` (`ridge_side`: which ceiling binds, within
the margin), `classify` (`classify`, its rules),
`advice` (`advice`, `sentence`).
"""

from optimizer.bottleneck.advice import advice, sentence
from optimizer.bottleneck.classify import classify
from optimizer.bottleneck.evidence import Evidence, evidence_from
from optimizer.bottleneck.memory_fit import GIB, is_fp8_kv, is_fp8_weights, memory_problem
from optimizer.bottleneck.ridge import ridge_side
from optimizer.bottleneck.roofline import (
    Roofline,
    StepRoofline,
    level_metrics,
    roofline_decode_s,
    roofline_terms,
    step_roofline,
)
from optimizer.bottleneck.thresholds import DEFAULT_THRESHOLDS, Thresholds
from optimizer.bottleneck.verdict import LABELS, Label, Source, Verdict

__all__ = [
    "DEFAULT_THRESHOLDS",
    "GIB",
    "LABELS",
    "Evidence",
    "Label",
    "Roofline",
    "Source",
    "StepRoofline",
    "Thresholds",
    "Verdict",
    "advice",
    "classify",
    "evidence_from",
    "is_fp8_kv",
    "is_fp8_weights",
    "level_metrics",
    "memory_problem",
    "ridge_side",
    "roofline_decode_s",
    "roofline_terms",
    "sentence",
    "step_roofline",
]
