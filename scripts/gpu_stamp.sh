#!/usr/bin/env bash
# The commit a GPU run names, and whether the tree it ran is that commit's tree. The device
# gets a copy of the working tree without git, so the commit travels in .gpu/commit:
#   here, before the device calls:        bash scripts/gpu_stamp.sh
#     refuses a tree with changes not committed (git status), else writes .gpu/commit: the
#     commit, then every tracked file's sha256. Carry .gpu/commit with every call.
#   on the device (the GPU scripts do it): source scripts/gpu_stamp.sh check
#     exports HARNESS_GIT_COMMIT and HARNESS_GIT_DIRTY: 1, with the files named on stderr,
#     where a file sent differs from the stamp (or the stamp has no file list), else 0.
# Before this the scripts wrote git_dirty=False into every report whatever was sent: the H200
# once ran a fix that was not yet committed under the commit before it
# (reports/h200/nightly-46d913b/README.md).
if [ "${1:-}" = check ]; then
  # No stamp: "unstamped", never the device's own copy of .git (it can be stale).
  HARNESS_GIT_COMMIT=$(head -n 1 .gpu/commit 2> /dev/null || true)
  HARNESS_GIT_COMMIT=${HARNESS_GIT_COMMIT:-unstamped}
  _stamp_out=$(tail -n +2 .gpu/commit 2> /dev/null | sha256sum --quiet --strict -c - 2>&1)
  if [ $? -eq 0 ] && [ "$HARNESS_GIT_COMMIT" != unstamped ]; then
    HARNESS_GIT_DIRTY=0
  else
    HARNESS_GIT_DIRTY=1
    echo "gpu_stamp: the tree sent is not commit '${HARNESS_GIT_COMMIT}' as stamped" \
         "(run bash scripts/gpu_stamp.sh here and carry .gpu/commit):" >&2
    printf '%s\n' "$_stamp_out" | head -n 5 >&2
  fi
  unset _stamp_out
  export HARNESS_GIT_COMMIT HARNESS_GIT_DIRTY
  return 0 2> /dev/null || exit 0
fi
set -euo pipefail
if [ -n "$(git status --porcelain)" ]; then
  echo "gpu_stamp: the tree has changes not committed (git status --porcelain): commit them" \
       "first, so that the run names the code it ran" >&2
  exit 1
fi
# reports/ (the runs' output, most of the tree) may be left out of what travels, so that a
# call has room for two bundles: a sparse checkout without it keeps git status clean
# (`git sparse-checkout set --no-cone '/*' '!/reports/'`; `git sparse-checkout disable` brings
# it back). No other tracked file may be missing: the stamp covers all the code that runs.
missing=$(git ls-files -z | xargs -0 -I{} sh -c '[ -e "$1" ] || [ -L "$1" ] || echo "$1"' _ {} \
          | grep -v '^reports/' || true)
if [ -n "$missing" ]; then
  echo "gpu_stamp: tracked files outside reports/ are not in the working tree (only reports/" \
       "may stay behind): $(echo "$missing" | head -n 3 | tr '\n' ' ')" >&2
  exit 1
fi
mkdir -p .gpu
trap 'rm -f .gpu/commit.tmp' EXIT
# Files only (a submodule or a tracked symlink to nowhere has no content to hash here).
{ git rev-parse HEAD; git ls-files -z | xargs -0 -I{} sh -c '[ -f "$1" ] || exit 0
  sha256sum "$1"' _ {}; } > .gpu/commit.tmp
mv .gpu/commit.tmp .gpu/commit
left=$(git ls-files -z reports | xargs -0 -I{} sh -c '[ -e "$1" ] || echo "$1"' _ {} | wc -l)
echo "stamped $(head -n 1 .gpu/commit): $(($(wc -l < .gpu/commit) - 1)) files" \
     "($left under reports/ not in the working tree, not sent, not stamped)"
