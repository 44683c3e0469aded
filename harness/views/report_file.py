"""The JSON Lines report: a header line describing the run, then one line per record.

Schema 2. Line 1: {"type": "run", "schema": 2, "environment": {...}, "suite": ..., "kernels":
[...], "cases": N, "seeds": N, "probe_mode": ..., and once the run finished "wall_s" and
"timing" (per kernel: wall, lower, compile, wait and execute seconds)}. Every other line: {"type":
"record", ...} with the fields written by harness.engine.runner: kernel, case_id, layout, family,
dtype, batch, seq_len, heads, kv_heads, head_dim, causal, seed, check (out|dq|dk|dv|leak, or *
for a kernel-level skip/error), row, segment (1-based), segment_label (r<row>s<segment>), start,
length, max_abs_err, mean_abs_err, worst_token, nonfinite, peer_err, tolerance, ratio, verdict,
expected, outcome (harness.judge.judging has the vocabulary), message, mode (default or
deterministic: the build that produced it), and for leak records probed/unprobed (tensors) and
gated (tensor -> the change that counts, where a tensor is probed above its run-to-run noise).
Schema 1 reports (before the leak probe's modes) are read too.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from harness.errors import UsageError

SCHEMA = 2
READABLE = (1, 2)
RECORDS_FILE = "report.jsonl"
TRACES_FILE = "traces.jsonl"


def write_header(path: Path, environment: dict, **run_info) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"type": "run", "schema": SCHEMA, "environment": environment,
                            **run_info}) + "\n")


def update_header(path: Path, **run_info) -> None:
    """Adds fields to the header line of a finished report (wall time, timing)."""
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header.update(run_info)
    lines[0] = json.dumps(header) + "\n"
    path.write_text("".join(lines))


def append(path: Path, rows: list[dict], kind: str = "record") -> None:
    """Appends as it goes, so a run that dies keeps what it had finished."""
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({"type": kind, **row}) + "\n")


def _open(path: Path):
    """Plain or gzip-compressed (committed reports and baselines are kept as .jsonl.gz)."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def resolve(path: str | Path, what: str = "report") -> Path:
    """A report file, or a report folder holding report.jsonl (or .jsonl.gz); a UsageError
    naming the path when there is none."""
    p = Path(path)
    if p.is_dir():
        for name in (RECORDS_FILE, RECORDS_FILE + ".gz"):
            if (p / name).is_file():
                return p / name
        raise UsageError(f"{what} {path}: a folder without {RECORDS_FILE}; give a report folder "
                         "or a report.jsonl(.gz) file")
    if not p.is_file():
        raise UsageError(f"{what} {path}: no such file or folder")
    return p


def read(path: str | Path, what: str = "report") -> tuple[dict, list[dict]]:
    """(header, records) of a report file or folder; a UsageError for anything else."""
    path = resolve(path, what)
    header, records = None, []
    try:
        with _open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("type") == "run":
                    if row.get("schema") not in READABLE:
                        raise UsageError(f"{what} {path}:{n}: report schema {row.get('schema')}, "
                                         f"this harness reads {READABLE}")
                    header = header or row
                elif row.get("type") == "record":
                    records.append(row)
    except (json.JSONDecodeError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as exc:
        raise UsageError(f"{what} {path}: not a harness report ({type(exc).__name__})") from None
    if header is None:
        raise UsageError(f"{what} {path}: no run header line; not a harness report")
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
