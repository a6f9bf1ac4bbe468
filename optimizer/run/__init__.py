"""Running a study: `runtime` wires `nightshift start` (with `engine_choice`, `space_context`
and `seeds`), `daemon` is the loop that drives the search (`optimizer.search`) on an executor
(`executor`: the protocol and the in-process one; `ray_executor` and `ray_cluster`: Ray, the only
modules of `optimizer` that import it). This file imports nothing: importing the loop must not
load Ray."""
