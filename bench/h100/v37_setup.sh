#!/bin/bash
# Runs ON the device machine (copied to .gpu37/setup.sh by bench/h100/v37_bundle.sh). Each call
# carries ".gpu37/setup.sh", ".gpu37/setup.sha256" and one ".gpu37/cNN" (or "pNN"); this stashes
# the chunk outside the repo (the repo copy is replaced between calls; /root lasts while the
# machine stays warm, 30 s idle). vLLM 0.26.0 (.gpu/, /tmp/site) is left as it is.
#   bash .gpu37/setup.sh               # stash what this call carried
#   bash .gpu37/setup.sh install       # after the last core chunk: assemble, check the sha256,
#                                      # install into /tmp/site37, then the smoke check
#   bash .gpu37/setup.sh install-pins  # only where the smoke check failed on cudnn/cublas/cusparseLt
#                                      # and the pNN chunks were carried: torch 2.13.0's own pins
#   bash .gpu37/setup.sh check         # the smoke check again
# then: source bench/h100/v37_env.sh  (PYTHONPATH=/tmp/site37:/tmp/site, LD_LIBRARY_PATH)
set -euo pipefail
S=/root/gpu37-stash; mkdir -p $S
for d in .gpu37/[cp][0-9]*; do [ -d "$d" ] && cp -n "$d"/*.part.* $S/ 2>/dev/null || true; done
echo "stashed: $(ls $S | tr '\n' ' ')"
assemble() {  # assemble TIER: join its parts, check size and sha256, unpack /root/wheels37
  local tier=$1 want size got
  read -r _ want size < <(grep "^$tier " .gpu37/setup.sha256)
  cat $S/$tier.part.* > /root/$tier.tar
  got=$(sha256sum /root/$tier.tar | cut -d' ' -f1)
  if [ "$want" != "$got" ]; then
    echo "$tier bundle incomplete or corrupt: $(stat -c %s /root/$tier.tar) of $size bytes (a chunk is missing: machine went cold?)"
    exit 3
  fi
  rm -rf /root/wheels37; tar xf /root/$tier.tar -C /root; rm /root/$tier.tar
}
smoke() {
  # shellcheck source=/dev/null
  source bench/h100/v37_env.sh
  python3 - <<'PY'
import torch, triton
print("torch", torch.__version__, torch.__file__, "triton", triton.__version__)
assert torch.__version__.startswith("2.13.0"), "torch 2.13.0 is not the one imported"
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
print("matmul ok", float((x @ x).float().abs().mean()) > 0, torch.cuda.get_device_name())
print("cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())
conv = torch.nn.functional.conv2d(torch.randn(1, 3, 32, 32, device="cuda"),
                                  torch.randn(8, 3, 3, 3, device="cuda"))
print("cudnn conv ok", tuple(conv.shape))
f = torch.compile(lambda a: torch.nn.functional.silu(a) * 2)
print("torch.compile + triton ok", float(f(x[:8, :8].float()).sum()) == float(f(x[:8, :8].float()).sum()))
import vllm, flashinfer
print("vllm", vllm.__version__, vllm.__file__, "flashinfer", flashinfer.__version__)
from vllm.entrypoints.openai import api_server  # noqa: F401  the serve path's imports
print("vllm serve imports ok")
PY
  python3 bench/h100/v37_deps.py vllm
}
case "${1:-}" in
  install)
    if [ ! -d /tmp/site37/vllm ]; then
      assemble core
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site37 /root/wheels37/*.whl 2>&1 | tail -3
    else echo "core already installed"; fi
    smoke ;;
  install-pins)
    # Unzipped over /tmp/site37, not `pip --target --upgrade`, which would replace the whole
    # nvidia/ folder (nccl 2.29.7's with it) by these wheels' one.
    assemble pins
    for w in /root/wheels37/*.whl; do unzip -q -o "$w" -d /tmp/site37; done
    smoke ;;
  check) smoke ;;
esac
