#!/bin/bash
# `harness merge` of one report at two commits, alternating, on this machine: the H200 warm3
# report of reports/nightly-h200-bcdc9ba/ (87,496 records; not committed), into a fresh folder
# each time. One line per run into runs.txt; then whether the two commits' outputs are equal.
src=${SRC:-/tmp/gpu5/gpu-040830/warm3}
out=${OUT:-/tmp/merge-side}
rm -rf $out; mkdir -p $out
for i in 1 2 3; do
  for name in 716fde9 810f4e8; do
    tree=/tmp/wt-$name
    cd $tree
    s=$(date +%s.%N)
    /work/main/.venv/bin/python -m harness merge $out/$name-$i $src > $out/$name-$i.log 2>&1
    rc=$?; e=$(date +%s.%N)
    echo "$name run $i rc=$rc command_s=$(echo "$e - $s" | bc)" >> $out/runs.txt
  done
done
cmp -s $out/716fde9-1/report.jsonl $out/810f4e8-1/report.jsonl && echo "report.jsonl: equal" >> $out/runs.txt || echo "report.jsonl: differ" >> $out/runs.txt
cmp -s $out/716fde9-1/summary.md $out/810f4e8-1/summary.md && echo "summary.md: equal" >> $out/runs.txt || echo "summary.md: differ" >> $out/runs.txt
