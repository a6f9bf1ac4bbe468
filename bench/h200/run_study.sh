#!/bin/bash
# ON the lent H200, after the chunks of ../shared/gpu/bundle.sh were stashed (.gpu/setup.sh):
#   bash bench/h200/run_study.sh start    # install vLLM, start the study (or studies) in its own session
#   bash bench/h200/run_study.sh wait N   # wait up to N s, print progress
#   bash bench/h200/run_study.sh collect [gpu-test]  # (GPU_TESTS=files: which) stop it (GRACE=S: let the trial in
#                                      flight finish first), (run the GPU test,) pack into $OUT
# STUDY=bench/h200/study3.yaml picks another study file; STUDY="a.yaml b.yaml" runs several one
# after the other in one background session (one GPU: never side by side); TRIALS=N overrides
# budget.trials; RESUME=docs/h200/grid/optuna.db starts from an earlier session's Optuna storage
# (single study only), RESUME="bench/h200/knobs.yaml=tests/fixtures/h200/knobs/knobs/optuna.db ..." each
# named study from its own; TRIM=1 cuts trace fixtures at collect. An entry `regress:LIB.yaml` in STUDY
# runs `nightshift regress` on a benchmark library (issue 24) in the same sequence, its report
# under /root/h200-results/regress/<library file name>; `sh:SCRIPT` runs a script there
# (bench/h200/regress_pair.sh: issue 24's two runs). SMOLLM2=1 converts SmolLM2-135M (the real
# model, scripts/convert_smollm2.py) into /root/smollm2-135m-bf16 before the sequence starts;
# COMPILEALL=1 byte-compiles the installed wheels first.
set -uo pipefail
# The daemon outlives this call, and the repo copy here is replaced by the next one: run from a
# private copy so a Ray worker starting mid-replacement never imports a half-written file.
src=/root/ns-src
if [ "${1:-}" = start ]; then rm -rf $src; mkdir -p $src; tar cf - --exclude=.gpu . | tar xf - -C $src; fi
cd $src 2>/dev/null || { echo "no $src: run 'start' first"; exit 3; }
export PYTHONPATH=$src:/tmp/site PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
export MLFLOW_LOGGING_LEVEL=WARNING
studies=${STUDY:-bench/h200/study.yaml}
status() { for s in $studies; do case $s in regress:*|sh:*) continue;; esac
  python3 -m optimizer.cli status $s 2>&1 | tail -40; done; }
# Every call that waits also brings back what exists so far: a machine given back between two
# calls (30 s idle) takes everything on it, as it did to study 3 (NOTES.md).
pack() { mkdir -p $OUT/r; tar czf $OUT/r/h200-results.tar.gz -C /root \
  --exclude='*.pt.trace.json*' h200-results 2>/dev/null; }
# The sequence's pid is in a file (never pgrep -f: it matches this very command line).
running() { local pid; pid=$(cat /root/h200-results/sequence.pid 2>/dev/null) &&
  kill -0 "$pid" 2>/dev/null; }
case "${1:-}" in
  start)
    (cd "$OLDPWD" && bash .gpu/setup.sh install) || exit 3
    # COMPILEALL=1: byte-compile the installed wheels (the bundle installs with --no-compile), to
    # see whether the 39-74 s before vLLM's engine starts its work shrinks (docs/startup-cost.md).
    if [ "${COMPILEALL:-0}" = 1 ] && [ ! -e /tmp/site/.compiled ]; then
      t=$SECONDS; python3 -m compileall -q -j 16 /tmp/site > /dev/null 2>&1
      touch /tmp/site/.compiled; echo "compileall: $((SECONDS - t)) s"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    mkdir -p /root/h200-results
    # RESUME entries: a bare DB (the old form: /root/h200-results/optuna.db) or STUDY.yaml=DB,
    # copied to the storage that study file names (its results_dir's optuna.db by default).
    for r in ${RESUME:-}; do
      case $r in
        *=*) dest=$(python3 -c "import sys; from pathlib import Path
from optimizer.config import load_study
from optimizer.errors import NightshiftError
try:
    cfg = load_study(Path(sys.argv[1]))
except NightshiftError as exc:
    sys.exit(f'RESUME: {exc}')
url = cfg.storage_url
print(url.removeprefix('sqlite:///') if url.startswith('sqlite:///') else '')" "${r%%=*}") ||
               exit 3
             [ -n "$dest" ] || { echo "RESUME: ${r%%=*} names no sqlite storage"; exit 3; }
             db=${r#*=};;
        *) dest=/root/h200-results/optuna.db; db=$r;;
      esac
      if [ ! -e "$dest" ]; then mkdir -p "$(dirname "$dest")" && cp "$src/$db" "$dest" || exit 3
        echo "resumed from $db: $dest"; fi
    done
    export TRIALS=${TRIALS:-}
    if [ "${SMOLLM2:-0}" = 1 ] && [ ! -e /root/smollm2-135m-bf16/config.json ]; then
      python3 scripts/convert_smollm2.py --out /root/smollm2-135m-bf16 2>&1 | tail -3 || exit 3
    fi
    # One background session runs the studies (and regress libraries) in order; each one's
    # output is appended.
    setsid nohup bash -c 'for s in "$@"; do echo "=== $s $(date -u +%FT%TZ)"; case $s in
        sh:*) bash "${s#sh:}"; echo "${s#sh:} exit $?";;
        regress:*) lib=${s#regress:}; python3 -m optimizer.cli regress "$lib" \
          --report /root/h200-results/regress/$(basename $lib .yaml)
          echo "regress exit $?";;
        *) python3 -m optimizer.cli start "$s" --no-progress ${TRIALS:+--trials $TRIALS};;
        esac; done' seq $studies > /root/h200-results/daemon.out 2>&1 < /dev/null &
    echo $! > /root/h200-results/sequence.pid
    sleep 45; tail -20 /root/h200-results/daemon.out ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    # Packs every minute too: a call cut off by the device's time limit returns what $OUT holds.
    last=$SECONDS
    while [ $SECONDS -lt $end ] && running; do
      sleep 10; if [ $((SECONDS - last)) -ge 60 ]; then pack; last=$SECONDS; fi
    done
    grep -E "INFO trial|ERROR|Traceback" /root/h200-results/daemon.out | cut -c1-400 | tail -30
    status; pack ;;
  collect)
    # collect [gpu-test]: stop the daemon, export, cut trace fixtures, pack what comes back
    # (8 files of 16 MiB at most: full traces stay on the device).
    # GRACE=S lets the trial in flight finish for up to S s first (study 4 lost a trial whose
    # levels were measured, to --now in its profile window); then --now.
    if running; then
      kill -STOP "$(cat /root/h200-results/sequence.pid)" 2>/dev/null  # no next study starts
      for s in $studies; do
        case $s in regress:*|sh:*) continue;; esac
        { [ "${GRACE:-0}" -gt 0 ] && python3 -m optimizer.cli stop $s --timeout-s "$GRACE"; } ||
          python3 -m optimizer.cli stop $s --now --timeout-s 120
      done
      kill -9 "$(cat /root/h200-results/sequence.pid)" 2>/dev/null
    fi
    status
    if [ "${2:-}" = gpu-test ]; then
      python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests/runners/test_vllm_gpu.py \
        tests/runners/test_quality_gpu.py tests/runners/test_text_prompts_gpu.py} \
        -W ignore::DeprecationWarning 2>&1 | tail -30 | tee /root/h200-results/gpu-test.txt
    fi
    for s in $studies; do
      case $s in regress:*|sh:*) continue;; esac
      python3 -m optimizer.cli export $s > /root/h200-results/best-$(basename $s .yaml).yaml
      python3 -m optimizer.cli report $s 2>&1 | tail -3
    done
    pack
    if [ "${TRIM:-0}" = 1 ]; then
      timeout 150 python3 bench/h200/trim_traces.py /root/h200-results /root/h200-fixtures \
        2>&1 | tee /root/h200-fixtures.txt
      tar czf $OUT/r/h200-fixtures.tar.gz -C /root h200-fixtures h200-fixtures.txt
    fi
    # The trimmed traces logged to MLflow, if they fit in one file back.
    (cd /root && find h200-results/mlruns -name '*.pt.trace.json*' -print0 |
      tar czf $OUT/r/mlruns-traces.tar.gz --null -T -)
    [ "$(stat -c %s $OUT/r/mlruns-traces.tar.gz)" -lt 16000000 ] || rm $OUT/r/mlruns-traces.tar.gz
    ls -la $OUT/r ;;
esac
