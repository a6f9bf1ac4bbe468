#!/bin/bash
# A `sh:` entry of bench/h200/run_study.sh (ON the device, cwd its private copy /root/ns-src):
# the "before" arm of issue 32's trials-per-hour pair. Unpacks the old code that
# bench/h100/tph_pair/make_before.sh packed (.tph/before-src.tar.gz, carried by the call that
# starts the sequence)
# into /root/ns-before, copies the tree's before.yaml in, and runs its one trial there, with the
# old code first on PYTHONPATH (its Ray workers inherit it). Its records land in
# /root/h200-results/tph-before, which run_study.sh packs. Needs bench/h100/tok.sh first.
# NS_BEFORE and RESULTS move the two /root folders (a rehearsal on the CPU machine).
set -uo pipefail
here=bench/h100/tph_pair
dest=${NS_BEFORE:-/root/ns-before}
results=${RESULTS:-/root/h200-results}/tph-before
tarball=.tph/before-src.tar.gz
if [ ! -f $tarball ]; then
  echo "tph_pair: no $tarball: run bash $here/make_before.sh on the CPU machine and carry" \
    ".tph in the call that starts the sequence" >&2
  exit 2
fi
rm -rf $dest && mkdir -p $dest && tar xzf $tarball -C $dest || exit 3
mkdir -p $dest/$here $results && cp $here/before.yaml $dest/$here/ || exit 3
cp $dest/COMMIT $results/COMMIT
echo "tph_pair before: the code of $(cat $dest/COMMIT)"
(cd $dest && PYTHONPATH=$dest:/tmp/site python3 -m optimizer.cli start $here/before.yaml \
  --no-progress)
rc=$?
# A vLLM left behind would take the after arm's GPU memory: say so in the log.
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null |
  sed 's/^/tph_pair before: still on the GPU: /'
exit $rc
