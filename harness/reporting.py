"""Writes a run's report folder: report.jsonl (records), traces.jsonl (per-token errors of
failing and near-failing rows), summary.md and report.html; prints the console summary."""
from __future__ import annotations

from pathlib import Path

from harness import records as rec
from harness.summary import print_console, problems


def write_views(report_dir: Path) -> tuple[dict, list[dict]]:
    """summary.md and report.html from the folder's report.jsonl and traces.jsonl."""
    from harness.html_report import write_html
    from harness.markdown_report import write_markdown

    header, records = rec.read(report_dir / rec.RECORDS_FILE)
    traces = rec.read_traces(report_dir / rec.TRACES_FILE)
    write_markdown(report_dir / "summary.md", header, records)
    write_html(report_dir / "report.html", header, records, traces)
    return header, records


class ReportWriter:
    def __init__(self, report_dir: Path, environment: dict, **run_info):
        self.dir = report_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        rec.write_header(self.dir / rec.RECORDS_FILE, environment, **run_info)
        (self.dir / rec.TRACES_FILE).write_text("")

    def add(self, result) -> None:
        rec.append(self.dir / rec.RECORDS_FILE, result.records)
        rec.append(self.dir / rec.TRACES_FILE, result.traces, kind="trace")

    def finish(self, baseline: str | None = None, growth: float = 2.0) -> int:
        """Prints the summary, writes the views; 1 if anything is bad or regressed."""
        _, records = write_views(self.dir)
        print_console(records)
        print(f"report: {self.dir}/ (report.jsonl, summary.md, report.html)")
        status = 1 if problems(records) else 0
        if baseline:
            from harness.baseline import compare_files
            status |= compare_files(str(self.dir / rec.RECORDS_FILE), baseline, growth=growth)
        return status


def merge_parts(report_dir: Path, suite: str, baseline: str | None = None,
                growth: float = 2.0) -> int:
    """Joins the per-worker part files of a pytest run into one report; returns 1 on a
    regression against the baseline (problems themselves already failed their tests)."""
    from harness.environment import describe

    parts = report_dir / "parts"
    records_path, traces_path = report_dir / rec.RECORDS_FILE, report_dir / rec.TRACES_FILE
    rec.write_header(records_path, describe(), suite=suite, source="pytest")
    with records_path.open("a") as out, traces_path.open("w") as traces:
        for part in sorted(parts.glob("*.jsonl")):
            target = traces if part.name.endswith(".traces.jsonl") else out
            target.write(part.read_text())
    _, records = write_views(report_dir)
    print(f"\nharness report: {report_dir}/ ({len(records)} records)")
    if baseline:
        from harness.baseline import compare_files
        return compare_files(str(records_path), baseline, growth=growth)
    return 0


def rejudge(records: list[dict]) -> list[dict]:
    """Recomputes each record's expectation and outcome from the kernels as registered now.
    Errors, ratios and verdicts stay as measured; only what they were expected to be changes
    (for reports measured before an expectation was corrected)."""
    from harness.cases import Case
    from harness.layouts import Segment
    from harness.registry import all_kernels
    from harness.runner import _outcome

    kernels = all_kernels()
    out = []
    for r in records:
        kernel = kernels.get(r["kernel"])
        if kernel is not None and r["verdict"] in ("pass", "fail") and r.get("segment"):
            case = Case.from_id(r["case_id"])
            seg = Segment(r["row"], r["segment"], r["start"], r["length"])
            expected = kernel.expected(case, r["check"], seg)
            r = {**r, "expected": expected, "outcome": _outcome(r["verdict"], expected)}
        out.append(r)
    return out


def merge_reports(out_dir: Path, sources: list[Path], rejudged: bool = False) -> None:
    """One report from several runs' folders (e.g. a suite run in shards). A kernel x case in a
    later source replaces the same one from an earlier source."""
    by_case: dict[tuple, list[dict]] = {}
    traces: dict[tuple, list[dict]] = {}
    headers = []
    for src in sources:
        header, records = rec.read(src / rec.RECORDS_FILE)
        headers.append(header)
        fresh: dict[tuple, list[dict]] = {}
        for r in records:
            fresh.setdefault((r["kernel"], r["case_id"]), []).append(r)
        by_case.update(fresh)
        fresh_traces: dict[tuple, list[dict]] = {key: [] for key in fresh}
        for t in rec.read_traces(src / rec.TRACES_FILE):
            fresh_traces.setdefault((t["kernel"], t["case_id"]), []).append(t)
        traces.update(fresh_traces)
    records = [r for rows in by_case.values() for r in rows]
    if rejudged:
        records = rejudge(records)
    out_dir.mkdir(parents=True, exist_ok=True)
    first = headers[0]
    rec.write_header(out_dir / rec.RECORDS_FILE, first["environment"], suite=first.get("suite"),
                     merged_from=[{"path": str(s), "environment": h["environment"]}
                                  for s, h in zip(sources, headers)],
                     rejudged=rejudged)
    rec.append(out_dir / rec.RECORDS_FILE, [{k: v for k, v in r.items() if k != "type"}
                                            for r in records])
    (out_dir / rec.TRACES_FILE).write_text("")
    rec.append(out_dir / rec.TRACES_FILE,
               [{k: v for k, v in t.items() if k != "type"}
                for key in by_case for t in traces.get(key, [])], kind="trace")
    write_views(out_dir)
