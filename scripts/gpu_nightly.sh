#!/usr/bin/env bash
# The nightly suite on one GPU runner, as run on the H200 for the committed reports:
#   bash scripts/gpu_nightly.sh OUT_DIR
# Needs jax with its CUDA plugin; Transformer Engine is used when importable (on the project's
# H200 runner: `source .gpu/te/activate.sh` first, see ../shared/gpu/README.md).
set -uo pipefail
out=${1:?usage: gpu_nightly.sh OUT_DIR}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.txt" 2>&1
python3 -m harness list --suite nightly
# Leave time for the report views if the run is cut short: the records are written as it goes.
timeout "${NIGHTLY_TIMEOUT:-420}" python3 -m harness run --suite nightly --report-dir "$out/nightly" \
  ${KERNELS:+--kernels "$KERNELS"} 2>&1 | tee "$out/nightly.log"
python3 -m harness report "$out/nightly" > /dev/null 2>&1
timeout "${BENCH_TIMEOUT:-120}" python3 -m harness bench --shapes hopper --repeats 10 \
  --kernels "xla,maxtext_original:cudnn_flash_jax,sut:cudnn_flash_jax,sut:cudnn_flash_jax:fallback,sut:cudnn_flash_te,pallas_mha" \
  --output "$out/bench.json" 2>&1 | tee "$out/bench.log"
exit 0
