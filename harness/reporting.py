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
