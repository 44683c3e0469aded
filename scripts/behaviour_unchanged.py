"""Does a change leave the harness's verdicts as they were? Two runs of one suite at two commits.

    python3 scripts/behaviour_unchanged.py BEFORE AFTER

Each argument is a report folder or file, or a digest (scripts/verdict_digest.py). On the
records both runs have (kernel, case, check, row, segment): how many, and those whose verdict,
outcome or max abs error differ (the error compared as the digest writes it: Python's repr of
the float, so equal text is an equal double). Records only one run has are counted, not judged
(the later commit may add cases). Exit status 1 if any common record differs or none is common.
"""
import sys

from series_check import load  # this folder is on sys.path when run as a script


def main(before: str, after: str) -> int:
    (c0, old, _), (c1, new, _) = load(before), load(after)
    common = old.keys() & new.keys()
    differ = sorted(k for k in common if old[k] != new[k])
    print(f"before: {before} (commit {c0 or 'not in the digest'}), {len(old)} records")
    print(f"after:  {after} (commit {c1 or 'not in the digest'}), {len(new)} records")
    print(f"records in both: {len(common)}; only before: {len(old.keys() - new.keys())}; "
          f"only after: {len(new.keys() - old.keys())}")
    print(f"records in both whose verdict, outcome or max abs error differ: {len(differ)}")
    for key in differ[:20]:
        print("  " + " ".join(key) + f": {old[key]} -> {new[key]}")
    return 1 if differ or not common else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
