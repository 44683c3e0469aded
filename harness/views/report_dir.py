"""A report folder's views: summary.md and report.html, written from its report.jsonl and
traces.jsonl (harness.store), and the console print-out. Nothing here decides a verdict."""
from __future__ import annotations

from pathlib import Path

from harness.store import report_file as rec


def write_views(report_dir: Path) -> tuple[dict, list]:
    """summary.md and report.html from the folder's report.jsonl and traces.jsonl; returns
    (header, records)."""
    from harness.views.html import write_html
    from harness.views.markdown import write_markdown

    header, records = rec.read(report_dir)
    traces = rec.read_traces(Path(report_dir) / rec.TRACES_FILE)
    write_markdown(Path(report_dir) / rec.SUMMARY_FILE, header, records)
    write_html(Path(report_dir) / rec.HTML_FILE, header, records, traces)
    return header, records
