"""One line per record of a report: kernel, case, check, row, segment, verdict, outcome, max abs
error (tab-separated, gzipped; harness.views.digest). Small enough to commit beside a run's
summary where the full records of every run would not fit the tree; two digests of runs that
agree are identical.

    python3 scripts/verdict_digest.py REPORT_DIR_OR_FILE OUT.tsv.gz
"""
import sys

from harness.store import report_file
from harness.views import digest


def main(source: str, out: str) -> None:
    _, records = report_file.read(source)
    digest.write(records, out)
    print(f"{len(records)} records -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
