#!/bin/bash
# ON the lent H200, inside run_study.sh's sequence (STUDY="sh:bench/h200/regress_pair.sh ..."):
# issue 24's proof. Run 1 re-measures tests/fixtures/regress/h200-library.yaml against the references of
# the studies in docs/ (same vLLM 0.26.0: a drift check of this machine) and saves its own
# measurements as new references; run 2 re-measures against those, with a known regression
# injected into one case's deployed config: `--enforce-eager` left on in qwen7b-chat (the usual
# debugging switch; eager measured -50% on this card). smollm2-135m is unchanged and must hold.
set -uo pipefail
R=/root/h200-results/regress; mkdir -p $R
URI=sqlite:///$R/mlruns/mlflow.db
python3 -m optimizer.cli regress tests/fixtures/regress/h200-library.yaml --workdir $R/run1 \
  --report $R/run1 --tracking-uri $URI --save-references $R/library-run1.yaml
echo "regress run 1 exit $?"
python3 - "$R" <<'PY'
import sys, yaml
r = sys.argv[1]
lib = yaml.safe_load(open(f"{r}/library-run1.yaml"))
case = next(c for c in lib["cases"] if c["name"] == "qwen7b-chat")
case["configs"][0]["flags"]["enforce_eager"] = True  # the debug flag left on
yaml.safe_dump(lib, open(f"{r}/library-run2.yaml", "w"), sort_keys=False)
PY
python3 -m optimizer.cli regress $R/library-run2.yaml --workdir $R/run2 \
  --report $R/run2 --tracking-uri $URI
echo "regress run 2 exit $?"
