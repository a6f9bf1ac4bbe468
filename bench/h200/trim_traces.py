"""ON the device, after a profiled study: cut each trial's full rank-0 trace to a small fixture of
steady-state kernel events (tests/fixtures/traces/h200/), plus the summary of the full trace, so
tests can check that the fixture tells the same story as the whole window.

    python3 bench/h200/trim_traces.py RESULTS_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runners.profiler_trace.summary import summarize
from runners.profiler_trace.trim import trim

SKIP_US = 1_500_000  # past the prefill of the profiled burst: decode steady state
MAX_EVENTS = 6000  # ~15-20 decode steps of a 28-layer model


def main(results: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    for trial_dir in sorted((results / "trials").iterdir()):
        ranks = sorted(p for p in (trial_dir / "profile").rglob("*.pt.trace.json*")
                       if "async_llm" not in p.name)
        if not ranks:
            continue
        full = ranks[-1]
        name = f"trial{int(trial_dir.name)}"
        summary = summarize(full)
        summary["source_bytes"] = full.stat().st_size
        (out / f"{name}.summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
        written = trim(full, out / f"{name}.pt.trace.json.gz", max_events=MAX_EVENTS,
                       start_offset_us=SKIP_US,
                       note=f"H200 2026-12-02 vLLM 0.26.0, {full.name}, kernel events "
                            f"from {SKIP_US / 1e6:g} s into the profiled window")
        print(name, full.name, f"{full.stat().st_size / 1e6:.1f} MB", written, "events",
              {k: round(v, 3) for k, v in summary.items() if k.endswith(("share", "fraction"))})
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
