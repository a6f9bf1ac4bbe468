"""The ridge point: which ceiling two roofline figures of one level show binding, within the
margin the roofline resolves (`ridge_side`; docs/bottleneck.md, rule 5b)."""

from __future__ import annotations

from typing import Literal

Side = Literal["compute", "memory", "ridge"]


def ridge_side(compute: float, memory: float, margin: float) -> Side:
    """Which ceiling two roofline figures of one level show binding (its utilisation of each,
    or its decode step's FLOP and byte times): `ridge` where neither exceeds the other by more
    than `margin` (relative; `Thresholds.ridge_margin`), i.e. the FLOP term over the byte term,
    the arithmetic intensity over the ridge point, lies within [1 / (1 + margin), 1 + margin]."""
    if compute > (1.0 + margin) * memory:
        return "compute"
    if memory > (1.0 + margin) * compute:
        return "memory"
    return "ridge"
