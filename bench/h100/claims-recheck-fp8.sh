#!/bin/bash
# A `sh:` entry of bench/h200/run_study.sh, with no study before it: vLLM's own client on the
# claim the sixteenth session's fp8 study held ([14.6, 15.3) req/s; its store is
# docs/h100/session16/optuna.db, which the call that starts the sequence copies in with
# RESUME="bench/h100/steady-hold-fp8.yaml=docs/h100/session16/optuna.db"). The sixteenth
# session's device time ran out 178 s into the first rate's 180 s of arrivals. Rates: 14.6 (C),
# 16.79 (1.15 C), 15.3 (the claim's upper end, where the trial's hold missed), then 15.18 (where
# the fifteenth session's client met, on another machine: how far a 3-minute p99 moves between
# runs near the edge), on one server.
CHECK_UPPER=1 CHECK_EXTRA=15.18 python3 bench/h100/check_claims.py bench/h100/steady-hold-fp8.yaml \
  /root/h200-results/claims-recheck-fp8 fp8
