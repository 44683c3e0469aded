"""One line per record of a report: kernel, case, check, row, segment, verdict, outcome, max abs
error (tab-separated, gzipped). Small enough to commit beside a run's summary where the full
records of every run would not fit the tree; two digests of runs that agree are identical.

    python3 scripts/verdict_digest.py REPORT_DIR_OR_FILE OUT.tsv.gz
"""
import gzip
import sys

from harness.views import report_file

FIELDS = ("kernel", "case_id", "check", "row", "segment", "verdict", "outcome", "max_abs_err")


def main(source: str, out: str) -> None:
    _, records = report_file.read(source)
    lines = ["\t".join(FIELDS)]
    lines += ["\t".join(str(getattr(r, f)) for f in FIELDS) for r in records]
    with gzip.open(out, "wt", compresslevel=9) as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(records)} records -> {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
