"""The lines every view prints about a run: each problem, the known upstream bugs, what was not
judged and why, leak-probe coverage and power, padding hygiene, the margin over seeds, and the
console print-out. The counts and verdicts come from harness.judge.tallies; this only words them.
"""
from __future__ import annotations

import sys

from harness.judge import tallies
from harness.judge import vocabulary as v
from harness.judge.record import Record


def fmt(x, digits=3) -> str:
    return "nan/inf" if x is None else f"{x:.{digits}g}"


def describe_problem(r: Record) -> str:
    """One line with the numbers: kernel, check, where, tokens, error, tolerance, ratio, worst
    token and case id (what a failing test says, and every view's problem list)."""
    if r.outcome == v.ERROR or r.check == v.KERNEL_LEVEL:
        return f"{r.kernel} on {r.case_id}: {r.outcome.upper()} {r.message}"
    what = "MISSED (expected to fail, passed)" if r.outcome == v.MISSED else "FAIL"
    if r.check in (v.PADDING.name, v.CONTRACT.name):
        where = f" {r.where}" if r.where else ""
        return f"{r.kernel} {r.check}{where} of {r.case_id}: {what}: {r.message}"
    if r.check == v.DSINKS.name:   # one per case, over the heads: no segment, no token
        tol = "" if r.tolerance is None else f" tol={r.tolerance:.3g}"
        ratio = "inf (non-finite)" if r.ratio is None else f"{r.ratio:.3g}"
        return (f"{r.kernel} dsinks of {r.case_id}: {what} max|err|={fmt(r.max_abs_err)}{tol} "
                f"ratio={ratio}" + (f": {r.message}" if r.message else ""))
    if r.check == v.LEAK.name:
        what = "MISSED (expected a leak, none seen)" if r.outcome == v.MISSED else "LEAK"
        change = "" if r.max_abs_err is None else f", max change {r.max_abs_err:.3g}"
        return (f"{r.kernel} leak {r.segment_label} of {r.case_id}: {what}: {r.message}; "
                f"first changed token {r.worst_token}{change}")
    if r.expected == v.EITHER:
        return f"{r.kernel} {r.check} {r.segment_label} of {r.case_id}: MISSED: {r.message}"
    ratio = f"inf (non-finite {r.check})" if r.ratio is None else f"{r.ratio:.3g}"
    text = (f"{r.kernel} {r.check} {r.segment_label} of {r.case_id}: {what} "
            f"max|err|={fmt(r.max_abs_err)} tol={r.tolerance:.3g} ratio={ratio} "
            f"worst token {r.worst_token} (segment {r.tokens})")
    # Its message where the numbers do not say why (non-finite; a ratio within tolerance,
    # failed on its reruns: judging.reruns_within_tolerance), else its diagnosis, where one
    # was made (harness.engine.diagnosis: what the kernel computed instead); the message
    # begins with the diagnosis.
    if r.nonfinite or (r.ratio is not None and r.ratio <= 1):
        return text + f": {r.message}"
    return text + (f": {r.diagnosis}" if r.diagnosis else "")


def kept_text(kept: dict) -> str:
    """What merge --rejudge left as recorded (header `rejudge_kept`: kernel -> why), in
    words."""
    return (f"kept the records of {len(kept)} kernel(s) as recorded: "
            + ", ".join(f"{name} ({why})" for name, why in kept.items()))


def known_lines(records: list[Record]) -> list[str]:
    """Failures a known upstream bug predicts, with the bug: reported, never counted as ok."""
    return [f"{kernel}: {n} cases raise the known upstream error ({reason})"
            if check == v.KERNEL_LEVEL else
            f"{kernel} {check}: {n} segments fail as known ({reason})"
            for (kernel, check, reason), n in sorted(tallies.known(records).items())] + [
        f"{kernel} {check}: {n} segments declared known, passed ({reason})"
        for (kernel, check, reason), n in sorted(tallies.known_passed(records).items())]


def refusal_lines(records: list[Record]) -> list[str]:
    """Features a kernel refused before computing, with its words."""
    return [f"{kernel}: refused {feature} on {n} case{'s' if n > 1 else ''} ({why})"
            for (kernel, feature, why), n in sorted(tallies.refusals(records).items())]


def skipped_kernel_lines(records: list[Record]) -> list[str]:
    """Kernels that skipped every case, once each with the reason (not rows of the grid)."""
    return [f"{kernel}: {why}" for kernel, why in sorted(tallies.skipped_everything(records)
                                                         .items())]


def named_idle_text(idle: dict[str, str]) -> str:
    """The kernels a run named that judged nothing (tallies.named_idle), in one line."""
    return (f"{len(idle)} kernel{'s' if len(idle) > 1 else ''} named with --kernels judged "
            "nothing (every case skipped or refused): "
            + "; ".join(f"{k}: {why}" for k, why in idle.items()) + "; this run is not a pass")


def digest_lines(records: list[Record]) -> list[str]:
    """A failing kernel's digest, per check: how many segments failed, the worst ratio, the
    first failing segment (what a reader needs before the list of every segment)."""
    out = []
    for d in tallies.digests(records):
        worst = (f", worst ratio {tallies.ratio_text(d.worst)}" if d.has_ratio else "")
        tokens = f" (tokens {d.first.tokens})" if d.first.tokens else ""
        diagnosis = f"; {d.first.diagnosis}" if d.first.diagnosis else ""
        unit = ("segment" if d.first.segment else "record") + ("s" if d.segments != 1 else "")
        first = (f"first {d.first.where}{tokens} of {d.first.case_id}" if d.first.where
                 else f"first on {d.first.case_id}")
        out.append(f"{d.kernel} {d.check}: {d.segments} {unit} {d.first.outcome}{worst}; "
                   f"{first}{diagnosis}")
    return out


def not_judged_lines(records: list[Record]) -> list[str]:
    """What was not judged, with the reason: every view shows these apart from ok."""
    lines = [f"{kernel} leak: the probe was off (--no-leak-probe): not run on {n} cases"
             if check == v.LEAK.name else
             f"{kernel} {check}: {n} not run (left to the leak probe, which was off: "
             "--no-leak-probe)" for (kernel, check), n in sorted(tallies.not_run(records)
                                                                  .items())]
    for (kernel, check, reason, by), n in sorted(tallies.unjudged(records).items()):
        covered = f"; leak probe on the same segments: {by.split(':', 1)[1]}" if by else ""
        lines.append(f"{kernel} {check}: {n} not judged ({reason}{covered})")
    for (kernel, tensor), n in sorted(tallies.unprobed(records).items()):
        lines.append(f"{kernel} leak: {tensor} unprobed in {n} segments (not reproducible run "
                     "to run)")
    quiet = tallies.quiet(records)
    for (kernel, tensor), (n, worst) in sorted(tallies.gated(records).items()):
        silent = quiet.get((kernel, tensor), 0)
        lines.append(f"{kernel} leak: {tensor} probed above run-to-run noise only in {n} "
                     f"segments (threshold up to {worst:.2g}, on amplified perturbations"
                     + (f"; no noise seen in its reruns in {silent}: the floor threshold"
                        if silent else "") + ")")
    for (kernel, tensor), n in sorted(tallies.unsteady(records).items()):
        lines.append(f"{kernel} leak: {tensor} not reproducible in the probes of {n} segments "
                     "(two runs of one perturbation differed; a change counted where both made "
                     "it)")
    for (kernel, reason), n in sorted(tallies.uncompared(records).items()):
        lines.append(f"{kernel} leak: {n} segments not compared ({reason})")
    for (kernel, why), n in sorted(tallies.fallbacks(records).items()):
        lines.append(f"{kernel} leak: {n} segments probed on the default build: {why}")
    return lines


def coverage_lines(records: list[Record]) -> list[str]:
    out = []
    for kernel, (full, total) in sorted(tallies.probe_coverage(records).items()):
        if full < total:
            out.append(f"{kernel}: {full}/{total} segments ({100 * full / total:.1f}%) "
                       "with out/dq/dk/dv all probed")
    return out


def power_rows(records: list[Record]) -> list[tuple[str, str, str]]:
    """(kernel, smallest detectable leak per tensor, false-alarm probability over the run) for
    kernels whose leak probe was measured: 'bitwise' where every change counts."""
    detect, alarms = tallies.detectable(records), tallies.false_alarms(records)
    quiet = tallies.quiet(records)
    rows = []
    for kernel, tensors in sorted(detect.items()):
        parts = [f"{t} {'bitwise' if frac == 0 else format(frac, '.2g')}"
                 + (" (no noise seen)" if (kernel, t) in quiet else "")
                 for t, frac in tensors.items()]
        silent = [t for t in tensors if (kernel, t) in quiet]
        alarm = f"{alarms.get(kernel, 0.0):.2g}" + (
            f"; not measurable for {', '.join(silent)}" if silent else "")
        rows.append((kernel, ", ".join(parts), alarm))
    return rows


def padding_lines(records: list[Record]) -> list[str]:
    return [f"{kernel}: {good}/{total} padded rows as expected (gradients zero, output "
            "finite or per the kernel's convention)"
            for kernel, (good, total) in sorted(tallies.padding_rows(records).items())]


def margin_rows(records: list[Record]) -> list[tuple[str, int, str, str, str, str, int]]:
    """(kernel, cases, min, median, p95, max, over 1) of the worst ratios per case."""
    import numpy as np
    rows = []
    for kernel, worst in sorted(tallies.margins(records).items()):
        finite = np.array([np.inf if w is None else w for w in worst])
        q = np.quantile(finite, [0.0, 0.5, 0.95, 1.0])
        rows.append((kernel, len(worst), *(tallies.ratio_text(None if np.isinf(x) else float(x))
                                           for x in q), int((finite > 1).sum())))
    return rows


def outcome_text(records: list[Record]) -> str:
    return ", ".join(f"{k} {n}" for k, n in tallies.counts(records).items()) or "no records"


STYLES = {v.CELL_OK: "green", v.CELL_NEAR: "yellow", v.CELL_CAUGHT: "cyan",
          v.CELL_KNOWN: "yellow", v.CELL_REFUSED: "magenta", v.CELL_FAIL: "bold red",
          v.CELL_MISSED: "bold red", v.CELL_ERROR: "bold red", v.CELL_SKIP: "dim",
          v.CELL_NOT_RUN: "yellow"}


INCOMPLETE = ("INCOMPLETE: the run that wrote this report never finished (killed before its "
              "end); only what it finished is here, and it is not a pass")
NONE_BAD_SHARD_IDLE = ("None, and nothing judged: every kernel skips this shard's cases (listed "
                       "below). One shard of several may; a merge of the shards is not a pass "
                       "unless something is judged.")
INTERRUPTED_TEXT = "interrupted: only what finished is here, and it is not a pass"


def unfinished(header: dict | None) -> str | None:
    """What a view says first where the run that wrote the report did not finish
    (tallies.unfinished: killed, or stopped by the user); None for a run that finished."""
    how = tallies.unfinished(header)
    if how == v.SHARDS_MISSING:
        return (f"INCOMPLETE: shard(s) {', '.join(header['shards_missing'])} missing from this "
                "merge of shards; their pairs are not here, and it is not a pass")
    if how == v.CUT_SHORT:
        return (f"INCOMPLETE: {header[v.CUT_SHORT_FIELD]}; the records it lacks are not here, "
                "and it is not a pass")
    if how == v.INTERRUPTED and (why := header.get("stopped_by")):
        why = "; ".join(why) if isinstance(why, list) else why   # merged: each source's
        return f"STOPPED by an error once the run had begun: {why}; this report is not a pass"
    return {v.RUNNING: INCOMPLETE, v.INTERRUPTED: INTERRUPTED_TEXT}.get(how)


def print_console(records: list[Record], header: dict | None = None, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    # Wide enough for the grid in CI logs, where there is no terminal to measure.
    console = console or Console(width=None if sys.stdout.isatty() else 220)
    kernels, layouts, cells = tallies.grid(records)
    table = Table(title="kernel x layout: segments passing every check / segments, "
                        "worst error/tolerance ratio r")
    table.add_column("kernel", no_wrap=True)
    for layout in layouts:
        # Family above name: "unaligned/odd" and "unaligned/long-edges" stay apart when cut.
        table.add_column(layout.replace("/", "/\n", 1), overflow="fold")
    for kernel in kernels:
        row = [kernel]
        for layout in layouts:
            cell = cells.get((kernel, layout))
            row.append("" if cell is None else f"[{STYLES[cell.status]}]{cell.text}[/]")
        table.add_row(*row)
    console.print(table)
    idle = skipped_kernel_lines(records)
    if idle:
        console.print(f"[dim]skipped every case ({len(idle)} "
                      f"kernel{'s' if len(idle) != 1 else ''}): " + "; ".join(idle) + "[/]",
                      highlight=False)
    for line in digest_lines(records):
        console.print(f"[red]{line}[/]", highlight=False)
    problems = tallies.bad(records)
    for r in problems[:50]:
        console.print(f"[red]{describe_problem(r)}[/]", highlight=False)
    if len(problems) > 50:
        console.print(f"[red]... and {len(problems) - 50} more problems (summary.md lists them)[/]")
    caught = [r for r in records if r.outcome == v.CAUGHT]
    if caught:
        kernels_caught = sorted({r.kernel for r in caught})
        console.print(f"caught as expected: {len(caught)} failing checks of "
                      f"{', '.join(kernels_caught)}", highlight=False)
    for line in refusal_lines(records):
        console.print(f"[magenta]{line}[/]", highlight=False)
    for line in known_lines(records) + not_judged_lines(records) + coverage_lines(records):
        console.print(f"[yellow]{line}[/]", highlight=False)
    console.print(f"outcomes: {outcome_text(records)}", highlight=False)
    if (notice := unfinished(header)) is not None:
        console.print(f"[bold red]{notice}[/]", highlight=False)
    if deaths := tallies.unblamed(header):
        console.print(f"[bold red]{tallies.unblamed_text(deaths)}[/]", highlight=False)
    nothing = tallies.judged_nothing(records, header)
    if tallies.shard_idle(records, header):
        console.print(f"[yellow]{NONE_BAD_SHARD_IDLE}[/]", highlight=False)
    if (idle := tallies.named_idle(records, header)) and not nothing:
        console.print(f"[bold red]{named_idle_text(idle)}[/]", highlight=False)
    if nothing:
        console.print("[bold red]nothing was judged: no check measured anything (every kernel x "
                      "case skipped or refused its features, or none finished; summary.md "
                      "lists the skips and refusals and why); "
                      "this run is not a pass[/]", highlight=False)
