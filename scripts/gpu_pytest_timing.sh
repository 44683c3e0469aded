#!/usr/bin/env bash
# Issue 21's timings on the two-H200 runner (nvidia-h200-x2): the full nightly three ways, each
# from an empty compilation cache, one after another on the same machine:
#   cli-1gpu     python -m harness run --suite nightly        GPU 0 and 16 cores (a one-H200 runner)
#   pytest-1gpu  pytest cases/test_matrix.py --suite nightly -n 2           the same GPU and cores
#   pytest-2gpu  the same with --gpu-per-worker                 both GPUs and all 32 cores
#   OUT=DIR bash scripts/gpu_pytest_timing.sh [one|two|all]   # carry .gpu/te (.gpu/maxtext
#                                                 already there); one: the two one-GPU runs
#                                                 (about 8 minutes), two: pytest-2gpu, all: all three
# pytest runs the pairs ahead of its tests in the CLI's engine (the default on GPUs; one lane per
# GPU with --gpu-per-worker). Every step has a time limit inside the tool's 10 minutes.
set -uo pipefail
phase=${1:-all}
source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh || exit 3
source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
r=/tmp/timing; mkdir -p "$r"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  HARNESS_COMPILATION_CACHE=/tmp/cache-$name timeout "$limit" "$@" > "$r/$name.log" 2>&1
  local rc=$?; echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$r/steps.txt"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
nproc >> "$r/nvidia-smi.txt"
one="env CUDA_VISIBLE_DEVICES=0 taskset -c 0-15"
if [ "$phase" != two ]; then
  step pytest-1gpu 270 $one python3 -m pytest -q -p no:cacheprovider cases/test_matrix.py \
    --suite nightly -n 2 --report-dir "$r/pytest-1gpu" --junitxml="$r/pytest-1gpu/junit.xml"
  step cli-1gpu 270 $one python3 -m harness run --suite nightly --report-dir "$r/cli-1gpu"
fi
if [ "$phase" != one ]; then
  step pytest-2gpu 170 python3 -m pytest -q -p no:cacheprovider cases/test_matrix.py \
    --suite nightly -n 2 --gpu-per-worker --report-dir "$r/pytest-2gpu" \
    --junitxml="$r/pytest-2gpu/junit.xml"
fi
for d in cli-1gpu pytest-1gpu pytest-2gpu; do [ -d "$r/$d" ] || continue
  python3 -m harness compare "$r/$d" "$r/cli-1gpu" > "$r/$d.compare.txt" 2>&1; done
for f in "$r"/*.log; do grep -v "^[EW][0-9]\{4\} \|Source Location\|cuda_status.cc\|^$" "$f" \
  | tail -c 200000 > "$f.txt"; rm "$f"; done
cd "$r" && for d in cli-1gpu pytest-1gpu pytest-2gpu; do [ -d "$d" ] || continue
  gzip -9 -f "$d/report.jsonl"; rm -f "$d/traces.jsonl" "$d/report.html"; done
tar -cf - $(ls -d cli-1gpu pytest-1gpu pytest-2gpu 2>/dev/null) nvidia-smi.txt steps.txt \
  *.log.txt *.compare.txt | xz -T0 -6 > "$OUT/h200x2-timing-$phase.tar.xz"
cat steps.txt; tail -n 3 *.compare.txt
