"""The search, split as Ray Tune splits it: `searcher` (what to try next; the study's sampler
from `samplers`, the informed start's ranking from `screen`), `scheduler` (when to stop a
trial; its pruners in `pruners`), `placement` (where and when a trial runs: GPUs, the
compile-cache order of `startup`), `retries` (what runs again), and the one `controller` that
drives them (`SearchController`, used by the daemon and `bench/replay.py`); `tell` writes what
Optuna is told of each trial (with the conclusion's `notes`), `trials` the types a trial passes
through. Pure policy: no processes, Ray or MLflow. The modules are imported by name; this file
imports nothing, so that importing one pulls in no other."""
