"""Capacity on one running engine: the highest load a config serves within the SLO in steady
state. The package's public face to the optimizer is the SLO check and the logged bracket
(`meets_slo`, `slo_miss`, `failures_miss`, `bracket_from_metrics`); the runner uses the
modules directly. Modules, each importing only those before it:

- `slo`: a measured level against the SLO; `bracket`: a logged bracket read back;
- `plan`: a step's request life, warm-up and window; `judge`: a window's verdict (the SLO and
  steady state), whether an in-flight count has settled;
- `driver`: `StaircaseDriver`, the continuous stream; `step`: one step walked on it
  (`measure_step`); `profile_window`: a profiled window of the stream;
- `staircase`: the search on one stream (`run_staircase`), each step as a `StepMetrics`;
  `probes`: a trace's or conversations' search, one bounded level per probe (`run_probes`).
"""

from runners.capacity.bracket import bracket_from_metrics
from runners.capacity.slo import failures_miss, meets_slo, slo_miss

__all__ = ["bracket_from_metrics", "failures_miss", "meets_slo", "slo_miss"]
