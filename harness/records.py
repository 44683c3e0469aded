"""The JSON Lines report: a header line describing the run, then one line per record.

Schema (version 1). Line 1: {"type": "run", "schema": 1, "environment": {...}, "suite": ...,
"kernels": [...], "cases": N}. Every other line: {"type": "record", ...} with the fields written
by harness.runner: kernel, case_id, layout, family, dtype, batch, seq_len, heads, kv_heads,
head_dim, check (out|dq|dk|dv, or * for a kernel-level skip/error), row, segment (1-based),
segment_label (r<row>s<segment>), start, length, max_abs_err, mean_abs_err, worst_token,
nonfinite, peer_err, tolerance, ratio, verdict (pass|fail|skip|error), expected
(pass|fail|either), outcome (ok|caught|known|fail|missed|skip|error), message (skips and errors).
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

SCHEMA = 1
RECORDS_FILE = "report.jsonl"
TRACES_FILE = "traces.jsonl"


def write_header(path: Path, environment: dict, **run_info) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"type": "run", "schema": SCHEMA, "environment": environment,
                            **run_info}) + "\n")


def append(path: Path, rows: list[dict], kind: str = "record") -> None:
    """Appends as it goes, so a run that dies keeps what it had finished."""
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({"type": kind, **row}) + "\n")


def _open(path: Path):
    """Plain or gzip-compressed (committed reports and baselines are kept as .jsonl.gz)."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def read(path: str | Path) -> tuple[dict, list[dict]]:
    """(header, records) of a report; raises ValueError for a file of another schema."""
    header, records = None, []
    with _open(Path(path)) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("type") == "run":
                if row.get("schema") != SCHEMA:
                    raise ValueError(f"{path}:{n}: report schema {row.get('schema')}, "
                                     f"this harness reads {SCHEMA}")
                header = header or row
            elif row.get("type") == "record":
                records.append(row)
    if header is None:
        raise ValueError(f"{path}: no run header line; not a harness report")
    return header, records


def read_traces(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    with _open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def record_key(r: dict) -> tuple:
    """Identifies one check of one segment across runs."""
    return (r["kernel"], r["case_id"], r["check"], r.get("row"), r.get("segment"))
