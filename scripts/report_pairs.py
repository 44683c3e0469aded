"""What a report holds, pair by pair: its state and wall time, how many (kernel, case) pairs
have records, which worker reports it merged, and each error record (for a report whose
records are not committed: reports/*/records.txt).

    python scripts/report_pairs.py REPORT.jsonl[.gz] > records.txt
"""
import collections
import gzip
import json
import sys


def main(path: str) -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        head = json.loads(f.readline())
        pairs, errors = set(), collections.Counter()
        for line in f:
            r = json.loads(line)
            if r.get("type") != "record":
                continue
            pairs.add((r["kernel"], r["case_id"]))
            if r["outcome"] == "error":
                errors[(r["kernel"], r["case_id"], r["message"][:160])] += 1
    print("state", head.get("state"), "wall_s", head.get("wall_s"))
    print("pairs with records", len(pairs))
    print("worker reports merged:", ", ".join(m["path"].split("/workers/")[-1]
                                              for m in head.get("merged_from", [])))
    for key, n in errors.items():
        print("error records", n, "|", " | ".join(key))


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a report.jsonl (or report.jsonl.gz)")
    path = parser.parse_args().report
    try:
        main(path)
    except (OSError, ValueError, KeyError) as exc:
        sys.exit(f"report_pairs: {path}: not a readable report ({type(exc).__name__}: {exc})")
