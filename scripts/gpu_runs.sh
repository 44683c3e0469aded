#!/usr/bin/env bash
# The GPU runs behind reports/h200/ (its README says which report came from which step), on the
# project's two-H200 runner (nvidia-h200-x2, 32 cores). Single-GPU steps are pinned to one GPU
# and 16 cores (what the one-H200 runner has), two lanes at a time:
#   OUT=DIR bash scripts/gpu_runs.sh a   # GPU0: nightly cold, then warm | GPU1: op overhead,
#                                        #   bench, 50-seed flake study
#   OUT=DIR bash scripts/gpu_runs.sh c   # pytest -n 2 --gpu-per-worker on both GPUs
#   OUT=DIR bash scripts/gpu_runs.sh f   # the bench on GPU0 alone, then as c
#   OUT=DIR bash scripts/gpu_runs.sh g   # pytest -n 2 on GPU0 and 16 cores (a one-H200 runner)
# On the one-H200 runner (nvidia-h200), one step after another:
#   OUT=DIR bash scripts/gpu_runs.sh b1  # nightly cold, then warm (sampling profiles)
#   OUT=DIR bash scripts/gpu_runs.sh b3  # pytest -n 2 (cold), the CLI nightly on its cache
#                                        #   (warm), then the bench
#   OUT=DIR bash scripts/gpu_runs.sh d   # op overhead, bench, then the CLI nightly (cold)
#   OUT=DIR bash scripts/gpu_runs.sh e   # bench, 50-seed flake study, the CLI nightly cold
#                                        #   then warm
#   OUT=DIR bash scripts/gpu_runs.sh h   # bench, then the nightly of the op's kernels (cold)
# Needs the .gpu/te and .gpu/maxtext bundles (../shared/gpu) and .gpu/commit
# (`bash scripts/gpu_stamp.sh`).
set -uo pipefail
phase=${1:?usage: gpu_runs.sh a|b1|b3|c|d|e|f|g|h}
source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh
source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
r=/tmp/h200; mkdir -p "$r"
ts() { command -v taskset > /dev/null && echo "taskset -c $1"; }
# Each lane has its own compilation cache: "cold" means nothing compiled before, "warm" a
# second run on the first one's cache.
G0="env CUDA_VISIBLE_DEVICES=0 HARNESS_COMPILATION_CACHE=/tmp/jaxcache0 $(ts 0-15)"
G1="env CUDA_VISIBLE_DEVICES=1 HARNESS_COMPILATION_CACHE=/tmp/jaxcache1 $(ts 16-31)"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$r/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$r/steps.txt"; }
PASSING=dot_product,xla,pallas_mha,sut:dot_product,sut:cudnn_flash_jax,sut:cudnn_flash_jax:fallback,sut:cudnn_flash_te,te:thd,maxtext:dot_product,maxtext:cudnn_flash_te
bench() { step "$1" 150 $G1 python3 -m harness bench --shapes hopper --repeats 20 \
  --output "$r/$1.json"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
if [ "$phase" = a ]; then
  ( step nightly-cold 320 $G0 python3 -m harness run --suite nightly \
      --report-dir "$r/nightly-cold"
    step nightly-warm 180 $G0 python3 -m harness run --suite nightly \
      --report-dir "$r/nightly-warm" ) &
  ( step op-overhead 90 $G1 python3 scripts/op_overhead.py "$r/op_overhead.txt"
    bench bench
    step flake 250 $G1 python3 -m harness run --suite nightly --seeds 50 --no-leak-probe \
      --cases '*-b4-t2048-h8kv2-d128-bf16-s0' --kernels "$PASSING" --report-dir "$r/flake" ) &
  wait
elif [ "$phase" = b1 ]; then
  step nightly-cold 320 $G0 python3 scripts/sample_profile.py "$r/profile-cold.txt" run \
    --suite nightly --report-dir "$r/nightly-cold"
  step nightly-warm 200 $G0 python3 scripts/sample_profile.py "$r/profile-warm.txt" run \
    --suite nightly --report-dir "$r/nightly-warm"
elif [ "$phase" = b3 ]; then
  step pytest-1gpu 300 $G0 python3 -m pytest -q -p no:cacheprovider cases/test_matrix.py \
    --suite nightly -n 2 --report-dir "$r/pytest-1gpu" --junitxml "$r/pytest-1gpu/junit.xml"
  step nightly-warm 150 $G0 python3 -m harness run --suite nightly --report-dir "$r/nightly-warm"
  G1=$G0 bench bench
elif [ "$phase" = d ]; then
  step op-overhead 100 $G0 python3 scripts/op_overhead.py "$r/op_overhead.txt"
  G1=$G0 bench bench
  step nightly-cold 320 $G0 python3 -m harness run --suite nightly --report-dir "$r/nightly-cold"
elif [ "$phase" = e ]; then
  G1=$G0 bench bench
  step flake 200 env CUDA_VISIBLE_DEVICES=0 HARNESS_COMPILATION_CACHE=/tmp/jaxcache-flake \
    python3 -m harness run --suite nightly --seeds 50 --no-leak-probe \
    --cases '*-b4-t2048-h8kv2-d128-bf16-s0' --kernels "$PASSING" --report-dir "$r/flake"
  step nightly-cold 200 $G0 python3 -m harness run --suite nightly --report-dir "$r/nightly-cold"
  step nightly-warm 120 $G0 python3 -m harness run --suite nightly --report-dir "$r/nightly-warm"
elif [ "$phase" = h ]; then
  G1=$G0 bench bench
  step nightly-op 110 $G0 python3 -m harness run --suite nightly --report-dir "$r/nightly-op" \
    --kernels sut:cudnn_flash_jax,sut:cudnn_flash_jax:fallback,sut:cudnn_flash_te,sut:dot_product
elif [ "$phase" = g ]; then
  step pytest-1gpu 300 $G0 python3 -m pytest -q -p no:cacheprovider cases/test_matrix.py \
    --suite nightly -n 2 --report-dir "$r/pytest-1gpu" --junitxml "$r/pytest-1gpu/junit.xml"
else
  [ "$phase" = f ] && G1=$G0 bench bench
  step pytest-2gpu 240 env HARNESS_COMPILATION_CACHE=/tmp/jaxcache2 python3 -m pytest -q \
    -p no:cacheprovider cases/test_matrix.py --suite nightly -n 2 --gpu-per-worker \
    --report-dir "$r/pytest-2gpu" --junitxml "$r/pytest-2gpu/junit.xml"
fi
for f in "$r"/*.log; do grep -v "^[EW][0-9]\{4\} \|Source Location\|cuda_status.cc\|^$" "$f" \
  | tail -c 200000 > "$f.txt"; rm "$f"; done
cd /tmp/h200
if [ "$phase" = a ]; then
  tar -cf - nightly-cold nightly-warm nvidia-smi.txt steps.txt *.log.txt | xz -T0 -6 > "$OUT/h200-a.tar.xz"
  tar -cf - flake bench.json op_overhead.txt* | xz -T0 -9 > "$OUT/h200-a2.tar.xz"
elif [ "$phase" = b1 ]; then
  tar -cf - nightly-cold nightly-warm profile-*.txt nvidia-smi.txt steps.txt *.log.txt \
    | xz -T0 -6 > "$OUT/h200-b.tar.xz"
elif [ "$phase" = b3 ]; then
  tar -cf - pytest-1gpu nightly-warm bench.json nvidia-smi.txt steps.txt *.log.txt \
    | xz -T0 -6 > "$OUT/h200-b3.tar.xz"
elif [ "$phase" = d ]; then
  tar -cf - nightly-cold bench.json op_overhead.txt* nvidia-smi.txt steps.txt *.log.txt \
    | xz -T0 -6 > "$OUT/h200-d.tar.xz"
elif [ "$phase" = e ]; then
  tar -cf - nightly-cold nightly-warm flake bench.json nvidia-smi.txt steps.txt *.log.txt \
    | xz -T0 -6 > "$OUT/h200-e.tar.xz"
elif [ "$phase" = h ]; then
  tar -cf - nightly-op bench.json nvidia-smi.txt steps.txt *.log.txt | xz -T0 -6 > "$OUT/h200-h.tar.xz"
elif [ "$phase" = g ]; then
  tar -cf - pytest-1gpu steps.txt *.log.txt | xz -T0 -6 > "$OUT/h200-g.tar.xz"
else
  tar -cf - pytest-2gpu $([ "$phase" = f ] && echo bench.json) nvidia-smi.txt steps.txt \
    *.log.txt | xz -T0 -6 > "$OUT/h200-$phase.tar.xz"
fi
cat steps.txt
