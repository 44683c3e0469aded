#!/usr/bin/env bash
# The GPU runs behind reports/census/ and reports/h200/census-runs/ (its README says which report
# came from which step), on the one-H200 runner, in calls of the device tool:
#   machine 1, carry .gpu/te .gpu/maxtext:
#     OUT=DIR bash scripts/gpu_census_runs.sh a1  # the census's part "te" (its nightly of the
#                                                 #   census kernels, bench, reproducers), then
#                                                 #   the nightly of every other kernel: together
#                                                 #   nightly 1
#     OUT=DIR bash scripts/gpu_census_runs.sh a2  # the bench (the op's auto mode, MaxText before
#                                                 #   and after the patch), MaxText's own test of
#                                                 #   the patch, nightlies 2, 3 and 4
#   machine 2, carry .gpu/fa .gpu/maxtext:
#     OUT=DIR bash scripts/gpu_census_runs.sh b   # the census's part "fa" (the FlashAttention
#                                                 #   ports), then the nightly of every kernel
#                                                 #   without TE on a second fresh machine
# Needs .gpu/commit (written here by `bash scripts/gpu_stamp.sh`: the commit, and each file's
# hash). Every step has a time limit, so a command ends inside the tool's 10 minutes whatever a
# kernel does.
set -uo pipefail
phase=${1:?usage: gpu_census_runs.sh a1|a2|b}
if [ "$phase" = b ]; then
  source .gpu/fa/activate.sh && source .gpu/maxtext/activate.sh || exit 3
else
  source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh || exit 3
fi
source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HARNESS_COMPILATION_CACHE=/tmp/jaxcache
r=/tmp/h200; mkdir -p "$r"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$r/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$r/steps.txt"; }
nightly() { step "$1" "$2" python3 -m harness run --suite nightly --report-dir "$r/$1" "${@:3}"; }
# Kernels chosen by a predicate on the registry (the runner has no other way to list them).
kernels() { python3 -c "from harness.engine.registry import all_kernels
from harness.tools.census.options import CENSUS_KERNELS
print(','.join(n for n, k in all_kernels().items() if $1))"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
if [ "$phase" = a1 ]; then
  step census-te 470 python3 -m harness census --part te --without 'flash_attn*' \
    --report-dir "$r/census"
  nightly nightly-1-rest 110 --kernels "$(kernels 'n not in CENSUS_KERNELS')"
  cd "$r" && tar -cf - census nightly-1-rest nvidia-smi.txt steps.txt *.log | xz -T0 -6 \
    > "$OUT/h200-a1.tar.xz"
elif [ "$phase" = a2 ]; then
  step bench 150 python3 -m harness bench --shapes hopper --repeats 20 --output "$r/bench.json"
  step patch-test 60 python3 scripts/maxtext_patch_test.py -q
  nightly nightly-2 130
  nightly nightly-3 120
  cd "$r" && tar -cf - bench.json nightly-2 nightly-3 steps.txt *.log | xz -T0 -6 \
    > "$OUT/h200-a2.tar.xz"
else
  step census-fa 330 python3 -m harness census --part fa \
    --kernels flash_attn:varlen,flash_attn:varlen_vmap,flash_attn3:varlen --report-dir "$r/census"
  nightly nightly-b 230 --kernels "$(kernels '"transformer_engine" not in k.requires')"
  cd "$r" && tar -cf - census nightly-b nvidia-smi.txt steps.txt *.log | xz -T0 -6 > "$OUT/h200-b.tar.xz"
fi
cat "$r/steps.txt"
