#!/bin/bash
tree=/tmp/wt-head; name=head
rm -rf /tmp/cc-$name /tmp/side-$name-*
cd $tree
for run in cold warm; do
  s=$(date +%s.%N)
  PYTHONPATH=$tree /work/main/.venv/bin/python -m harness run --suite smoke --report-dir /tmp/side-$name-$run --compilation-cache /tmp/cc-$name > /tmp/side-$name-$run.log 2>&1
  rc=$?; e=$(date +%s.%N)
  echo "$name $run rc=$rc command_s=$(echo "$e - $s" | bc)" >> /tmp/side.txt
done
s=$(date +%s.%N)
PYTHONPATH=$tree /work/main/.venv/bin/python -m harness run --suite smoke --features none --report-dir /tmp/side-$name-nofeat --compilation-cache /tmp/cc-$name > /tmp/side-$name-nofeat.log 2>&1
rc=$?; e=$(date +%s.%N)
echo "$name warm --features none rc=$rc command_s=$(echo "$e - $s" | bc)" >> /tmp/side.txt
