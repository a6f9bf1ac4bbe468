#!/bin/bash
# A `sh:` entry of bench/h200/run_study.sh: vLLM's own client on steady-hold-fp8's claim (its one
# trial is the baseline with fp8 weights and KV as fixed flags: labelled fp8, not defaults).
python3 bench/h100/check_claims.py bench/h100/steady-hold-fp8.yaml /root/h200-results/claims-hold-fp8 fp8
