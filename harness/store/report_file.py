"""The JSON Lines report: a header line describing the run, then one line per record.

Schema 2. Line 1: {"type": "run", "schema": 2, "environment": {...}, "suite": ..., "selection":
{suite, cases, seeds, shard}, "kernels": [...], "cases": N, "seeds": N, "probe_mode": ..., and
once the run finished "wall_s" and "timing" (per kernel: wall, lower, compile, wait and execute
seconds)}. Every other line is {"type": "record", ...}: a harness.judge.record.Record (its
fields are listed there, the words in harness.judge.vocabulary), or {"type": "trace", ...}
in traces.jsonl. Records are read and written through Record.from_json / to_json, but where a
merge copies each line as its source wrote it (read_lines, harness.store.merge). Schema
1 reports (before the leak probe's modes) are read too.
"""
from __future__ import annotations

import functools
import gzip
import json
import os
from pathlib import Path

from harness.errors import UsageError
from harness.judge.record import BadRecord, Record, Trace
from harness.judge.vocabulary import CUT_SHORT_FIELD, RUNNING

SCHEMA = 2
READABLE = (1, 2)
RECORDS_FILE = "report.jsonl"
TRACES_FILE = "traces.jsonl"
# The views written from them (harness.views.report_dir).
SUMMARY_FILE = "summary.md"
HTML_FILE = "report.html"
# The header's count of the records its report holds, written where the report is finished
# (update_header, a merge, write_report): a report that holds fewer was cut short or edited.
RECORDS_WRITTEN = "records_written"
RECORD_PREFIX = '{"type": "record"'   # how record_line begins a record's line
# What reading a whole report adds to its header (never written by a run): why it holds fewer
# records or pairs than its header says (shortfall); a merge writes its sources' reasons.
CUT_SHORT = CUT_SHORT_FIELD


def write_header(path: Path, environment: dict, **run_info) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write(json.dumps({"type": "run", "schema": SCHEMA, "environment": environment,
                            **run_info}) + "\n")


def write_report(path: str | Path, environment: dict, records: list,
                 keep_fields: tuple[str, ...] | None = None, **run_info) -> Path:
    """A whole report in one go (header and records), gzip-compressed where the name ends in
    .gz: the form committed baselines take; `keep_fields`: each record's JSON keeps only these
    (harness.judge.regression.BASELINE_FIELDS; reading fills the rest with their defaults)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    records = list(records)
    with opener(path, "wt") as f:
        f.write(json.dumps({"type": "run", "schema": SCHEMA, "environment": environment,
                            **run_info, RECORDS_WRITTEN: len(records)}) + "\n")
        for r in records:
            row = r.to_json()
            if keep_fields is not None:
                row = {k: x for k, x in row.items() if k in keep_fields}
            f.write(json.dumps({"type": "record", **row}) + "\n")
    return path


def update_header(path: Path, **run_info) -> None:
    """Adds fields to the header line of a finished report (wall time, timing), and the count
    of its records (RECORDS_WRITTEN) as the file holds them now."""
    lines = path.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header.update(run_info)
    header[RECORDS_WRITTEN] = sum(1 for x in lines[1:] if x.startswith(RECORD_PREFIX))
    lines[0] = json.dumps(header) + "\n"
    # A new file moved over the old one: a reader (harness.engine.lanes) sees the old file or
    # the new one, whole, never one half written.
    fresh = path.with_name(path.name + ".new")
    fresh.write_text("".join(lines))
    os.replace(fresh, path)


def shortfall(header: dict, pairs_held: int, records_held: int) -> str | None:
    """Why a report holds fewer pairs than its run selected (pairs_expected) or fewer records
    than its header counts (RECORDS_WRITTEN): a file cut at a line, or lines deleted; None
    where they agree."""
    n, written = pairs_expected(header), header.get(RECORDS_WRITTEN)
    if n is not None and pairs_held < n:
        return (f"it holds {pairs_held} of the {n} kernel x case pairs its run selected: cut "
                "short or edited")
    if isinstance(written, int) and records_held < written:
        return (f"it holds {records_held} of the {written} records its run wrote: cut short or "
                "edited")
    return None


def record_line(item, kind: str = "record") -> str:
    """A record's (or trace's) line in the report."""
    return json.dumps({"type": kind, **item.to_json()}) + "\n"


def append(path: Path, items: list, kind: str = "record") -> None:
    """Appends records (or traces) as it goes, so a run that dies keeps what it had finished."""
    with path.open("a") as f:
        f.writelines(record_line(item, kind) for item in items)


def _open(path: Path):
    """Plain or gzip-compressed (committed reports and baselines are kept as .jsonl.gz)."""
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def narrowed(header: dict) -> bool:
    """Whether pytest's -k, --deselect or test ids ran fewer pairs than the header's kernels x
    cases (its `pairs_selected`), or a source of a merged report was so narrowed (`narrowed`):
    which pairs, the header does not say."""
    n = header.get("pairs_selected")
    return bool(header.get("narrowed")) or (isinstance(n, int) and n < (all_pairs(header) or 0))


def all_pairs(header: dict) -> int | None:
    """Every kernel x case pair of a run's selection (its header's kernels x cases), before
    pytest's narrowing; None where the header does not list them (a merged report)."""
    kernels, cases = header.get("kernels"), header.get("cases")
    return len(kernels) * cases if isinstance(kernels, list) and isinstance(cases, int) else None


def pairs_expected(header: dict) -> int | None:
    """How many kernel x case pairs a run's report holds when whole: the pairs its run
    selected (`pairs_selected`; a finished run gives each selected pair a record, an error
    where it wrote none); None where the header does not say (a merged report)."""
    n = header.get("pairs_selected")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    return None if narrowed(header) else all_pairs(header)   # older headers: every pair


def canonical(selection: dict | None) -> dict | None:
    """A selection with its comma-separated lists (kernels, case globs, features) as sorted
    sets: `--kernels a,b` and `--kernels b,a` select alike."""
    if selection is None:
        return None
    return {k: (",".join(sorted(set(x.split(",")))) if k in ("kernels", "cases", "features")
                and isinstance(x, str) else x) for k, x in selection.items()}


def shard_part(text) -> tuple[int, int] | None:
    """A selection's or header's shard text "I/N" as (I, N); None where it names no shard
    (--shard wrote it: harness.engine.options.check_shard)."""
    if not isinstance(text, str) or "/" not in text:
        return None
    index, count = text.split("/", 1)
    return (int(index), int(count)) if index.isdigit() and count.isdigit() else None


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=64)
def _same_text(plain: tuple, packed: tuple) -> bool:
    """Whether report.jsonl and report.jsonl.gz (their _stat_key: a file rewritten since is
    compared again) hold the same bytes, read side by side in blocks: a nightly's copies
    are tens of MB, and a command resolves a folder several times. Unreadable: not the same."""
    block = 1 << 20
    try:
        with Path(plain[0]).open("rb") as a, gzip.open(packed[0], "rb") as b:
            while True:
                x, y = a.read(block), b.read(block)
                if x != y:
                    return False
                if not x:
                    return True
    except (OSError, EOFError):
        return False


def report_files(folder: Path) -> list[Path]:
    """The report files a folder holds: report.jsonl, report.jsonl.gz, either or both."""
    return [folder / name for name in (RECORDS_FILE, RECORDS_FILE + ".gz")
            if (folder / name).is_file()]


def resolve(path: str | Path, what: str = "report") -> Path:
    """A report file, or a report folder holding report.jsonl (or .jsonl.gz); a UsageError
    naming the path when there is none."""
    if not str(path).strip():
        raise UsageError(f"{what} {str(path)!r}: an empty path; give a report folder or a "
                         "report.jsonl(.gz) file")
    p = Path(path)
    if p.is_dir():
        found = report_files(p)
        if len(found) == 2 and _same_text(_stat_key(found[0]), _stat_key(found[1])):
            return found[0]   # report.jsonl and its gzip copy (scripts/gpu.sh keeps both)
        if len(found) == 2:
            raise UsageError(f"{what} {path}: holds both {RECORDS_FILE} and {RECORDS_FILE}.gz, "
                             "which differ; which is the report? Give the file, or move one "
                             "away")
        if found:
            return found[0]
        raise UsageError(f"{what} {path}: a folder without {RECORDS_FILE}; give a report folder "
                         "or a report.jsonl(.gz) file")
    if not p.is_file():
        raise UsageError(f"{what} {path}: no such file or folder")
    return p


def read(path: str | Path, what: str = "report") -> tuple[dict, list[Record]]:
    """(header, records) of a report file or folder; a UsageError for anything else."""
    return _read(path, what, with_records=True)


def read_header(path: str | Path, what: str = "report") -> dict:
    """The report's run header alone (its first line, as written), without reading its
    records; a UsageError where `read` would give one for the header."""
    return _read(path, what, with_records=False)[0]


def read_lines(path: str | Path, what: str = "report") -> tuple[dict, list[tuple]]:
    """(header, [((kernel, case_id), line), ...]) of a report file or folder: each record's
    line as written, with its pair, not made a Record (what a merge copies: on the H200's
    87,496-record nightly, parsing each record and writing it again was most of the merge)."""
    return _read(path, what, with_records=True, as_lines=True)


def _read(path: str | Path, what: str, with_records: bool, as_lines: bool = False
          ) -> tuple[dict, list]:
    path = resolve(path, what)
    header, records, n = None, [], 0
    try:
        with _open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if cut_short(line) and header is not None and header.get("state") == RUNNING:
                    break   # the line a run killed while appending left cut short
                row = json.loads(line)
                if row.get("type") == "run":
                    if row.get("schema") not in READABLE:
                        raise UsageError(f"{what} {path}:{n}: report schema {row.get('schema')}, "
                                         f"this harness reads {READABLE}")
                    if header is None:
                        for field in ("environment", "selection"):
                            if row.get(field) is not None and not isinstance(row[field], dict):
                                raise UsageError(f"{what} {path}:{n}: its header's {field} is "
                                                 "not a mapping; not a report as the harness "
                                                 "wrote it (edited?)")
                        if not isinstance(row.get("environment"), dict):
                            raise UsageError(f"{what} {path}:{n}: its header has no "
                                             "environment; not a report as the harness wrote "
                                             "it (edited?)")
                    header = header or row
                    if not with_records:
                        break
                elif with_records and row.get("type") == "record":
                    records.append(((row["kernel"], row["case_id"]),
                                    line if line.endswith("\n") else line + "\n")
                                   if as_lines else Record.from_json(row))
    except BadRecord as exc:
        raise UsageError(f"{what} {path}:{n}: {exc}; not a report as the harness wrote it "
                         "(edited?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError, gzip.BadGzipFile, EOFError, TypeError,
            KeyError, AttributeError) as exc:
        # A line's own error names it; a decoding error comes from a chunk read ahead, whose
        # line the loop has not reached.
        line_of = n and not isinstance(exc, (UnicodeDecodeError, gzip.BadGzipFile, EOFError))
        raise UsageError(f"{what} {path}: not a harness report ({_why_unread(exc, n, line_of)})"
                         ) from None
    if header is None:
        raise UsageError(f"{what} {path}: no run header line; not a harness report")
    if with_records and header.get("state") != RUNNING and (why := shortfall(
            header, len({r[0] if as_lines else r.pair for r in records}), len(records))):
        header = {**header, CUT_SHORT: why}
    return header, records


def _why_unread(exc: Exception, n: int, line_of) -> str:
    """What was wrong where a report could not be read, in words."""
    if isinstance(exc, gzip.BadGzipFile):
        return "not gzip data, though its name ends .gz"
    if isinstance(exc, EOFError):
        return "its gzip data ends early: cut short"
    if isinstance(exc, UnicodeDecodeError):
        return "not text"
    if isinstance(exc, json.JSONDecodeError):
        return f"line {n} is not JSON: {exc.msg} at column {exc.colno}"
    if isinstance(exc, KeyError):
        return f"line {n}: a record without its field {exc.args[0]!r}"
    return (f"line {n}: a line that is not a JSON object with the fields a record has" if line_of
            else type(exc).__name__)


def cut_short(line: str) -> bool:
    """A last line without its end that does not parse: what a process killed while appending
    leaves (every line is written whole, with its newline)."""
    if line.endswith("\n"):
        return False
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return True
    return False


def read_traces(path: str | Path) -> list[Trace]:
    return [Trace.from_json(row) for row, _ in _trace_rows(path)]


def read_trace_lines(path: str | Path) -> list[tuple]:
    """[((kernel, case_id), line), ...] of a traces file, each line as written."""
    return [((row["kernel"], row["case_id"]), line) for row, line in _trace_rows(path)]


def _trace_rows(path: str | Path) -> list[tuple[dict, str]]:
    """(row, line with its newline) of each trace; a line cut short by a killed run is left
    out (the records came first: theirs are whole), anything else unreadable is a UsageError."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        with _open(path) as f:
            return [(json.loads(line), line if line.endswith("\n") else line + "\n")
                    for line in f if line.strip() and not cut_short(line)]
    except (json.JSONDecodeError, UnicodeDecodeError, gzip.BadGzipFile, EOFError) as exc:
        raise UsageError(f"traces {path}: not a harness traces file ({type(exc).__name__})"
                         ) from None


def check_writable(report_dir: str | Path, option: str = "--report-dir") -> Path:
    """A report folder the run can write: made if missing; a file in its way, or a folder the
    run may not write, is a UsageError naming it (found before any work, not at the end)."""
    import os
    path = Path(report_dir)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise UsageError(f"{option} {report_dir}: {p} is a file, not a folder")
        if p.exists():
            break
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{option} {report_dir}: cannot create it ({exc.strerror})") from None
    probe = path / f".write-test-{os.getpid()}"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"{option} {report_dir}: the folder is not writable "
                         f"({exc.strerror})") from None
    return path
