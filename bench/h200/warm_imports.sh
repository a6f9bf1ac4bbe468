#!/bin/bash
# Before a side-by-side pair (bench/h200/pair_*.yaml): import what `vllm serve` imports once, so
# that neither arm pays the machine's first import (bytecode written, files in the page cache)
# alone. Prints how long it took.
start=$SECONDS
python3 -c "import vllm.entrypoints.openai.api_server, vllm.v1.engine.core" 2>&1 | tail -2
echo "warm_imports: $((SECONDS - start)) s"
