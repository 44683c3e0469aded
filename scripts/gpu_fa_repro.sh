#!/usr/bin/env bash
# The FlashAttention reproducers of reports/census/repro/ on the H200 runner, each output
# written beside its script as the census's other reproducers are (`$ python X.py`, output, exit).
#   OUT=DIR bash scripts/gpu_fa_repro.sh        # carry .gpu/fa (../shared/gpu/make_fa_bundle.sh)
# flash_attn_varlen_vmap.py runs three times: what FlashAttention-2 writes at padding through
# its vmap rule is not the same from run to run (reports/census/ says which records flip).
set -uo pipefail
source .gpu/fa/activate.sh || exit 3
source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi-fa.txt" 2>&1
cd reports/census/repro
run() { local script=$1 txt=$2; { echo "\$ python $script"; timeout 240 python3 "$script" 2>&1 \
  | grep -v "^[EW][0-9]\{4\} \|Source Location\|cuda_status.cc"; echo "exit status ${PIPESTATUS[0]}"; } \
  >> "$OUT/$txt"; tail -3 "$OUT/$txt"; }
run flash_attn_ffi_clash.py flash_attn_ffi_clash.txt
for i in 1 2 3; do run flash_attn_varlen_vmap.py flash_attn_varlen_vmap.txt; done
