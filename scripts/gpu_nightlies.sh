#!/usr/bin/env bash
# Issue 17's GPU runs: consecutive full nightlies of one commit with every kernel (Transformer
# Engine, MaxText and the FlashAttention ports), on the one-H200 runner. The three bundles do
# not fit one upload, but each unpacks under /tmp once and stays while the machine is warm, so
# the calls of the device tool go back to back on one machine. Stamp the commit first, here,
# with reports/ left out of the working tree so that TE's and MaxText's bundles fit one upload
# (`git sparse-checkout set --no-cone '/*' '!/reports/' && bash scripts/gpu_stamp.sh`;
# `git sparse-checkout disable` afterwards):
#   carry .gpu/fa .gpu/commit                    OUT=DIR bash scripts/gpu_nightlies.sh env
#   carry .gpu/te .gpu/maxtext .gpu/commit       OUT=DIR bash scripts/gpu_nightlies.sh env nightly:1
#   carry .gpu/commit                            OUT=DIR bash scripts/gpu_nightlies.sh nightly:2 nightly:3
# (the first `env` has only the FlashAttention bundle, so its import line fails on TE; the
# second checks all three bundles import). At 831b954 a nightly took 374-408 s cold and
# 225-242 s warm, as a command: a cold and a warm one do not fit one call. A second fresh
# machine: the same calls with the next nights' numbers (`nightly:4`, then `nightly:5`), so
# that no folder is written twice. CALL_S (default 570) is the call's own time: every step
# runs under what is left of it, so that a call given less (the session's device time nearly
# spent: `CALL_S=340` for night 5 of 831b954) still ends with its files written.
# Steps, in the order given:
#   env         the GPU and driver, and whether every bundle imports;
#   unwritten   the FlashAttention-2 kernels on the cases whose padding verdicts used to flip,
#               twice: what their vmap rule leaves unwritten must read NaN both times;
#   nightly:N   the full nightly into nightly-N;
#   flake:N     the flake study (issue 17, item 6): every kernel on the main nightly shapes'
#               layouts (GQA bf16, MHA bf16, float16) under N seeds with the leak probe; a kernel
#               that skips a case is listed in the report's skips.
# Nightly 1 starts on an empty compilation cache; the next ones reuse it, as a nightly runner
# keeps its cache. Each step runs under the time left of the call (CALL_S, 570 s by default),
# so a call ends inside the tool's 10 minutes; a run that cannot start with MIN_LEFT s left
# (default 270: a warm nightly took up to 242 s as a command at 831b954) is not started, and
# one stopped by the limit keeps what finished (its summary says it was interrupted).
# Needs .gpu/commit (written here by `bash scripts/gpu_stamp.sh`: the commit, each file's
# hash, the files left behind). Back here, `python3 scripts/series_check.py FIRST OTHER...`
# says whether the runs agree record by record, with no problem.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: gpu_nightlies.sh env|unwritten|nightly:N|flake:SEEDS ..."; exit 2; }
t_start=$(date +%s)
for b in fa maxtext te; do
  [ -f ".gpu/$b/activate.sh" ] && { source ".gpu/$b/activate.sh" || exit 3; }
done
source scripts/gpu_stamp.sh check
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_CACHE_PATH=/tmp/nvcache
r=/tmp/h200; mkdir -p "$r"; : > "$r/packed.txt"
echo "tree: commit $HARNESS_GIT_COMMIT, dirty $HARNESS_GIT_DIRTY (scripts/gpu_stamp.sh)" >> "$r/steps.txt"
left() { echo $(( ${CALL_S:-570} - ($(date +%s) - t_start) )); }
step() { local name=$1 limit=$2; shift 2; local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$r/$name.log.txt" 2>&1; local rc=$?
  # The allocator's diagnostics (out-of-memory dumps) go to a file of their own, kept.
  grep 'Allocator\|bfc_allocator\|OUT_OF_MEMORY\|out of memory' "$r/$name.log.txt" > "$r/$name.alloc.txt"
  sed -i '/Allocator\|bfc_allocator\|^W0000\|^I0000/d' "$r/$name.log.txt"
  echo "$name rc=$rc wall=$(( $(date +%s) - t0 ))s limit=${limit}s" | tee -a "$r/steps.txt"; }
run_dir() { local name=$1; shift           # a harness run into $r/NAME, under the time left
  if [ "$(left)" -lt "${MIN_LEFT:-270}" ]; then echo "$name not started: $(left)s left" | tee -a "$r/steps.txt"; return; fi
  # The device's memory in use, every half second: the peak goes into steps.txt.
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits -lms 500 \
    > "$r/$name.mem.txt" 2>/dev/null & local mon=$!
  step "$name" "$(left)" env HARNESS_COMPILATION_CACHE=/tmp/jaxcache \
    python3 -m harness run --suite nightly --report-dir "$r/$name" "$@"
  kill "$mon" 2>/dev/null
  sort -t, -k1 -n "$r/$name.mem.txt" | tail -1 \
    | awk -F, -v n="$name" '{printf "%s peak memory used %d of %d MiB\n", n, $1, $2}' | tee -a "$r/steps.txt"
  [ -f "$r/$name/report.jsonl" ] && gzip -kf "$r/$name/report.jsonl"
  echo "$name/report.jsonl.gz $name/summary.md $name.log.txt $name.alloc.txt $name.mem.txt" >> "$r/packed.txt"; }
unwritten_flips() {
  python3 - "$r" <<'PY' | tee "$r/unwritten.txt"
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
def padding(run):
    recs = [json.loads(l) for l in open(r / f"unwritten-{run}" / "report.jsonl")]
    return {(x["kernel"], x["case_id"], x["row"]): x for x in recs
            if x.get("type") == "record" and x["check"] == "padding"}
a, b = padding("a"), padding("b")
print("padding records", len(a), len(b),
      "flips", sum(a[k]["verdict"] != b[k]["verdict"] for k in a if k in b))
PY
}
for s in "$@"; do
  case "$s" in
    env)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$r/nvidia-smi.txt" 2>&1
      python3 -c "import transformer_engine, maxtext, flash_attn_jax" 2>&1 | tail -1
      cat "$r/nvidia-smi.txt"; echo nvidia-smi.txt >> "$r/packed.txt" ;;
    unwritten)
      cases='unpacked/pad-tail-*,packed/many-b4-t1024-*,packed/random-b4-t1024-*'
      cases+=',padded/between-b4-t1024-*,unaligned/odd-b4-t1024-*,extremes/single-tokens-*'
      for run in a b; do
        [ "$(left)" -ge 240 ] || { echo "unwritten-$run not started: $(left)s left" | tee -a "$r/steps.txt"; continue; }
        step "unwritten-$run" 240 env HARNESS_COMPILATION_CACHE=/tmp/jaxcache-unwritten \
          python3 -m harness run --suite nightly --kernels flash_attn:varlen,flash_attn:varlen_vmap \
          --cases "$cases" --report-dir "$r/unwritten-$run"
      done
      [ -f "$r/unwritten-b/report.jsonl" ] && unwritten_flips
      echo "unwritten-a unwritten-b unwritten.txt unwritten-a.log.txt unwritten-b.log.txt" >> "$r/packed.txt" ;;
    nightly:*) run_dir "nightly-${s#nightly:}" ;;
    flake:*)
      run_dir "flake-${s#flake:}" --seeds "${s#flake:}" \
        --cases '*-b4-t2048-h8kv2-d128-bf16-s0,*-b4-t1024-h8kv8-d64-bf16-s1,*-b4-t2048-h8kv8-d128-f16-s2' ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
# One file back per call (the tool returns at most 8); what a step did not write is left out.
(cd "$r" && tar -cf - steps.txt $(for f in $(cat packed.txt); do [ -e "$f" ] && echo "$f"; done) \
  | xz -T0 -6 > "$OUT/h200-$(date +%H%M%S).tar.xz")
cat "$r/steps.txt"
