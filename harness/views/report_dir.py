"""Writes a run's report folder: report.jsonl (records), traces.jsonl (per-token errors of
failing and near-failing rows), summary.md and report.html; prints the console summary; joins
the parts of a pytest run and the shards of a suite."""
from __future__ import annotations

import json
import time
from pathlib import Path

from harness.judge import tallies
from harness.views import report_file as rec
from harness.views.summary import print_console


def write_views(report_dir: Path) -> tuple[dict, list]:
    """summary.md and report.html from the folder's report.jsonl and traces.jsonl."""
    from harness.views.html import write_html
    from harness.views.markdown import write_markdown

    header, records = rec.read(report_dir)
    traces = rec.read_traces(report_dir / rec.TRACES_FILE)
    write_markdown(report_dir / "summary.md", header, records)
    write_html(report_dir / "report.html", header, records, traces)
    return header, records


class ReportWriter:
    def __init__(self, report_dir: Path, environment: dict, **run_info):
        self.dir = Path(report_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        rec.write_header(self.dir / rec.RECORDS_FILE, environment, **run_info)
        (self.dir / rec.TRACES_FILE).write_text("")

    def add(self, result) -> None:
        rec.append(self.dir / rec.RECORDS_FILE, result.records)
        rec.append(self.dir / rec.TRACES_FILE, result.traces, kind="trace")

    def close(self, timing: dict | None = None) -> None:
        """A worker's end: the wall time and timing in the header; no views, no print-out."""
        rec.update_header(self.dir / rec.RECORDS_FILE,
                          wall_s=round(time.monotonic() - self.start, 1), timing=timing or {})

    def finish(self, baseline: str | None = None, growth: float = 2.0,
               timing: dict | None = None, interrupted: bool = False) -> int:
        """Records the wall time (and per-kernel timing) in the header, prints the summary,
        writes the views; 1 if anything is bad or regressed."""
        extra = {"interrupted": True} if interrupted else {}
        rec.update_header(self.dir / rec.RECORDS_FILE,
                          wall_s=round(time.monotonic() - self.start, 1), timing=timing or {},
                          **extra)
        header, records = write_views(self.dir)
        print_console(records)
        print(f"wall time {header['wall_s']:.0f} s; report: {self.dir}/ (report.jsonl, "
              "summary.md, report.html)")
        status = run_status(records)
        if baseline:
            from harness.views.compare import compare_files
            status |= compare_files(self.dir / rec.RECORDS_FILE, baseline, growth=growth)
        return status


def finish_merged(report_dir: Path, baseline: str | None = None, growth: float = 2.0,
                  interrupted: bool = False, **run_info) -> int:
    """The end of a run whose records came from workers: the header says what the run was,
    the console shows the joined records, the baseline is checked."""
    rec.update_header(report_dir / rec.RECORDS_FILE, **run_info,
                      **({"interrupted": True} if interrupted else {}))
    header, records = write_views(report_dir)
    print_console(records)
    print(f"report: {report_dir}/ (report.jsonl, summary.md, report.html)")
    status = run_status(records)
    if baseline:
        from harness.views.compare import compare_files
        status |= compare_files(report_dir / rec.RECORDS_FILE, baseline, growth=growth)
    return 130 if interrupted else status


def run_status(records) -> int:
    """1 if anything is bad, or if nothing at all was judged (a run where every pair skipped is
    never green); else 0."""
    return 1 if tallies.bad(records) or tallies.judged_nothing(records) else 0


def merge_timing(timings: list[dict]) -> dict:
    """Per-kernel seconds and counts summed over workers or shards."""
    out: dict[str, dict] = {}
    for timing in timings:
        for kernel, t in (timing or {}).items():
            acc = out.setdefault(kernel, {})
            for k, v in t.items():
                acc[k] = round(acc.get(k, 0) + v, 3)
    return out


def merge_parts(report_dir: Path, parts: Path, header_info: dict, wall_s: float,
                baseline: str | None = None, growth: float = 2.0) -> int:
    """Joins the per-worker part files of a pytest run (records, traces, and each worker's
    probe mode and timing) into one report; returns 1 on a regression against the baseline
    (problems themselves already failed their tests)."""
    from harness.engine.environment import describe

    records_path, traces_path = report_dir / rec.RECORDS_FILE, report_dir / rec.TRACES_FILE
    runs = [json.loads(p.read_text()) for p in sorted(parts.glob("*.run.json"))]
    modes = sorted({r["probe_mode"] for r in runs})
    environment = describe()
    # The run's start, as the CLI records it (describe() now would say when it ended).
    environment["time_utc"] = header_info.pop("started_utc", environment["time_utc"])
    rec.write_header(records_path, environment, source="pytest", wall_s=round(wall_s, 1),
                     timing=merge_timing([r["timing"] for r in runs]),
                     probe_mode=modes[0] if len(modes) == 1 else modes, **header_info)
    with records_path.open("a") as out, traces_path.open("w") as traces:
        for part in sorted(parts.glob("*.jsonl")):
            target = traces if part.name.endswith(".traces.jsonl") else out
            target.write(part.read_text())
    _, records = write_views(report_dir)
    print(f"\nharness report: {report_dir}/ ({len(records)} records, wall time {wall_s:.0f} s)")
    status = 1 if tallies.judged_nothing(records) else 0
    if status:
        print("harness: nothing was judged (no check measured anything): not a pass")
    if baseline:
        from harness.views.compare import compare_files
        status |= compare_files(records_path, baseline, growth=growth)
    return status


def merged_environment(environments: list[dict]) -> dict:
    """One environment for several runs: a value they share, or the list of their values."""
    keys = list(dict.fromkeys(k for env in environments for k in env))
    out = {}
    for key in keys:
        values = list(dict.fromkeys(json.dumps(env.get(key)) for env in environments))
        values = [json.loads(v) for v in values]
        present = [v for v in values if v is not None]
        out[key] = present[0] if len(present) == 1 else (present or None)
    return out


# What a merged header keeps of its sources' (shared, or the list of their values).
RUN_FACTS = ("seeds", "shard", "probe_mode", "leak_probe", "interrupted")


def merge_reports(out_dir: Path, sources: list[Path], rejudged: bool = False
                  ) -> list[tuple[Path, int]]:
    """One report from several runs' folders (e.g. a suite run in shards). A kernel x case in a
    later source replaces the same one from an earlier source; returns (source, pairs it
    replaced) for each source that overlapped an earlier one, for the caller to say."""
    by_case: dict[tuple, list[dict]] = {}
    traces: dict[tuple, list[dict]] = {}
    headers, overlaps = [], []
    for src in sources:
        header, records = rec.read(src)
        headers.append(header)
        fresh: dict[tuple, list] = {}
        for r in records:
            fresh.setdefault(r.pair, []).append(r)
        replaced = sorted(set(fresh) & set(by_case))
        if replaced:
            overlaps.append((src, len(replaced)))
        by_case.update(fresh)
        fresh_traces: dict[tuple, list] = {key: [] for key in fresh}
        for t in rec.read_traces(Path(src) / rec.TRACES_FILE):
            fresh_traces.setdefault((t.kernel, t.case_id), []).append(t)
        traces.update(fresh_traces)
    records = [r for rows in by_case.values() for r in rows]
    if rejudged:
        from harness.engine.registry import all_kernels
        from harness.judge.judging import rejudge
        records = rejudge(records, all_kernels())
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = merged_environment([{k: h.get(k) for k in RUN_FACTS} for h in headers])
    suites = sorted({h.get("suite") for h in headers}, key=str)
    rec.write_header(out_dir / rec.RECORDS_FILE,
                     merged_environment([h["environment"] for h in headers]),
                     **facts, suite=suites[0] if len(suites) == 1 else suites,
                     merged_from=[{"path": str(s), "environment": h["environment"],
                                   "wall_s": h.get("wall_s")}
                                  for s, h in zip(sources, headers)],
                     timing=merge_timing([h.get("timing") for h in headers]),
                     rejudged=rejudged)
    rec.append(out_dir / rec.RECORDS_FILE, records)
    (out_dir / rec.TRACES_FILE).write_text("")
    rec.append(out_dir / rec.TRACES_FILE,
               [t for key in by_case for t in traces.get(key, [])], kind="trace")
    write_views(out_dir)
    return overlaps
