#!/bin/bash
# A `sh:` entry of bench/h200/run_study.sh: vLLM's own client on steady-hold's claim.
python3 bench/h100/check_claims.py bench/h100/steady-hold.yaml /root/h200-results/claims-hold
