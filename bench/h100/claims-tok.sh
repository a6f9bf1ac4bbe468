#!/bin/bash
# A `sh:` entry of bench/h200/run_study.sh: vLLM's own client on steady-tok's claim.
python3 bench/h100/check_claims.py bench/h100/steady-tok.yaml /root/h200-results/claims-tok
