#!/bin/bash
# ON the CPU machine, from the repository root: both arms of the pair on the simulated engine,
# then table.py on their records; a rehearsal of the device run, never a measurement. Small
# copies of before.yaml and after.yaml under $DRY (default /tmp/tph-dry): the model directory
# written here, answers of 60-140 tokens, SLO TPOT p99 <= 7 ms, range [8, 32] req/s, 10 s probes
# (before), windows of >= 80 requests and >= 2 s and holds of 20 s (after), /tmp paths. About 1
# and 2 minutes on a 2-core machine. Needs the tarball of make_before.sh.
#   bash bench/h100/tph_pair/dry_run.sh
set -euo pipefail
here=bench/h100/tph_pair
dry=${DRY:-/tmp/tph-dry}
[ -f .tph/before-src.tar.gz ] || { echo "dry_run: run bash $here/make_before.sh first" >&2
  exit 2; }
rm -rf "$dry" && mkdir -p "$dry/ns-before/$here" "$dry/h200-results/tph-before"
tar xzf .tph/before-src.tar.gz -C "$dry/ns-before"
PYTHONPATH=$PWD python3 bench/h100/make_tok_model.py "$dry/qwen3-8b-tok"
shrink() {  # the load shortened for the simulated engine, every /root path under $dry
  sed -e "s#/root/qwen3-8b-tok#$dry/qwen3-8b-tok#; s#/root/#$dry/#g" \
    -e 's/low: 600, high: 1400/low: 60, high: 140/; s/tpot_p99_ms: 15/tpot_p99_ms: 7/' \
    -e 's/low: 8, high: 12,/low: 8, high: 32,/; s/probe_duration_s: 30/probe_duration_s: 10/' \
    -e 's/min_window_requests: 150, min_window_s: 10/min_window_requests: 80, min_window_s: 2/' \
    -e 's/hold_s: 180/hold_s: 20/' "$1"
  echo "simulated: {hardware: h100-8x-nvlink, num_gpus: 1}"
}
shrink $here/before.yaml > "$dry/ns-before/$here/before.yaml"
shrink $here/after.yaml | sed "s#\.\./\.\./h200/space.yaml#$PWD/bench/h200/space.yaml#" \
  > "$dry/after.yaml"
cp "$dry/ns-before/COMMIT" "$dry/h200-results/tph-before/"
export RAY_AUTH_MODE=disabled
echo "dry_run: before arm (the old code, $dry/before.out), then after arm ($dry/after.out)"
(cd "$dry/ns-before" && PYTHONPATH=$PWD python3 -m optimizer.cli start $here/before.yaml \
  --dry-run --no-progress) > "$dry/before.out" 2>&1
PYTHONPATH=$PWD python3 -m optimizer.cli start "$dry/after.yaml" --dry-run --no-progress \
  > "$dry/after.out" 2>&1
PYTHONPATH=$PWD python3 $here/table.py "$dry/h200-results"
