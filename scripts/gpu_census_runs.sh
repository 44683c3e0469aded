#!/usr/bin/env bash
# The GPU runs behind reports/h200/census-*/ and reports/census/ (their READMEs say which report
# came from which step), on the one-H200 runner, in three calls of the device tool:
#   machine 1, carry .gpu/te .gpu/maxtext:
#     OUT=DIR bash scripts/gpu_census_runs.sh a1  # nightly 1 (cold) and 2, the bench (the op's
#                                                 #   auto mode, MaxText before/after the patch),
#                                                 #   MaxText's own test of the patch
#     OUT=DIR bash scripts/gpu_census_runs.sh a2  # nightlies 3, 4, 5 (the same machine, warm),
#                                                 #   the flake study
#   machine 2, carry .gpu/fa .gpu/maxtext:
#     OUT=DIR bash scripts/gpu_census_runs.sh b   # the FlashAttention ports' nightlies (census
#                                                 #   part "fa", twice), the nightly of every
#                                                 #   kernel without TE on a second fresh machine
# Needs .gpu/commit (the git commit of the tree sent). Every step has a time limit, so a
# command ends inside the tool's 10 minutes whatever a kernel does.
set -uo pipefail
phase=${1:?usage: gpu_census_runs.sh a1|a2|b}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HARNESS_GIT_COMMIT=$(cat .gpu/commit) \
  HARNESS_GIT_DIRTY=0 HARNESS_COMPILATION_CACHE=/tmp/jaxcache
if [ "$phase" = b ]; then
  source .gpu/fa/activate.sh && source .gpu/maxtext/activate.sh
else
  source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh
fi
r=/tmp/h200; mkdir -p "$r"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$r/$name.log" 2>&1; local rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$r/steps.txt"; }
nightly() { step "$1" "$2" python3 -m harness run --suite nightly --report-dir "$r/$1" "${@:3}"; }
# Every kernel expected to pass that the runner can run (the flake study's list).
PASSING=dot_product,xla,pallas_mha,sut:dot_product,sut:cudnn_flash_jax,sut:cudnn_flash_auto,\
sut:cudnn_flash_jax:fallback,sut:cudnn_flash_te,te:thd,maxtext:dot_product,maxtext:cudnn_flash_te,\
maxtext_fixed:cudnn_flash_jax,tokamax:xla,tokamax:xla_chunked,tokamax:cudnn,te:flax_segment_ids,\
te:flax_seqlens_offsets,jax_nn:cudnn
FA=flash_attn:varlen,flash_attn:varlen_vmap,flash_attn3:varlen
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
if [ "$phase" = a1 ]; then
  nightly nightly-1 300
  step bench 150 python3 -m harness bench --shapes hopper --repeats 20 --output "$r/bench.json"
  step patch-test 60 python3 scripts/maxtext_patch_test.py -q
  nightly nightly-2 200
  tar -cf - nightly-1 nightly-2 bench.json nvidia-smi.txt steps.txt *.log | xz -T0 -6 \
    > "$OUT/h200-a1.tar.xz"
elif [ "$phase" = a2 ]; then
  nightly nightly-3 150
  nightly nightly-4 150
  nightly nightly-5 150
  step flake 200 python3 -m harness run --suite nightly --seeds 3 --kernels "$PASSING" \
    --cases '*-b4-t2048-h8kv2-d128-bf16-s0,*-b4-t1024-h8kv8-d64-bf16-s1' --report-dir "$r/flake"
  tar -cf - nightly-3 nightly-4 nightly-5 flake steps.txt *.log | xz -T0 -6 \
    > "$OUT/h200-a2.tar.xz"
else
  nightly fa-1 240 --kernels "$FA"
  nightly fa-2 120 --kernels "$FA"
  nightly nightly-b 240 --kernels "$(python3 -c 'from harness.engine.registry import all_kernels
print(",".join(n for n, k in all_kernels().items() if "transformer_engine" not in k.requires))')"
  tar -cf - fa-1 fa-2 nightly-b nvidia-smi.txt steps.txt *.log | xz -T0 -6 > "$OUT/h200-b.tar.xz"
fi
cat "$r/steps.txt"
