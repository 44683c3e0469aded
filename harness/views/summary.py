"""Summaries of a run's records, shared by every view: the kernel x layout grid, the problems,
what was not judged, and the console print-out. Verdicts come from harness.judge.judging; nothing
here re-derives one."""
from __future__ import annotations

import math
import sys
from collections import defaultdict
from dataclasses import dataclass

from harness.judge import judging


@dataclass
class Cell:
    """One kernel on one layout, over every case, check and segment of that layout."""
    status: str          # ok | caught | known | FAIL | MISSED | ERROR | skip
    segments: int = 0    # segments measured
    failing: int = 0     # segments with at least one failing check (the leak probe included)
    worst_ratio: float | None = None   # worst tolerance ratio (None: non-finite, or none)
    has_ratio: bool = False

    @property
    def text(self) -> str:
        if self.status in ("skip", "ERROR") or (self.status == "known" and not self.segments):
            return self.status
        ratio = judging.ratio_text(self.worst_ratio) if self.has_ratio else "—"
        return f"{self.status} {self.segments - self.failing}/{self.segments} r={ratio}"

    @property
    def heat(self) -> float | None:
        """log10 of the worst ratio for the heatmap's colour; a cell with a failing check is
        at least as red as a ratio of 10, whichever check failed (a leak has no ratio)."""
        if self.status in ("skip", "ERROR") or (self.status == "known" and not self.segments):
            return None
        if not self.has_ratio:
            value = -2.0
        elif self.worst_ratio is None:
            value = 4.0
        else:
            value = math.log10(max(self.worst_ratio, 1e-4))
        return max(value, 1.0) if self.status in ("FAIL", "MISSED") else value


_STATUS = (("error", "ERROR"), ("fail", "FAIL"), ("missed", "MISSED"), ("caught", "caught"),
           ("known", "known"))


def grid(records: list[dict]) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    by_cell: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by_cell[(r["kernel"], r["layout"])].append(r)
    kernels = list(dict.fromkeys(r["kernel"] for r in records))
    layouts = sorted(dict.fromkeys(r["layout"] for r in records))
    cells = {}
    for key, rows in by_cell.items():
        outcomes = judging.counts(rows)
        seg_fail = defaultdict(bool)
        for r in rows:
            if judging.measured(r):
                seg_fail[(r["case_id"], r["row"], r["segment"])] |= r["verdict"] == "fail"
        status = next((s for o, s in _STATUS if outcomes.get(o)), None)
        if status is None:
            status = "ok" if seg_fail else "skip"
        has_ratio, worst = judging.worst_ratio(rows)
        cells[key] = Cell(status, len(seg_fail), sum(seg_fail.values()), worst, has_ratio)
    return kernels, layouts, cells


def describe_problem(r: dict) -> str:
    if r["outcome"] == "error" or r["check"] == judging.KERNEL_LEVEL:
        return f"{r['kernel']} on {r['case_id']}: {r['outcome'].upper()} {r.get('message', '')}"
    if r["check"] == judging.LEAK.name:
        what = ("MISSED (expected a leak, none seen)" if r["outcome"] == "missed" else "LEAK")
        change = "" if r.get("max_abs_err") is None else f", max change {r['max_abs_err']:.3g}"
        return (f"{r['kernel']} leak {r['segment_label']} of {r['case_id']}: {what}: "
                f"{r.get('message', '')}; first changed token {r['worst_token']}{change}")
    if r["expected"] == "either":
        return (f"{r['kernel']} {r['check']} {r['segment_label']} of {r['case_id']}: MISSED: "
                f"{r.get('message', '')}")
    ratio = "inf (non-finite output)" if r["ratio"] is None else f"{r['ratio']:.3g}"
    what = "MISSED (expected to fail, passed)" if r["outcome"] == "missed" else "FAIL"
    err = "nan/inf" if r["max_abs_err"] is None else f"{r['max_abs_err']:.3g}"
    return (f"{r['kernel']} {r['check']} {r['segment_label']} of {r['case_id']}: {what} "
            f"max|err|={err} tol={r['tolerance']:.3g} ratio={ratio} "
            f"worst token {r['worst_token']} (segment {r['start']}..{r['start'] + r['length'] - 1})")


def known_lines(records: list[dict]) -> list[str]:
    """Failures a known upstream bug predicts, with the bug: reported, never counted as ok."""
    return [f"{kernel}: {n} cases raise the known upstream error ({reason})"
            if check == judging.KERNEL_LEVEL else
            f"{kernel} {check}: {n} segments fail as known ({reason})"
            for (kernel, check, reason), n in sorted(judging.known(records).items())]


def not_judged_lines(records: list[dict]) -> list[str]:
    """What was not judged, with the reason: every view shows these apart from ok."""
    lines = []
    for (kernel, check, reason, by), n in sorted(judging.unjudged(records).items()):
        covered = f"; leak probe on the same segments: {by.split(':', 1)[1]}" if by else ""
        lines.append(f"{kernel} {check}: {n} not judged ({reason}{covered})")
    for (kernel, tensor), n in sorted(judging.unprobed(records).items()):
        lines.append(f"{kernel} leak: {tensor} unprobed in {n} segments (not reproducible run "
                     "to run)")
    for (kernel, tensor), (n, worst) in sorted(judging.gated(records).items()):
        lines.append(f"{kernel} leak: {tensor} probed above run-to-run noise only in {n} "
                     f"segments (changes up to {worst:.2g} would not show)")
    for (kernel, reason), n in sorted(judging.uncompared(records).items()):
        lines.append(f"{kernel} leak: {n} segments not compared ({reason})")
    for (kernel, why), n in sorted(judging.fallbacks(records).items()):
        lines.append(f"{kernel} leak: {n} segments probed on the default build: {why}")
    return lines


def margins(records: list[dict]) -> dict[str, list[float | None]]:
    """kernel -> the worst tolerance ratio of each case it passed or failed (None: non-finite):
    over many seeds, the distribution of how close a kernel comes to its tolerance."""
    by_case: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        by_case[(r["kernel"], r["case_id"])].append(r)
    out: dict[str, list[float | None]] = defaultdict(list)
    for (kernel, _), rows in by_case.items():
        has_ratio, worst = judging.worst_ratio(rows)
        if has_ratio and all(r["expected"] != "fail" for r in rows):
            out[kernel].append(worst)
    return dict(out)


def margin_rows(records: list[dict]) -> list[tuple[str, int, str, str, str, str, int]]:
    """(kernel, cases, min, median, p95, max, over 1) of the worst ratios per case."""
    import numpy as np
    rows = []
    for kernel, worst in sorted(margins(records).items()):
        finite = np.array([np.inf if w is None else w for w in worst])
        q = np.quantile(finite, [0.0, 0.5, 0.95, 1.0])
        rows.append((kernel, len(worst), *(judging.ratio_text(None if np.isinf(x) else float(x))
                                           for x in q), int((finite > 1).sum())))
    return rows


def coverage_lines(records: list[dict]) -> list[str]:
    out = []
    for kernel, (full, total) in sorted(judging.probe_coverage(records).items()):
        if full < total:
            out.append(f"{kernel}: {full}/{total} segments ({100 * full / total:.1f}%) "
                       "with out/dq/dk/dv all probed")
    return out


def print_console(records: list[dict], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Wide enough for the grid in CI logs, where there is no terminal to measure.
    console = console or Console(width=None if sys.stdout.isatty() else 220)
    kernels, layouts, cells = grid(records)
    styles = {"ok": "green", "caught": "cyan", "known": "yellow", "FAIL": "bold red",
              "MISSED": "bold red", "ERROR": "bold red", "skip": "dim"}
    table = Table(title="kernel x layout: segments passing every check / segments, "
                        "worst error/tolerance ratio r")
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
    bad = judging.bad(records)
    for r in bad[:50]:
        console.print(f"[red]{describe_problem(r)}[/]", highlight=False)
    if len(bad) > 50:
        console.print(f"[red]... and {len(bad) - 50} more problems (summary.md lists them)[/]")
    caught = [r for r in records if r["outcome"] == "caught"]
    if caught:
        kernels_caught = sorted({r["kernel"] for r in caught})
        console.print(f"caught as expected: {len(caught)} failing checks of "
                      f"{', '.join(kernels_caught)}", highlight=False)
    for line in known_lines(records) + not_judged_lines(records) + coverage_lines(records):
        console.print(f"[yellow]{line}[/]", highlight=False)
    console.print(f"outcomes: {judging.counts(records)}", highlight=False)
