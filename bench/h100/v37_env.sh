# Source ON the device machine: run vLLM 0.32.0 from /tmp/site37 (bench/h100/v37_setup.sh) in
# front of the 0.26.0 bundle's /tmp/site (optuna, mlflow, ray, ...) and the image's packages.
# torch 2.13.0's libraries find nccl 2.29.7 through their RPATH (/tmp/site37/nvidia/nccl/lib);
# the image's cudnn 9.19, cusparseLt 0.8.0, cublas 13.1.0 and the other CUDA 13.0 libraries, which
# /tmp/site37 does not carry, through LD_LIBRARY_PATH (site37's own folders first).
img=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export PYTHONPATH=${NS_SRC:+$NS_SRC:}/tmp/site37:/tmp/site
LD_LIBRARY_PATH=$( (ls -d /tmp/site37/nvidia/*/lib "$img"/nvidia/*/lib 2>/dev/null || true) |
  paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
# torch 2.13.0 was built with cudnn 9.20 and refuses a 9.19 runtime at its first cudnn call unless
# told; every cudnn symbol it imports is in 9.19 (checked on CPU). Not needed once install-pins
# put 9.20 in /tmp/site37.
if [ ! -d /tmp/site37/nvidia/cudnn ]; then export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1; fi
unset img
