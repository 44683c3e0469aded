#!/usr/bin/env bash
# The census (python -m harness census) on the one-H200 runner. The FlashAttention bundle and the
# TE + MaxText bundles do not travel in one upload (../shared/gpu/README.md), so it runs in two
# calls of the device tool, each writing a part:
#   OUT=DIR bash scripts/gpu_census.sh te   # carry .gpu/te, .gpu/maxtext: every census kernel
#                                           #   but the FlashAttention ports
#   OUT=DIR bash scripts/gpu_census.sh fa   # carry .gpu/fa: the FlashAttention ports
# Should `te` not fit one call, run it as two parts instead (same bundles):
#   OUT=DIR bash scripts/gpu_census.sh mt   # TE, MaxText and the op
#   OUT=DIR bash scripts/gpu_census.sh jax  # the dense references, Pallas, jax.nn, tokamax
# Each call writes $OUT/census/parts/<part>/ and $OUT/census/repro/ (with the log, steps.txt and
# nvidia-smi's line beside them); copy every part's folder into reports/census/ and run
# `python -m harness census --table-only` there. Options after the part go to the census
# (e.g. --no-bench). HARNESS_GIT_COMMIT (or .gpu/commit: scripts/gpu_stamp.sh) names the
# commit in the headers (set by hand, give HARNESS_GIT_DIRTY=0 too, or the run reads dirty):
# the runner's copy of .git can be stale.
set -uo pipefail
part=${1:?usage: gpu_census.sh te|fa|mt|jax [census options]}
shift
FA=flash_attn:varlen,flash_attn:varlen_vmap,flash_attn3:varlen
MT=te:thd,te:flax_segment_ids,te:flax_seqlens_offsets,maxtext:dot_product
MT=$MT,maxtext:cudnn_flash_jax,maxtext:cudnn_flash_te,maxtext_fixed:cudnn_flash_jax
MT=$MT,sut:cudnn_flash_jax,sut:cudnn_flash_auto
JAX=dot_product,xla,pallas_mha,jax_nn:cudnn,tokamax:xla,tokamax:xla_chunked,tokamax:cudnn
JAX=$JAX,tokamax:triton,tokamax:mosaic
case $part in
  te) source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh || exit 3
      select=(--without 'flash_attn*') ;;
  mt) source .gpu/te/activate.sh && source .gpu/maxtext/activate.sh || exit 3
      select=(--kernels "$MT") ;;
  jax) source .gpu/maxtext/activate.sh || exit 3   # tokamax travels in the MaxText bundle
      select=(--kernels "$JAX") ;;
  fa) source .gpu/fa/activate.sh || exit 3
      select=(--kernels "$FA") ;;
  *) echo "usage: gpu_census.sh te|fa|mt|jax [census options]" >&2; exit 2 ;;
esac
[ -n "${HARNESS_GIT_COMMIT:-}" ] || source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HARNESS_GIT_COMMIT \
  HARNESS_GIT_DIRTY=${HARNESS_GIT_DIRTY:-1}
out=${OUT:?set OUT to the folder that comes back}/census
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
  > "$out/nvidia-smi-$part.txt" 2>&1
t0=$(date +%s)
timeout "${CENSUS_LIMIT:-570}" python3 -m harness census --part "$part" "${select[@]}" \
  --report-dir "$out" "$@" > "$out/census-$part.log" 2>&1
rc=$?
echo "census $part rc=$rc wall=$(( $(date +%s) - t0 ))s" | tee -a "$out/steps.txt"
tail -n 60 "$out/census-$part.log"
exit $rc
