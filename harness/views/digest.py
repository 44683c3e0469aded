"""A report's records as a digest: one tab-separated line per record (kernel, case, check, row,
segment, verdict, outcome, max abs error), gzipped. Small enough to commit beside a run's
summary where the full records of every run would not fit the tree; two digests of runs that
agree are identical. Written by scripts/verdict_digest.py; read back by scripts/series_check.py
and the tests that check predictions against committed GPU runs."""
from __future__ import annotations

import csv
import gzip
from pathlib import Path

KEY = ("kernel", "case_id", "check", "row", "segment")
VALUES = ("verdict", "outcome", "max_abs_err")
FIELDS = KEY + VALUES


def rows(records) -> list[dict[str, str]]:
    """Each record as the digest holds it: every field as text."""
    return [{f: str(getattr(r, f)) for f in FIELDS} for r in records]


def write(records, out: Path) -> None:
    with gzip.open(out, "wt", compresslevel=9) as f:
        f.write("\n".join(["\t".join(FIELDS)] + ["\t".join(r[f] for f in FIELDS)
                                                  for r in rows(records)]) + "\n")


def read(path: Path) -> list[dict[str, str]]:
    with gzip.open(path, "rt") as f:
        return list(csv.DictReader(f, delimiter="\t"))
