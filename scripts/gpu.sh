#!/usr/bin/env bash
# The one entry point for GPU runs (docs/gpu-runner.md). On the GPU runner, from the project
# root, with the bundles the steps need (../shared/gpu/make_*_bundle.sh; carried as .gpu/...)
# and the stamp (`bash scripts/gpu_stamp.sh` here, before the calls; .gpu/commit carried):
#
#   OUT=DIR bash scripts/gpu.sh STEP...        run the steps in order; one .tar.xz into OUT
#   bash scripts/gpu.sh --plan STEP...         print what each step would run, run nothing
#
# Steps:
#   env                 the GPU, the driver, and which bundled libraries import
#   nightly:NAME        the full nightly suite with the CLI, into NAME/
#   pytest:NAME         the nightly with pytest as the workflow runs it (-n <GPUs>
#                       --gpu-per-worker), into NAME/
#   census:PART         a census part (te: TE, MaxText, tokamax and the rest; fa: the
#                       FlashAttention ports; new: the libraries of harness/kernels/new_libs)
#                       into census/, its table, reproducers and bench
#   census:PART=KERNELS the census of these kernels (comma-separated) as part PART, e.g.
#                       census:drops=maxtext:cudnn_flash_jax with HARNESS_ARGS narrowing cases
#   features:NAME       every kernel on the suite's feature cases (--features), into NAME/
#   sharded:NAME        the sharded kernels (two GPUs) on their cases, into NAME/
#   bench               python -m harness bench --shapes hopper
#   patch-test          MaxText's own test of the patch (scripts/maxtext_patch_test.py)
#   repro:PATH          a committed reproducer script, its output beside it in repro/
#   flake:SEEDS         every kernel on the main nightly shapes under SEEDS seeds, into flake/
#   costs:KERNELS       seconds per run of the nightly's oracle programs and of these kernels'
#                       default and deterministic builds (scripts/program_costs.py; after a
#                       nightly, whose compilation cache it reads), into costs.log.txt;
#                       HARNESS_ARGS (options of `harness run`) are not passed to it
#   compile-costs:KERNELS  compile seconds of a sample of the nightly's oracle programs and of
#                       these kernels' builds under XLA option sets, no cache
#                       (scripts/compile_costs.py; COST_CASES cases, default 6), into
#                       compile-costs.log.txt
#
# PYSPY (optional): a py-spy binary; each run step then runs under `py-spy record --nonblocking
# --idle --threads --subprocesses --rate 20 --format raw` (sampling without pausing the run),
# its raw profile packed beside the step's log as NAME.pyspy.txt.xz (scripts/pyspy_digest.py
# reads it). With PYSPY_GIL=1 it samples a thread only while it holds the GIL (--gil in place
# of --idle): which threads' Python the run's thread waits behind.
# .gpu/python (optional, `pip install --no-deps --target .gpu/python PKG` here): pure-Python
# dependencies the runner lacks (it has no package registry), put on PYTHONPATH.
# HARNESS_ARGS (optional) is appended to every harness command (e.g. `--suite smoke` to try a
# step on a CPU, as cases/test_gpu_script.py does). Each step runs under what is left of the
# call (CALL_S seconds, default 570, so that a call of the device tool ends inside its ten
# minutes with its files written) less PACK_S (default 40): a run stopped at its limit still
# merges what finished (it is killed KILL_S, 20, seconds later if it has not ended), and the
# archive is packed after it (a warm run stopped at CALL_S=400 in a call of 420 s at 79376bd
# lost all its files to the tool's own limit while they were packed); a run that cannot start
# with MIN_LEFT seconds left (default 240) is not started and says so in steps.txt. Every
# step's exit status (profiled: its command's own, `unknown` where it wrote none), wall time,
# (for runs) the device's peak memory, and the cores busy in each 10 s (NAME.cpu.txt: CPU
# seconds sampled once a second) go to steps.txt, which the script writes; nothing in it
# is typed by hand.
set -uo pipefail
plan=0
if [ "${1:-}" = --plan ]; then plan=1; shift; fi
[ $# -gt 0 ] || { echo "usage: [OUT=DIR] bash scripts/gpu.sh [--plan] STEP... (see the header)" >&2; exit 2; }
for s in "$@"; do
  case "$s" in
    env|bench|patch-test|nightly:?*|pytest:?*|census:te|census:fa|census:new|census:?*=?*|features:?*|sharded:?*|repro:?*|flake:[0-9]*|costs:?*|compile-costs:?*) ;;
    *) echo "gpu.sh: unknown step '$s' (env, nightly:NAME, pytest:NAME, census:te|fa|new|PART=KERNELS, features:NAME, sharded:NAME, bench, patch-test, repro:PATH, flake:SEEDS, costs:KERNELS, compile-costs:KERNELS)" >&2; exit 2 ;;
  esac
done
t_start=$(date +%s)
read -r -a extra <<< "${HARNESS_ARGS:-}"
FA=flash_attn:varlen,flash_attn:varlen_vmap,flash_attn3:varlen
SHARDED=sharded:sut:dot_product:data,sharded:sut:dot_product:heads
SHARDED=$SHARDED,sharded:sut:cudnn_flash_jax:data,sharded:sut:cudnn_flash_jax:heads
SHARDED=$SHARDED,sharded:cp:dot_product,sharded:reorder_canary,sharded:te:ring
SHARDED=$SHARDED,sharded:maxtext:cudnn_flash_te
FLAKE_CASES='*-b4-t2048-h8kv2-d128-bf16-s0,*-b4-t1024-h8kv8-d64-bf16-s1,*-b4-t2048-h8kv8-d128-f16-s2'

command_of() {   # the command a step runs, one word per line (run and --plan print the same)
  local s=$1 name=${1#*:}
  case "$s" in
    nightly:*)  printf '%s\n' python3 -m harness run --suite nightly --report-dir "$r/$name" "${extra[@]}" ;;
    pytest:*)   printf '%s\n' python3 -m pytest -q -p no:cacheprovider cases/test_matrix.py --suite nightly \
                  -n "$(gpus)" --gpu-per-worker --report-dir "$r/$name" "${extra[@]}" ;;
    census:te)  printf '%s\n' python3 -m harness census --part te --without 'flash_attn*' --report-dir "$r/census" "${extra[@]}" ;;
    census:fa)  printf '%s\n' python3 -m harness census --part fa --kernels "$FA" --report-dir "$r/census" "${extra[@]}" ;;
    census:new) printf '%s\n' python3 -m harness census --part new --kernels "$(new_libs)" --report-dir "$r/census" "${extra[@]}" ;;
    census:*=*) printf '%s\n' python3 -m harness census --part "${name%%=*}" --kernels "${name#*=}" --report-dir "$r/census" "${extra[@]}" ;;
    features:*) printf '%s\n' python3 -m harness run --suite nightly --features window,softcap,chunk,sinks,head_dim_v \
                  --report-dir "$r/$name" "${extra[@]}" ;;
    sharded:*)  printf '%s\n' python3 -m harness run --suite nightly --kernels "$SHARDED" --report-dir "$r/$name" "${extra[@]}" ;;
    flake:*)    printf '%s\n' python3 -m harness run --suite nightly --seeds "$name" --cases "$FLAKE_CASES" \
                  --report-dir "$r/flake" "${extra[@]}" ;;
    bench)      printf '%s\n' python3 -m harness bench --shapes hopper --repeats 10 --output "$r/bench.json" ;;
    patch-test) printf '%s\n' python3 scripts/maxtext_patch_test.py -q ;;
    repro:*)    printf '%s\n' python3 "$name" ;;
    costs:*)    printf '%s\n' python3 scripts/program_costs.py --suite nightly --kernels "$name" ;;
    compile-costs:*) printf '%s\n' python3 scripts/compile_costs.py --suite nightly --cases "${COST_CASES:-6}" \
                  --kernels "$name" ;;
  esac
}
gpus() { local n; n=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU '); [ "${n:-0}" -gt 0 ] && echo "$n" || echo 1; }
new_libs() { python3 -c "from harness.engine.registry import all_kernels; print(','.join(n for n in all_kernels() if n.startswith(('dew_flash_attn:', 'fa4:', 'tokamax17:'))))"; }

r=${GPU_SCRATCH:-/tmp/gpu-run}
if [ "$plan" = 1 ]; then
  for s in "$@"; do
    [ "$s" = env ] && { echo "env: nvidia-smi; the bundles' imports"; continue; }
    echo "$s: $(command_of "$s" | tr '\n' ' ')"
  done
  exit 0
fi
: "${OUT:?set OUT to the folder that comes back}"
mkdir -p "$r" "$OUT"
for b in fa maxtext te new; do   # the bundles carried (BUNDLES: another folder of them)
  [ -f "${BUNDLES:-.gpu}/$b/activate.sh" ] && { source "${BUNDLES:-.gpu}/$b/activate.sh" || exit 3; }
done
[ -n "${HARNESS_GIT_COMMIT:-}" ] || source scripts/gpu_stamp.sh check
py_deps=${BUNDLES:-.gpu}/python; [ -d "$py_deps" ] && py_deps=:$(cd "$py_deps" && pwd) || py_deps=""
export PYTHONPATH=$PWD$py_deps:${PYTHONPATH:-} PYTHONUNBUFFERED=1 CUDA_CACHE_PATH=/tmp/nvcache CUDA_CACHE_MAXSIZE=4294967296 \
  HARNESS_COMPILATION_CACHE=${HARNESS_COMPILATION_CACHE:-/tmp/jaxcache} HARNESS_GIT_COMMIT HARNESS_GIT_DIRTY
echo "tree: commit $HARNESS_GIT_COMMIT, dirty $HARNESS_GIT_DIRTY (scripts/gpu_stamp.sh)" >> "$r/steps.txt"
: > "$r/packed.txt"
left() { echo $(( ${CALL_S:-570} - ($(date +%s) - t_start) )); }
step() {   # step NAME: its command under the time left, its log, its line in steps.txt
  local s=$1 log=$2 t0 rc mon=""; t0=$(date +%s)
  if [ "$(left)" -lt "${MIN_LEFT:-240}" ]; then
    echo "$s not started: $(left)s left" | tee -a "$r/steps.txt"; return; fi
  mapfile -t cmd < <(command_of "$s")
  local prof="" status=""
  if [ -n "${PYSPY:-}" ]; then
    prof=$log.pyspy.txt
    local sampled=--idle; [ "${PYSPY_GIL:-0}" = 1 ] && sampled=--gil
    # py-spy exits 0 whatever its command did (the H200's cold nightly at 396cbf3 recorded an
    # error and exited 1; steps.txt read rc=0): the command's own status goes to a file.
    status=$r/$log.status; rm -f "$status"
    cmd=("$PYSPY" record --nonblocking "$sampled" --threads --subprocesses --rate 20 --format raw
         -o "$r/$prof" -- bash -c '"${@:2}"; echo $? > "$1"' bash "$status" "${cmd[@]}")
  fi
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits \
      -lms 500 \
      > "$r/$log.mem.txt" 2> /dev/null & mon=$!
  fi
  # The CPU seconds used so far, once a second: the step's cgroup's (v2's cpu.stat) or,
  # without one, the host's (/proc/stat's busy jiffies), so that steps.txt can say when in the
  # run the cores were busy and when they stood idle.
  local cpumon=""
  ( tick=$(getconf CLK_TCK 2> /dev/null || echo 100)
    if [ -r /sys/fs/cgroup/cpu.stat ]; then echo "# the cgroup's (/sys/fs/cgroup/cpu.stat)"
    else echo "# the host's (/proc/stat)"; fi
    while :; do
      if [ -r /sys/fs/cgroup/cpu.stat ]; then
        awk -v t="$(date +%s.%N)" '$1 == "usage_usec" { printf "%s %.3f\n", t, $2 / 1e6; exit }' \
          /sys/fs/cgroup/cpu.stat
      else   # user, nice, system, irq, softirq (not idle, iowait or steal)
        awk -v t="$(date +%s.%N)" -v k="$tick" '/^cpu / { printf "%s %.3f\n", t, ($2+$3+$4+$7+$8) / k; exit }' \
          /proc/stat
      fi
      sleep 1
      kill -0 $$ 2> /dev/null || exit 0   # gpu.sh itself killed: no sampler left behind
    done ) > "$r/$log.cpu.txt" 2> /dev/null & cpumon=$!
  local limit=$(( $(left) - ${PACK_S:-40} ))
  [ "$limit" -ge 1 ] || limit=1    # `timeout 0` would be no limit at all
  # Stopped at its limit, a profiled step gets SIGINT, on which py-spy writes what it sampled
  # (on SIGTERM it wrote nothing: a narrowed run stopped at a83ae73 lost its profile); the
  # run stops as interrupted on either.
  local sig=TERM; [ -n "$prof" ] && sig=INT
  timeout -s "$sig" -k "${KILL_S:-20}" "$limit" "${cmd[@]}" > "$r/$log.log.txt" 2>&1; rc=$?
  [ -n "$mon" ] && kill "$mon" 2> /dev/null
  kill "$cpumon" 2> /dev/null; wait "$cpumon" 2> /dev/null
  # Profiled: the command's own status wherever it wrote one (py-spy may also end non-zero
  # after its command did), except for a step stopped at its limit: timeout's 124 or 137
  # stands (the command's own status there is that of being stopped).
  # None written, py-spy ending well, no stop: the shell around the command was killed, and
  # how the command ended is unknown, never a success.
  if [ -n "$status" ] && [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ]; then
    if [ -s "$status" ]; then rc=$(cat "$status"); elif [ "$rc" -eq 0 ]; then rc=unknown; fi
  fi
  # The allocator's diagnostics (out-of-memory dumps) apart, kept; the log without them.
  grep 'Allocator\|bfc_allocator\|OUT_OF_MEMORY\|out of memory' "$r/$log.log.txt" > "$r/$log.alloc.txt"
  sed -i '/Allocator\|bfc_allocator\|^W0000\|^I0000/d' "$r/$log.log.txt"
  local peak=""
  [ -s "$r/$log.mem.txt" ] && peak=$(sort -t, -k1 -n "$r/$log.mem.txt" | tail -1 \
    | awk -F, '{printf " peak memory %d of %d MiB", $1, $2}')
  # utilization.gpu: the share of the last sample period in which a kernel ran on the device
  # (nvidia-smi's own measure, any process's kernels): its mean over the command's samples.
  [ -s "$r/$log.mem.txt" ] && peak+=$(awk -F, 'NF >= 3 && $3 + 0 == $3 { s += $3; n++ }
    END { if (n) printf ", device busy %.0f%% (mean of %d utilization.gpu samples)", s / n, n }' \
    "$r/$log.mem.txt")
  # Cores busy in each 10 s of the step: CPU seconds used in it over its seconds.
  [ -s "$r/$log.cpu.txt" ] && peak+=$(awk -v n="$(nproc)" '
    NR == 1 { src = substr($0, 3); last = -1; next }
    NR == 2 { t0 = $1 }
    NR > 2  { b = int(($1 - t0) / 10); cpu[b] += $2 - pc; wall[b] += $1 - pt; if (b > last) last = b }
            { pc = $2; pt = $1 }
    END { if (last < 0) exit; out = ", cores busy by 10 s, " src ":"
          for (i = 0; i <= last; i++) out = out (wall[i] > 0 ? sprintf(" %.1f", cpu[i] / wall[i]) : " -")
          printf "%s (of %d)", out, n }' "$r/$log.cpu.txt")
  echo "$s rc=$rc wall=$(( $(date +%s) - t0 ))s${peak}" | tee -a "$r/steps.txt"
  echo "$log.log.txt $log.alloc.txt $log.mem.txt $log.cpu.txt" >> "$r/packed.txt"
  if [ -n "$prof" ] && [ -f "$r/$prof" ]; then xz -T0 -f "$r/$prof"; echo "$prof.xz" >> "$r/packed.txt"; fi
}
for s in "$@"; do
  name=${s#*:}
  case "$s" in
    env)
      { nvidia-smi --query-gpu=name,driver_version,memory.total,uuid --format=csv 2>&1
        for m in tblib transformer_engine maxtext tokamax flash_attn_jax flash_attn3_jax dew_flash_attn fa4_jax; do
          # The import's last line where it fails. Imported as the harness imports it, CUDA
          # 12's runtime loaded first (harness.kernels.flash_attn.load_cudart12): a bare import
          # of flash_attn_jax read "no" (libcudart.so.12) on runs whose FlashAttention kernels ran.
          if why=$(python3 -c "try:
    from harness.kernels.flash_attn import load_cudart12
    load_cudart12()
except ImportError:
    pass
import $m" 2>&1); then echo "import $m: ok"
          else echo "import $m: no ($(printf '%s\n' "$why" | grep -v '^\s*$' | tail -1 | cut -c1-200))"; fi
        done; } > "$r/env.txt"
      cat "$r/env.txt"; echo env.txt >> "$r/packed.txt" ;;
    nightly:*|pytest:*|features:*|sharded:*)
      step "$s" "$name"
      for f in report.jsonl; do [ -f "$r/$name/$f" ] && gzip -kf "$r/$name/$f"; done
      echo "$name/report.jsonl.gz $name/summary.md" >> "$r/packed.txt" ;;
    flake:*)
      step "$s" flake; [ -f "$r/flake/report.jsonl" ] && gzip -kf "$r/flake/report.jsonl"
      echo "flake/report.jsonl.gz flake/summary.md" >> "$r/packed.txt" ;;
    census:*)
      step "$s" "census-${name%%=*}"; echo census >> "$r/packed.txt" ;;
    bench)
      step bench bench; echo bench.json >> "$r/packed.txt" ;;
    patch-test)
      step patch-test patch-test ;;
    costs:*)
      step "$s" costs ;;
    compile-costs:*)
      step "$s" compile-costs ;;
    repro:*)
      mkdir -p "$r/repro"; step "$s" "repro-$(basename "$name" .py)"
      mv "$r/repro-$(basename "$name" .py).log.txt" "$r/repro/$(basename "$name" .py).txt" 2> /dev/null
      echo "repro" >> "$r/packed.txt" ;;
  esac
done
# One file back per call (the device tool returns at most 8): what a step did not write is
# left out.
stamp=$(date +%H%M%S)
(cd "$r" && tar -cf - steps.txt $(for f in $(cat packed.txt); do [ -e "$f" ] && echo "$f"; done | sort -u) \
  | xz -T0 -6 > "$OUT/gpu-$stamp.tar.xz")
cat "$r/steps.txt"
