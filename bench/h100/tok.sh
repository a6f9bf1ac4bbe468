#!/bin/bash
# A `sh:` entry of bench/h200/run_study.sh, before bench/h100/steady-tok.yaml.
python3 bench/h100/make_tok_model.py /root/qwen3-8b-tok
