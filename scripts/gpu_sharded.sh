#!/usr/bin/env bash
# The sharded kernels on the two-H200 runner (nvidia-h200-x2): one jax process over both GPUs.
#   OUT=DIR bash scripts/gpu_sharded.sh a   # TE's reorder against ours (pytest), then every
#                                           #   sharded kernel on the nightly's MHA shape
#   OUT=DIR bash scripts/gpu_sharded.sh b   # the same kernels on its GQA shape, and bidirectional
#   OUT=DIR bash scripts/gpu_sharded.sh ab  # both (about 3 minutes on the x2 runner, warm), and
#                                           #   reports/h200x2/reorder_gradient_check.py
# Each phase fits one call of the device tool (about 6 minutes, machine start aside).
# Needs the .gpu/te and .gpu/maxtext bundles (../shared/gpu) and .gpu/commit
# (`bash scripts/gpu_stamp.sh`).
set -uo pipefail
phase=${1:?usage: gpu_sharded.sh a|b|ab}
source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh
source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 HARNESS_COMPILATION_CACHE=/tmp/jaxcache-sharded
r=/tmp/h200x2; mkdir -p "$r"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$r/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$r/steps.txt"; }
KERNELS=sharded:sut:dot_product:data,sharded:sut:dot_product:heads
KERNELS=$KERNELS,sharded:sut:cudnn_flash_jax:data,sharded:sut:cudnn_flash_jax:heads
KERNELS=$KERNELS,sharded:cp:dot_product,sharded:reorder_canary
KERNELS=$KERNELS,sharded:te:ring,sharded:maxtext:cudnn_flash_te
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
if [ "$phase" != b ]; then
  step te-reorder 120 python3 -m pytest -q -p no:cacheprovider cases/test_sharded.py \
    -k "transformer_engine or within or round_trips or striped"
  # Every main layout (one shape: 12 cases), MHA.
  step sharded-mha 330 python3 -m harness run --suite nightly --kernels "$KERNELS" \
    --cases '*-b4-t1024-h8kv8-d64-bf16-s1' --report-dir "$r/sharded-mha"
fi
if [ "$phase" != a ]; then
  # GQA (8 query heads over 2 kv heads), head_dim 128, on the layouts with many packed rows;
  # bidirectional rows (TE's ring and MaxText's decoder are causal only: skipped there).
  step sharded-gqa 300 python3 -m harness run --suite nightly --kernels "$KERNELS" \
    --cases 'packed/*-b4-t2048-h8kv2-d128-bf16-s0,unaligned/*-b4-t2048-h8kv2-d128-bf16-s0,padded/*-b4-t2048-h8kv2-d128-bf16-s0,extremes/single-tokens-b4-t2048-h8kv2-d128-bf16-s0' \
    --report-dir "$r/sharded-gqa"
  step sharded-bidir 120 python3 -m harness run --suite nightly --kernels "$KERNELS" \
    --cases '*-b4-t1024-h8kv8-d64-bf16-s4-bidir' --report-dir "$r/sharded-bidir"
fi
if [ "$phase" = ab ]; then
  step reorder-gradient-check 120 python3 reports/h200x2/reorder_gradient_check.py
fi
for f in "$r"/*.log; do grep -v "^[EW][0-9]\{4\} \|Source Location\|cuda_status.cc\|^$" "$f" \
  | tail -c 200000 > "$f.txt"; rm "$f"; done
cd "$r"
tar -cf - $(ls -d sharded-* 2>/dev/null) nvidia-smi.txt steps.txt *.log.txt \
  | xz -T0 -6 > "$OUT/h200x2-sharded-$phase.tar.xz"
cat steps.txt
