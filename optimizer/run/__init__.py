"""Running a study: `runtime` wires `nightshift start` (with `engine_choice`, `space_context`
and `seeds`), `daemon` is the loop that drives the search (`optimizer.search`) on an executor
(`executor`: the protocol and the in-process one; `ray_executor` and `ray_cluster`: Ray, the only
modules of `optimizer` that import it), `engines` the runners a trial runs on, by name
(`RUNNERS`, `RunnerSpec`, `build_runner`). What a dead daemon left: `recovery` (its trials
failed and re-queued, MLflow caught up) and `strays` (its engines reaped). The daemon's MLflow
side is `study_runs`, what it tells the CLI `events`. This file imports nothing: importing the
loop must not load Ray."""
