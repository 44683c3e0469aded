"""Summaries of a run's records: the kernel x layout grid and the list of problems."""
from __future__ import annotations

import sys
from collections import Counter, defaultdict
from dataclasses import dataclass

from harness.registry import LEAK

BAD_OUTCOMES = ("fail", "missed", "error")


@dataclass
class Cell:
    """One kernel on one layout, over every case, check and segment of that layout."""
    status: str          # ok | caught | FAIL | MISSED | ERROR | skip
    segments: int = 0    # segments judged
    failing: int = 0     # segments with at least one failing check
    worst_ratio: float | None = None
    note: str = ""

    @property
    def text(self) -> str:
        if self.status in ("skip", "known"):
            return self.status
        if self.status == "ERROR":
            return "ERROR"
        ratio = "inf" if self.worst_ratio is None else f"{self.worst_ratio:.3g}"
        return f"{self.status} {self.segments - self.failing}/{self.segments} r={ratio}"


def _worst(records: list[dict]) -> float | None:
    # The leak probe has no tolerance, hence no ratio: its verdicts count, not its numbers.
    ratios = [r["ratio"] for r in records if r["verdict"] in ("pass", "fail") and r["check"] != LEAK]
    if any(r is None for r in ratios):
        return None  # non-finite values: reported as inf
    return max(ratios) if ratios else None


def grid(records: list[dict]) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    by_cell: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by_cell[(r["kernel"], r["layout"])].append(r)
    kernels = list(dict.fromkeys(r["kernel"] for r in records))
    layouts = sorted(dict.fromkeys(r["layout"] for r in records))
    cells = {}
    for key, rows in by_cell.items():
        outcomes = Counter(r["outcome"] for r in rows)
        judged = [r for r in rows if r["verdict"] in ("pass", "fail")]
        seg_fail = defaultdict(bool)
        for r in judged:
            seg_fail[(r["case_id"], r["row"], r["segment"])] |= r["verdict"] == "fail"
        if outcomes["error"]:
            status = "ERROR"
        elif outcomes["fail"]:
            status = "FAIL"
        elif outcomes["missed"]:
            status = "MISSED"
        elif outcomes["caught"]:
            status = "caught"
        elif outcomes["known"]:
            status = "known"
        elif judged:
            status = "ok"
        else:
            status = "skip"
        note = next((r.get("message", "") for r in rows if r["verdict"] in ("skip", "error")), "")
        cells[key] = Cell(status, len(seg_fail), sum(seg_fail.values()), _worst(rows), note)
    return kernels, layouts, cells


def problems(records: list[dict]) -> list[dict]:
    """Records a run must be red for: unexpected failures, missed catches and errors."""
    return [r for r in records if r["outcome"] in BAD_OUTCOMES]


def counts(records: list[dict]) -> dict[str, int]:
    return dict(Counter(r["outcome"] for r in records))


def describe_problem(r: dict) -> str:
    if r["outcome"] == "error":
        return f"{r['kernel']} on {r['case_id']}: ERROR {r.get('message', '')}"
    if r["check"] == LEAK:
        what = "MISSED (expected a leak, none seen)" if r["outcome"] == "missed" else "LEAK"
        return (f"{r['kernel']} leak {r['segment_label']} of {r['case_id']}: {what}: "
                f"{r.get('message', '')}; first changed token {r['worst_token']}, "
                f"max change {r['max_abs_err']:.3g}")
    ratio = "inf (non-finite output)" if r["ratio"] is None else f"{r['ratio']:.3g}"
    what = "MISSED (expected to fail, passed)" if r["outcome"] == "missed" else "FAIL"
    err = "nan/inf" if r["max_abs_err"] is None else f"{r['max_abs_err']:.3g}"
    return (f"{r['kernel']} {r['check']} {r['segment_label']} of {r['case_id']}: {what} "
            f"max|err|={err} tol={r['tolerance']:.3g} ratio={ratio} "
            f"worst token {r['worst_token']} (segment {r['start']}..{r['start'] + r['length'] - 1})")


def print_console(records: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Wide enough for the grid in CI logs, where there is no terminal to measure.
    console = console or Console(width=None if sys.stdout.isatty() else 220)
    kernels, layouts, cells = grid(records)
    styles = {"ok": "green", "caught": "cyan", "known": "yellow", "FAIL": "bold red", "MISSED": "bold red",
              "ERROR": "bold red", "skip": "dim"}
    table = Table(title="kernel x layout: segments passing every check / segments, worst error/tolerance ratio r")
    table.add_column("kernel", no_wrap=True)
    for layout in layouts:
        table.add_column(layout)
    for kernel in kernels:
        row = [kernel]
        for layout in layouts:
            cell = cells.get((kernel, layout))
            row.append("" if cell is None else f"[{styles[cell.status]}]{cell.text}[/]")
        table.add_row(*row)
    console.print(table)
    bad = problems(records)
    for r in bad[:50]:
        console.print(f"[red]{describe_problem(r)}[/]", highlight=False)
    if len(bad) > 50:
        console.print(f"[red]... and {len(bad) - 50} more problems[/]")
    caught = [r for r in records if r["outcome"] == "caught"]
    if caught:
        kernels_caught = sorted({r["kernel"] for r in caught})
        console.print(f"caught as expected: {len(caught)} failing checks of "
                      f"{', '.join(kernels_caught)}", highlight=False)
    console.print(f"outcomes: {counts(records)}", highlight=False)
