#!/usr/bin/env bash
# The nightly suite on one GPU runner, as run on the H200 for the committed reports:
#   bash scripts/gpu_nightly.sh OUT_DIR [python -m harness run options...]
# Default options: --suite nightly. Then the benchmark (BENCH=0 leaves it out). Exits with the
# nightly run's status: 1 when a kernel failed, a catch was missed or a kernel errored.
# Needs jax with its CUDA plugin; Transformer Engine and MaxText are used when importable (on the
# project's H200 runner: `source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh` first,
# see ../shared/gpu/README.md).
set -uo pipefail
out=${1:?usage: gpu_nightly.sh OUT_DIR [harness run options]}
shift
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--suite nightly)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.txt" 2>&1 || true
python3 -m harness run "${args[@]}" --report-dir "$out/nightly" 2>&1 | tee "$out/nightly.log"
status=${PIPESTATUS[0]}
if [ "${BENCH:-1}" != 0 ]; then
  python3 -m harness bench --shapes "${BENCH_SHAPES:-hopper}" --repeats 10 --output "$out/bench.json" \
    2>&1 | tee "$out/bench.log"
fi
exit "$status"
