"""Do consecutive runs of one commit agree? For issue 17's series of nightlies.

    python3 scripts/series_check.py FIRST OTHER...

Each argument is a run: a report folder or file (full records), or a digest
(`verdicts.tsv.gz`, scripts/verdict_digest.py). For each run: its commit, outcomes and
problems (records whose outcome is bad: fail, missed, error). For each later run against the
first: the records only one has, and those whose verdict, outcome or max abs error differ. Where both have full records,
`harness compare` (harness.judge.regression) too. Exit status 1 if any run has a problem,
a different commit, or disagrees with the first; 0 otherwise.
"""
import sys
from collections import Counter
from pathlib import Path

from harness.judge import regression
from harness.judge import vocabulary as v
from harness.store import report_file
from harness.views import digest


def load(source: str):
    """(commit, {digest key: (verdict, outcome, max abs err)}, full records or None)."""
    path = Path(source)
    if path.name.endswith(".tsv.gz"):
        commit, rows, records = None, digest.read(path), None
    else:
        header, records = report_file.read(path)
        commit, rows = header.get("environment", {}).get("git_commit"), digest.rows(records)
    table = {tuple(r[f] for f in digest.KEY): tuple(r[f] for f in digest.VALUES) for r in rows}
    return commit, table, records


def main(sources: list[str]) -> int:
    runs = [(s, *load(s)) for s in sources]
    bad = False
    commits = {c for _, c, _, _ in runs if c}
    print(f"commits: {', '.join(sorted(commits)) or 'not in the digests'}")
    bad |= len(commits) > 1
    for source, _, table, _ in runs:
        outcomes = Counter(outcome for _, outcome, _ in table.values())
        problems = sum(outcomes[o] for o in v.BAD)
        bad |= problems > 0
        print(f"{source}: {len(table)} records; " + ", ".join(
            f"{k} {n}" for k, n in outcomes.most_common()) + f"; problems {problems}")
    first_source, _, first, first_records = runs[0]
    for source, _, table, records in runs[1:]:
        only = len(first.keys() ^ table.keys())
        differ = Counter()
        for key in first.keys() & table.keys():
            for field, a, b in zip(digest.VALUES, first[key], table[key]):
                differ[field] += a != b
        print(f"{source} vs {first_source}: records in one only {only}; differing "
              + ", ".join(f"{f} {differ[f]}" for f in digest.VALUES))
        bad |= only > 0 or any(differ.values())
        if records is not None and first_records is not None:
            result = regression.compare(records, first_records)
            print(f"  harness compare: flips {len(result.flips)}, grown {len(result.grown)}, "
                  f"regressed {result.regressed}")
            bad |= result.regressed
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
