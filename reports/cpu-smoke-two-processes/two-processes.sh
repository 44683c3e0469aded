#!/bin/bash
# The CPU smoke run (the README's main job) in one process, then as two shards in two processes
# at once and merged, both with the same warm compilation cache, on this machine. Writes
# runs.txt (the commit, the tree state, the cores, each command's seconds), the report headers'
# outcome lines, and the merged report's records compared with the single run's
# (scripts/behaviour_unchanged.py). Usage: bash two-processes.sh OUT_DIR (from the repository).
set -u
out=${1:?usage: two-processes.sh OUT_DIR}
py=${PYTHON:-python3}
work=$(mktemp -d)
mkdir -p "$out"
{
  echo "commit $(git rev-parse HEAD)"
  echo "tree_dirty $([ -z "$(git status --porcelain --untracked-files=no)" ] && echo false || echo true)"
  echo "nproc $(nproc)"
  echo "python $($py -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__)')"
} > "$out/runs.txt"
timed() {  # NAME COMMAND...: the command's wall seconds into runs.txt
  local name=$1; shift
  local s e rc
  s=$(date +%s.%N); "$@"; rc=$?; e=$(date +%s.%N)
  echo "$name rc=$rc command_s=$(echo "$e - $s" | bc)" >> "$out/runs.txt"
}
run() { $py -m harness run --suite smoke --compilation-cache "$work/cache" "$@"; }
timed "cold (fills the cache)" run --report-dir "$work/cold" > "$work/cold.log" 2>&1
timed "one process, warm" run --report-dir "$work/single" > "$work/single.log" 2>&1
two() {
  run --shard 1/2 --report-dir "$work/s1" > "$work/s1.log" 2>&1 &
  run --shard 2/2 --report-dir "$work/s2" > "$work/s2.log" 2>&1
  wait
  $py -m harness merge "$work/merged" "$work/s1" "$work/s2" > "$work/merge.log" 2>&1
}
timed "two processes at once + merge, warm" two
for r in single s1 s2; do
  echo "== $r: $(tail -n 2 "$work/$r.log" | tr '\n' ' ')" >> "$out/runs.txt"
done
$py scripts/behaviour_unchanged.py "$work/single" "$work/merged" > "$out/merged-vs-single.txt" 2>&1
echo "behaviour_unchanged exit $?" >> "$out/merged-vs-single.txt"
rm -rf "$work"
