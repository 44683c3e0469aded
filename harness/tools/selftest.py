"""python -m harness selftest: the harness's proof of detection power.

Every broken kernel of the zoo (harness.tools.zoo) must be caught and no correct kernel flagged, on a
compact list of cases (SELFTEST_CASES) small enough for CPU CI. Broken kernels are judged as
if they were expected to pass: a bug is caught when one of its records is bad (a tolerance
check or the leak probe fails). A broken kernel stops at the case that catches it; correct
kernels run every case. For each entry the table shows where it was caught first: the first
check in the order out, dq, dk, dv, leak of the first case (in list order) that catches it,
the first segment that check flags, and that segment's worst token (for the leak probe: its
first changed token).

Exit status 0 only when every bug is caught and no correct kernel is flagged (or raises).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from harness.errors import UsageError
from harness.judge import tallies
from harness.judge import vocabulary as v
from harness.judge.record import Record
from harness.kernels.kernel import Platform
from harness.model.case import Case
from harness.model.features import Features
from harness.tools.zoo import Entry
from harness.tools.zoo import entries as zoo_entries

# Small shapes, kept few (programs compile once per shape): rows of 256 tokens with 4 query
# heads over 2 kv heads (GQA), and rows of 1152 (MQA, float32) for boundaries at 511-513 and
# 1023-1025 and a segment longer than a 512-token window. In list order: bugs that every packed
# row shows are caught on the first case; the others wait for the layout that shows them.
SELFTEST_CASES = (
    Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", seed=0),
    Case("extremes/single-tokens", 4, 256, 4, 2, 32, "bfloat16", seed=0),
    Case("padded/between", 4, 256, 4, 2, 32, "bfloat16", seed=0),
    Case("packed/dozens", 4, 256, 4, 2, 32, "bfloat16", seed=0),
    Case("packed/random", 4, 256, 4, 2, 32, "bfloat16", seed=0, causal=False),
    Case("unaligned/long-edges", 4, 1152, 2, 1, 32, "float32", seed=0),
    # The features (harness.model.features): a window, chunks, a soft cap, sinks.
    Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", seed=0, features=Features(window=(15, 0))),
    Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", seed=0, features=Features(chunk=32)),
    Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", seed=0, features=Features(softcap=2.0)),
    Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", seed=0, features=Features(sinks=True)),
    Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", seed=0, causal=False,
         features=Features(softcap=2.0)),
)

CPU = Platform("cpu")


@dataclass
class Result:
    entry: Entry
    verdict: str = ""             # vocabulary.ZOO_*: CAUGHT | MISSED (bugs), ok | FLAGGED, ERROR
    first: Record | None = None   # the record that caught (or flagged) it first
    case_index: int | None = None
    worst_ratio: float = 0.0      # worst tolerance ratio over the cases run (inf: non-finite)
    measured: bool = False
    cases_run: int = 0
    message: str = ""

    @property
    def good(self) -> bool:
        return self.verdict in v.ZOO_GOOD


def select(names: str | None, zoo: list[Entry]) -> list[Entry]:
    """The entries named (comma-separated), or all; an unknown name is a UsageError."""
    if names is None:
        return zoo
    from harness.engine.options import check_names
    wanted = check_names("--bugs", names, "zoo entry")
    known = {e.name: e for e in zoo}
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise UsageError(f"unknown zoo entr{'ies' if len(unknown) > 1 else 'y'} "
                         f"{', '.join(unknown)}; known: {', '.join(known)}")
    return [known[n] for n in wanted]


def _errors(records: list[Record]) -> list[Record]:
    return [r for r in records if r.outcome == v.ERROR]


def _judge_case(e: Entry, res: Result, case, platform, programs) -> None:
    """One zoo kernel on one case: what it showed, into its result (the verdict itself comes
    from harness.judge.tallies.zoo_verdict)."""
    from harness.engine.runner import run_kernel_case
    if e.correct:
        records = run_kernel_case(e.kernel, case, platform, programs).records
    else:
        # The probe judges last: run it only when no other check caught the bug.
        records = run_kernel_case(e.kernel, case, platform, programs, leak=False).records
        if tallies.first_catch(records) is None and not _errors(records):
            records = run_kernel_case(e.kernel, case, platform, programs).records
    res.cases_run += 1
    errors = _errors(records)
    if errors:
        res.first, res.message = errors[0], errors[0].message
        res.verdict = tallies.zoo_verdict(e.correct, False, True, res.measured)
        return
    measured, ratio = tallies.worst_ratio(records)
    if measured:
        res.measured = True
        res.worst_ratio = max(res.worst_ratio, math.inf if ratio is None else ratio)
    hit = tallies.first_catch(records)
    if hit is not None and res.first is None:
        res.first = hit
        if not e.correct:
            res.verdict = tallies.zoo_verdict(False, True, False, True)


def run(entries: list[Entry], cases=SELFTEST_CASES, programs=None,
        platform: Platform = CPU, on_case=None) -> list[Result]:
    """Runs the zoo over the cases (cases outermost: one reference per case). A broken kernel
    stops at the case that catches it; correct kernels run every case."""
    from harness.engine.programs import Programs
    from harness.judge.oracle import reference_for

    own = programs is None
    programs = programs or Programs()
    results = {e.name: Result(e) for e in entries}
    try:
        for index, case in enumerate(cases):
            pending = [e for e in entries if not results[e.name].verdict]
            if not pending:
                break
            programs.prefetch([(e.kernel, case) for e in pending
                               if not e.kernel.unsupported_reasons(case, platform)])
            reference_for(case, programs)
            for e in pending:
                res = results[e.name]
                first = res.first
                _judge_case(e, res, case, platform, programs)
                if res.first is not first:
                    res.case_index = index
            if on_case:
                on_case(index, case)
    finally:
        if own:
            programs.close()
    for res in results.values():
        if not res.verdict:
            res.verdict = tallies.zoo_verdict(res.entry.correct, res.first is not None, False,
                                              res.measured)
            if res.verdict == v.ZOO_FLAGGED and not res.measured:
                res.message = "skipped on every case: nothing was measured"
    return [results[e.name] for e in entries]


# ----- output -----------------------------------------------------------------------------------

WIDTH = 200
_STYLE = {v.ZOO_CAUGHT: "green", v.ZOO_OK: "green", v.ZOO_MISSED: "bold red",
          v.ZOO_FLAGGED: "bold red", v.ZOO_ERROR: "bold red"}


def _ratio_text(res: Result) -> str:
    r = res.first
    if res.entry.correct and res.verdict == v.ZOO_OK:
        worst = None if math.isinf(res.worst_ratio) else res.worst_ratio
        return f"worst {tallies.ratio_text(worst)}"
    if r is None or r.check == v.KERNEL_LEVEL:
        return ""
    if not v.has_ratio(r.check):
        return v.rule(r.check)
    return tallies.ratio_text(r.ratio)


def table(results: list[Result], cases):
    from rich import box
    from rich.table import Table

    # Markdown's box: the table pastes into the README as it is.
    t = Table(box=box.MARKDOWN, show_edge=True)
    for name, kw in (("kernel", {"no_wrap": True}), ("bug class / math", {}),
                     ("verdict", {"no_wrap": True}), ("check", {}), ("case", {"no_wrap": True}),
                     ("segment", {}), ("token", {"justify": "right"}),
                     ("ratio", {"justify": "right", "no_wrap": True})):
        t.add_column(name, **kw)
    for res in results:
        r = res.first
        where = ["", "", "", ""]
        if r is not None:
            case = cases[res.case_index]
            where = [r.check, f"#{res.case_index + 1} {case.layout}", r.where,
                     "" if r.worst_token is None else str(r.worst_token)]
        verdict = f"[{_STYLE[res.verdict]}]{res.verdict}[/]"
        t.add_row(res.entry.name, res.entry.bug, verdict,
                  *where, _ratio_text(res))
    return t


def report(results: list[Result], cases, wall_s: float, console=None) -> None:
    from rich.console import Console

    console = console or Console()
    if console.width < WIDTH:  # one line per entry, also in CI logs (80 columns by default)
        console = Console(width=WIDTH, file=console.file, force_terminal=console.is_terminal)
    console.print(table(results, cases))
    console.print("cases:")
    for i, case in enumerate(cases):
        console.print(f"  #{i + 1} {case.id}", highlight=False)
    for res in results:
        if res.verdict in (v.ZOO_ERROR, v.ZOO_FLAGGED) and res.message:
            console.print(f"[red]{res.entry.name}[/]: {res.message[:500]}", highlight=False)
    bugs = [r for r in results if not r.entry.correct]
    correct = [r for r in results if r.entry.correct]
    caught = sum(r.verdict == v.ZOO_CAUGHT for r in bugs)
    ok = sum(r.verdict == v.ZOO_OK for r in correct)
    status = "[green]pass[/]" if all(r.good for r in results) else "[bold red]FAIL[/]"
    console.print(f"selftest {status}: {caught}/{len(bugs)} bugs caught, {ok}/{len(correct)} "
                  f"correct kernels unflagged, {len(cases)} cases, wall time {wall_s:.1f} s",
                  highlight=False)


def main(bugs: str | None = None, zoo: list[Entry] | None = None, cases=None) -> int:
    """`bugs`: comma-separated entries, or None for all. `zoo` and `cases` replace the
    built-in zoo and case list (for the harness's own tests)."""
    start = time.perf_counter()
    chosen = select(bugs, zoo_entries() if zoo is None else zoo)
    cases = tuple(SELFTEST_CASES if cases is None else cases)
    from harness.views.progress import progress
    with progress(len(cases), "selftest case") as step:
        results = run(chosen, cases, on_case=lambda index, case: step(case.id))
    report(results, cases, time.perf_counter() - start)
    return 0 if all(r.good for r in results) else 1
