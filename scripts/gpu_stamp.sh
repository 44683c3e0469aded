#!/usr/bin/env bash
# The commit a GPU run names, and whether the tree it ran is that commit's tree. The device
# gets a copy of the working tree without git, so the commit travels in .gpu/commit:
#   here, before the device calls:        bash scripts/gpu_stamp.sh
#     refuses a tree with changes not committed (git status, and each file's content against
#     its blob, which a skip-worktree or assume-unchanged flag would hide from git status),
#     else writes .gpu/commit: the commit, each tracked file's sha256, and the tracked files
#     left out of the working tree ("absent" lines: only reports/ may be, see below). Carry
#     .gpu/commit with every call.
#   on the device (the GPU scripts do it): source scripts/gpu_stamp.sh check
#     exports HARNESS_GIT_COMMIT and HARNESS_GIT_DIRTY: 1, with the files named on stderr,
#     where a file sent differs from the stamp, a file stamped absent is there (its content
#     is unknown: reports/ holds scripts the GPU scripts run), or the stamp has no file list;
#     else 0.
# Before this the scripts wrote git_dirty=False into every report whatever was sent: the H200
# once ran a fix that was not yet committed under the commit before it
# (reports/h200/nightly-46d913b/README.md).
if [ "${1:-}" = check ]; then
  # No stamp: "unstamped", never the device's own copy of .git (it can be stale).
  HARNESS_GIT_COMMIT=$(head -n 1 .gpu/commit 2> /dev/null || true)
  HARNESS_GIT_COMMIT=${HARNESS_GIT_COMMIT:-unstamped}
  _stamp_out=$(tail -n +2 .gpu/commit 2> /dev/null | grep -v '^absent ' \
               | sha256sum --quiet --strict -c - 2>&1)
  _stamp_ok=$?
  # A file stamped absent that is here anyway: not the stamped tree's (stale, or sent later).
  _stamp_extra=$(grep '^absent ' .gpu/commit 2> /dev/null | cut -c8- | while IFS= read -r f; do
                   if [ -e "$f" ] || [ -L "$f" ]; then printf '%s: present, stamped absent\n' "$f"; fi
                 done)
  if [ -n "$_stamp_extra" ]; then _stamp_ok=1; _stamp_out=$_stamp_extra; fi
  if [ "$_stamp_ok" -eq 0 ] && [ "$HARNESS_GIT_COMMIT" != unstamped ]; then
    HARNESS_GIT_DIRTY=0
  else
    HARNESS_GIT_DIRTY=1
    echo "gpu_stamp: the tree sent is not commit '${HARNESS_GIT_COMMIT}' as stamped" \
         "(run bash scripts/gpu_stamp.sh here and carry .gpu/commit):" >&2
    printf '%s\n' "$_stamp_out" | head -n 5 >&2
  fi
  unset _stamp_out _stamp_ok _stamp_extra
  export HARNESS_GIT_COMMIT HARNESS_GIT_DIRTY
  return 0 2> /dev/null || exit 0
fi
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
if [ -n "$(git status --porcelain)" ]; then
  echo "gpu_stamp: the tree has changes not committed (git status --porcelain): commit them" \
       "first, so that the run names the code it ran" >&2
  exit 1
fi
mkdir -p .gpu
scratch=$(mktemp -d)
trap 'rm -rf "$scratch" .gpu/commit.tmp' EXIT
# Each tracked file: regular files (mode 100644/100755) present here are hashed and compared
# with their blob; those not here are listed absent. reports/ (the runs' output, most of the
# tree) may be left out of what travels, so that a call has room for two bundles: a sparse
# checkout without it keeps git status clean (`git sparse-checkout set --no-cone '/*'
# '!/reports/'`; `git sparse-checkout disable` brings it back). Any other file missing is
# refused: everything else the runs read must travel and be stamped. Symlinks and submodules
# have no content to hash here.
git ls-files -s -z | while IFS= read -r -d '' entry; do
  mode=${entry%% *}; rest=${entry#* }; blob=${rest%% *}; path=${entry#*$'\t'}
  case "$mode" in 100644|100755) ;; *) continue ;; esac
  if [ -f "$path" ]; then
    printf '%s\n' "$blob" >> "$scratch/blobs"; printf '%s\n' "$path" >> "$scratch/present"
  else
    printf '%s\n' "$path" >> "$scratch/absent"
  fi
done
touch "$scratch/blobs" "$scratch/present" "$scratch/absent"
if grep -qv '^reports/' "$scratch/absent"; then
  echo "gpu_stamp: tracked files outside reports/ are not in the working tree (only reports/" \
       "may stay behind): $(grep -v '^reports/' "$scratch/absent" | head -n 3 | tr '\n' ' ')" >&2
  exit 1
fi
# The content against the commit: git status trusts a skip-worktree or assume-unchanged flag.
git hash-object --stdin-paths < "$scratch/present" > "$scratch/hashes"
if ! cmp -s "$scratch/blobs" "$scratch/hashes"; then
  echo "gpu_stamp: files differ from their committed content although git status is clean" \
       "(a skip-worktree or assume-unchanged flag?): $(paste "$scratch/blobs" "$scratch/hashes" \
       "$scratch/present" | awk -F'\t' '$1 != $2 {print $3}' | head -n 3 | tr '\n' ' ')" >&2
  exit 1
fi
{ git rev-parse HEAD
  tr '\n' '\0' < "$scratch/present" | xargs -0 -r sha256sum --
  sed 's/^/absent /' "$scratch/absent"; } > .gpu/commit.tmp
mv .gpu/commit.tmp .gpu/commit
echo "stamped $(head -n 1 .gpu/commit): $(wc -l < "$scratch/present") files" \
     "($(wc -l < "$scratch/absent") under reports/ not in the working tree: not sent, stamped" \
     "absent)"
