"""Capacity on one running engine: the highest load a config serves within the SLO in steady
state. Modules, each importing only those before it (import them by name: this `__init__`
imports nothing, so that `runners.base` and `runners.workload`, which hold a `Bracket` and a
`CapacitySearch`, can import the first two while the later ones import them):

- `bracket`: what a search showed (`Bracket`) and a logged bracket read back
  (`bracket_from_metrics`); `search`: the search's pure decisions (`CapacitySearch`: what load
  to probe next, what to hold, the bracket the probes showed; `Probe`);
- `slo`: a measured level against the SLO (`meets_slo`, `slo_miss`, `failures_miss`);
- `plan`: a step's request life, warm-up and window; `judge`: a window's verdict (the SLO and
  steady state), whether an in-flight count has settled;
- `stream_source`: what the stream draws from (`endless_requests`, `ArrivalGaps`);
  `stream_loop`: the end of the stream's event loop (`close_loop`); `driver`:
  `StaircaseDriver`, the continuous stream; `step`: one step walked on it (`measure_step`);
  `profile_window`: a profiled window of the stream;
- `staircase`: the search on one stream (`run_staircase`), each step as a `StepMetrics`;
  `probes`: a trace's or conversations' search, one bounded level per probe (`run_probes`).
"""
