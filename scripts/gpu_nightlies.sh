#!/usr/bin/env bash
# Issue 17's GPU runs: consecutive full nightlies of one commit with every kernel (Transformer
# Engine, MaxText and the FlashAttention ports), on the one-H200 runner. The three bundles do
# not fit one upload, but each unpacks under /tmp once and stays while the machine is warm, so
# the calls of the device tool go back to back on one machine:
#   carry .gpu/fa .gpu/commit       OUT=DIR bash scripts/gpu_nightlies.sh unwritten
#       (the FlashAttention-2 kernels on the cases whose padding verdicts used to flip, twice:
#        what their vmap rule leaves unwritten must read NaN both times)
#   carry .gpu/maxtext .gpu/commit  OUT=DIR bash scripts/gpu_nightlies.sh env
#   carry .gpu/te .gpu/commit       OUT=DIR bash scripts/gpu_nightlies.sh nightly 1 2
#   (nothing carried)               OUT=DIR bash scripts/gpu_nightlies.sh nightly 3 4 5
# A second fresh machine: the same first three calls with `nightly m2` last.
# The flake study (issue 17, item 6): `flake N` runs every kernel on the 13 layouts of the main
# nightly shape under N seeds with the leak probe (kernels that skip a case are listed there).
# Nightly 1 starts on an empty compilation cache; the next ones reuse it, as a nightly runner
# keeps its cache. Each nightly runs under the time left of the call (570 s in all), so a call
# ends inside the tool's 10 minutes; a nightly that cannot start with 150 s left is not started.
# Needs .gpu/commit (the git commit of the tree sent).
set -uo pipefail
phase=${1:?usage: gpu_nightlies.sh unwritten|env|nightly N...|flake SEEDS}
shift
t_start=$(date +%s)
for b in fa maxtext te; do
  [ -f ".gpu/$b/activate.sh" ] && { source ".gpu/$b/activate.sh" || exit 3; }
done
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HARNESS_GIT_COMMIT=$(cat .gpu/commit) \
  HARNESS_GIT_DIRTY=0 CUDA_CACHE_PATH=/tmp/nvcache
r=/tmp/h200; mkdir -p "$r"
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$r/$name.log.txt" 2>&1; local rc=$?
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s limit=${limit}s" | tee -a "$r/steps.txt"; }
pack() { (cd "$r" && tar -cf - "$@" | xz -T0 -6 > "$OUT/$phase-$(date +%H%M%S).tar.xz"); }
case "$phase" in
  unwritten)
    cases='unpacked/pad-tail-*,packed/many-b4-t1024-*,packed/random-b4-t1024-*'
    cases+=',padded/between-b4-t1024-*,unaligned/odd-b4-t1024-*,extremes/single-tokens-*'
    for run in a b; do
      step "unwritten-$run" 240 env HARNESS_COMPILATION_CACHE=/tmp/jaxcache-unwritten \
        python3 -m harness run --suite nightly --kernels flash_attn:varlen,flash_attn:varlen_vmap \
        --cases "$cases" --report-dir "$r/unwritten-$run"
    done
    python3 - "$r" <<'EOF' | tee "$r/unwritten.txt"
import gzip, json, pathlib, sys
from collections import Counter
r = pathlib.Path(sys.argv[1])
def padding(run):
    p = r / f"unwritten-{run}" / "report.jsonl"
    recs = [json.loads(l) for l in open(p)]
    return {(x["kernel"], x["case_id"], x["row"]): x for x in recs
            if x.get("type") == "record" and x["check"] == "padding"}
a, b = padding("a"), padding("b")
print("padding records", len(a), len(b), "flips", sum(a[k]["verdict"] != b[k]["verdict"] for k in a if k in b))
for k in sorted(a):
    if k[0].endswith("vmap") and k[2] == max(x[2] for x in a if x[1] == k[1]):
        print(k[1], "last row:", a[k]["verdict"], a[k]["message"][:90], "|", b[k]["verdict"], b[k]["message"][:90])
EOF
    pack unwritten-a unwritten-b unwritten.txt steps.txt unwritten-*.log.txt ;;
  env)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
    python3 -c "import transformer_engine, maxtext, flash_attn_jax" 2>&1 | tail -1
    cat "$r/nvidia-smi.txt" ;;
  nightly)
    for n in "$@"; do
      left=$(( 570 - ($(date +%s) - t_start) ))
      if [ "$left" -lt 150 ]; then echo "nightly-$n not started: ${left}s left" | tee -a "$r/steps.txt"; continue; fi
      step "nightly-$n" "$left" env HARNESS_COMPILATION_CACHE=/tmp/jaxcache \
        python3 -m harness run --suite nightly --report-dir "$r/nightly-$n"
      gzip -kf "$r/nightly-$n/report.jsonl"
      sed -i '/Allocator\|bfc_allocator\|^W0000\|^I0000/d' "$r/nightly-$n.log.txt"
    done
    (cd "$r" && for n in "$@"; do [ -d "nightly-$n" ] && echo "nightly-$n"; done) > "$r/packed.txt"
    pack $(sed 's|$|/report.jsonl.gz|' "$r/packed.txt") $(sed 's|$|/summary.md|' "$r/packed.txt") \
      nvidia-smi.txt steps.txt $(sed 's|$|.log.txt|' "$r/packed.txt") ;;
  flake)
    seeds=${1:?flake N}; left=$(( 570 - ($(date +%s) - t_start) ))
    step "flake-$seeds" "$left" env HARNESS_COMPILATION_CACHE=/tmp/jaxcache \
      python3 -m harness run --suite nightly --seeds "$seeds" \
      --cases '*-b4-t2048-h8kv2-d128-bf16-s0' --report-dir "$r/flake-$seeds"
    gzip -kf "$r/flake-$seeds/report.jsonl"
    pack "flake-$seeds/report.jsonl.gz" "flake-$seeds/summary.md" steps.txt "flake-$seeds.log.txt" ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
cat "$r/steps.txt"
