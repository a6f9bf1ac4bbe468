"""Writes examples/traces/synthetic_chat.jsonl: a SYNTHETIC trace (no real traffic), for trying
`workload.trace`. 120 requests over about a minute: a quiet start, a burst, a quiet end; prompt
and output lengths lognormal around chat-like sizes. Deterministic (seed 0)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "examples" / "traces" / "synthetic_chat.jsonl"


def main() -> None:
    rng = np.random.default_rng(0)
    t = 0.0
    lines = []
    for i in range(120):
        rate_rps = 4.0 if 40 <= i < 80 else 1.5  # the middle third arrives as a burst
        t += float(rng.exponential(1.0 / rate_rps))
        input_length = int(min(2048, max(16, rng.lognormal(math.log(400), 0.6))))
        output_length = int(min(512, max(8, rng.lognormal(math.log(150), 0.5))))
        lines.append(json.dumps({"timestamp": round(t, 3), "input_length": input_length,
                                 "output_length": output_length}))
    OUT.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
