#!/bin/bash
# ON the CPU machine, from the repository root (it needs .git): the "before" code of issue 32's
# trials-per-hour pair, as a small git-ignored tarball that one device call carries.
#   bash bench/h100/tph_pair/make_before.sh    # -> .tph/before-src.tar.gz (git-ignored)
# "Before" is the parent of commit 515c1d3 ("Capacity on a steady staircase"): capacity by fixed
# probes (each sends arrivals for probe_duration_s, then drains; one engine per trial). The
# tarball holds that commit's optimizer/, runners/ and search_spaces/ (all the code the study
# imports: they import nothing else of the repository) and its bench/h200/space.yaml (the search
# space bench/h100/tph_pair/before.yaml names), plus COMMIT. No patch: that code imports and runs
# with the device bundle's vLLM 0.26.0, optuna 5.0.0, mlflow 3.17.2 and ray 2.60.0 (its
# pyproject pins the same ranges as today's; a --dry-run of before.yaml ran it on 2026-12-06).
# bench/h100/tph_pair/before.sh unpacks it on the device and copies before.yaml in.
set -euo pipefail
commit=$(git rev-parse --verify '515c1d3~1^{commit}')
out=.tph/before-src.tar.gz
mkdir -p .tph
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
git archive "$commit" optimizer runners search_spaces bench/h200/space.yaml | tar xf - -C "$stage"
echo "$commit" > "$stage/COMMIT"
tar czf "$out" -C "$stage" --owner=0 --group=0 --sort=name COMMIT optimizer runners \
  search_spaces bench
echo "$out: $(stat -c %s "$out") bytes, the code of $commit"
